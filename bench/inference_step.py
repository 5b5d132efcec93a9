"""500 steps of sparse iterative inference in a CapsNet: poecaps' compiled loop against eager steps.

A CapsNet of the paper's sizes without routing (untrained weights, seeded),
a batch of real digits (tests/data/mnist-5k), the primary and class
capsules free, L1 weight 1, learning rate 0.01, 500 steps, no label.
poecaps runs `poecaps.inference.infer`: one `tf.while_loop` whose steps
contract the primary capsules with the class capsules' W without forming the
votes, the L1 term by its proximal step. The reference, in this file, is a
Python loop of eager steps written plainly: the votes `[B, 1152, 10, 16]`
formed and summed at every step, a gradient tape per step, the same
proximal L1 step. Both reach the same states (printed: the largest
difference of the final class lengths).

Last line: RESULT images_per_s=<n> vs_reference=<ratio> matmul_fraction=<f>,
images_per_s counting one image through all 500 steps, matmul_fraction =
achieved FLOP/s (the class votes' contraction forward and backward, x 3) /
dense-matmul FLOP/s measured in the same run.
"""

import argparse
import os
import time

import keras
import numpy as np
import tensorflow as tf
from common import count, dense_matmul_flops_per_s, machine

from poecaps import data, inference
from poecaps.capsules import squash
from poecaps.models import CapsNet

MNIST_5K = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "mnist-5k")


def eager_reference(model, images, steps, learning_rate, l1):
    """The same inference as plain eager steps, votes formed at every step; returns the final class lengths."""
    h = model.conv1(images)
    u_target = model.primary(model.primary_conv(h))
    kernel = model.class_capsules.kernel
    c0 = 1.0 / model.num_classes

    def predict(u):
        votes = tf.einsum("bie,ijoe->bijo", u, kernel)                      # [B, I, J, D]
        return squash(tf.reduce_sum(c0 * votes, axis=1))

    u = tf.identity(u_target)
    v = predict(u)
    for _ in range(steps):
        with tf.GradientTape() as tape:
            tape.watch([u, v])
            energy = tf.reduce_sum(tf.square(u - u_target)) + tf.reduce_sum(tf.square(v - predict(u)))
        du, dv = tape.gradient(energy, [u, v])
        u, v = u - learning_rate * du, inference.shrink(v - learning_rate * dv, learning_rate * l1)
    return tf.norm(v, axis=-1)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=32)
    p.add_argument("--steps", type=count(), default=500)
    p.add_argument("--seed", type=count(0), default=0)
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    images, _, _ = data.load_arrays("mnist", "test", MNIST_5K)
    pick = np.linspace(0, len(images) - 1, args.batch).round().astype(int)
    images = tf.constant(data.to_float(images[pick]))
    model = CapsNet((28, 28, 1), 10, routing_iterations=0, reconstruction=False, seed=args.seed)
    matmul = dense_matmul_flops_per_s()

    run = lambda: inference.infer(model, images, steps=args.steps)["lengths"].numpy()
    run()                                                   # trace once
    start = time.perf_counter()
    lengths = run()
    seconds = time.perf_counter() - start

    eager_reference(model, images, 2, 0.01, 1.0)            # warm the eager kernels
    start = time.perf_counter()
    reference_lengths = eager_reference(model, images, args.steps, 0.01, 1.0).numpy()
    reference = time.perf_counter() - start

    # [B, 1152, 8] x [1152, 10, 16, 8]: forward, and the backward's two products
    flops = 3 * 2 * args.batch * 1152 * 10 * 16 * 8 * args.steps
    print(f"poecaps (one tf.while_loop): {seconds:7.2f} s for {args.steps} steps of {args.batch} digits")
    print(f"reference (eager Python loop, votes formed): {reference:7.2f} s")
    print(f"largest difference of the final class lengths: {np.abs(lengths - reference_lengths).max():.2e}")
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s")
    print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference={reference / seconds:.2f} "
          f"matmul_fraction={flops / seconds / matmul:.3f}")


if __name__ == "__main__":
    main()
