"""What a training step costs: its seconds (a `fit` callback) and its peak memory (one extra step).

Both are measured on the run's own trainer, so the routing comparison's
columns come from the runs they describe. Peak memory is read from
TensorFlow's allocator statistics, which the BFC allocator keeps (poecaps
turns it on, `poecaps/__init__.py`); with another allocator it is None.
"""

import statistics
import time

import keras
import tensorflow as tf


class StepTimer(keras.callbacks.Callback):
    """Records the wall time between consecutive training batches' ends within each epoch.

    The first interval of an epoch is not recorded (its batch includes the
    epoch's start, and in the first epoch tracing and compilation), nor is
    validation, which comes after an epoch's last batch.
    """

    def __init__(self):
        super().__init__()
        self.intervals = []
        self._last = None

    def on_epoch_begin(self, epoch, logs=None):
        self._last = None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.intervals.append(now - self._last)
        self._last = now

    @property
    def median_seconds(self):
        """Median seconds per training step, or None before two batches."""
        return statistics.median(self.intervals) if self.intervals else None


def _device():
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def peak_step_bytes(trainer, images, labels):
    """Peak bytes a training step allocates beyond what is live before it; None without allocator statistics.

    Runs two steps of `trainer.train_on_batch` on `(images, labels)` (the
    first warms the step up; its weights change, so call this after the
    model is saved) and reads the allocator's peak during the second.
    """
    device = _device()
    try:
        tf.config.experimental.get_memory_info(device)
    except ValueError:
        return None
    trainer.train_on_batch(images, labels)
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    trainer.train_on_batch(images, labels)
    return int(tf.config.experimental.get_memory_info(device)["peak"] - before)
