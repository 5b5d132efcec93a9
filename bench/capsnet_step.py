"""One CapsNet training step (Sabour et al. 2017): poecaps against a plain reference.

Batch 128, 28x28x1, conv 256 9x9, 32 x 8-D primary capsules, 10 x 16-D class
capsules, 3 routing rounds (2 agreement updates), margin loss plus the
reconstruction decoder, Adam. The reference writes the class-capsule layer
as the original code does: W tiled over the batch, inputs tiled over the
classes, one small matmul per (example, input, class); before timing, it is
given a CapsNet's weights and must give its class capsules and loss (the
run stops otherwise). Last line: RESULT
images_per_s=<n> vs_reference=<ratio> matmul_fraction=<f>, with
matmul_fraction = achieved FLOP/s (the convolutions, votes, routing sums and
decoder, forward and backward) / dense-matmul FLOP/s measured in the same run.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from common import (
    adam_step,
    best_seconds,
    count,
    cpu_allocator,
    dense_matmul_flops_per_s,
    machine,
    require_same_function,
)

from poecaps import distribute, losses
from poecaps.capsules import squash
from poecaps.models import CapsNet
from poecaps.trainers.supervised import SupervisedTrainer

# The largest difference from poecaps that the reference check accepts (see `reference_disagreement`).
TOLERANCE = 1e-5


class TiledReference(keras.Model):
    """CapsNet with the class capsules computed from tiled tensors (the original code's way)."""

    def __init__(self, num_classes=10, rounds=3):
        super().__init__()
        self.rounds = rounds
        self.conv1 = keras.layers.Conv2D(256, 9, activation="relu")
        self.primary = keras.layers.Conv2D(256, 9, strides=2)
        self.w = self.add_weight(shape=(1152, num_classes, 16, 8),
                                 initializer=keras.initializers.RandomNormal(stddev=0.1))
        self.decoder = keras.Sequential([keras.layers.Dense(512, activation="relu"),
                                         keras.layers.Dense(1024, activation="relu"),
                                         keras.layers.Dense(784, activation="sigmoid")])

    def class_poses(self, images):
        """The class capsules `v` `[B, J, 16]` after `rounds` routing rounds on the tiled votes."""
        batch = tf.shape(images)[0]
        u = squash(tf.reshape(self.primary(self.conv1(images)), (batch, 1152, 8)))
        w = tf.tile(self.w[None], [batch, 1, 1, 1, 1])                       # [B, I, J, 16, 8]
        u = tf.tile(u[:, :, None, :, None], [1, 1, self.w.shape[1], 1, 1])   # [B, I, J, 8, 1]
        votes = tf.squeeze(tf.matmul(w, u), -1)                               # [B, I, J, 16]
        logits = tf.zeros(tf.shape(votes)[:3])
        for r in range(self.rounds):
            c = tf.nn.softmax(logits, axis=2)
            v = squash(tf.reduce_sum(c[..., None] * votes, axis=1))
            if r < self.rounds - 1:
                logits += tf.reduce_sum(votes * v[:, None], -1)
        return v

    def call(self, images, labels):
        batch = tf.shape(images)[0]
        v = self.class_poses(images)
        lengths = tf.norm(v + 1e-9, axis=-1)
        mask = tf.one_hot(labels, self.w.shape[1])
        recon = self.decoder(tf.reshape(v * mask[..., None], (batch, -1)))
        loss = losses.margin_loss(labels, lengths) + 0.0005 * tf.reduce_sum(
            tf.square(tf.reshape(images, (batch, -1)) - recon), -1)
        return tf.reduce_mean(loss)


def reference_disagreement(ref, images, labels, seed):
    """How far the reference is from poecaps' CapsNet given the same weights (0 up to float32 sums).

    A fresh CapsNet (3 rounds) with its class capsules' W scaled by 10, so
    that routing moves the coefficients far from uniform (a round more or
    less then changes `v` by ~3e-3; at the initial W by ~6e-6, float noise),
    lends its weights to the reference. Returns the larger of
    max |v_ref - v| / max |v| (class capsules) and |loss_ref - loss| / |loss|;
    both are float32 sums of at most 1152 terms in another order, ~1e-6.
    """
    network = CapsNet((28, 28, 1), 10, routing_iterations=3, seed=seed)
    network.class_capsules.kernel.assign(network.class_capsules.kernel * 10)
    pairs = [(ref.conv1.kernel, network.conv1.kernel), (ref.conv1.bias, network.conv1.bias),
             (ref.primary.kernel, network.primary_conv.kernel), (ref.primary.bias, network.primary_conv.bias),
             (ref.w, network.class_capsules.kernel)]
    pairs += list(zip(ref.decoder.weights, network.decoder.weights))
    for target, source in pairs:
        target.assign(source)
    poses = network.encode(images).poses.numpy()
    loss = float(network.loss_terms(images, labels)[0])
    return max(np.abs(ref.class_poses(images).numpy() - poses).max() / np.abs(poses).max(),
               abs(float(ref(images, labels)) - loss) / abs(loss))


def capsnet_flops(batch, rounds=3):
    """Training FLOPs (forward x 3) of the convolutions, votes, routing sums and decoder."""
    conv = 2 * 81 * (20 * 20 * 1 * 256 + 6 * 6 * 256 * 256)
    unit = 2 * 1152 * 10 * 16
    votes = unit * 8
    routing = unit * (rounds + rounds - 1)     # weighted sums and agreements
    decoder = 2 * (160 * 512 + 512 * 1024 + 1024 * 784)
    return 3 * batch * (conv + votes + routing + decoder)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=128)
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--repeats", type=count(), default=3)
    p.add_argument("--precision", choices=distribute.PRECISIONS, default="float32",
                   help="policy of the poecaps model (routing stays float32; the reference is float32)")
    p.add_argument("--xla", action="store_true", help="compile the poecaps step with XLA")
    p.add_argument("--skip-reference", action="store_true")
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    images = rng.uniform(size=(args.batch, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 10, size=args.batch)
    matmul = dense_matmul_flops_per_s()
    flops = capsnet_flops(args.batch)
    with distribute.precision_policy(args.precision):
        model = SupervisedTrainer(CapsNet((28, 28, 1), 10, routing_iterations=3, seed=args.seed))
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.optimizer.build(model.trainable_variables)
    step = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=args.xla)
    seconds = best_seconds(lambda: float(step(images, labels)["loss"]), warmup=2, repeats=args.repeats)
    print(f"poecaps CapsNet ({args.precision}, xla={args.xla}): {seconds * 1e3:7.1f} ms/step  "
          f"{args.batch / seconds:6.1f} images/s  {flops / seconds / 1e9:5.1f} GFLOP/s", flush=True)
    if args.skip_reference:
        print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference=nan "
              f"matmul_fraction={flops / seconds / matmul:.3f}")
        return
    ref = TiledReference()
    ref(images, labels)
    difference = reference_disagreement(ref, images, labels, args.seed)
    require_same_function(difference, TOLERANCE, "CapsNet")
    ref_step = adam_step(ref, ref.trainable_weights, 1e-3)
    reference = best_seconds(lambda: float(ref_step(images, labels)), warmup=2, repeats=args.repeats)
    print(f"reference (tiled votes): {reference * 1e3:7.1f} ms/step  {args.batch / reference:6.1f} images/s")
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s; algorithm: {flops / 1e9:.1f} GFLOP/step; "
          f"CPU allocator: {cpu_allocator()}")
    print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference={reference / seconds:.2f} "
          f"matmul_fraction={flops / seconds / matmul:.3f}")


if __name__ == "__main__":
    main()
