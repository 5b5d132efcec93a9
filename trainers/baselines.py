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
from poecaps.runs import RunDir
from poecaps.validation import check_images
from trainers.supervised import CHUNK_CAPSULES, CapsNet, MatrixCapsNet

# Settings that fix the data or the model's shape: a resumed run must keep them.
ARCHITECTURE = ("model", "dataset", "limit", "seed", "routing_iterations", "reconstruction",
                "em_size", "em_cost_normalization")


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
