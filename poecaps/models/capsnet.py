"""CapsNet with dynamic routing (Sabour, Frosst and Hinton 2017) on poecaps' layers."""

import math
import numbers

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from poecaps import losses
from poecaps.errors import InputError
from poecaps.layers import CapsuleDense, PrimaryCapsules
from poecaps.routing import DynamicRouting
from poecaps.validation import (
    check_flag,
    check_image_batch,
    check_image_shape,
    check_integer,
    check_integers,
    check_labels,
    check_number,
    check_seed,
    shape_fits,
    sizes_fit,
)


def check_classifier_arguments(image_shape, num_classes, convolutions=()):
    """Return `(image_shape, num_classes)` as a tuple of ints and an int; `InputError` unless `num_classes` is
    an integer >= 2, `image_shape` is (H, W, C) (`check_image_shape`), and H and W leave at least one position
    after the network's unpadded `convolutions` ((kernel, stride) pairs, bottom up).

    An unpadded convolution maps a side n to floor((n - kernel) / stride) + 1, so the smallest side that
    leaves one position is found top down: n_in = (n_out - 1) * stride + kernel, from n_out = 1.
    """
    image_shape = check_image_shape(image_shape)
    num_classes = check_integer(num_classes, "num_classes", minimum=2)
    side = 1
    for kernel, stride in reversed(convolutions):
        side = (side - 1) * stride + kernel
    if min(image_shape[:2]) < side:
        raise InputError(f"image_shape is too small: the network's unpadded convolutions (kernel, stride) "
                         f"{tuple(convolutions)} need at least {side} x {side} pixels. "
                         f"Received: image_shape={image_shape}")
    return image_shape, num_classes


def check_loss_inputs(model, images, labels, step=None):
    """`labels` of a classifier's `loss_terms`, `[B]` class indices for images `[B, ...]`, or an `InputError`.

    Shapes are checked always, the labels' dtype and values when run eagerly (in a traced training step they
    are the labels the trainer checked), as is a `step` given as a Python number (>= 0, finite). An index past
    the classes would otherwise be read as a label of no class (an all-zero one-hot).
    """
    labels = np.asarray(labels) if isinstance(labels, (list, tuple)) else labels
    batch = images.shape[0]
    if len(labels.shape) != 1 or not sizes_fit(labels.shape[0], batch):
        raise InputError(f"labels must be one class per image, shape [{batch}]. Received: shape="
                         f"{tuple(labels.shape)}")
    if tf.executing_eagerly():
        check_labels(np.asarray(labels), model.num_classes, labels.shape[0])
    if isinstance(step, (numbers.Number, str)):     # given by hand; a tensor or variable is the trainer's counter
        check_number(step, "step", minimum=0)
    return labels


@keras.saving.register_keras_serializable(package="poecaps")
class CapsNet(keras.Model):
    """CapsNet: conv, primary capsules, one class capsule per class by dynamic routing.

    conv 256 9x9 ReLU -> primary capsules (32 types x 8-D, 9x9 stride 2,
    squashed, Sabour eq. 1) -> `CapsuleDense` to one 16-D capsule per class
    with `DynamicRouting` (eq. 2-3, Procedure 1) -> lengths |v_k|. The loss
    (`loss_terms`): margin loss (eq. 4; m+ = 0.9, m- = 0.1, lambda = 0.5)
    plus `reconstruction_weight` times the summed squared error of a
    512-1024-pixels sigmoid decoder fed the class capsules masked by the
    true class. `call` masks by the longest capsule instead. Training
    (`poecaps.trainers.supervised.SupervisedTrainer`) adds random shifts.

    Args:
        image_shape: (H, W, C) of the input.
        num_classes: K.
        routing_iterations: routing rounds, Sabour's r (3 in the paper;
            0 and 1 give uniform coefficients, the no-routing ablation).
        reconstruction: whether the decoder and its loss are used.
        reconstruction_weight: weight of the summed squared error (0.0005).
        conv_filters, primary_types, primary_dim, class_dim, kernel_size:
            sizes (256, 32, 8, 16, 9).
        seed: seed of the class capsules' initial W.

    Call arguments:
        images: `[B, H, W, C]` in [0, 1].

    Returns:
        dict with `scores` (class-capsule lengths `[B, K]`), `poses`
        `[B, K, 16]`, routing `coefficients` `[B, I, K]` and, with the
        decoder, `reconstruction` `[B, H, W, C]`.
    """

    def __init__(self, image_shape, num_classes, routing_iterations=3, reconstruction=True,
                 reconstruction_weight=0.0005, conv_filters=256, primary_types=32, primary_dim=8,
                 class_dim=16, kernel_size=9, seed=0, **kwargs):
        super().__init__(**kwargs)
        conv_filters, primary_types, primary_dim, class_dim, kernel_size = check_integers(
            conv_filters=conv_filters, primary_types=primary_types, primary_dim=primary_dim,
            class_dim=class_dim, kernel_size=kernel_size)
        self.image_shape, num_classes = check_classifier_arguments(
            image_shape, num_classes, ((kernel_size, 1), (kernel_size, 2)))
        self.num_classes = num_classes
        self.routing_iterations = check_integer(routing_iterations, "routing_iterations", minimum=0)
        self.reconstruction = reconstruction = check_flag(reconstruction, "reconstruction")
        self.reconstruction_weight = check_number(reconstruction_weight, "reconstruction_weight", minimum=0)
        self.conv_filters = conv_filters
        self.primary_types = primary_types
        self.primary_dim = primary_dim
        self.class_dim = class_dim
        self.kernel_size = kernel_size
        self.seed = seed = check_seed(seed, allow_none=True)
        dtype = self.dtype_policy  # every layer's, as Keras layers hand theirs on
        self.conv1 = keras.layers.Conv2D(conv_filters, kernel_size, activation="relu", name="conv1", dtype=dtype)
        self.primary_conv = keras.layers.Conv2D(primary_types * primary_dim, kernel_size,
                                                strides=2, name="primary_conv", dtype=dtype)
        self.primary = PrimaryCapsules(primary_dim, name="primary_capsules", dtype=dtype)
        self.class_capsules = CapsuleDense(
            num_classes, class_dim, routing=DynamicRouting(routing_iterations, "dot", dtype=dtype),
            # N(0, 0.1): with 1152 inputs the class capsules start at lengths ~0.1, where the
            # squash still passes gradient (N(0, 0.01) starts them at ~0.002).
            kernel_initializer=keras.initializers.RandomNormal(stddev=0.1, seed=seed),
            name="class_capsules", dtype=dtype)
        self.decoder = None if not reconstruction else keras.Sequential([
            keras.layers.Dense(512, activation="relu", dtype=dtype),
            keras.layers.Dense(1024, activation="relu", dtype=dtype),
            keras.layers.Dense(math.prod(self.image_shape), activation="sigmoid", dtype=dtype),
            keras.layers.Reshape(self.image_shape, dtype=dtype),
        ], name="decoder")
        self.build()

    def build(self, input_shape=None):
        self.call(ops.zeros((1, *self.image_shape)))

    @property
    def routers(self):
        """The routing layers, bottom up (here the class capsules' one)."""
        return [self.class_capsules.routing]

    @property
    def loss_term_names(self):
        return ("margin_loss", "reconstruction_loss") if self.reconstruction else ("margin_loss",)

    def encode(self, images, training=None):
        """Class capsules: a `RoutingResult` with poses `[B, K, 16]` and lengths `[B, K]`."""
        check_image_batch(images, self.image_shape[:2], type(self).__name__, self.image_shape[2])
        code = self.primary_conv(self.conv1(images))
        return self.class_capsules.route(self.primary(code), training=training)

    def reconstruct(self, poses, classes):
        """Decode the class capsules `poses [B, K, class_dim]` masked to `classes` (`[B]` integers in [0, K)).

        Shapes are checked always; the classes' values only when run eagerly (in a traced step they are the
        trainer's checked labels or the network's own argmax).
        """
        if self.decoder is None:
            raise InputError("This CapsNet was built with reconstruction=False; it has no decoder.")
        shape, expected = tuple(poses.shape), (None, self.num_classes, self.class_dim)
        if not shape_fits(shape, expected):
            raise InputError(f"poses must be the class capsules [batch, {self.num_classes}, {self.class_dim}]. "
                             f"Received: shape={shape}")
        classes = np.asarray(classes) if isinstance(classes, (list, tuple)) else classes
        if len(classes.shape) != 1 or not sizes_fit(classes.shape[0], shape[0]):
            raise InputError(f"classes must be one class per example, shape [{shape[0]}]. Received: shape="
                             f"{tuple(classes.shape)}")
        if tf.executing_eagerly():
            check_labels(np.asarray(classes), self.num_classes, shape[0], "classes")
        return self._decode(poses, classes)

    def _decode(self, poses, classes):
        """`reconstruct` without its checks, for classes known to fit (the network's own argmax)."""
        mask = ops.one_hot(ops.cast(classes, "int32"), self.num_classes, dtype=poses.dtype)
        return self.decoder(ops.reshape(poses * mask[..., None], (-1, self.num_classes * self.class_dim)))

    def call(self, images, training=None):
        result = self.encode(images, training)
        outputs = {"scores": result.activations, "poses": result.poses,
                   "coefficients": result.coefficients}
        if self.decoder is not None:
            outputs["reconstruction"] = self._decode(
                result.poses, ops.argmax(result.activations, axis=-1))
        return outputs

    def loss_terms(self, images, labels, training=False, step=None):
        """`(total, scores [B, K], {term: batch mean})`: the margin loss plus the weighted reconstruction.

        `labels`: `[B]` class indices (`check_loss_inputs`); `step`, checked as the other networks' is, is
        unused (the margin loss has no schedule)."""
        result = self.encode(images, training)
        labels = check_loss_inputs(self, images, labels, step)
        margin = ops.mean(losses.margin_loss(labels, result.activations))
        terms = {"margin_loss": margin}
        total = margin
        if self.reconstruction:
            recon = ops.cast(self.reconstruct(result.poses, labels), images.dtype)
            terms["reconstruction_loss"] = ops.mean(losses.reconstruction_loss(images, recon))
            total = total + self.reconstruction_weight * terms["reconstruction_loss"]
        return total, result.activations, terms

    def get_config(self):
        return {**super().get_config(),  # name, trainable, dtype
                "image_shape": list(self.image_shape), "num_classes": self.num_classes,
                "routing_iterations": self.routing_iterations, "reconstruction": self.reconstruction,
                "reconstruction_weight": self.reconstruction_weight, "conv_filters": self.conv_filters,
                "primary_types": self.primary_types, "primary_dim": self.primary_dim,
                "class_dim": self.class_dim, "kernel_size": self.kernel_size, "seed": self.seed}
