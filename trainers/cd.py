"""Contrastive-divergence trainer for any energy model (Hauser Algorithm 1)."""

import sys

import keras
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.experts import DECODER_RULES, CapsuleExperts, EnergyModel, check_sparsity
from poecaps.graphs import graph
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import to_dtype, unpack
from poecaps.trainers.schedule import ScaledSchedule
from poecaps.trainers.shards import batch_size, nonempty, shard_bounds, size_weighted_mean
from poecaps.validation import (
    check_array,
    check_choice,
    check_flag,
    check_integer,
    check_integers,
    check_number,
    check_seed,
    shape_fits,
)


def _check_chain_shape(chain_shape):
    """`chain_shape` as a tuple of positive ints, `[chains, *the visible units' shape]`, else an `InputError`."""
    try:
        sizes = tuple(check_integer(size, "size") for size in chain_shape)
    except (InputError, TypeError):     # a size that is no positive integer, or no sequence at all
        sizes = ()
    if len(sizes) < 2:
        raise InputError("chain_shape must be [chains, *the visible units' shape], positive integers. "
                         f"Received: chain_shape={chain_shape!r}")
    return sizes


def _check_chain_fits(chain_shape, batch_shape):
    """An `InputError` unless the chains hold visible units of the batch's shape (an unknown size fits any)."""
    if not shape_fits(chain_shape, (None, *batch_shape[1:])):
        raise InputError(f"The persistent chains hold visible units of shape {chain_shape[1:]} (chain_shape="
                         f"{chain_shape}), the batch's are {batch_shape[1:]}; give chain_shape as "
                         "[chains, *the visible units' shape].")


def cd_step(model, x, steps=1, chain=None, l2=0.0, sparsity=None):
    """One pure CD step: the descent gradients (with L2) and the statistics.

    Returns `(grads, negatives, stats)`; `grads` are aligned with
    `model.trainable_weights` and are *descent* directions, i.e. `-dW + l2 W`
    for the CD update dW (Hauser eq. 18), ready for a Keras optimizer.
    `sparsity=(target, cost)` adds the sparsity penalty of `EnergyModel`; `l2`
    is a finite number >= 0.
    """
    l2 = check_number(l2, "l2", minimum=0)
    ascent, negatives, stats = model.cd_gradients(x, steps=steps, chain=chain, sparsity=sparsity)
    return descent(ascent, model.trainable_weights, l2), negatives, stats


def descent(ascent, weights, l2):
    """Descent directions for a Keras optimizer: `-dW + l2 W` for each ascent direction dW.

    `ascent` holds one direction per weight, in the order of `weights` and of its shape (a model's
    `cd_gradients` contract); else an `InputError`, not a silent zip of the shorter list or a broadcast.
    """
    ascent, weights = list(ascent), list(weights)
    if len(ascent) != len(weights):
        raise InputError(f"descent needs one ascent direction per trainable weight. Received: "
                         f"{len(ascent)} directions for {len(weights)} weights")
    for k, (g, w) in enumerate(zip(ascent, weights)):
        if not shape_fits(tuple(g.shape), tuple(w.shape)):          # an unknown traced size fits
            raise InputError(f"Ascent direction {k} must have its weight's shape {tuple(w.shape)}. "
                             f"Received: shape {tuple(g.shape)}")
    return [-g + l2 * w for g, w in zip(ascent, weights)]


def sharded_cd_step(step, x, shards, chain=None, targets=None):
    """`step(x, chain, targets) -> (grads, negatives, stats)` on `shards` parts of the batch, combined.

    The gradients are batch means, so the whole batch's is the mean of the
    shards' weighted by their sizes (`poecaps.trainers.shards`); negatives
    and statistics are per example and are concatenated. `targets` (the
    decoder's lower capsules) are cut like `x`, a persistent chain by its
    own length.
    """
    n = batch_size(x)
    bounds = shard_bounds(n, shards)
    chain_bounds = bounds if chain is None else shard_bounds(batch_size(chain), shards)
    kept = nonempty(bounds, n)
    bounds, chain_bounds = [bounds[k] for k in kept], [chain_bounds[k] for k in kept]
    parts = [step(x[a:b], None if chain is None else chain[c:d], None if targets is None else targets[a:b])
             for (a, b), (c, d) in zip(bounds, chain_bounds)]
    grads = [size_weighted_mean([part[0][k] for part in parts], bounds, n)
             for k in range(len(parts[0][0]))]
    negatives = ops.concatenate([part[1] for part in parts], axis=0)
    stats = {key: ops.concatenate([part[2][key] for part in parts], axis=0) for key in parts[0][2]}
    return grads, negatives, stats


def default_optimizer(learning_rate=0.05, decay_steps=1000, decay_rate=0.95, momentum=0.9):
    """SGD with momentum and exponential learning-rate decay (Hauser Algorithm 1):
    `lr(step) = learning_rate * decay_rate ^ (step / decay_steps)`, momentum in [0, 1)."""
    learning_rate = check_number(learning_rate, "learning_rate", above=0)
    decay_steps = check_integer(decay_steps, "decay_steps")
    decay_rate = check_number(decay_rate, "decay_rate", above=0)
    momentum = check_number(momentum, "momentum", minimum=0, below=1)
    schedule = keras.optimizers.schedules.ExponentialDecay(learning_rate, decay_steps, decay_rate)
    # Scaled so that the NaN guard can halve it (poecaps.trainers.guard).
    return keras.optimizers.SGD(learning_rate=ScaledSchedule(schedule), momentum=momentum)


class CDTrainer(Trainer):
    """Trains an energy model (`poecaps.experts.EnergyModel`) with CD-k or persistent CD.

    `train_step` maps images to the model's visible units with the frozen
    `preprocess` callable, asks the model for its closed-form CD update, adds
    L2 weight decay and applies it through the compiled Keras optimizer (SGD
    with momentum and decay by default). Metrics per epoch:
    `reconstruction_error` (mean squared error of a one-step reconstruction
    of the visible units), `p_on` (mean probability that a hidden unit is
    on), `free_energy` (mean F of the training batches) and, at the end of
    each epoch (`FreeEnergyGap` callback), `free_energy_gap`: mean F on the
    held-out batch minus mean F on a fixed training batch of the same size
    (growing means overfitting).

    Args:
        model: the energy model to train (its weights are the trainable ones).
        preprocess: frozen callable images -> visible units (None: identity).
        steps: k of CD-k (>= 1).
        persistent: keep persistent chains (PCD) of shape `chain_shape`.
        chain_shape: visible shape of the chains, `[batch, ...]` (persistent only).
        l2: L2 weight decay coefficient (>= 0).
        heldout: a held-out batch of images for the free-energy gap, or None.
        seed: seed (an integer >= 0, or None: unseeded) of the persistent
            chains' initial states. The samples of CD are the model's own
            draws (the RBM's from its own `seed`; capsule experts draw none).
        sparsity_target, sparsity_cost: with a cost > 0, the update also
            descends `cost sum_j (q_j - target)^2`, `q_j` the batch's mean
            probability that hidden unit j is on (per replica under a
            strategy, per shard with `shards > 1`); cost 0 (default) turns
            it off. The target is a probability in (0, 1), with a cost or
            without.
        population_sparsity_cost: with a cost > 0, the update also descends
            `cost J mean_b (r_b - sparsity_target)^2`, `r_b` the mean
            probability over the J hidden units for example b (population
            sparsity: few units on per example); 0 (default) turns it off.
        shards: cut each batch into this many near-equal parts, each a CD
            step compiled by XLA on its own, which TensorFlow's executor runs
            at the same time on different cores (XLA runs one computation's
            element-wise work on one core). The update is the same as the
            whole batch's (a size-weighted mean of the shards' means), bar
            the sparsity penalty's `q_j`. With `shards > 1` the trainer
            itself is never XLA-compiled, whatever `compile(jit_compile=...)`
            says: one XLA computation would run the shards one after the
            other. Not for models that draw random numbers (the RBM's Gibbs
            sampler): concurrent shards would share its seed generator.
    """

    trained_as = "energy_model"
    trains = (EnergyModel,)

    def __init__(self, model, preprocess=None, steps=1, persistent=False, chain_shape=None,
                 l2=1e-4, heldout=None, seed=None, sparsity_target=0.1, sparsity_cost=0.0, shards=1,
                 population_sparsity_cost=0.0, **kwargs):
        super().__init__(model, **kwargs)
        steps, shards = check_integers(steps=steps, shards=shards)
        if shards > 1 and getattr(model, "draws_random_numbers", False):
            raise InputError(f"{type(model).__name__} draws random numbers from one seed generator, which "
                             f"concurrent shards would share; use shards=1. Received: shards={shards}")
        l2 = check_number(l2, "l2", minimum=0)
        persistent = check_flag(persistent, "persistent")
        if persistent and chain_shape is None:
            raise InputError("Persistent CD needs the chains' shape. Received: chain_shape=None")
        if not persistent and chain_shape is not None:
            raise InputError("chain_shape is the shape of persistent CD's chains; pass persistent=True for "
                             f"persistent CD, or no chain_shape for CD-k. Received: chain_shape={chain_shape!r}")
        if persistent:
            chain_shape = _check_chain_shape(chain_shape)
        if persistent and distribute.num_replicas() > 1:
            raise InputError("Persistent chains live on one device; use CD-k (persistent=False) under a "
                             f"strategy with {distribute.num_replicas()} replicas. Received: persistent=True")
        sparsity = check_sparsity((sparsity_target, sparsity_cost, population_sparsity_cost))
        self.sparsity = sparsity if sparsity[1] or sparsity[2] else None      # no penalty without a cost
        self.energy_model = model
        self._identity_preprocess = preprocess is None
        self.preprocess = preprocess or (lambda images: images)
        self.steps = steps
        self.persistent = persistent
        self.l2 = l2
        self.shards = shards
        self._shard_step = graph(self._one_shard, jit_compile=True) if shards > 1 else None
        seed = check_seed(seed, allow_none=True)
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.chain = None
        if persistent:
            self.chain = self.add_weight(
                name="chain", shape=tuple(chain_shape), trainable=False,
                initializer=keras.initializers.RandomUniform(0.0, 0.1, seed=seed))
        self.heldout = None if heldout is None else ops.convert_to_numpy(self.preprocess(heldout))
        self.trackers = {name: keras.metrics.Mean(name=name)
                         for name in ("reconstruction_error", "p_on", "free_energy")}

    def compile(self, *args, jit_compile="auto", auto_scale_loss=False, **kwargs):
        """Keras' `compile`, with two differences. With shards, each shard is its own XLA computation (see the
        class docstring). And no loss scaling: the optimizer receives CD's closed-form statistics, computed in
        float32 (the energy models keep float32 under a mixed policy), not the gradients of a scaled loss, so
        the `LossScaleOptimizer` that Keras puts in under mixed_float16 would divide them by its scale (2^15 at
        first) and CD would barely move. Refused if the optimizer given is one."""
        super().compile(*args, jit_compile=False if self.shards > 1 else jit_compile,
                        auto_scale_loss=auto_scale_loss, **kwargs)
        if isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer):
            raise InputError(f"{type(self).__name__} hands the optimizer CD's statistics, not a scaled loss's "
                             "gradients; a LossScaleOptimizer would divide them by its scale. Pass its "
                             "inner_optimizer, or compile with auto_scale_loss=False.")

    @property
    def metrics(self):
        return list(self.trackers.values())

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` fit the energy model (whether a y is given is `check_batch`'s to judge)."""
        shape = self.energy_model.visible_shape if self.energy_model.built else None
        if self._identity_preprocess:
            check_array(x, "x (visible units)", shape)
        else:
            check_array(x, "x (images)")

    def call(self, images):
        return self.energy_model(self.preprocess(images))

    def _batch(self, data):
        """`(visible units, targets or None)` of a batch: its images through the frozen `preprocess`, both in
        `data_dtype`."""
        images, targets = unpack(data, self)
        return to_dtype(ops.stop_gradient(self.preprocess(images)), self.data_dtype), to_dtype(targets, self.data_dtype)

    def _update_metrics(self, x, stats):
        error = ops.mean(ops.square(ops.reshape(x - stats["reconstruction"], (ops.shape(x)[0], -1))))
        self.trackers["reconstruction_error"].update_state(error)
        self.trackers["p_on"].update_state(ops.mean(stats["p_on"]))
        self.trackers["free_energy"].update_state(ops.mean(stats["free_energy"]))
        return {name: tracker.result() for name, tracker in self.trackers.items()}

    def train_step(self, data):
        x, targets = self._batch(data)
        chain = None if self.chain is None else ops.convert_to_tensor(self.chain)
        if chain is not None:
            _check_chain_fits(tuple(chain.shape), tuple(x.shape))
        if self._shard_step is None:
            grads, negatives, stats = self._one_shard(x, chain, targets)
        else:
            grads, negatives, stats = sharded_cd_step(self._shard_step, x, self.shards, chain, targets)
        grads = self.regularized_gradients(grads, self.energy_model.trainable_weights)
        # Each replica's statistics average its share of the batch; Keras sums replicas' gradients.
        scale = distribute.replica_scale()
        grads = [g * scale for g in grads]
        self.optimizer.apply(grads, self.energy_model.trainable_weights)
        if self.chain is not None:
            self.chain.assign(negatives)
        return self._update_metrics(x, stats)

    def _one_shard(self, x, chain, targets):
        return cd_step(self.energy_model, x, self.steps, chain, self.l2, self.sparsity)

    def test_step(self, data):
        x, _ = self._batch(data)
        _, _, stats = self.energy_model.cd_gradients(x, steps=1)
        return self._update_metrics(x, stats)


# CDTrainer's settings of its sampling, which the decoder rules do not use.
SAMPLING_SETTINGS = ("steps", "persistent", "chain_shape", "sparsity_target", "sparsity_cost",
                     "population_sparsity_cost")


class DecoderTrainer(CDTrainer):
    """Trains a capsule decoder's U on (upper, lower) pairs by one of Hauser's decoder rules.

    `rule="section41"` (section 4.1's update as printed) or `"delta"` (the
    wake-sleep delta rule, not in the paper), both in
    `poecaps.experts.CapsuleExperts`, with L2 weight decay, through the
    compiled Keras optimizer. `fit(upper, lower)`. Metrics per epoch:
    `code_error` (mean squared error of the decoded pre-activations `z~`
    against the data's), `p_on` and `free_energy` as for `CDTrainer`.

    Args: `rule`, then `model`, `preprocess`, `l2`, `heldout`, `seed` and
    `shards` as for `CDTrainer` (these rules draw no samples, so CD's steps,
    chains and sparsity do not apply: `SAMPLING_SETTINGS` are refused).
    """

    targets = "lower capsules"
    trains = (CapsuleExperts,)

    def __init__(self, model, rule="section41", preprocess=None, l2=1e-4, heldout=None, seed=None, shards=1,
                 **kwargs):
        check_choice(rule, "rule", DECODER_RULES)
        unused = [name for name in SAMPLING_SETTINGS if name in kwargs]
        if unused:
            raise InputError(f"The decoder rules draw no samples, so CD's {', '.join(unused)} would be unused. "
                             f"Received: {', '.join(f'{name}={kwargs[name]!r}' for name in unused)}")
        super().__init__(model, preprocess, l2=l2, heldout=heldout, seed=seed, shards=shards, **kwargs)
        self.rule = rule
        self.trackers = {name: keras.metrics.Mean(name=name) for name in ("code_error", "p_on", "free_energy")}

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` (upper capsules) and `y` (their lower capsules, if given) fit."""
        super().check_inputs(x)
        if y is not None:
            check_array(y, "y (lower capsules)")

    def _one_shard(self, x, chain, targets):
        ascent, negatives, stats = self.energy_model.decoder_gradients(x, targets, self.rule)
        return descent(ascent, self.energy_model.trainable_weights, self.l2), negatives, stats

    def _update_metrics(self, x, stats):
        for name in self.trackers:
            self.trackers[name].update_state(ops.mean(stats[name]))
        return {name: tracker.result() for name, tracker in self.trackers.items()}

    def test_step(self, data):
        _, _, stats = self.energy_model.decoder_gradients(*self._batch(data), self.rule)
        return self._update_metrics(None, stats)


class FreeEnergyGap(keras.callbacks.Callback):
    """Adds `free_energy_gap` = mean F(held-out) - mean F(training batch) to each epoch's logs.

    Hinton's guide to RBMs: a growing gap between held-out and training data
    signals overfitting. Put it before loggers in the callback list.

    Args:
        train_batch: visible units of a fixed training batch.
        heldout: visible units of a held-out batch (same size).
    """

    def __init__(self, train_batch, heldout):
        super().__init__()
        self.train_batch, self.heldout = train_batch, heldout

    def gap(self):
        free_energy = self.model.energy_model.free_energy
        return float(ops.mean(free_energy(self.heldout)) - ops.mean(free_energy(self.train_batch)))

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["free_energy_gap"] = self.gap()


class OffCapsulesWarning(keras.callbacks.Callback):
    """Warns on stderr when an epoch ends with the hidden units all but off: mean P(on) below `threshold`.

    For capsule experts eq. 18's positive phase `2 c_ij z_j x_i^T / (1 + |z_j|^2)`
    grows `z_j` in proportion to itself, so capsules this short stay off
    (P(on) = |z_j|^2 / (1 + |z_j|^2)). The usual cause is children
    normalisation at the default initial W (docs/departures.md, "Routing axis").
    """

    def __init__(self, threshold=1e-3):
        super().__init__()
        self.threshold = check_number(threshold, "threshold", minimum=0, maximum=1)

    def on_epoch_end(self, epoch, logs=None):
        p_on = (logs or {}).get("p_on")
        if p_on is not None and p_on < self.threshold:
            print(f"\nwarning: epoch {epoch + 1}: mean P(on) of the capsules is {p_on:.3g}; CD "
                  "grows a capsule in proportion to its length, so they may never turn on. With "
                  "normalize='children' scale the initial W by I/J, the learning rate by (I/J)^2 "
                  "and L2 by (J/I)^2 (docs/departures.md, 'Routing axis').", file=sys.stderr, flush=True)
