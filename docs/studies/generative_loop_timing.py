"""EM's iterations as a loop or unrolled: what compiling and running the generative layer's steps cost.

Usage: python docs/studies/generative_loop_timing.py OUT.json [--repeats 3] [--seed 0]

`GenerativeCapsules.infer` runs its EM iterations in a `tf.while_loop`;
until 4f46c1a it unrolled them in Python (`iterations x pose_steps`
gradient steps in one graph). The unrolled reference is kept here,
verbatim but for its name. Each measurement runs in a new process (no
trace or XLA cache carried over), the two kinds alternating, `--repeats`
of each, at the sizes of the mnist-5k runs (1,152 children of 8
dimensions, 10 parents of 16, batches of 32, 10 iterations, seeded random
children with the lengths of squashed capsules):

- the inversion (`infer` and the bound, compiled by XLA as
  `experiments.generative_capsules` compiles it): its first call (tracing
  and compiling) and the median of 10 calls after it;
- the training step (`GenerativeCapsuleTrainer`, XLA): the same;
- the loop's outputs against the unrolled ones on the same batch and
  weights (max absolute difference of poses, coefficients and bound).

Prints each process's line and a `RESULT` line of the medians' ratios
(loop / unrolled); writes every figure to OUT.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np


def _unrolled_infer(self, children, activations=None, iterations=None, return_trace=False):
    """`GenerativeCapsules.infer` as of 4f46c1a (iterations unrolled)."""
    import tensorflow as tf

    from poecaps.models.generative_capsules import _TINY
    from poecaps.routing.base import RoutingResult

    children = self._children(children)
    dtype = children.dtype
    a = tf.ones(tf.shape(children)[:2], dtype) if activations is None else tf.cast(activations, dtype)
    params = {k: tf.stop_gradient(t) for k, t in self._parameters(dtype).items()}
    bound = lambda v, r: self.log_joint(children, v, r, a, params)
    v = tf.stop_gradient(self.bottom_up(children, a))
    r = self.posterior(children, v, params)
    trace = [bound(v, r)]
    step = tf.fill(tf.shape(children)[:1], tf.constant(0.1, dtype))
    for _ in range(iterations or self.em_iterations):
        r = self.posterior(children, v, params)
        current = bound(v, r)
        for _ in range(self.pose_steps):
            with tf.GradientTape() as tape:
                tape.watch(v)
                value = bound(v, r)
            grad = tape.gradient(value, v)
            trial = v + step[:, None, None] * grad
            better = bound(trial, r) >= current
            v = tf.where(better[:, None, None], trial, v)
            current = tf.where(better, bound(v, r), current)
            step = tf.where(better, step * 1.5, step * 0.5)
        trace.append(current)
    r = self.posterior(children, v, params)
    explained = tf.einsum("bi,bij->bj", a, r) / (tf.reduce_sum(a, -1, keepdims=True) + _TINY)
    result = RoutingResult(v, explained, r)
    return (result, tf.stack(trace)) if return_trace else result


def _children(seed, batch=32, count=1152, dim=8):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, count, dim))
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    return (x * rng.uniform(0.05, 0.95, size=(batch, count, 1))).astype("float32")


def _timed(fn, calls=10):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def measure(kind, seed, out):
    """In this process: one kind's timings, and its outputs saved to `out` (.npz)."""
    import keras
    import tensorflow as tf

    from poecaps.models import GenerativeCapsules
    from poecaps.trainers.generative import GenerativeCapsuleTrainer

    if kind == "unrolled":
        GenerativeCapsules.infer = _unrolled_infer
    keras.utils.set_random_seed(seed)
    x = tf.constant(_children(seed))
    layer = GenerativeCapsules(10, 16, 8, kappa=5.0, sigma=0.25, seed=seed)
    layer.build(x.shape)

    def infer(children):
        found = layer.infer(children, iterations=10)
        return found.poses, found.coefficients, layer.log_joint(children, found.poses, found.coefficients)

    invert = tf.function(infer, jit_compile=True)
    saved = []
    invert_first, invert_step = _timed(lambda: saved.append([t.numpy() for t in invert(x)]))
    np.savez(out, *saved[0])                                   # the first call's outputs
    trainer = GenerativeCapsuleTrainer(layer, iterations=10)
    trainer.compile(optimizer=keras.optimizers.Adam(3e-3), jit_compile=True)
    train_first, train_step = _timed(lambda: trainer.train_on_batch(x))
    return {"kind": kind, "inversion_first_call_s": invert_first, "inversion_call_s": invert_step,
            "train_first_step_s": train_first, "train_step_s": train_step}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=["loop", "unrolled"], help=argparse.SUPPRESS)
    p.add_argument("--outputs", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.seed, args.outputs)), flush=True)
        return
    rows = []
    base = os.path.splitext(args.out)[0]
    for repeat in range(args.repeats):
        for kind in ("loop", "unrolled"):
            outputs = f"{base}_{kind}.npz"
            line = subprocess.run([sys.executable, __file__, args.out, "--seed", str(args.seed), "--child", kind,
                                   "--outputs", outputs], check=True, capture_output=True, text=True).stdout
            row = json.loads(line.strip().splitlines()[-1])
            rows.append({"repeat": repeat, **row})
            print(json.dumps(rows[-1]), flush=True)
    loop, unrolled = (np.load(f"{base}_{k}.npz") for k in ("loop", "unrolled"))
    difference = {name: float(np.max(np.abs(loop[key] - unrolled[key])))
                  for name, key in zip(("poses", "coefficients", "bound"), ("arr_0", "arr_1", "arr_2"))}
    for k in ("loop", "unrolled"):
        os.remove(f"{base}_{k}.npz")
    medians = {kind: {name: statistics.median(r[name] for r in rows if r["kind"] == kind)
                      for name in rows[0] if name.endswith("_s")} for kind in ("loop", "unrolled")}
    ratios = {name: medians["loop"][name] / medians["unrolled"][name] for name in medians["loop"]}
    with open(args.out, "w") as handle:
        json.dump({"seed": args.seed, "repeats": args.repeats, "rows": rows, "medians": medians,
                   "loop_over_unrolled": ratios, "max_abs_difference": difference}, handle, indent=1)
    print("max |loop - unrolled|:", json.dumps(difference))
    print("RESULT " + " ".join(f"{name}={ratio:.3f}" for name, ratio in ratios.items()) + " (loop / unrolled)")


if __name__ == "__main__":
    main()
