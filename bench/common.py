"""Timing helpers shared by the benchmarks (not tests: they print figures)."""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import tensorflow as tf


def count(minimum=1):
    """An argparse type: an integer >= `minimum` (`--batch 0` or `--repeats 0` end the run with argparse's one
    line, not a traceback from inside the timing)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


def best_seconds(fn, warmup=2, repeats=5):
    """Best wall time of `fn()` over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def adam_step(loss, weights, learning_rate):
    """A reference's training step, as its authors write one: `loss(x, y)` in a `tf.function` graph (no XLA),
    its gradient by `tf.GradientTape`, one Adam update of `weights`; returns the loss."""
    optimizer = keras.optimizers.Adam(learning_rate)
    optimizer.build(weights)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            value = loss(x, y)
        optimizer.apply(tape.gradient(value, weights), weights)
        return value

    return step


def dense_matmul_flops_per_s(n=2048):
    """FLOP/s of one large float32 matmul on this machine, measured now."""
    a, b = tf.random.normal((n, n)), tf.random.normal((n, n))
    matmul = tf.function(lambda: tf.matmul(a, b))
    return 2 * n**3 / best_seconds(lambda: matmul().numpy())


def machine():
    """This machine in one line, as a run's `environment.jsonl` records it: CPU name, identity, the instruction
    sets that pick kernels, and the CPUs this process may use (ratios to a reference move with the machine)."""
    from poecaps.experiments.environment import cpu, usable_cpus

    name, identity, flags = cpu()
    return (f"{name} ({identity or 'identity unknown'}; {' '.join(flags) or 'no listed flags'}), "
            f"{usable_cpus()} usable CPUs")


def cpu_allocator():
    """"BFC" or "default": TensorFlow's CPU allocator in this process (see poecaps/__init__.py)."""
    try:
        tf.config.experimental.get_memory_info("CPU:0")   # only BFC allocators keep statistics
    except ValueError:
        return "default"
    return "BFC"


def require_same_function(difference, tolerance, model, prefix=""):
    """Print the reference check's figure; stop the run unless the reference computes `model`'s function."""
    print(f"{prefix}the reference given poecaps' weights: difference {difference:.1e}", flush=True)
    if difference > tolerance:
        raise SystemExit(f"the reference computes another function than poecaps' {model}; its timing compares "
                         "nothing")
