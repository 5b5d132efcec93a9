"""Train a supervised capsule baseline (CapsNet or matrix capsules) into a run directory."""

import dataclasses
import json
import os
import time

import keras
import numpy as np
import tensorflow as tf

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.experiments.baseline_evaluation import (
    compiled_predictor,
    predict_in_batches,
    routing_statistics,
)
from poecaps.experiments.configs import BaselineConfig
from poecaps.experiments.runs import (
    RunDir,
    check_resumable,
    limit_test_split,
    load_images,
    read_settings,
    run_record,
)
from poecaps.experiments.step_costs import StepTimer, peak_step_bytes
from poecaps.models import CapsNet, MatrixCapsNet, RoutingCapsNet
from poecaps.models.matrix_capsnet import CHUNK_CAPSULES
from poecaps.models.routing_capsnet import layer_routers
from poecaps.models.saving import save_component
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.schedule import ScaledSchedule
from poecaps.trainers.shards import default_shards
from poecaps.trainers.supervised import SupervisedTrainer

# Settings that fix the data or the model's shape: a resumed run must keep them.
ARCHITECTURE = ("model", "routing", "loss", "dataset", "limit", "seed", "batch_size", "routing_iterations",
                "reconstruction", "em_size", "em_cost_normalization", "em_final_lambda")


def train_shards(config):
    """Concurrent XLA parts of each train step: `shards`, or 2 on a CPU under XLA, else 1."""
    if config.shards is not None:
        return config.shards
    return default_shards() if config.xla else 1


def build_network(config, image_shape, num_classes, steps_per_epoch):
    """The baseline's network for `config`: `CapsNet`, `MatrixCapsNet` or `RoutingCapsNet`."""
    if config.model == "routingnet":
        options = ({"final_lambda": config.em_final_lambda, "cost_normalization": config.em_cost_normalization}
                   if config.router == "em" else {})
        routers = layer_routers(config.router, config.routing_iterations, config.seed, **options)
        return RoutingCapsNet(image_shape, num_classes, routing=routers,
                              routing_iterations=config.routing_iterations, loss=config.loss,
                              logit_scale=config.logit_scale,
                              margin_steps=max(1, config.epochs * steps_per_epoch), seed=config.seed)
    if config.model == "capsnet":
        return CapsNet(image_shape, num_classes, routing_iterations=config.routing_iterations,
                       reconstruction=config.reconstruction, seed=config.seed)
    sizes = {"a": 64, "b": 8, "c": 16, "d": 16} if config.em_size == "small" else {"a": 32, "b": 32, "c": 32, "d": 32}
    return MatrixCapsNet(image_shape, num_classes, routing_iterations=config.routing_iterations,
                         final_lambda=config.em_final_lambda, cost_normalization=config.em_cost_normalization,
                         margin_steps=max(1, config.epochs * steps_per_epoch),
                         chunk_capsules=CHUNK_CAPSULES if config.xla else None,  # chunks pay under XLA
                         **sizes)


def _resume_state(run, config, record):
    """The run's `state.json`, checked: this version's settings, a readable state, the same model."""
    recorded = dataclasses.asdict(read_settings(run, BaselineConfig)) if record is not None else {}
    state = run.read_json("state.json", {})
    if state and (state.get("kind") != "baseline" or not isinstance(state.get("settings"), dict)):
        raise InputError(f"{run.file('state.json')} is not a baseline's state as this version writes it; "
                         "restore it or start a new run directory (--run-dir).")
    check_resumable(run, state.get("settings") or recorded, config, ARCHITECTURE)
    return state


def _routing_now(network, test, config, count=1000):
    """The class layer's routing statistics on the first `count` test images (before training: at init)."""

    _, coefficients = predict_in_batches(compiled_predictor(network, config.xla), test[:count], 256)
    return routing_statistics(network, coefficients)


class _MetricsLog(keras.callbacks.Callback):
    """Each epoch's figures to `metrics.jsonl`; Keras's `val_*` are named `test_*`, for what they are.

    The fit's validation data is the test split (or `test_images` of its
    images, which each line records: a resumed run may change the count
    between calls): its curves are drawn, and nothing (no epoch, no
    setting) is chosen by them.
    """

    def __init__(self, run, test_images):
        super().__init__()
        self.run = run
        self.test_images = test_images

    def on_epoch_end(self, epoch, logs=None):
        named = {("test_" + k[4:] if k.startswith("val_") else k): float(v) for k, v in (logs or {}).items()}
        self.run.append_metrics({"stage": "baseline", "epoch": epoch, "test_images": self.test_images, **named})


class _EpochScalars(keras.callbacks.Callback):
    """Each epoch's metrics as TensorBoard scalars (`epoch_<metric>`): the training figures under
    `logs/train/`, the fit's validation figures under `logs/test/`, since they are the test split's."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self._writers = {}

    def _writer(self, split):
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(os.path.join(self.log_dir, split))
        return self._writers[split]

    def on_epoch_end(self, epoch, logs=None):
        for name, value in (logs or {}).items():
            split, metric = ("test", name[4:]) if name.startswith("val_") else ("train", name)
            with self._writer(split).as_default():
                tf.summary.scalar("epoch_" + metric, float(value), step=epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs=None):
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def train_baseline(config, run_dir, record=None, resume=False, test_limit=None):
    """Train into `run_dir` (resuming from the last checkpoint); returns the trained network.

    `record` is what `config.json` keeps besides the settings (kind, preset,
    overrides). The network is saved as `models/model.keras`. Each epoch's
    test figures (the fit's validation) and the routing statistics at
    initialisation are measured on the test split, or on `test_limit` of its
    images spread over it (`runs.limit_test_split`); `state.json` and each
    epoch's line of `metrics.jsonl` record how many (`test_images`).
    """
    if not isinstance(config, BaselineConfig):
        raise InputError(f"config must be a BaselineConfig. Received: {type(config).__name__}")
    keras.utils.set_random_seed(config.seed)
    run = RunDir(run_dir, create="later")
    existing = run_record(run, "baseline")
    if resume:
        _resume_state(run, config, existing)
    # The data before the run is touched: images that cannot be read leave the run as it was.
    train, train_labels, source = load_images(config, "train")
    test, test_labels, _ = load_images(config, "test")
    num_classes = int(max(train_labels.max(), test_labels.max())) + 1     # the whole split's: test_limit cuts no class
    test, test_labels = limit_test_split(test, test_labels, test_limit)
    run.make()
    if not resume:
        run.start_afresh(("metrics.jsonl", "faults.jsonl", "environment.jsonl"))
    strategy = distribute.get_strategy(config.strategy)
    settings = dataclasses.asdict(config)
    record = record or existing or {"kind": "baseline", "preset": None, "overrides": {}}
    run.write_json("config.json", {**record,
                                   "settings": settings})
    run.record_environment("train")
    steps = int(np.ceil(len(train) / config.batch_size))
    print(f"{config.dataset}: {len(train)} training images from {source}", flush=True)
    with strategy.scope(), distribute.precision_policy(config.precision):
        network = build_network(config, train.shape[1:], num_classes, steps)
        trainer = SupervisedTrainer(network, max_shift=config.max_shift, seed=config.seed,
                                    shards=train_shards(config))
        schedule = keras.optimizers.schedules.ExponentialDecay(
            config.learning_rate, decay_steps=steps, decay_rate=config.decay_rate)
        # Scaled so that the NaN guard can halve it (poecaps.trainers.guard).
        trainer.compile(optimizer=keras.optimizers.Adam(ScaledSchedule(schedule)), jit_compile=config.xla)
        previous = run.read_json("state.json", {}) if resume else {}
        initial = previous.get("initial_routing") or _routing_now(network, test, config)
        timer = StepTimer()
        callbacks = [_EpochScalars(run.logs), _MetricsLog(run, len(test)), timer]
        start = time.perf_counter()
        history = fit_resumable(
            trainer, train, train_labels, epochs=config.epochs, batch_size=config.batch_size,
            seed=config.seed, checkpoint_dir=os.path.join(run.checkpoints, "baseline"),
            checkpoint_config={k: getattr(config, k) for k in ARCHITECTURE},
            resume=resume, save_every=config.save_every, on_nan=config.on_nan,
            fault_log=run.file("faults.jsonl"), callbacks=callbacks,
            validation_data=(test, test_labels))
        seconds = time.perf_counter() - start
        save_component(network, os.path.join(run.models, "model.keras"))
        # Two more steps on the model in memory (the saved one is final): the peak memory of one.
        peak = peak_step_bytes(trainer, train[:config.batch_size], train_labels[:config.batch_size])
    epochs_run = len(history.get("loss", []))
    state = {"kind": "baseline", "settings": settings, "seconds": seconds,
             "seconds_per_epoch": seconds / max(epochs_run, 1), "epochs_this_call": epochs_run,
             "seconds_per_step": timer.median_seconds, "step_peak_bytes": peak, "initial_routing": initial,
             "test_images": len(test)}
    run.write_json("state.json", state)
    print(json.dumps({"train_seconds": round(seconds, 1),
                      "seconds_per_epoch": round(state["seconds_per_epoch"], 1)}))
    return network
