"""Train a supervised capsule baseline (CapsNet or matrix capsules) into a run directory."""

import dataclasses
import json
import os
import time

import keras
import numpy as np

from poecaps import data as data_lib
from poecaps import distribute
from poecaps.errors import InputError
from poecaps.guard import ScaledSchedule
from poecaps.resumable import fit_resumable
from poecaps.run_options import RunOptions
from poecaps.runs import RunDir
from poecaps.validation import check_images
from trainers.shards import default_shards
from trainers.supervised import CHUNK_CAPSULES, CapsNet, MatrixCapsNet

MODELS = ("capsnet", "em")
# Settings that fix the data or the model's shape: a resumed run must keep them.
ARCHITECTURE = ("model", "dataset", "limit", "seed", "routing_iterations", "reconstruction",
                "em_size", "em_cost_normalization")


@dataclasses.dataclass(frozen=True)
class BaselineConfig(RunOptions):
    """Every setting of a baseline run (the papers' choices by default)."""

    model: str = "capsnet"             # "capsnet" (dynamic routing) or "em" (matrix capsules)
    dataset: str = "fashion_mnist"     # "mnist" or "fashion_mnist"
    data_dir: str | None = None        # IDX folder (default: Debian path, then TFDS)
    seed: int = 0                      # seeds weights, shuffling and augmentation
    limit: int | None = None           # use only this many training images
    epochs: int = 1                    # training epochs
    batch_size: int = 128              # images per step
    routing_iterations: int = -1       # -1: the paper's (2 agreement updates for CapsNet, 3 EM rounds)
    reconstruction: bool = True        # CapsNet's reconstruction decoder and loss
    learning_rate: float = 1e-3        # Adam's initial learning rate
    decay_rate: float = 0.96           # Adam's learning rate times this every epoch
    max_shift: int = 2                 # random shifts (CapsNet)
    em_size: str = "small"             # "small" (A=64, B=8, C=D=16) or "paper" (all 32)
    em_cost_normalization: str = "standardize"   # or "none": the paper's eq. 27
    em_final_lambda: float = -1.0      # -1: 1 with standardised costs, 0.01 with the paper's
    jit_compile: str = "auto"          # "auto": XLA for EM (routing-bound), not for CapsNet (conv-bound)
    shards: int | None = None          # each train step in this many concurrent XLA parts (default: 2 on a CPU under XLA, else 1; needs XLA)

    def __post_init__(self):
        super().__post_init__()
        if self.model not in MODELS:
            raise InputError(f"model must be one of {MODELS}. Received: model={self.model!r}")
        if self.dataset not in data_lib.DATASETS:
            raise InputError(f"dataset must be one of {data_lib.DATASETS}. Received: dataset={self.dataset!r}")
        if self.em_size not in ("small", "paper"):
            raise InputError(f"em_size must be 'small' or 'paper'. Received: em_size={self.em_size!r}")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1. Received: {name}={getattr(self, name)}")
        if self.learning_rate <= 0:
            raise InputError(f"learning_rate must be positive. Received: learning_rate={self.learning_rate}")
        if self.jit_compile not in ("auto", "true", "false"):
            raise InputError("jit_compile must be 'auto', 'true' or 'false'. "
                             f"Received: jit_compile={self.jit_compile!r}")
        if self.shards is not None and (self.shards < 1 or (self.shards > 1 and not self.xla)):
            raise InputError(f"shards must be >= 1, and 1 without XLA (each shard is an XLA "
                             f"computation). Received: shards={self.shards}, jit_compile={self.jit_compile!r}")
        if self.routing_iterations < -1 or (self.model == "em" and self.routing_iterations == 0):
            raise InputError("routing_iterations must be >= 0 for capsnet, >= 1 for em, or -1 for "
                             f"the paper's. Received: routing_iterations={self.routing_iterations}")

    @property
    def xla(self):
        return self.model == "em" if self.jit_compile == "auto" else self.jit_compile == "true"

    @property
    def train_shards(self):
        """Concurrent XLA parts of each train step: `shards`, or 2 on a CPU under XLA, else 1."""
        if self.shards is not None:
            return self.shards
        return default_shards() if self.xla else 1

    @property
    def iterations(self):
        if self.routing_iterations >= 0:
            return self.routing_iterations
        return 2 if self.model == "capsnet" else 3


def load_split(config, split):
    """float32 images `[N, H, W, C]` in [0, 1] and int64 labels; training split shuffled and limited."""
    images, labels, source = data_lib.load_arrays(config.dataset, split, config.data_dir)
    if split == "train":
        order = np.random.default_rng(config.seed).permutation(len(images))[:config.limit or None]
        images, labels = images[order], labels[order]
    if len(images) == 0:
        raise InputError(f"The {split} split of {config.dataset} is empty.")
    return check_images(data_lib.to_float(images), f"{config.dataset} {split} images"), labels, source


def build_model(config, image_shape, num_classes, steps_per_epoch):
    if config.model == "capsnet":
        return CapsNet(image_shape, num_classes, routing_iterations=config.iterations,
                       reconstruction=config.reconstruction, max_shift=config.max_shift,
                       seed=config.seed, shards=config.train_shards)
    sizes = {"a": 64, "b": 8, "c": 16, "d": 16} if config.em_size == "small" else {"a": 32, "b": 32, "c": 32, "d": 32}
    final_lambda = config.em_final_lambda
    if final_lambda <= 0:
        final_lambda = 1.0 if config.em_cost_normalization == "standardize" else 0.01
    return MatrixCapsNet(image_shape, num_classes, routing_iterations=config.iterations,
                         final_lambda=final_lambda, cost_normalization=config.em_cost_normalization,
                         margin_steps=max(1, config.epochs * steps_per_epoch), max_shift=0,
                         chunk_capsules=CHUNK_CAPSULES if config.xla else None,  # chunks pay under XLA
                         seed=config.seed, shards=config.train_shards, **sizes)


class _MetricsLog(keras.callbacks.Callback):
    def __init__(self, run):
        super().__init__()
        self.run = run

    def on_epoch_end(self, epoch, logs=None):
        self.run.append_metrics({"stage": "baseline", "epoch": epoch,
                                 **{k: float(v) for k, v in (logs or {}).items()}})


def train_baseline(config, run_dir, resume=False):
    """Train into `run_dir` (resuming from the last epoch backup); returns the model."""
    keras.utils.set_random_seed(config.seed)
    run = RunDir(run_dir)
    state = run.read_json("state.json", {}) if resume else {}
    if resume and state.get("config"):
        changed = [k for k in ARCHITECTURE if state["config"].get(k) != getattr(config, k)]
        if changed:
            raise InputError(f"{run_dir} was trained with other {', '.join(changed)}; resume it "
                             "with the same values or use a new --run-dir.")
    if not resume and os.path.exists(run.file("metrics.jsonl")):
        os.remove(run.file("metrics.jsonl"))
    strategy = distribute.get_strategy(config.strategy)
    run.write_json("config.json", dataclasses.asdict(config))
    train, train_labels, source = load_split(config, "train")
    test, test_labels, _ = load_split(config, "test")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1
    steps = int(np.ceil(len(train) / config.batch_size))
    print(f"{config.dataset}: {len(train)} training images from {source}", flush=True)
    with strategy.scope(), distribute.precision_policy(config.precision):
        model = build_model(config, train.shape[1:], num_classes, steps)
        schedule = keras.optimizers.schedules.ExponentialDecay(
            config.learning_rate, decay_steps=steps, decay_rate=config.decay_rate)
        # Scaled so that the NaN guard can halve it (poecaps.guard).
        model.compile(optimizer=keras.optimizers.Adam(ScaledSchedule(schedule)), jit_compile=config.xla)
        callbacks = [keras.callbacks.TensorBoard(run.logs, write_graph=False), _MetricsLog(run)]
        start = time.perf_counter()
        history = fit_resumable(
            model, train, train_labels, epochs=config.epochs, batch_size=config.batch_size,
            seed=config.seed, checkpoint_dir=os.path.join(run.checkpoints, "baseline"),
            checkpoint_config={k: getattr(config, k) for k in ARCHITECTURE + ("batch_size",)},
            resume=resume, save_every=config.save_every, on_nan=config.on_nan,
            fault_log=run.file("faults.jsonl"), callbacks=callbacks,
            validation_data=(test, test_labels))
        seconds = time.perf_counter() - start
        model.save(os.path.join(run.models, "baseline.keras"))
    epochs_run = len(history.get("loss", []))
    state = {"config": dataclasses.asdict(config), "seconds": seconds,
             "seconds_per_epoch": seconds / max(epochs_run, 1), "epochs_this_call": epochs_run}
    run.write_json("state.json", state)
    print(json.dumps({"train_seconds": round(seconds, 1),
                      "seconds_per_epoch": round(state["seconds_per_epoch"], 1)}))
    return model
