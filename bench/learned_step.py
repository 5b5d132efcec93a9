"""One training step of Faria's Table 1 network with a learned router: poecaps against a plain reference.

Batch 32, 28x28x1, 10 classes, 3 routing iterations, softmax cross-entropy on
the class activations, Adam. For each learned router (similarity,
connectionist), poecaps runs `RoutingCapsNet` as one XLA computation with its
convolutional capsule layers in chunks of 1024 lower capsules (the pipeline's
two concurrent XLA shards were no faster here: docs/benchmarks.md);
the reference, in this file, is written as the author's TensorFlow code is:
receptive fields extracted by `tf.image.extract_patches`, votes from pose
matrices and transformation matrices tiled to one small matmul per vote,
each parent's pose tiled over its children, and for the connectionist
router one LSTM input `[mu, V, c, a]` concatenated per pair; one graph, no
XLA. Both have the same weights' shapes and the same arithmetic: before
timing, the reference is given a `RoutingCapsNet`'s weights and must
reproduce its class capsules and loss to 1e-5, or the run stops.

For each router: a line per implementation, the peak memory of a step
(bytes the allocator held at its peak beyond what was live before the
step), then `RESULT images_per_s=<n> vs_reference=<ratio> matmul_fraction=<f>`,
with matmul_fraction = achieved FLOP/s (convolutions, votes, routing,
forward x 3) / dense-matmul FLOP/s measured in the same run.
"""

import argparse
import itertools

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
from poecaps.models import RoutingCapsNet
from poecaps.models.matrix_capsnet import CHUNK_CAPSULES
from poecaps.models.routing_capsnet import LAYER_SETTINGS
from poecaps.trainers.supervised import SupervisedTrainer

ITERATIONS = 3


# The largest difference from poecaps that the reference check accepts (see `reference_disagreement`).
TOLERANCE = 1e-5


def patches(x, kernel, strides):
    """`[B, H, W, C]` -> `[B, H', W', K*K*C]` by `tf.image.extract_patches` (offset-major, as the author's)."""
    return tf.image.extract_patches(x, [1, kernel, kernel, 1], [1, strides, strides, 1], [1, 1, 1, 1], "VALID")


def tiled_votes(poses, w):
    """Votes `[N, I, J, 16]` from poses `[N, I, 16]` and W `[I, J, 4, 4]`, both tiled: one 4x4 matmul per vote."""
    n, i, j = tf.shape(poses)[0], w.shape[0], w.shape[1]
    m = tf.tile(tf.reshape(poses, (-1, i, 1, 4, 4)), [1, 1, j, 1, 1])
    w = w / tf.sqrt(tf.reduce_sum(tf.square(w), axis=(-2, -1), keepdims=True) + 1e-7)
    return tf.reshape(tf.matmul(m, tf.tile(w[None], [n, 1, 1, 1, 1])), (n, i, j, 16))


class TiledSimilarity(keras.layers.Layer):
    """Similarity routing with every parent pose tiled over its children."""

    def __init__(self, num_out, num_kernels):
        super().__init__()
        per_parent = lambda value: self.add_weight(shape=(num_out,), initializer=keras.initializers.Constant(value))
        self.alpha, self.beta = per_parent(1.0), per_parent(1.0)
        self.theta1, self.theta2, self.theta3 = per_parent(1.0), per_parent(1.0), per_parent(0.1)
        widths = np.geomspace(0.25, 2.0, num_kernels)
        self.widths = self.add_weight(shape=(num_kernels,), initializer=keras.initializers.Constant(
            widths + np.log(-np.expm1(-widths))))
        self.mixture = self.add_weight(shape=(num_kernels,), initializer="zeros")

    def call(self, votes, act):
        num_in = votes.shape[1]
        log_a = tf.math.log(tf.maximum(act, 1e-12))[:, :, None]
        widths, mixture = tf.nn.softplus(self.widths), tf.nn.softmax(self.mixture)
        l1, l2 = tf.abs(self.alpha), tf.abs(self.beta)
        c = tf.ones_like(votes[..., 0]) / num_in
        mu = tf.reduce_sum(c[..., None] * votes, axis=1, keepdims=True)
        for _ in range(ITERATIONS):
            d2 = tf.reduce_sum(tf.square(votes - tf.tile(mu, [1, num_in, 1, 1])), axis=-1)
            k = tf.reduce_sum(mixture * tf.exp(-d2[..., None] / (2 * tf.square(widths))), axis=-1)
            logits = (l2 * log_a + k) / (l1 + l2 + 1e-12)
            c = tf.nn.softmax(logits, axis=1)
            mu = tf.reduce_sum(c[..., None] * votes, axis=1, keepdims=True)
        divergence = tf.reduce_sum(c * (tf.math.log(c + 1e-30) - log_a), axis=1)
        a = tf.sigmoid(tf.abs(self.theta1) * tf.reduce_sum(c * k, axis=1) - tf.abs(self.theta3) * divergence
                       + self.theta2)
        return mu[:, 0], a


class TiledConnectionist(keras.layers.Layer):
    """Connectionist routing with the LSTM input `[mu, V, c, a]` concatenated for every pair."""

    def __init__(self, units, compatibility_hidden, activation_hidden):
        super().__init__()
        self.units = units
        mlp = lambda hidden: [keras.layers.Dense(n, activation="relu") for n in hidden] + [keras.layers.Dense(1)]
        self.f_c, self.f_a = mlp(compatibility_hidden), mlp(activation_hidden)

    def build(self, votes_shape, act_shape=None):
        self.kernel = self.add_weight(shape=(2 * votes_shape[-1] + 2, 4 * self.units))
        self.recurrent = self.add_weight(shape=(self.units, 4 * self.units), initializer="orthogonal")
        self.bias = self.add_weight(shape=(4 * self.units,), initializer="zeros")

    @staticmethod
    def _mlp(layers, x):
        for layer in layers:
            x = layer(x)
        return x[..., 0]

    def call(self, votes, act):
        num_in, num_out = votes.shape[1], votes.shape[2]
        c = tf.ones_like(votes[..., 0]) / num_in
        mu = tf.reduce_sum(c[..., None] * votes, axis=1, keepdims=True)
        a = tf.tile(act[:, :, None, None], [1, 1, num_out, 1])
        h = m = tf.zeros(tf.concat([tf.shape(votes)[:3], [self.units]], 0))
        for _ in range(ITERATIONS):
            x = tf.concat([tf.tile(mu, [1, num_in, 1, 1]), votes, c[..., None], a], axis=-1)
            i, f, g, o = tf.split(tf.matmul(x, self.kernel) + tf.matmul(h, self.recurrent) + self.bias, 4, -1)
            m = tf.sigmoid(f) * m + tf.sigmoid(i) * tf.tanh(g)
            h = tf.sigmoid(o) * tf.tanh(m)
            c = tf.nn.softmax(self._mlp(self.f_c, h), axis=1)
            mu = tf.reduce_sum(c[..., None] * votes, axis=1, keepdims=True)
        return mu[:, 0], tf.sigmoid(self._mlp(self.f_a, tf.reduce_sum(c[..., None] * m, axis=1)))


class TiledReference(keras.Model):
    """The Table 1 network written as the author's code is (see the module docstring)."""

    def __init__(self, router):
        super().__init__()
        self.conv1 = keras.layers.Conv2D(64, 5, strides=2, activation="relu")
        self.batch_norm = keras.layers.BatchNormalization()
        self.pose = keras.layers.Conv2D(8 * 16, 1)
        self.act = keras.layers.Conv2D(8, 1, activation="sigmoid")
        near_identity = lambda shape: keras.initializers.Constant(
            np.eye(4) + np.random.default_rng(0).uniform(-0.1, 0.1, shape))
        self.w = [self.add_weight(shape=s, initializer=near_identity(s))
                  for s in ((72, 16, 4, 4), (144, 16, 4, 4), (144, 10, 4, 4))]
        if router == "similarity":
            self.routers = [TiledSimilarity(j, s["num_kernels"])
                            for j, s in zip((16, 16, 10), LAYER_SETTINGS["similarity"])]
        else:
            self.routers = [TiledConnectionist(s["units"], s["compatibility_hidden"], s["activation_hidden"])
                            for s in LAYER_SETTINGS["connectionist"]]

    def _conv_caps(self, poses, act, k, strides):
        p, a = patches(poses, 3, strides), patches(act, 3, strides)
        _, h, w, _ = p.shape
        num_in = self.w[k].shape[0]
        votes = tiled_votes(tf.reshape(p, (-1, num_in, 16)), self.w[k])
        mu, a_out = self.routers[k](votes, tf.reshape(a, (-1, num_in)))
        return tf.reshape(mu, (-1, h, w, 16 * 16)), tf.reshape(a_out, (-1, h, w, 16))

    def class_capsules(self, images):
        """`(poses [B, 10, 16], scores [B, 10])`, batch norm in training mode."""
        x = self.batch_norm(self.conv1(images), training=True)
        unit = lambda p: p / tf.sqrt(tf.reduce_sum(tf.square(p), axis=-1, keepdims=True) + 1e-7)
        poses = unit(tf.reshape(self.pose(x), (-1, 12, 12, 8, 16)))
        p1, a1 = self._conv_caps(tf.reshape(poses, (-1, 12, 12, 128)), self.act(x), 0, 2)
        p1 = tf.reshape(unit(tf.reshape(p1, (-1, 5, 5, 16, 16))), (-1, 5, 5, 256))
        p2, a2 = self._conv_caps(p1, a1, 1, 1)
        votes = tiled_votes(unit(tf.reshape(p2, (-1, 144, 16))), self.w[2])
        return self.routers[2](votes, tf.reshape(a2, (-1, 144)))

    def call(self, images, labels):
        _, scores = self.class_capsules(images)
        return tf.reduce_mean(losses.softmax_cross_entropy(labels, scores))


def router_pairs(ref_router, router):
    """(reference weight, poecaps weight) pairs of one layer's router."""
    if isinstance(ref_router, TiledSimilarity):
        names = [("alpha", "alpha"), ("beta", "beta"), ("theta1", "theta1"), ("theta2", "theta2"),
                 ("theta3", "theta3"), ("widths", "length_scale_logits"), ("mixture", "mixture_logits")]
        return [(getattr(ref_router, a), getattr(router, b)) for a, b in names]
    pairs = [(ref_router.kernel, router.kernel), (ref_router.recurrent, router.recurrent_kernel),
             (ref_router.bias, router.bias)]
    for ref_layers, layers in ((ref_router.f_c, router.compatibility_layers),
                               (ref_router.f_a, router.activation_layers)):
        pairs += [(a.kernel, b.kernel) for a, b in zip(ref_layers, layers, strict=True)]
        pairs += [(a.bias, b.bias) for a, b in zip(ref_layers, layers, strict=True)]
    return pairs


def reference_disagreement(ref, router, images, labels, seed):
    """How far the reference is from poecaps' `RoutingCapsNet` given the same weights (0 up to float32 sums).

    A fresh `RoutingCapsNet` (routed whole, eagerly, batch norm in training
    mode) lends every weight to the reference. Returns the larger of
    max |mu_ref - mu| / max |mu| (class poses), max |a_ref - a| (class
    activations) and |loss_ref - loss| / |loss|: float32 sums in another
    order, ~1e-6.
    """
    network = RoutingCapsNet((28, 28, 1), 10, routing=router, seed=seed)
    pairs = [(ref.conv1.kernel, network.conv1.kernel), (ref.conv1.bias, network.conv1.bias),
             (ref.pose.kernel, network.primary.pose_conv.kernel), (ref.pose.bias, network.primary.pose_conv.bias),
             (ref.act.kernel, network.primary.activation_conv.kernel),
             (ref.act.bias, network.primary.activation_conv.bias)]
    pairs += list(zip(ref.batch_norm.weights, network.batch_norm.weights, strict=True))
    pairs += list(zip(ref.w, [network.conv_caps1.kernel, network.conv_caps2.kernel,
                              network.class_capsules.kernel], strict=True))
    for ref_router, poecaps_router in zip(ref.routers, network.routers, strict=True):
        pairs += router_pairs(ref_router, poecaps_router)
    for target, source in pairs:
        assert target.shape == source.shape, (target.path, source.path)
        target.assign(source)
    result = network.encode(images, training=True)
    poses, scores = result.poses.numpy(), result.activations.numpy()
    loss = float(network.loss_terms(images, labels, training=True)[0])
    ref_poses, ref_scores = (t.numpy() for t in ref.class_capsules(images))
    return max(np.abs(ref_poses - poses).max() / np.abs(poses).max(), np.abs(ref_scores - scores).max(),
               abs(float(ref(images, labels)) - loss) / abs(loss))


def step_flops(batch, router):
    """Training FLOPs (forward x 3): convolutions, votes and the routing's main arithmetic."""
    conv = 2 * 12 * 12 * 64 * 25 + 2 * 12 * 12 * 64 * 8 * 17
    total = conv
    for k, (positions, num_in, num_out) in enumerate([(25, 72, 16), (9, 144, 16), (1, 144, 10)]):
        pairs = positions * num_in * num_out
        total += pairs * 2 * 64                                    # one 4x4 by 4x4 product per vote
        if router == "similarity":
            q = LAYER_SETTINGS["similarity"][k]["num_kernels"]
            total += pairs * ITERATIONS * (2 * 16 * 2 + 3 * q)     # distances, weighted means, kernel mixture
        else:
            s = LAYER_SETTINGS["connectionist"][k]
            widths = [16, *s["compatibility_hidden"], 1]
            mlp = sum(2 * a * b for a, b in itertools.pairwise(widths))
            total += pairs * (2 * 16 * 64 + ITERATIONS * (2 * 16 * 64 + 2 * 16 + mlp + 12 * 16))
    return 3 * batch * total


def peak_bytes(step):
    """Bytes the allocator held at its peak during `step()` beyond what was live before it (None: no statistics)."""
    if cpu_allocator() != "BFC":
        return None
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step()
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before


def poecaps_run(router, images, labels, seed):
    """A function that runs one training step of poecaps' `RoutingCapsNet` on `images` and returns the loss
    (weights from Keras seeded with `seed`; one XLA computation, convolutional capsule layers in chunks)."""
    keras.utils.set_random_seed(seed)
    model = SupervisedTrainer(RoutingCapsNet((28, 28, 1), 10, routing=router, chunk_capsules=CHUNK_CAPSULES))
    model.compile(optimizer=keras.optimizers.Adam(3e-3))
    model.optimizer.build(model.trainable_variables)
    step = tf.function(lambda x, y: model.train_step((x, y)), jit_compile=True)
    return lambda: float(step(images, labels)["loss"])


def reference_run(router, images, labels, seed):
    """A function that runs one training step of the reference on `images` and returns the loss. Before it is
    returned, the reference is given poecaps' weights and must reproduce its function (`reference_disagreement`;
    the run stops if not)."""
    ref = TiledReference(router)
    ref(images, labels)
    difference = reference_disagreement(ref, router, images, labels, seed)
    require_same_function(difference, TOLERANCE, f"RoutingCapsNet ({router})", prefix=f"{router}: ")
    step = adam_step(ref, ref.trainable_weights, 3e-3)
    return lambda: float(step(images, labels))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=32)
    p.add_argument("--router", action="append", choices=["similarity", "connectionist"])
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--repeats", type=count(), default=3)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    images = rng.uniform(size=(args.batch, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 10, size=args.batch)
    matmul = dense_matmul_flops_per_s()
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s; CPU allocator: {cpu_allocator()}")
    for router in args.router or ["similarity", "connectionist"]:
        run = poecaps_run(router, images, labels, args.seed)
        seconds = best_seconds(run, warmup=2, repeats=args.repeats)
        peak = peak_bytes(run)

        ref_run = reference_run(router, images, labels, args.seed)
        reference = best_seconds(ref_run, warmup=1, repeats=args.repeats)
        ref_peak = peak_bytes(ref_run)
        flops = step_flops(args.batch, router)
        mib = lambda b: "n/a" if b is None else f"{b / 2 ** 20:.0f} MiB"
        print(f"{router}: poecaps (XLA, chunks of {CHUNK_CAPSULES}) {seconds * 1e3:8.1f} ms/step, "
              f"peak {mib(peak)}; reference (tiled, extract_patches, no XLA) {reference * 1e3:8.1f} ms/step, "
              f"peak {mib(ref_peak)}; peak ratio {'n/a' if not ref_peak else f'{peak / ref_peak:.3f}'}; "
              f"{flops / 1e9:.2f} GFLOP/step", flush=True)
        print(f"RESULT images_per_s={args.batch / seconds:.1f} vs_reference={reference / seconds:.2f} "
              f"matmul_fraction={flops / seconds / matmul:.3f}", flush=True)


if __name__ == "__main__":
    main()
