"""Layer-wise training of the products of expert capsules (Hauser Figure 1).

Stages, in order: the conv autoencoder front end (backprop), the capsule
encoder W (CD, Algorithm 1), the capsule decoder U (section 4.1, with the
rule `--decoder-rule` names: `CapsuleExperts`), and the Bernoulli RBM
baseline on the same data and budget.
"""

import dataclasses
import json
import os
import shutil
import time

import keras
import numpy as np

from poecaps import data as data_lib
from poecaps import distribute, figures, metrics
from poecaps.capsules import with_length
from poecaps.configs import STAGES, LayerwiseConfig
from poecaps.constraints import IsometricPoses
from poecaps.errors import InputError
from poecaps.experts import CLAMPED_RULES, CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.rbm import BernoulliRBM
from poecaps.resumable import fit_resumable
from poecaps.routing import DynamicRouting
from poecaps.runs import CapsulePipeline, RunDir, batched, build_layer, load_layer, save_layer
from poecaps.validation import check_images
from trainers.autoencoder import AutoencoderTrainer
from trainers.cd import (
    CDTrainer,
    ClampedDecoderTrainer,
    FreeEnergyGap,
    OffCapsulesWarning,
    default_optimizer,
)
from trainers.shards import default_shards

# Settings that fix the data or a component's shape: a resumed run must keep them.
ARCHITECTURE = ("dataset", "limit", "seed", "filters", "kernel_size", "strides", "capsule_dim",
                "num_capsules", "upper_dim", "rbm_hidden")


def load_images(config, split):
    """Images float32 `[N, H, W, C]` and labels, shuffled with the seed (train) and limited."""
    images, labels, source = data_lib.load_arrays(config.dataset, split, config.data_dir)
    if split == "train":
        order = np.random.default_rng(config.seed).permutation(len(images))
        if config.limit:
            order = order[:config.limit]
        images, labels = images[order], labels[order]
    if len(images) == 0:
        raise InputError(f"The {split} split of {config.dataset} is empty.")
    return check_images(data_lib.to_float(images), f"{config.dataset} {split} images"), labels, source


class _MetricsLog(keras.callbacks.Callback):
    def __init__(self, run, stage):
        super().__init__()
        self.run, self.stage = run, stage

    def on_epoch_end(self, epoch, logs=None):
        self.run.append_metrics({"stage": self.stage, "epoch": epoch,
                                 **{k: float(v) for k, v in (logs or {}).items()}})


def _fit(trainer, x, config, run, stage, epochs, resume, validation_data=None, verbose="auto", y=None,
         callbacks=()):
    callbacks = list(callbacks)
    if isinstance(trainer, CDTrainer) and trainer.heldout is not None:
        callbacks.append(FreeEnergyGap(x[:len(trainer.heldout)], trainer.heldout))
    callbacks += [keras.callbacks.TensorBoard(os.path.join(run.logs, stage), write_graph=False),
                  _MetricsLog(run, stage)]
    fit_resumable(trainer, x, y, epochs=epochs, batch_size=config.batch_size, seed=config.seed,
                  checkpoint_dir=os.path.join(run.checkpoints, stage),
                  checkpoint_config={k: getattr(config, k) for k in ARCHITECTURE + ("batch_size",)},
                  resume=resume, save_every=config.save_every, on_nan=config.on_nan,
                  fault_log=run.file("faults.jsonl"), callbacks=callbacks,
                  validation_data=validation_data, verbose=verbose)


def _capsule_model(num_capsules, capsule_dim, iterations, agreement, normalize, seed, init_stddev,
                   pose_constraint="none"):
    routing = DynamicRouting(iterations, agreement=agreement, normalize=normalize)
    return CapsuleExperts(num_capsules, capsule_dim, routing=routing,
                          kernel_initializer=keras.initializers.RandomNormal(stddev=init_stddev, seed=seed),
                          kernel_constraint=IsometricPoses() if pose_constraint == "isometric" else None)


def decoder_kernel_from_encoder(encoder, reads_length=False):
    """The decoder's `U [J, I, D_in, D_out]` that starts as `encoder`'s own down pass.

    Algorithm 1 reconstructs the lower capsules as `z~_i = sum_j c_ij W_ij^T x_j`;
    the decoder computes `sum_j e_ji U_ji x_j` with `e` summing to one over the
    J upper capsules. At uniform coefficients `e = 1/J` and `c = 1/J` over
    parents or `1/I` over children, so `U_ji = (c / e) W_ij^T`: the plain
    transpose for parents, scaled by `J/I` for children (whose W are `I/J`
    times larger for the same model; tests/test_energy.py).

    With `reads_length` the decoder reads `with_length(x) = (x, |x|)/sqrt(2)`:
    the pose columns are scaled by sqrt(2) and the length column starts at 0,
    so the starting decoder computes the same as without it.
    """
    num_in, num_out = encoder.kernel.shape[:2]
    scale = encoder.routing.uniform_coefficient(num_in, num_out) * num_out
    kernel = scale * keras.ops.transpose(encoder.kernel, (1, 0, 3, 2))
    if not reads_length:
        return kernel
    return keras.ops.concatenate([kernel * np.sqrt(2.0), keras.ops.zeros_like(kernel[..., :1])], axis=-1)


def stage_l2(config, stage):
    """L2 weight decay of a CD stage: `decoder_l2` for the decoder when set, else `l2`."""
    if stage == "decoder" and config.decoder_l2 is not None:
        return config.decoder_l2
    return config.l2


def _cd_trainer(model, config, steps_per_epoch, heldout, learning_rate, l2, sparsity_cost=0.0,
                population_sparsity_cost=0.0, clamped_rule=None):
    shards = 1
    if config.jit_cd:
        shards = default_shards() if config.cd_shards is None else config.cd_shards
    if clamped_rule is not None:
        trainer = ClampedDecoderTrainer(model, clamped_rule, l2=l2, heldout=heldout, seed=config.seed, shards=shards)
    else:
        trainer = CDTrainer(model, steps=config.cd_steps, persistent=config.persistent,
                            chain_shape=(config.batch_size, *heldout.shape[1:]) if config.persistent else None,
                            l2=l2, heldout=heldout, seed=config.seed,
                            sparsity_target=config.sparsity_target, sparsity_cost=sparsity_cost, shards=shards,
                            population_sparsity_cost=population_sparsity_cost)
    trainer.compile(optimizer=default_optimizer(learning_rate, steps_per_epoch, config.decay_rate,
                                                config.momentum),
                    jit_compile=config.jit_cd)
    return trainer


def _check_encoder_stage(pipeline, config, run):
    """The decoder stage needs the trained encoder and the mean code it was trained with."""
    if pipeline.encoder is None:
        raise InputError(f"No trained encoder in {run.models}; run the 'encoder' stage first.")
    if config.center_code and pipeline.code_mean is None:
        raise InputError(f"center_code is on, but {run.models} has no code_mean.npy, the mean code the "
                         "encoder's capsules were centred with; run the 'encoder' stage again (or pass "
                         "--center-code false if the encoder was trained on uncentred capsules).")


def train_stage(stage, config, run, train, test, resume=False):
    """Train one stage and save its component under `run/models`."""
    images, test_images = train, test
    steps = int(np.ceil(len(images) / config.batch_size))
    heldout_images = test_images[:config.heldout_size]
    if stage == "autoencoder":
        ae = build_layer(ConvAutoencoder(config.filters, config.kernel_size, config.strides,
                                         config.dropout, seed=config.seed), images.shape[1:])
        trainer = AutoencoderTrainer(ae)
        trainer.compile(optimizer=keras.optimizers.Adam(config.ae_learning_rate))
        _fit(trainer, images, config, run, stage, config.ae_epochs, resume,
             validation_data=(heldout_images,))
        save_layer(ae, os.path.join(run.models, "autoencoder.npz"))
        figures.filters(keras.ops.convert_to_numpy(ae.kernel1), run.file("filters.png"))
        return
    pipeline = CapsulePipeline.load(run.models, config.capsule_dim)
    if stage == "decoder":
        _check_encoder_stage(pipeline, config, run)
    print("Computing lower capsules of the training images ...", flush=True)
    codes = batched(pipeline.autoencoder.encode, images)
    if stage == "encoder":
        code_mean_path = os.path.join(run.models, "code_mean.npy")
        if os.path.exists(code_mean_path):
            os.remove(code_mean_path)
        pipeline.code_mean = None
        if config.center_code:
            pipeline.code_mean = codes.mean(axis=0)
            np.save(code_mean_path, pipeline.code_mean)
    lower = batched(pipeline.capsules_from_code, codes)
    del codes
    heldout_lower = batched(pipeline.lower_capsules, heldout_images)
    if stage == "encoder":
        encoder = build_layer(_capsule_model(config.num_capsules, config.upper_dim,
                                             config.routing_iterations, config.agreement,
                                             config.normalize, config.seed, config.init_stddev,
                                             config.pose_constraint),
                              lower.shape[1:])
        trainer = _cd_trainer(encoder, config, steps, heldout_lower, config.cd_learning_rate,
                              stage_l2(config, stage),
                              config.sparsity_cost, config.population_sparsity_cost)
        _fit(trainer, lower, config, run, stage, config.encoder_epochs, resume,
             callbacks=[OffCapsulesWarning()])
        save_layer(encoder, os.path.join(run.models, "encoder.npz"))
    elif stage == "decoder":
        upper = batched(pipeline.upper_capsules, lower)
        directions = np.mean(upper / (np.linalg.norm(upper, axis=-1, keepdims=True) + 1e-8), axis=0)
        directions /= np.linalg.norm(directions, axis=-1, keepdims=True) + 1e-8
        # Each lower capsule's coefficients sum to one over the upper capsules,
        # as the encoder's do ("children" of the decoder are the upper capsules).
        in_dim = upper.shape[2] + int(config.decoder_length)
        decoder = build_layer(_capsule_model(lower.shape[1], lower.shape[2],
                                             config.routing_iterations, config.agreement,
                                             "children", config.seed + 1, init_stddev=0.01),
                              (upper.shape[1], in_dim))   # N(0, 0.01); --init-stddev is the encoder's
        if config.decoder_init == "encoder_transpose":
            # The trained encoder's own routing axis, whatever this call's --normalize says.
            decoder.kernel.assign(decoder_kernel_from_encoder(pipeline.encoder, config.decoder_length))
        heldout_upper = batched(pipeline.upper_capsules, heldout_lower)
        inputs = upper
        if config.decoder_input == "longest":
            # Each image's code cut to its longest capsule (the others 0), so the
            # decoder learns what one capsule alone stands for, as a Figure 2
            # sample asks of it; the targets stay the whole image's capsules.
            inputs, heldout_upper = metrics.keep_longest(upper), metrics.keep_longest(heldout_upper)
        if config.decoder_length:
            inputs, heldout_upper = (keras.ops.convert_to_numpy(with_length(v)) for v in (inputs, heldout_upper))
        trainer = _cd_trainer(decoder, config, steps, heldout_upper, config.decoder_learning_rate,
                              stage_l2(config, stage),
                              clamped_rule=config.decoder_rule if config.decoder_rule in CLAMPED_RULES else None)
        targets = None if config.decoder_rule == "mirror" else lower
        _fit(trainer, inputs, config, run, stage, config.decoder_epochs, resume, y=targets)
        save_layer(decoder, os.path.join(run.models, "decoder.npz"))
        np.save(os.path.join(run.models, "mean_directions.npy"), directions.astype("float32"))
        np.save(os.path.join(run.models, "pose_moments.npy"),
                metrics.pose_second_moments(upper).astype("float32"))
        longest_moments = metrics.longest_pose_second_moments(upper)[0]
        np.save(os.path.join(run.models, "longest_pose_moments.npy"), longest_moments.astype("float32"))
        np.save(os.path.join(run.models, "winning_axes.npy"),
                metrics.winning_side_axes(upper, longest_moments).astype("float32"))
    else:
        raise InputError(f"Unknown stage; expected one of {STAGES}. Received: stage={stage!r}")


def train_rbm(config, run, train, test, resume=False):
    """The Bernoulli RBM baseline: same pixels, batch size and epochs as the capsule encoder."""
    flat = train.reshape(len(train), -1)
    heldout = test[:config.heldout_size].reshape(-1, flat.shape[1])
    rbm = build_layer(BernoulliRBM(config.rbm_hidden, seed=config.seed), flat.shape[1:])
    trainer = CDTrainer(rbm, steps=config.cd_steps, l2=stage_l2(config, "rbm"), heldout=heldout, seed=config.seed)
    trainer.compile(optimizer=default_optimizer(config.rbm_learning_rate,
                                                int(np.ceil(len(flat) / config.batch_size)),
                                                config.decay_rate, config.momentum))
    _fit(trainer, flat, config, run, "rbm", config.encoder_epochs, resume)
    save_layer(rbm, os.path.join(run.models, "rbm.npz"))


def train_layerwise(config, run_dir, stages=STAGES, resume=False):
    """Train `stages` in order into `run_dir`; returns `{stage: seconds}`.

    With `resume`, finished stages are skipped and an interrupted stage goes
    on from its last epoch backup; without it, an existing run's state is
    discarded.
    """
    keras.utils.set_random_seed(config.seed)
    run = RunDir(run_dir)
    state = run.read_json("state.json", {}) if resume else {}
    if resume and state.get("config"):
        changed = [k for k in ARCHITECTURE if state["config"].get(k) != getattr(config, k)]
        if changed:
            raise InputError(
                f"{run_dir} was trained with other {', '.join(changed)} "
                f"(was {[state['config'].get(k) for k in changed]}); resume it "
                "with the same values or use a new --run-dir.")
    if not resume:
        for name in os.listdir(run.checkpoints):
            shutil.rmtree(os.path.join(run.checkpoints, name), ignore_errors=True)
        if os.path.exists(run.file("metrics.jsonl")):
            os.remove(run.file("metrics.jsonl"))
    state["config"] = dataclasses.asdict(config)
    state.setdefault("stages", {})
    run.write_json("config.json", dataclasses.asdict(config))
    strategy = distribute.get_strategy(config.strategy)
    train, _, source = load_images(config, "train")
    test, _, _ = load_images(config, "test")
    print(f"{config.dataset}: {len(train)} training images from {source}", flush=True)
    timings = {}
    for stage in stages:
        if stage not in STAGES:
            raise InputError(f"Unknown stage; expected one of {STAGES}. Received: stage={stage!r}")
        if resume and stage in state["stages"]:
            print(f"[{stage}] already trained ({state['stages'][stage]['seconds']:.0f} s); skipping")
            continue
        print(f"[{stage}] training ...", flush=True)
        start = time.perf_counter()
        with strategy.scope(), distribute.precision_policy(config.precision):
            if stage == "rbm":
                train_rbm(config, run, train, test, resume)
            else:
                train_stage(stage, config, run, train, test, resume)
        seconds = time.perf_counter() - start
        timings[stage] = seconds
        # A resumed run may change settings other than ARCHITECTURE, so each
        # stage keeps the ones it was trained with (config.json has the last call's).
        state["stages"][stage] = {"seconds": seconds, "config": dataclasses.asdict(config)}
        run.write_json("state.json", state)
        print(f"[{stage}] done in {seconds:.1f} s", flush=True)
    if os.path.exists(run.file("metrics.jsonl")):
        figures.training_curves(run.file("metrics.jsonl"), run.file("training_curves.png"))
    print(json.dumps({"stage_seconds": {k: round(v["seconds"], 1) for k, v in state["stages"].items()}}))
    return timings


__all__ = ["STAGES", "LayerwiseConfig", "load_images", "load_layer", "train_layerwise"]
