"""Supervised capsule baselines on poecaps' layers: CapsNet and matrix capsules with EM routing.

Both are `keras.Model`s that override `train_step` and `test_step`; `call`
returns a dict with the class-capsule `lengths` (CapsNet) or `activations`
(EM) under the common key `scores`, the class `poses`, the routing
`coefficients` and, for CapsNet, the `reconstruction`.
"""

import math

import keras
from keras import ops

from poecaps import (
    distribute,
    guard,  # noqa: F401  (registers ScaledSchedule, the saved optimizers' schedule)
    losses,
    transforms,
)
from poecaps.layers import (
    CapsuleDense,
    ClassCapsules,
    ConvCapsules,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
)
from poecaps.routing import DynamicRouting, EMRouting
from poecaps.validation import check_images, check_labels
from trainers.shards import batch_size, nonempty, shard_bounds, size_weighted_mean

# Lower capsules per chunk in MatrixCapsNet's convolutional capsule layers: the
# chunk's votes, 1024 x J x 16 floats, stay in cache (bench/em_step.py; README.md).
CHUNK_CAPSULES = 1024


class _Classifier(keras.Model):
    """Training loop shared by the baselines: augmentation, loss terms as metrics, accuracy."""

    def __init__(self, image_shape, num_classes, max_shift, seed, shards=1, **kwargs):
        import tensorflow as tf

        super().__init__(**kwargs)
        if not isinstance(shards, int) or shards < 1:
            raise ValueError(f"shards must be an integer >= 1. Received: shards={shards!r}")
        if len(image_shape) != 3 or min(image_shape) <= 0:
            raise ValueError(
                f"image_shape must be (height, width, channels). Received: image_shape={image_shape}")
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2. Received: num_classes={num_classes}")
        self.image_shape = tuple(image_shape)
        self.num_classes = num_classes
        self.max_shift = max_shift
        self.seed = seed
        self.shards = shards
        self._shard_gradients = tf.function(self._gradients, jit_compile=True) if shards > 1 else None
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy_tracker = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    def build(self, input_shape=None):
        self.call(ops.zeros((1, *self.image_shape)))

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` are `[N, *image_shape]` images in [0, 1] and `y` class labels."""
        check_images(x, "x (images)", image_shape=self.image_shape)
        if y is not None:
            check_labels(y, self.num_classes, len(x), "y (labels)")

    def _loss_terms(self, images, labels, training):
        """Returns `(total [scalar], outputs dict, {name: scalar})`."""
        raise NotImplementedError

    def compile(self, *args, jit_compile="auto", **kwargs):
        # With shards, each shard is its own XLA computation (see the subclasses' `shards`).
        super().compile(*args, jit_compile=False if self.shards > 1 else jit_compile, **kwargs)

    def compile_from_config(self, config):
        # Keras' own skips models that override `compile` (ours only keeps XLA off around shards).
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)

    def train_step(self, data):
        images, labels = data
        # Shifted here, outside the shards, which would otherwise share the seed generator.
        images = transforms.random_shift(images, self.max_shift, seed=self.seed_generator)
        if self._shard_gradients is None:
            grads, loss, scores, terms = self._gradients(images, labels)
        else:
            grads, loss, scores, terms = self._sharded_gradients(images, labels)
        self.optimizer.apply(grads, self.trainable_weights)
        return self._update_metrics(loss, labels, {"scores": scores}, terms)

    def _gradients(self, images, labels):
        """`(gradients, loss, scores, {name: term})` of one batch (or shard)."""
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss, outputs, terms = self._loss_terms(images, labels, training=True)
            # Keras sums replicas' gradients; under mixed_float16 the optimizer scales the loss.
            scaled = self.optimizer.scale_loss(loss * distribute.replica_scale())
        return tape.gradient(scaled, self.trainable_weights), loss, outputs["scores"], terms

    def _sharded_gradients(self, images, labels):
        """`_gradients` of the whole batch from `shards` concurrent XLA computations on its parts.

        Loss, terms and gradients are batch means: the shards' are joined by
        their size-weighted mean; the scores are concatenated.
        """
        n = batch_size(images)
        bounds = shard_bounds(n, self.shards)
        bounds = [bounds[k] for k in nonempty(bounds, n)]
        parts = [self._shard_gradients(images[a:b], labels[a:b]) for a, b in bounds]
        grads = [size_weighted_mean([part[0][k] for part in parts], bounds, n)
                 for k in range(len(parts[0][0]))]
        loss = size_weighted_mean([part[1] for part in parts], bounds, n)
        scores = ops.concatenate([part[2] for part in parts], axis=0)
        terms = {name: size_weighted_mean([part[3][name] for part in parts], bounds, n)
                 for name in parts[0][3]}
        return grads, loss, scores, terms

    def test_step(self, data):
        images, labels = data
        loss, outputs, terms = self._loss_terms(images, labels, training=False)
        return self._update_metrics(loss, labels, outputs, terms)

    def _update_metrics(self, loss, labels, outputs, terms):
        self.loss_tracker.update_state(loss)
        self.accuracy_tracker.update_state(labels, outputs["scores"])
        for name, value in terms.items():
            self._term_trackers[name].update_state(value)
        return {m.name: m.result() for m in self.metrics}

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy_tracker, *self._term_trackers.values()]

    def get_config(self):
        return {"image_shape": list(self.image_shape), "num_classes": self.num_classes,
                "max_shift": self.max_shift, "seed": self.seed, "shards": self.shards,
                "name": self.name}


@keras.saving.register_keras_serializable(package="poecaps")
class CapsNet(_Classifier):
    """CapsNet with dynamic routing (Sabour, Frosst, Hinton 2017).

    conv 256 9x9 ReLU -> primary capsules (32 types x 8-D, 9x9 stride 2,
    squashed, eq. 1) -> `CapsuleDense` to one 16-D capsule per class with
    `DynamicRouting` (eq. 2-3, Procedure 1) -> lengths |v_k|. Loss: margin
    loss (eq. 4; m+ = 0.9, m- = 0.1, lambda = 0.5) plus
    `reconstruction_weight` (0.0005) times the summed squared error of a
    512-1024-pixels sigmoid decoder fed the class capsules masked by the true
    class in training and by the longest capsule otherwise. Training shifts
    images by up to `max_shift` (2) pixels.

    `routing_iterations` counts agreement updates (poecaps' convention):
    Sabour's 3 routing rounds are `routing_iterations=2`; 0 is the
    no-routing ablation (uniform coefficients).

    Args:
        image_shape: (H, W, C) of the input.
        num_classes: K.
        routing_iterations: >= 0.
        reconstruction: whether the decoder and its loss are used.
        reconstruction_weight: weight of the summed squared error.
        conv_filters, primary_types, primary_dim, class_dim, kernel_size:
            sizes (256, 32, 8, 16, 9).
        max_shift: random shift in pixels during training.
        seed: seed of the augmentation.
        shards: compute each training batch's gradients in this many
            consecutive parts, each its own XLA computation, which
            TensorFlow runs at the same time (XLA runs one computation's
            element-wise work on one CPU core); the joined gradients equal
            the whole batch's. With `shards > 1` the train step itself is
            never XLA-compiled, whatever `compile(jit_compile=...)` says.
    """

    def __init__(self, image_shape, num_classes, routing_iterations=2, reconstruction=True,
                 reconstruction_weight=0.0005, conv_filters=256, primary_types=32, primary_dim=8,
                 class_dim=16, kernel_size=9, max_shift=2, seed=0, shards=1, **kwargs):
        super().__init__(image_shape, num_classes, max_shift, seed, shards, **kwargs)
        self.routing_iterations = routing_iterations
        self.reconstruction = reconstruction
        self.reconstruction_weight = reconstruction_weight
        self.conv_filters = conv_filters
        self.primary_types = primary_types
        self.primary_dim = primary_dim
        self.class_dim = class_dim
        self.kernel_size = kernel_size
        self.conv1 = keras.layers.Conv2D(conv_filters, kernel_size, activation="relu", name="conv1")
        self.primary_conv = keras.layers.Conv2D(primary_types * primary_dim, kernel_size,
                                                strides=2, name="primary_conv")
        self.primary = PrimaryCapsules(primary_dim, name="primary_capsules")
        self.class_capsules = CapsuleDense(
            num_classes, class_dim, routing=DynamicRouting(routing_iterations, "dot"),
            # N(0, 0.1): with 1152 inputs the class capsules start at lengths ~0.1, where the
            # squash still passes gradient (N(0, 0.01) starts them at ~0.002).
            kernel_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed),
            name="class_capsules")
        self.decoder = None if not reconstruction else keras.Sequential([
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(math.prod(self.image_shape), activation="sigmoid"),
            keras.layers.Reshape(self.image_shape),
        ], name="decoder")
        self._term_trackers = {"margin_loss": keras.metrics.Mean(name="margin_loss")}
        if reconstruction:
            self._term_trackers["reconstruction_loss"] = keras.metrics.Mean(
                name="reconstruction_loss")
        self.build()

    def encode(self, images, training=None):
        """Class capsules: a `RoutingResult` with poses `[B, K, 16]` and lengths `[B, K]`."""
        code = self.primary_conv(self.conv1(images))
        return self.class_capsules.route(self.primary(code), training=training)

    def reconstruct(self, poses, classes):
        """Decode the class capsules masked to `classes` (`[B]` integers)."""
        if self.decoder is None:
            raise ValueError("This CapsNet was built with reconstruction=False; it has no decoder.")
        mask = ops.one_hot(ops.cast(classes, "int32"), self.num_classes, dtype=poses.dtype)
        return self.decoder(ops.reshape(poses * mask[..., None], (-1, self.num_classes * self.class_dim)))

    def call(self, images, training=None):
        result = self.encode(images, training)
        outputs = {"scores": result.activations, "poses": result.poses,
                   "coefficients": result.coefficients}
        if self.decoder is not None:
            outputs["reconstruction"] = self.reconstruct(
                result.poses, ops.argmax(result.activations, axis=-1))
        return outputs

    def _loss_terms(self, images, labels, training):
        result = self.encode(images, training)
        outputs = {"scores": result.activations}
        margin = ops.mean(losses.margin_loss(labels, result.activations))
        terms = {"margin_loss": margin}
        total = margin
        if self.reconstruction:
            recon = ops.cast(self.reconstruct(result.poses, labels), "float32")
            terms["reconstruction_loss"] = ops.mean(losses.reconstruction_loss(images, recon))
            total = total + self.reconstruction_weight * terms["reconstruction_loss"]
        return total, outputs, terms

    def get_config(self):
        config = super().get_config()
        config.update(routing_iterations=self.routing_iterations, reconstruction=self.reconstruction,
                      reconstruction_weight=self.reconstruction_weight,
                      conv_filters=self.conv_filters, primary_types=self.primary_types,
                      primary_dim=self.primary_dim, class_dim=self.class_dim,
                      kernel_size=self.kernel_size)
        return config


@keras.saving.register_keras_serializable(package="poecaps")
class MatrixCapsNet(_Classifier):
    """Matrix capsules with EM routing (Hinton, Sabour, Frosst 2018).

    ReLU conv (A channels, 5x5 stride 2) -> primary capsules (B types, 4x4
    pose + logistic activation, 1x1) -> ConvCaps1 (C types, K=3 stride 2)
    -> ConvCaps2 (D types, K=3 stride 1) -> class capsules with coordinate
    addition; every capsule layer routes with `EMRouting`. Loss: spread loss
    with the margin raised linearly from 0.2 to 0.9 over `margin_steps`
    training steps. The EM costs are standardised over the parents by
    default (see `EMRouting`). The small configuration is A=64, B=8, C=D=16; the
    paper's A=B=C=D=32.

    Args:
        image_shape, num_classes: as `CapsNet`.
        routing_iterations: EM rounds (>= 1; the paper uses 3).
        a, b, c, d: the sizes A, B, C, D.
        final_lambda: sets EM's inverse temperatures, lambda_t = final_lambda
            * (1 - 0.95^(t+1)).
        cost_normalization: "standardize" (default; lambda_t = 0.05, 0.10,
            0.14 with final_lambda=1) or "none" with the paper's costs (use
            final_lambda=0.01): on 64 MNIST digits, 40 Adam steps bring the
            spread loss from 4.97 to 0.84 with standardised costs (final_lambda=20) and only
            from 7.13 to 6.81 with the paper's, whose activations saturate
            together.
        margin_steps: steps over which the spread-loss margin rises.
        chunk_capsules: lower capsules whose votes and routing are computed
            together in ConvCaps1 and ConvCaps2: each layer routes
            `max(1, chunk_capsules // (9 * types in))` receptive fields at a
            time (`ConvCapsules(chunk_size=...)`); None for all at once.
            Chunks pay under XLA (`scripts/baseline.py`'s default for EM:
            train step 0.85-1.02 s -> 0.63-0.65 s in `bench/em_step.py`);
            without XLA they cost (1.19-1.33 s -> 1.52-1.75 s), so pass
            None there.
        max_shift, seed, shards: as `CapsNet`. Two shards on a 2-core CPU:
            see `bench/em_step.py` and README.md.
    """

    def __init__(self, image_shape, num_classes, routing_iterations=3, a=64, b=8, c=16, d=16,
                 final_lambda=1.0, cost_normalization="standardize", margin_steps=10000,
                 chunk_capsules=CHUNK_CAPSULES, max_shift=0, seed=0, shards=1, **kwargs):
        super().__init__(image_shape, num_classes, max_shift, seed, shards, **kwargs)
        self.routing_iterations = routing_iterations
        self.a, self.b, self.c, self.d = a, b, c, d
        self.final_lambda = final_lambda
        self.cost_normalization = cost_normalization
        self.margin_steps = margin_steps
        self.chunk_capsules = chunk_capsules
        chunk = lambda types: None if chunk_capsules is None else max(1, chunk_capsules // (9 * types))
        em = lambda name: EMRouting(routing_iterations, final_lambda,
                                    cost_normalization=cost_normalization, name=name)
        self.conv1 = keras.layers.Conv2D(a, 5, strides=2, activation="relu", name="conv1")
        self.primary = PrimaryMatrixCapsules(b, name="primary_capsules")
        self.conv_caps1 = ConvCapsules(c, 16, 3, 2, routing=em("em1"), chunk_size=chunk(b),
                                       name="conv_caps1")
        self.conv_caps2 = ConvCapsules(d, 16, 3, 1, routing=em("em2"), chunk_size=chunk(c),
                                       name="conv_caps2")
        self.class_capsules = ClassCapsules(num_classes, 16, routing=em("em3"),
                                            name="class_capsules")
        self._term_trackers = {"spread_loss": keras.metrics.Mean(name="spread_loss"),
                               "margin": keras.metrics.Mean(name="margin")}
        self.build()

    def encode(self, images, training=None):
        poses, act = self.primary(self.conv1(images))
        r1 = self.conv_caps1.route(poses, act, training=training)
        r2 = self.conv_caps2.route(r1.poses, r1.activations, training=training)
        return self.class_capsules.route(r2.poses, r2.activations, training=training)

    def call(self, images, training=None):
        result = self.encode(images, training)
        return {"scores": result.activations, "poses": result.poses,
                "coefficients": result.coefficients}

    def _loss_terms(self, images, labels, training):
        result = self.encode(images, training)
        step = self.optimizer.iterations if training and self.optimizer is not None else self.margin_steps
        margin = losses.spread_margin(step, self.margin_steps)
        spread = ops.mean(losses.spread_loss(labels, result.activations, margin))
        return spread, {"scores": result.activations}, {"spread_loss": spread, "margin": margin}

    def get_config(self):
        config = super().get_config()
        config.update(routing_iterations=self.routing_iterations, a=self.a, b=self.b, c=self.c,
                      d=self.d, final_lambda=self.final_lambda,
                      cost_normalization=self.cost_normalization, margin_steps=self.margin_steps,
                      chunk_capsules=self.chunk_capsules)
        return config
