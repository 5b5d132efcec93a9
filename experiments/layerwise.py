"""The layer-wise run of the products of expert capsules (Hauser Figure 1), its result grid and evaluation.

Stages, in order: the conv autoencoder front end (backprop), the capsule
encoder W (CD, Algorithm 1), the capsule decoder U (section 4.1, by the rule
`decoder_rule` names) and the Bernoulli RBM baseline on the same data and
budget. Each stage's output on held-out data must be finite before the next
one starts.
"""

import dataclasses
import os
import shutil
import time

import keras
import numpy as np

from poecaps import distribute, metrics
from poecaps.capsules import with_length
from poecaps.errors import InputError, NonFiniteError
from poecaps.experiments import figures
from poecaps.experiments.configs import STAGES, LayerwiseConfig
from poecaps.experiments.runs import (
    RunDir,
    check_resumable,
    load_images,
    read_settings,
    run_record,
)
from poecaps.experiments.trained import store_training_capsules
from poecaps.experts import CapsuleExperts
from poecaps.graphs import batched
from poecaps.layers import ConvAutoencoder
from poecaps.models.capsule_pipeline import CapsulePipeline, decoder_kernel_from_encoder
from poecaps.models.saving import save_component
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from poecaps.trainers.autoencoder import AutoencoderTrainer
from poecaps.trainers.cd import (
    CDTrainer,
    DecoderTrainer,
    FreeEnergyGap,
    OffCapsulesWarning,
    default_optimizer,
)
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.shards import default_shards
from poecaps.validation import check_choice

# Each stage's learning rate: what a NaN or an overflow asks to lower.
RATES = {"autoencoder": "ae_learning_rate", "encoder": "cd_learning_rate", "decoder": "decoder_learning_rate",
         "rbm": "rbm_learning_rate"}
# Settings that fix the data, a component's shape or what its weights mean: a resumed run keeps them.
ARCHITECTURE = ("dataset", "limit", "seed", "batch_size", "filters", "kernel_size", "strides",
                "capsule_dim", "num_capsules", "upper_dim", "routing_iterations", "agreement", "normalize",
                "center_code", "decoder_rule", "decoder_input", "decoder_length", "rbm_hidden")


class _MetricsLog(keras.callbacks.Callback):
    def __init__(self, run, stage):
        super().__init__()
        self.run, self.stage = run, stage

    def on_epoch_end(self, epoch, logs=None):
        self.run.append_metrics({"stage": self.stage, "epoch": epoch,
                                 **{k: float(v) for k, v in (logs or {}).items()}})


def _fit(trainer, x, config, run, stage, epochs, resume, validation_data=None, y=None, callbacks=()):
    callbacks = list(callbacks)
    if isinstance(trainer, CDTrainer) and trainer.heldout is not None and y is None:
        callbacks.append(FreeEnergyGap(x[:len(trainer.heldout)], trainer.heldout))
    callbacks += [keras.callbacks.TensorBoard(os.path.join(run.logs, stage), write_graph=False),
                  _MetricsLog(run, stage)]
    try:
        fit_resumable(trainer, x, y, epochs=epochs, batch_size=config.batch_size, seed=config.seed,
                      checkpoint_dir=os.path.join(run.checkpoints, stage),
                      checkpoint_config={k: getattr(config, k) for k in ARCHITECTURE},
                      resume=resume, save_every=config.save_every, on_nan=config.on_nan,
                      fault_log=run.file("faults.jsonl"), callbacks=callbacks,
                      validation_data=validation_data)
    except NonFiniteError as error:
        raise NonFiniteError(f"The {stage} stage stopped ({RATES[stage]}={getattr(config, RATES[stage]):g}): "
                             f"{error}") from None


def _capsule_model(num_capsules, capsule_dim, config, normalize, seed, init_stddev):
    routing = DynamicRouting(config.routing_iterations, agreement=config.agreement, normalize=normalize)
    return CapsuleExperts(num_capsules, capsule_dim, routing=routing,
                          kernel_initializer=keras.initializers.RandomNormal(stddev=init_stddev, seed=seed))


def stage_l2(config, stage):
    """L2 weight decay of a CD stage: `decoder_l2` for the decoder when set, else `l2`."""
    if stage == "decoder" and config.decoder_l2 is not None:
        return config.decoder_l2
    return config.l2


def cd_trainer(stage, model, config, steps_per_epoch, heldout):
    """The compiled trainer of the "encoder" (CD with the sparsity costs) or "decoder" (`decoder_rule`) stage."""
    shards = 1
    if config.jit_cd:
        shards = default_shards() if config.cd_shards is None else config.cd_shards
    l2 = stage_l2(config, stage)
    if stage == "decoder":
        trainer = DecoderTrainer(model, config.decoder_rule, l2=l2, heldout=heldout, seed=config.seed,
                                 shards=shards)
        learning_rate = config.decoder_learning_rate
    else:
        trainer = CDTrainer(model, steps=config.cd_steps, persistent=config.persistent,
                            chain_shape=(config.batch_size, *heldout.shape[1:]) if config.persistent else None,
                            l2=l2, heldout=heldout, seed=config.seed, sparsity_target=config.sparsity_target,
                            sparsity_cost=config.sparsity_cost, shards=shards,
                            population_sparsity_cost=config.population_sparsity_cost)
        learning_rate = config.cd_learning_rate
    trainer.compile(optimizer=default_optimizer(learning_rate, steps_per_epoch, config.decay_rate,
                                                config.momentum),
                    jit_compile=config.jit_cd)
    return trainer


def check_finite_outputs(stage, outputs):
    """Accept a stage only if its outputs on held-out data are all finite; else `NonFiniteError`."""
    bad = int(np.size(outputs) - np.count_nonzero(np.isfinite(outputs)))
    if bad:
        raise NonFiniteError(f"The {stage} stage's outputs on held-out data hold {bad} NaN or infinite values, "
                             f"so no later stage starts on it; lower {RATES[stage]} (or set on_nan=reduce-lr) "
                             "and train the stage again.")


def _check_encoder_stage(pipeline, config, run):
    """The decoder stage needs the trained encoder and the mean code it was trained with."""
    if pipeline.encoder is None:
        raise InputError(f"No trained encoder in {run.models}; train the 'encoder' stage first.")
    if config.center_code and pipeline.code_mean is None:
        raise InputError(f"center_code is on, but {run.models} has no code_mean.npy, the mean code the "
                         "encoder's capsules were centred with; train the 'encoder' stage again.")


def _train_autoencoder(config, run, images, heldout, resume):
    ae = ConvAutoencoder(config.filters, config.kernel_size, config.strides, config.dropout, seed=config.seed)
    ae.build((None, *images.shape[1:]))
    trainer = AutoencoderTrainer(ae)
    trainer.compile(optimizer=keras.optimizers.Adam(config.ae_learning_rate))
    _fit(trainer, images, config, run, "autoencoder", config.ae_epochs, resume, validation_data=(heldout,))
    check_finite_outputs("autoencoder", batched(ae.encode, heldout))
    save_component(ae, os.path.join(run.models, "autoencoder.keras"))
    figures.filters(keras.ops.convert_to_numpy(ae.kernel1), run.file("filters.png"))


def _train_encoder(config, run, pipeline, train, codes, heldout_images, steps, resume):
    code_mean_path = os.path.join(run.models, "code_mean.npy")
    if os.path.exists(code_mean_path):
        os.remove(code_mean_path)
    pipeline.code_mean = codes.mean(axis=0) if config.center_code else None
    if pipeline.code_mean is not None:
        np.save(code_mean_path, pipeline.code_mean)
    lower = batched(pipeline.capsules_from_code, codes)
    heldout_lower = batched(pipeline.lower_capsules, heldout_images)
    encoder = _capsule_model(config.num_capsules, config.upper_dim, config, config.normalize, config.seed,
                             config.init_stddev)
    encoder.build((None, *lower.shape[1:]))
    trainer = cd_trainer("encoder", encoder, config, steps, heldout_lower)
    _fit(trainer, lower, config, run, "encoder", config.encoder_epochs, resume, callbacks=[OffCapsulesWarning()])
    check_finite_outputs("encoder", batched(encoder, heldout_lower))
    save_component(encoder, os.path.join(run.models, "encoder.keras"))


def _train_decoder(config, run, pipeline, train, codes, heldout_images, steps, resume):
    _check_encoder_stage(pipeline, config, run)
    lower = batched(pipeline.capsules_from_code, codes)
    upper = batched(pipeline.upper_capsules, lower)
    heldout_upper = batched(pipeline.encode, heldout_images)
    check_finite_outputs("encoder", np.concatenate([upper.ravel(), heldout_upper.ravel()]))
    # Each lower capsule's coefficients sum to one over the upper capsules,
    # as the encoder's do ("children" of the decoder are the upper capsules).
    decoder = _capsule_model(lower.shape[1], lower.shape[2], config, "children", config.seed + 1, 0.01)
    decoder.build((None, upper.shape[1], upper.shape[2] + int(config.decoder_length)))
    # Starts as the encoder's own down pass (Algorithm 1's reconstruction).
    decoder.kernel.assign(decoder_kernel_from_encoder(pipeline.encoder, config.decoder_length))
    inputs = upper
    if config.decoder_input == "longest":
        # Each image's code cut to its longest capsule (the others 0), so the
        # decoder learns what one capsule alone stands for, as a Figure 2
        # sample asks of it; the targets stay the whole image's capsules.
        inputs, heldout_upper = metrics.keep_longest(upper), metrics.keep_longest(heldout_upper)
    if config.decoder_length:
        inputs, heldout_upper = (keras.ops.convert_to_numpy(with_length(v)) for v in (inputs, heldout_upper))
    trainer = cd_trainer("decoder", decoder, config, steps, heldout_upper)
    _fit(trainer, inputs, config, run, "decoder", config.decoder_epochs, resume, y=lower)
    check_finite_outputs("decoder", batched(decoder, heldout_upper))
    save_component(decoder, os.path.join(run.models, "decoder.keras"))
    store_training_capsules(run, pipeline, train, upper)
    # The sampler's halves of capsule space (`poecaps.samplers.CapsuleSampler`).
    np.save(os.path.join(run.models, "mean_directions.npy"), metrics.mean_directions(upper).astype("float32"))
    np.save(os.path.join(run.models, "winning_axes.npy"), metrics.winning_side_axes(upper).astype("float32"))


def train_stage(stage, config, run, train, test, resume=False):
    """Train one capsule stage ("autoencoder", "encoder" or "decoder") and save it under `run/models`."""
    check_choice(stage, "stage", STAGES[:3])
    heldout = test[:config.heldout_size]
    steps = int(np.ceil(len(train) / config.batch_size))
    if stage == "autoencoder":
        return _train_autoencoder(config, run, train, heldout, resume)
    pipeline = CapsulePipeline.load(run.models, config.capsule_dim)
    print("Computing the front end's code of the training images ...", flush=True)
    codes = batched(pipeline.autoencoder.encode, train)
    check_finite_outputs("autoencoder", codes)
    train_part = _train_encoder if stage == "encoder" else _train_decoder
    return train_part(config, run, pipeline, train, codes, heldout, steps, resume)


def train_rbm(config, run, train, test, resume=False):
    """The Bernoulli RBM baseline: same pixels, batch size and epochs as the capsule encoder."""
    flat = train.reshape(len(train), -1)
    heldout = test[:config.heldout_size].reshape(-1, flat.shape[1])
    rbm = BernoulliRBM(config.rbm_hidden, seed=config.seed)
    rbm.build((None, flat.shape[1]))
    trainer = CDTrainer(rbm, steps=config.cd_steps, l2=stage_l2(config, "rbm"), heldout=heldout, seed=config.seed)
    trainer.compile(optimizer=default_optimizer(config.rbm_learning_rate,
                                                int(np.ceil(len(flat) / config.batch_size)),
                                                config.decay_rate, config.momentum))
    _fit(trainer, flat, config, run, "rbm", config.encoder_epochs, resume)
    check_finite_outputs("rbm", batched(rbm.p_on, heldout))
    save_component(rbm, os.path.join(run.models, "rbm.keras"))


def _resume_state(run, config, resume):
    """The run's `state.json` for a resumed call (checked against `config`), or a fresh one.

    `config.json` is read first, resumed or not: damaged, or a run of
    another kind, it is an error (a new run never writes over what it cannot
    tell apart). Resuming also needs this version's settings in it and a
    readable `state.json`: never a silent restart.
    """
    fresh = {"kind": "layerwise", "stages": {}}
    record = run_record(run, "layerwise")
    if not resume:
        return fresh
    recorded = dataclasses.asdict(read_settings(run, LayerwiseConfig)) if record is not None else {}
    state = run.read_json("state.json")
    if state is None:
        check_resumable(run, recorded, config, ARCHITECTURE)     # a first stage may have left checkpoints
        print(f"Nothing trained yet in {run.path}; resuming starts every stage from its checkpoints, if any.",
              flush=True)
        return fresh
    stages = state.get("stages")
    if state.get("kind") != "layerwise" or not isinstance(stages, dict) or any(
            name not in STAGES or not isinstance(entry, dict) or not isinstance(entry.get("seconds"), (int, float))
            for name, entry in stages.items()):
        raise InputError(f"{run.file('state.json')} does not list the trained stages as this version writes "
                         "them; restore it or start a new run directory (--run-dir).")
    check_resumable(run, state.get("settings") or recorded, config, ARCHITECTURE)
    return state


# The stages whose trained models a capsule stage starts from.
PREREQUISITES = {"encoder": ("autoencoder",), "decoder": ("autoencoder", "encoder")}


def _check_prerequisites(run, stages):
    """Refuse, before the run is touched, a stage whose prerequisites neither train in this call nor lie
    trained in `run.models` (without the check a run lost its logs and checkpoints first)."""
    for stage in stages:
        missing = [need for need in PREREQUISITES.get(stage, ())
                   if need not in stages and not os.path.exists(os.path.join(run.models, f"{need}.keras"))]
        if missing:
            raise InputError(f"The {stage!r} stage starts from a trained {' and '.join(missing)}, and "
                             f"{run.models} has none; train the {', '.join(map(repr, missing))} "
                             f"stage{'s' if len(missing) > 1 else ''} first (or with it).")


def train_layerwise(config, run_dir, record=None, stages=STAGES, resume=False):
    """Train `stages` (a non-empty list of `STAGES`; each once, in training order) into `run_dir`; returns
    `{stage: seconds}` of every stage the run has trained (this call's and, resumed, the earlier ones), in
    training order.

    `record` is what `config.json` keeps besides the settings (kind, preset,
    overrides; `poecaps.experiments.cli.config_from_args`). With `resume`,
    finished stages are skipped and an interrupted stage goes on from its
    last checkpoint; without it, an existing run's checkpoints and logs are
    discarded.
    """
    if not isinstance(config, LayerwiseConfig):
        raise InputError(f"config must be a LayerwiseConfig. Received: {type(config).__name__}")
    if isinstance(stages, str) or not isinstance(stages, (list, tuple)) or not stages:
        raise InputError(f"stages must be a non-empty list of stages among {STAGES}. Received: stages={stages!r}")
    unknown = [stage for stage in stages if stage not in STAGES]
    if unknown:
        raise InputError(f"stages must be among {STAGES}. Received: {unknown}")
    stages = [stage for stage in STAGES if stage in stages]     # each once, an encoder after its autoencoder
    keras.utils.set_random_seed(config.seed)
    run = RunDir(run_dir, create="later")
    state = _resume_state(run, config, resume)
    _check_prerequisites(run, stages)
    # The data before the run is touched: images that cannot be read leave the run as it was.
    train, _, source = load_images(config, "train")
    test, _, _ = load_images(config, "test")
    run.make()
    if not resume:
        run.start_afresh(("metrics.jsonl", "faults.jsonl", "environment.jsonl"))
        for name in os.listdir(run.checkpoints):
            shutil.rmtree(os.path.join(run.checkpoints, name), ignore_errors=True)
    settings = dataclasses.asdict(config)
    state["settings"] = settings
    run.write_json("config.json", {**(record or {"kind": "layerwise", "preset": None, "overrides": {}}),
                                   "settings": settings})
    run.record_environment("train")
    strategy = distribute.get_strategy(config.strategy)
    print(f"{config.dataset}: {len(train)} training images from {source}", flush=True)
    for stage in stages:
        if resume and stage in state["stages"]:
            print(f"[{stage}] already trained ({state['stages'][stage]['seconds']:.0f} s); skipping", flush=True)
            continue
        print(f"[{stage}] training ...", flush=True)
        start = time.perf_counter()
        with strategy.scope(), distribute.precision_policy(config.precision):
            if stage == "rbm":
                train_rbm(config, run, train, test, resume)
            else:
                train_stage(stage, config, run, train, test, resume)
        seconds = time.perf_counter() - start
        # A resumed run may change settings outside ARCHITECTURE, so each stage keeps its own.
        state["stages"][stage] = {"seconds": seconds, "settings": settings}
        run.write_json("state.json", state)
        print(f"[{stage}] done in {seconds:.1f} s", flush=True)
    if os.path.exists(run.file("metrics.jsonl")):
        figures.training_curves(run.file("metrics.jsonl"), run.file("training_curves.png"))
    return {stage: state["stages"][stage]["seconds"] for stage in STAGES if stage in state["stages"]}
