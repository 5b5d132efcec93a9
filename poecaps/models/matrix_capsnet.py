"""Matrix capsules with EM routing (Hinton, Sabour and Frosst 2018) on poecaps' layers."""

import keras
from keras import ops

from poecaps import distribute, losses
from poecaps.initializers import NearIdentity
from poecaps.layers import ClassCapsules, ConvCapsules, PrimaryMatrixCapsules
from poecaps.models.capsnet import check_classifier_arguments, check_loss_inputs
from poecaps.routing import EMRouting
from poecaps.validation import check_flag, check_image_batch, check_integer, check_integers

# Lower capsules per chunk in the convolutional capsule layers: the chunk's
# votes, 1024 x J x 16 floats, stay in the CPU's caches (bench/em_step.py).
CHUNK_CAPSULES = 1024
# the unpadded convolutions (kernel, stride), bottom up: conv1, primary capsules, ConvCaps1, ConvCaps2
CONVOLUTIONS = ((5, 2), (1, 1), (3, 2), (3, 1))


def _layer_copy(initializer, k):
    """A copy of `initializer` for the k-th capsule layer: its integer seed, if it has one, plus k."""
    config = keras.initializers.serialize(initializer)
    seed = config.get("config", {}).get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        config = {**config, "config": {**config["config"], "seed": seed + k}}
    return keras.initializers.get(config)


@keras.saving.register_keras_serializable(package="poecaps")
class MatrixCapsNet(keras.Model):
    """Matrix capsules: conv, primary matrix capsules, two convolutional capsule layers, class capsules.

    ReLU conv (A channels, 5x5 stride 2) -> primary capsules (B types, 4x4
    pose + logistic activation, 1x1) -> ConvCaps1 (C types, K=3 stride 2)
    -> ConvCaps2 (D types, K=3 stride 1) -> class capsules with coordinate
    addition; every capsule layer routes with `EMRouting`. The loss
    (`loss_terms`): spread loss with the margin raised linearly from 0.2 to
    0.9 over `margin_steps` training steps. The small configuration is
    A=64, B=8, C=D=16; the paper's A=B=C=D=32.

    Args:
        image_shape, num_classes: as `CapsNet`.
        routing_iterations: EM rounds (>= 1; the paper uses 3).
        a, b, c, d: the sizes A, B, C, D.
        final_lambda, cost_normalization: of every `EMRouting` (see there).
        margin_steps: steps over which the spread-loss margin rises.
        batch_norm: batch normalisation after the ReLU convolution (as the
            learned-routing network and public reimplementations have it).
        kernel_initializer: initializer of the capsule layers' transformation
            matrices (default `NearIdentity(0.1)`, W = I + U(-0.1, 0.1), so
            every vote starts near its child's pose; docs/em_study.md
            compares it with N(0, 0.5) and N(0, 1)). Each of the three
            layers gets its own copy; a seeded one gives layer k (0, 1, 2)
            the seed + k, so that layers of one shape do not start alike.
        chunk_capsules: lower capsules whose votes and routing are computed
            together in ConvCaps1 and ConvCaps2: each layer routes
            `max(1, chunk_capsules // (9 * types in))` receptive fields at a
            time (`ConvCapsules(chunk_size=...)`); None for all at once.
            Chunks pay under XLA and cost without it (bench/em_step.py).

    Call arguments:
        images: `[B, H, W, C]` in [0, 1].

    Returns:
        dict with `scores` (class activations `[B, K]`), `poses` `[B, K, 16]`
        and the class layer's routing `coefficients` `[B, H*W*D, K]`.
    """

    def __init__(self, image_shape, num_classes, routing_iterations=3, a=64, b=8, c=16, d=16,
                 final_lambda=1.0, cost_normalization="standardize", margin_steps=10000, batch_norm=False,
                 kernel_initializer=None, chunk_capsules=CHUNK_CAPSULES, **kwargs):
        super().__init__(**kwargs)
        a, b, c, d, margin_steps = check_integers(a=a, b=b, c=c, d=d, margin_steps=margin_steps)
        self.image_shape, num_classes = check_classifier_arguments(image_shape, num_classes, CONVOLUTIONS)
        self.num_classes = num_classes
        self.routing_iterations = routing_iterations = check_integer(routing_iterations, "routing_iterations")
        self.a, self.b, self.c, self.d = a, b, c, d
        self.final_lambda = final_lambda
        self.cost_normalization = cost_normalization
        self.margin_steps = margin_steps
        self.batch_norm = batch_norm = check_flag(batch_norm, "batch_norm")
        self.kernel_initializer = keras.initializers.get(
            kernel_initializer or NearIdentity(0.1))
        self.chunk_capsules = chunk_capsules = check_integer(chunk_capsules, "chunk_capsules", allow_none=True)
        chunk = lambda types: None if chunk_capsules is None else max(1, chunk_capsules // (9 * types))
        dtype = self.dtype_policy  # every layer's, as Keras layers hand theirs on
        em = lambda name: EMRouting(routing_iterations, final_lambda,
                                    cost_normalization=cost_normalization, name=name, dtype=dtype)
        init = lambda k: _layer_copy(self.kernel_initializer, k)
        self.conv1 = keras.layers.Conv2D(a, 5, strides=2, activation="relu", name="conv1", dtype=dtype)
        self.norm = distribute.batch_normalization(name="batch_norm", dtype=dtype) if batch_norm else None
        self.primary = PrimaryMatrixCapsules(b, name="primary_capsules", dtype=dtype)
        self.conv_caps1 = ConvCapsules(c, 16, 3, 2, routing=em("em1"), chunk_size=chunk(b),
                                       kernel_initializer=init(0), name="conv_caps1", dtype=dtype)
        self.conv_caps2 = ConvCapsules(d, 16, 3, 1, routing=em("em2"), chunk_size=chunk(c),
                                       kernel_initializer=init(1), name="conv_caps2", dtype=dtype)
        self.class_capsules = ClassCapsules(num_classes, 16, routing=em("em3"), kernel_initializer=init(2),
                                            name="class_capsules", dtype=dtype)
        self.build()

    def build(self, input_shape=None):
        self.call(ops.zeros((1, *self.image_shape)))

    loss_term_names = ("spread_loss", "margin")

    @property
    def routers(self):
        """The routing layers, bottom up: ConvCaps1, ConvCaps2, class capsules."""
        return [self.conv_caps1.routing, self.conv_caps2.routing, self.class_capsules.routing]

    def encode(self, images, training=None):
        check_image_batch(images, self.image_shape[:2], type(self).__name__, self.image_shape[2])
        features = self.conv1(images)
        if self.norm is not None:
            features = self.norm(features, training=training)
        poses, act = self.primary(features)
        r1 = self.conv_caps1.route(poses, act, training=training)
        r2 = self.conv_caps2.route(r1.poses, r1.activations, training=training)
        return self.class_capsules.route(r2.poses, r2.activations, training=training)

    def call(self, images, training=None):
        result = self.encode(images, training)
        return {"scores": result.activations, "poses": result.poses,
                "coefficients": result.coefficients}

    def loss_terms(self, images, labels, training=False, step=None):
        """`(spread loss, scores [B, K], {spread_loss, margin})`; the margin at training `step` (None: final);
        `labels` `[B]` class indices (`check_loss_inputs`)."""
        result = self.encode(images, training)
        labels = check_loss_inputs(self, images, labels, step)
        margin = losses.spread_margin(self.margin_steps if step is None else step, self.margin_steps)
        spread = ops.mean(losses.spread_loss(labels, result.activations, margin))
        return spread, result.activations, {"spread_loss": spread, "margin": margin}

    def get_config(self):
        return {**super().get_config(),  # name, trainable, dtype
                "image_shape": list(self.image_shape), "num_classes": self.num_classes,
                "routing_iterations": self.routing_iterations, "a": self.a, "b": self.b, "c": self.c,
                "d": self.d, "final_lambda": self.final_lambda,
                "cost_normalization": self.cost_normalization, "margin_steps": self.margin_steps,
                "batch_norm": self.batch_norm,
                "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
                "chunk_capsules": self.chunk_capsules}
