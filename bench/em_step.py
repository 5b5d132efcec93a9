"""One training step of matrix capsules with EM routing: poecaps against a plain reference.

Batch 64, 28x28x1, the small configuration (A=64, B=8, C=D=16; `--size
paper` for all 32), 3 EM rounds in every capsule layer, spread loss, Adam.
The reference computes the votes as the original code does, with the 4x4
transformation matrices tiled over the batch and positions and the poses
tiled over the output capsules (one tiny matmul per vote), and runs the same
EM algorithm on those tiled tensors, with `MatrixCapsNet`'s settings (costs
standardised over the parents, final inverse temperature 1, coordinate
addition). Before timing, it is given a `MatrixCapsNet`'s weights and must
reproduce its class capsules and loss to 1e-4, or the run stops.

poecaps runs its defaults: EM from moment contractions
(`EMRouting(implementation="moments")`) and the convolutional capsule
layers in chunks of 1024 lower capsules (`--chunk-capsules 0` routes the
whole batch at once), as one graph, as
one XLA computation, and as `--shards` concurrent XLA computations on
consecutive parts of the batch (`SupervisedTrainer(shards=...)`, 2 on a CPU);
the RESULT line is the fastest of the three, named on the line before it.
Last line: RESULT images_per_s=<n> vs_reference=<ratio> matmul_fraction=<f>, with
matmul_fraction = achieved FLOP/s (convolutions, votes and EM's weighted
sums, forward x 3) / dense-matmul FLOP/s measured in the same run.
"""

import argparse
import math

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

from poecaps import losses
from poecaps.layers.conv_capsules import capsule_patches
from poecaps.models.matrix_capsnet import CHUNK_CAPSULES, MatrixCapsNet
from poecaps.trainers.shards import default_shards
from poecaps.trainers.supervised import SupervisedTrainer

SIZES = {"small": (64, 8, 16, 16), "paper": (32, 32, 32, 32)}


# The largest difference from poecaps that the reference check accepts (see `reference_disagreement`).
TOLERANCE = 1e-4


def tiled_em(votes, act, beta_u, beta_a, iterations=3, final_lambda=1.0):
    """EM routing on `[N, I, J, 16]` votes, written plainly, costs standardised over the J parents."""
    num_out = votes.shape[2]
    r = tf.ones_like(votes[..., 0]) / num_out
    for t in range(iterations):
        lam = final_lambda * (1 - 0.95 ** (t + 1))
        rw = (r * act[..., None])[..., None]                                  # [N, I, J, 1]
        r_sum = tf.reduce_sum(rw, axis=1, keepdims=True) + 1e-8               # [N, 1, J, 1]
        mu = tf.reduce_sum(rw * votes, axis=1, keepdims=True) / r_sum
        var = tf.reduce_sum(rw * tf.square(votes - mu), axis=1, keepdims=True) / r_sum + 1e-4
        cost = tf.reduce_sum((beta_u[:, None] + 0.5 * tf.math.log(var)) * r_sum, -1)   # [N, 1, J]
        mean = tf.reduce_mean(cost, -1, keepdims=True)
        cost = (cost - mean) / tf.sqrt(tf.reduce_mean(tf.square(cost - mean), -1, keepdims=True) + 1e-8)
        a_out = tf.sigmoid(lam * (beta_a - cost))                             # [N, 1, J]
        if t < iterations - 1:
            log_p = -tf.reduce_sum(tf.square(votes - mu) / (2 * var) + 0.5 * tf.math.log(2 * math.pi * var), -1)
            r = tf.nn.softmax(tf.math.log(a_out) + log_p, axis=-1)
    return mu[:, 0], a_out[:, 0]


class TiledReference(keras.Model):
    """The same network with tiled votes (`tf.tile` + one 4x4 matmul per vote)."""

    def __init__(self, sizes, num_classes=10, iterations=3):
        super().__init__()
        a, b, c, d = sizes
        self.b, self.c, self.d = b, c, d
        self.iterations = iterations
        self.conv1 = keras.layers.Conv2D(a, 5, strides=2, activation="relu")
        self.pose = keras.layers.Conv2D(b * 16, 1)
        self.act = keras.layers.Conv2D(b, 1, activation="sigmoid")
        init = keras.initializers.RandomNormal(stddev=0.5)
        self.w1 = self.add_weight(shape=(9 * b, c, 4, 4), initializer=init)
        self.w2 = self.add_weight(shape=(9 * c, d, 4, 4), initializer=init)
        self.w3 = self.add_weight(shape=(d, num_classes, 4, 4), initializer=init)
        self.betas = [self.add_weight(shape=(n,), initializer="zeros") for n in (c, c, d, d, 10, 10)]

    def _conv_caps(self, poses, act, w, strides, betas):
        patches = capsule_patches(poses, 3, strides)                        # [B, H, W, I, 16]
        _, h, wd, i, _ = patches.shape
        act_p = tf.reshape(capsule_patches(act, 3, strides), (-1, i))
        m = tf.reshape(patches, (-1, i, 1, 4, 4))
        n = tf.shape(m)[0]
        votes = tf.matmul(tf.tile(m, [1, 1, w.shape[1], 1, 1]), tf.tile(w[None], [n, 1, 1, 1, 1]))
        mu, a = tiled_em(tf.reshape(votes, (n, i, w.shape[1], 16)), act_p, *betas, self.iterations)
        return tf.reshape(mu, (-1, h, wd, w.shape[1], 16)), tf.reshape(a, (-1, h, wd, w.shape[1]))

    def class_capsules(self, images):
        """`(poses [B, 10, 16], scores [B, 10])`."""
        x = self.conv1(images)
        h, w = x.shape[1], x.shape[2]
        poses = tf.reshape(self.pose(x), (-1, h, w, self.b, 16))
        p1, a1 = self._conv_caps(poses, self.act(x), self.w1, 2, self.betas[0:2])
        p2, a2 = self._conv_caps(p1, a1, self.w2, 1, self.betas[2:4])
        _, h, w, t, _ = p2.shape
        m = tf.reshape(p2, (-1, h * w * t, 1, 4, 4))
        n = tf.shape(m)[0]
        w3 = tf.tile(self.w3[None, None], [n, h * w, 1, 1, 1, 1])
        w3 = tf.reshape(w3, (n, h * w * t, 10, 4, 4))
        votes = tf.reshape(tf.matmul(tf.tile(m, [1, 1, 10, 1, 1]), w3), (n, h * w * t, 10, 16))
        # Coordinate addition: each position's scaled centre (row, column) to entries 3 and 7.
        rows = tf.repeat((tf.range(h, dtype="float32") + 0.5) / h, w * t)
        cols = tf.tile(tf.repeat((tf.range(w, dtype="float32") + 0.5) / w, t), [h])
        coordinates = tf.stack([tf.zeros_like(rows)] * 3 + [rows] + [tf.zeros_like(rows)] * 3 + [cols]
                               + [tf.zeros_like(rows)] * 8, axis=-1)
        return tiled_em(votes + coordinates[None, :, None], tf.reshape(a2, (n, -1)), *self.betas[4:6],
                        self.iterations)

    def call(self, images, labels, margin):
        _, scores = self.class_capsules(images)
        return tf.reduce_mean(losses.spread_loss(labels, scores, margin))


def reference_disagreement(ref, images, labels, sizes, seed):
    """How far the reference is from poecaps' `MatrixCapsNet` given the same weights (0 up to float32 sums).

    A fresh `MatrixCapsNet` (routed whole, eagerly), its betas drawn from
    N(0, 1) so that they enter the check, lends its weights to the
    reference. Returns the larger of max |mu_ref - mu| / max |mu| (class
    poses), max |a_ref - a| (class activations) and |loss_ref - loss| /
    |loss| at margin 0.2. They are float32 sums in another order, and
    poecaps' EM takes each variance as E[V^2] - mu^2 (one pass, votes
    centred), which loses ~1e-7 E[V^2] / var of it; measured 2e-6 to 4e-6.
    One round more or fewer in the reference moves them by 3e-2 or more.
    """
    a, b, c, d = sizes
    keras.utils.set_random_seed(seed)
    network = MatrixCapsNet((28, 28, 1), 10, a=a, b=b, c=c, d=d, chunk_capsules=None)
    routers = network.routers
    for router in routers:
        for beta in (router.beta_u, router.beta_a):
            beta.assign(keras.random.normal(beta.shape, seed=seed))
            seed += 1
    pairs = [(ref.conv1.kernel, network.conv1.kernel), (ref.conv1.bias, network.conv1.bias),
             (ref.pose.kernel, network.primary.pose_conv.kernel), (ref.pose.bias, network.primary.pose_conv.bias),
             (ref.act.kernel, network.primary.activation_conv.kernel),
             (ref.act.bias, network.primary.activation_conv.bias),
             (ref.w1, network.conv_caps1.kernel), (ref.w2, network.conv_caps2.kernel),
             (ref.w3, network.class_capsules.kernel)]
    pairs += list(zip(ref.betas, [beta for router in routers for beta in (router.beta_u, router.beta_a)]))
    for target, source in pairs:
        target.assign(source)
    result = network.encode(images)
    poses, scores = result.poses.numpy(), result.activations.numpy()
    loss = float(network.loss_terms(images, labels, step=0)[0])
    ref_poses, ref_scores = (t.numpy() for t in ref.class_capsules(images))
    return max(np.abs(ref_poses - poses).max() / np.abs(poses).max(), np.abs(ref_scores - scores).max(),
               abs(float(ref(images, labels, margin=0.2)) - loss) / abs(loss))


def em_flops(batch, sizes, iterations=3):
    """Training FLOPs (forward x 3): convolutions, votes, and EM's weighted sums."""
    a, b, c, d = sizes
    conv = 2 * 25 * 12 * 12 * a + 2 * 12 * 12 * a * b * 17
    layers = [(25, 9 * b, c), (9, 9 * c, d), (1, 9 * d, 10)]   # (positions, inputs, outputs)
    caps = 0
    for positions, num_in, num_out in layers:
        votes = positions * num_in * num_out * 16
        caps += votes * 2 * 4                          # one 4x4 by 4x4 product per vote
        caps += votes * 2 * (2 * iterations + (iterations - 1))   # mu, var; E-step distances
    return 3 * batch * (conv + caps)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=64)
    p.add_argument("--size", choices=sorted(SIZES), default="small")
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--repeats", type=count(), default=3)
    p.add_argument("--chunk-capsules", type=count(0), default=CHUNK_CAPSULES,
                   help="lower capsules routed together (0: all at once)")
    p.add_argument("--shards", type=count(), default=default_shards(),
                   help="concurrent XLA parts of the batch in the sharded variant")
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    images = rng.uniform(size=(args.batch, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 10, size=args.batch)
    sizes = SIZES[args.size]
    matmul = dense_matmul_flops_per_s()
    flops = em_flops(args.batch, sizes)
    a, b, c, d = sizes
    results = {}
    variants = [(False, 1), (True, 1)] + ([(True, args.shards)] if args.shards > 1 else [])
    for jit, shards in variants:
        keras.utils.set_random_seed(args.seed)      # the same weights in every variant
        model = SupervisedTrainer(MatrixCapsNet((28, 28, 1), 10, a=a, b=b, c=c, d=d,
                                                chunk_capsules=args.chunk_capsules or None), shards=shards)
        model.compile(optimizer=keras.optimizers.Adam(1e-3))
        model.optimizer.build(model.trainable_variables)
        # With shards, each shard is its own XLA computation inside a plain graph step.
        step = tf.function(lambda x, y, model=model: model.train_step((x, y)),
                           jit_compile=jit and shards == 1)
        seconds = best_seconds(lambda step=step: float(step(images, labels)["loss"]),
                               warmup=2, repeats=args.repeats)
        results[jit, shards] = seconds
        chunks = args.chunk_capsules or "all"
        print(f"poecaps EM ({args.size}, chunks of {chunks}) jit_compile={jit!s:5} shards={shards}: "
              f"{seconds * 1e3:7.1f} ms/step  "
              f"{args.batch / seconds:6.1f} images/s  {flops / seconds / 1e9:5.1f} GFLOP/s", flush=True)
    best = min(results, key=results.get)
    seconds = results[best]
    ref = TiledReference(sizes)
    ref(images, labels, margin=0.2)
    difference = reference_disagreement(ref, images, labels, sizes, args.seed)
    require_same_function(difference, TOLERANCE, "MatrixCapsNet")
    ref_step = adam_step(lambda x, y: ref(x, y, margin=0.2), ref.trainable_weights, 1e-3)
    reference = best_seconds(lambda: float(ref_step(images, labels)), warmup=1, repeats=args.repeats)
    print(f"reference (tiled votes, no XLA): {reference * 1e3:7.1f} ms/step  "
          f"{args.batch / reference:6.1f} images/s")
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s; algorithm: {flops / 1e9:.2f} GFLOP/step; "
          f"CPU allocator: {cpu_allocator()}")
    print(f"best: jit_compile={best[0]} shards={best[1]}")
    print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference={reference / seconds:.2f} "
          f"matmul_fraction={flops / seconds / matmul:.3f}")


if __name__ == "__main__":
    main()
