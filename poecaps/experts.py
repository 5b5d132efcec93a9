"""Energy models with one contract, and the product of expert capsules.

Every energy model offers `free_energy(x) -> [B]`, `p_on(x) -> [B, J]`,
`reconstruct(x)` and `cd_gradients(x, steps, chain)`; the CD trainer
(`trainers/cd.py`) trains any of them. Subclasses implement the private
`_cd_gradients`; the public method validates its arguments.
"""

import keras
from keras import ops

from poecaps import distribute, energy
from poecaps.capsules import squash, unsquash
from poecaps.errors import InputError
from poecaps.layers.capsule_dense import CapsuleDense, check_capsule_inputs
from poecaps.validation import check_choice, check_integer, check_number, shape_fits

# Rules of the capsule decoder, trained on (upper, lower) pairs (`CapsuleExperts.decoder_gradients`).
DECODER_RULES = ("section41", "delta")


class EnergyModel:
    """Mixin: the energy contract shared by capsule experts and the RBM.

    `cd_gradients(x, steps=1, chain=None)` returns `(grads, negatives, stats)`:
    `grads` is a list aligned with `trainable_weights`, each the ascent
    direction of contrastive divergence (`-grad [F(x) - F(x~)]` averaged over
    the batch); `negatives` are the samples `x~` (for persistent chains);
    `stats` holds `free_energy [B]`, `p_on [B, J]` and `reconstruction [B, ...]`
    (a one-step reconstruction of the data). `sparsity=(target, cost)` adds
    the ascent direction of the sparsity penalty `cost sum_j (q_j - target)^2`
    on the batch's mean probabilities `q_j = mean_b P(h_j = 1 | x_b)` (Lee,
    Ekanadham and Ng 2008; Hinton's practical guide to RBMs, section 11);
    `sparsity=(target, cost, population_cost)` also adds
    `population_cost J mean_b (r_b - target)^2` on each example's mean
    probability `r_b = mean_j P(h_j = 1 | x_b)` (`energy.sparsity_pull_j`).
    `draws_random_numbers` says whether `cd_gradients` draws from the model's
    seed generator (then `CDTrainer` cannot run it in concurrent shards).
    """

    draws_random_numbers = False

    def require_weights(self):
        """Raise `InputError` unless the layer is built (its weights exist)."""
        if not self.built or not hasattr(self, "kernel"):
            raise InputError(f"{self.name} has no weights yet; build it (call it on a batch of visible units) "
                             "or train it first.")

    def cd_gradients(self, x, steps=1, chain=None, sparsity=None):
        steps = check_integer(steps, "steps")
        if not self.built:
            self.build(tuple(x.shape))
        for visible in (x, chain):
            if visible is not None:
                self._check_visible(visible)
        sparsity = None if sparsity is None else check_sparsity(sparsity)
        return self._cd_gradients(x, steps, chain, sparsity=sparsity)


def check_sparsity(sparsity):
    """Validate `(target, cost)` or `(target, cost, population_cost)`; returns all three.

    The target is a probability in (0, 1); the costs are >= 0 (a missing
    population cost is 0).
    """
    if not isinstance(sparsity, (tuple, list)) or len(sparsity) not in (2, 3):
        raise InputError(f"sparsity must be (target, cost) or (target, cost, population_cost). "
                         f"Received: sparsity={sparsity!r}")
    target, cost, population_cost = (*sparsity, 0.0)[:3]
    return (check_number(target, "sparsity target", above=0, below=1), check_number(cost, "sparsity cost", minimum=0),
            check_number(population_cost, "population sparsity cost", minimum=0))


@keras.saving.register_keras_serializable(package="poecaps")
class CapsuleExperts(distribute.FullPrecision, CapsuleDense, EnergyModel):
    """A product of expert capsules (Hauser 2019, eq. 7-18, Algorithm 1).

    A `CapsuleDense` layer whose `W` defines the energy
    `E(x, h) = - sum_j h_j log |z_j|^2` with `z_j = sum_i c_ij W_ij x_i` and
    `c` from routing on the visible capsules (held fixed in the gradient).
    Free energy (eq. 10) `F(x) = - sum_j log(1 + |z_j|^2)`; `P(h_j=1|x) =
    |squash(z_j)|` (eq. 12-13). CD-k mixes k times by dynamic routing with
    the data's `c` (Algorithm 1); with a persistent `chain` the negative
    phase routes the chain's own state instead.

    Used as the capsule encoder (576 x 8-D -> 20 x 16-D) and, with the
    roles swapped, as the capsule decoder (20 x 16-D visible, 576 x 8-D
    hidden; Hauser section 4.1), whose `call` routes upper capsules down.

    The decoder is trained on (upper, lower) pairs by `decoder_gradients`,
    with the data's hidden pre-activations `z_i = unsquash(lower_i)` in the
    positive phase ("the data z_i and x_j fixed by the W's"):

    - `rule="section41"`, the rule as section 4.1 prints it,
      `dU_ji = 2 e_ji ( z_i x_j^T / (1 + |z_i|^2) - z~_i x~_j^T / (1 + |z~_i|^2) )`
      with `z~_i = sum_j e_ji U_ji x_j` from the data's `x_j` and
      `x~_j = squash(sum_i e_ji U_ji^T z~_i)`;
    - `rule="delta"` (not in the paper), the generative weights' delta rule
      of the wake-sleep algorithm (Hinton, Dayan, Frey and Neal 1995),
      `dU_ji = 2 e_ji ( z_i - z~_i ) x_j^T`: minus the gradient of
      `sum_i |z_i - z~_i|^2` with `e` held fixed, which regresses the
      decoded pre-activations onto the data's.

    Args: as `CapsuleDense`; the routing defaults to Hauser's cosine
    agreement with 3 rounds.
    """

    def __init__(self, num_capsules, capsule_dim, routing=None, **kwargs):
        if routing is None:
            routing = {"module": "poecaps.routing.dynamic", "class_name": "DynamicRouting",
                       "config": {"iterations": 3, "agreement": "cosine"},
                       "registered_name": "poecaps>DynamicRouting"}
        super().__init__(num_capsules, capsule_dim, routing=routing, **kwargs)

    @property
    def visible_shape(self):
        """Shape of one example's visible units, `(I, D_in)`."""
        self.require_weights()
        return (self.kernel.shape[0], self.kernel.shape[3])

    def _check_visible(self, x):
        """Refuse visible capsules that are not `[B, I, D_in]` of the kernel (`check_capsule_inputs`); the layer is
        built for the visible capsules it is first given (`CapsuleDense._check_inputs`)."""
        self._check_inputs(x)

    def coefficients(self, x):
        return ops.stop_gradient(self.route(x).coefficients)

    def _coefficients_for(self, x, c):
        """The routing's coefficients of `x`, or `c` if given: `[B, I, J]` for visible capsules `[B, I, D_in]`
        (another shape, even one that broadcasts, is an `InputError`)."""
        self._check_visible(x)
        if c is None:
            return self.coefficients(x)
        c = ops.convert_to_tensor(c)
        expected = (x.shape[0], self.kernel.shape[0], self.num_capsules)
        if not shape_fits(tuple(c.shape), expected):
            raise InputError(f"{self.name}: c must be the coefficients [B, I, J] = {list(expected)} of the visible "
                             f"capsules. Received: c of shape {list(c.shape)}")
        return c

    def free_energy(self, x, c=None):
        c = self._coefficients_for(x, c)          # first: it builds the layer on its first visible capsules
        return energy.free_energy(x, self.kernel, c)

    def p_on(self, x, c=None):
        c = self._coefficients_for(x, c)
        return energy.p_on(x, self.kernel, c)

    def reconstruct(self, x, steps=1):
        self._check_visible(x)
        return energy.mix(x, self.kernel, self.coefficients(x), steps)[0]

    def _route_j(self, x):
        """Coefficients `[J, B, I]` and pre-activations `[J, B, D_out]` of the data."""
        if hasattr(self.routing, "route_linear_j"):
            cj, zj = self.routing.route_linear_j(x, self.kernel)
            return ops.stop_gradient(cj), zj
        cj = energy.to_j_major(self.coefficients(x))
        return cj, energy.routed_sum_j(x, energy.kernel_views(self.kernel)[0], cj)

    def decoder_gradients(self, x, lower, rule):
        """A decoder rule on (upper `x`, `lower`) pairs, "section41" or "delta": `(grads, x, stats)`.

        The rules are in the class docstring. `stats` holds `free_energy [B]`,
        `p_on [B, J]` and `code_error [B]`, each example's mean squared error
        of the predicted pre-activations `z~` against `unsquash(lower)`.
        """
        check_choice(rule, "rule", DECODER_RULES)
        self._check_visible(x)
        check_capsule_inputs(self, lower.shape, (None, self.num_capsules, self.capsule_dim), what="lower capsules")
        cj, zj = self._route_j(x)
        target = ops.transpose(unsquash(lower), (1, 0, 2))
        if rule == "delta":
            grad = energy.delta_gradient_j(x, zj, cj, target)
        else:
            _, wt = energy.kernel_views(self.kernel)
            x_neg = squash(energy.reconstruct_j(zj, wt, cj, x.shape[-1]))
            grad = energy.cd_gradient_j(x, target, cj, x_neg, zj, cj)
        stats = {**_hidden_stats(zj), "code_error": ops.mean(ops.square(target - zj), axis=(0, 2))}
        return [grad], x, stats

    def _cd_gradients(self, x, steps, chain, sparsity=None):
        wr, wt = energy.kernel_views(self.kernel)
        cj, zj = self._route_j(x)
        reconstruction, zj_rec = energy.mix_j(x, wr, wt, cj, 1, zj=zj)
        if chain is None and steps == 1:
            negatives, cj_neg, zj_neg = reconstruction, cj, zj_rec
        elif chain is None:
            negatives, zj_neg = energy.mix_j(reconstruction, wr, wt, cj, steps - 1)
            cj_neg = cj
        else:
            cj_neg, zj_chain = self._route_j(chain)
            negatives, zj_neg = energy.mix_j(chain, wr, wt, cj_neg, steps, zj=zj_chain)
        grad = energy.cd_gradient_j(x, zj, cj, negatives, zj_neg, cj_neg, sparsity=sparsity)
        return [grad], negatives, {**_hidden_stats(zj), "reconstruction": reconstruction}


def _hidden_stats(zj):
    """`free_energy [B]` (eq. 10) and `p_on [B, J]` (eq. 12) from the data's pre-activations `[J, B, D]`."""
    sq = ops.transpose(ops.sum(ops.square(zj), axis=-1))
    return {"free_energy": -ops.sum(ops.log1p(sq), axis=-1), "p_on": sq / (1.0 + sq)}
