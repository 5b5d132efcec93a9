"""The convolutional autoencoder front end (Hauser section 4.1, Figure 1)."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.validation import (
    check_image_batch,
    check_integers,
    check_number,
    check_seed,
    shape_fits,
)


@keras.saving.register_keras_serializable(package="poecaps")
class ConvAutoencoder(keras.layers.Layer):
    """Two-layer convolutional autoencoder with tied, transposed filters.

    Encoder: conv K1 [k, k, C, F] (stride 1, valid), leaky ReLU, dropout;
    conv K2 [k, k, F, F] (stride `strides`, valid), leaky ReLU, dropout.
    Decoder: transposed conv with K2, leaky ReLU; transposed conv with K1,
    sigmoid. On 28 x 28 x 1 input with k = 9, F = 128 and stride 2 the code
    is 6 x 6 x 128 (Hauser: 576 capsules of 8 dimensions).

    Args:
        filters: F, channels of both filter banks.
        kernel_size: k.
        strides: stride of the second filter bank.
        dropout: dropout rate after each encoder activation (training only).
        negative_slope: leaky ReLU slope for negative inputs (>= 0).

    Call arguments:
        images: `[B, H, W, C]` in [0, 1].

    Returns:
        Reconstructions `[B, H, W, C]` in (0, 1); `encode` gives the code
        and `decode` maps a code back to images.
    """

    def __init__(self, filters=128, kernel_size=9, strides=2, dropout=0.1,
                 negative_slope=0.2, seed=None, **kwargs):
        super().__init__(**kwargs)
        filters, kernel_size, strides = check_integers(filters=filters, kernel_size=kernel_size, strides=strides)
        self.filters = filters
        self.kernel_size = kernel_size
        self.strides = strides
        self.dropout = check_number(dropout, "dropout", minimum=0, below=1)
        self.negative_slope = check_number(negative_slope, "negative_slope", minimum=0)
        self.seed = seed = check_seed(seed, allow_none=True)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape):
        if len(input_shape) != 4 or None in input_shape[1:]:
            raise InputError(f"ConvAutoencoder takes images of shape [batch, height, width, channels] with known "
                             f"sizes. Received: input_shape={tuple(input_shape)}")
        h, w, c = input_shape[1:]
        k, f, s = self.kernel_size, self.filters, self.strides
        h1, w1 = h - k + 1, w - k + 1
        h2, w2 = (h1 - k) // s + 1, (w1 - k) // s + 1
        if h2 < 1 or w2 < 1:
            raise InputError(
                f"Images of {h}x{w} are too small for two valid {k}x{k} convolutions. "
                f"Received: input_shape={input_shape}")
        self.image_shape = (h, w, c)
        self.code_shape = (h2, w2, f)
        # Output padding that makes the transposed conv invert the strided conv's size.
        self._output_padding = (h1 - ((h2 - 1) * s + k), w1 - ((w2 - 1) * s + k))
        init = keras.initializers.GlorotUniform(seed=self.seed)
        self.kernel1 = self.add_weight(name="kernel1", shape=(k, k, c, f), initializer=init)
        self.bias1 = self.add_weight(name="bias1", shape=(f,), initializer="zeros")
        self.kernel2 = self.add_weight(name="kernel2", shape=(k, k, f, f), initializer=init)
        self.bias2 = self.add_weight(name="bias2", shape=(f,), initializer="zeros")
        self.decoder_bias2 = self.add_weight(name="decoder_bias2", shape=(f,), initializer="zeros")
        self.decoder_bias1 = self.add_weight(name="decoder_bias1", shape=(c,), initializer="zeros")

    def _act(self, x):
        return ops.leaky_relu(x, self.negative_slope)

    def encode(self, images, training=False):
        if not self.built:
            self.build(tuple(images.shape))
        # The decoder's output padding holds for the size built for; another size decodes to a wrong one.
        check_image_batch(images, self.image_shape[:2], self.name, self.image_shape[2])
        x = self._act(ops.conv(images, self.kernel1, padding="valid") + self.bias1)
        x = self._dropout(x, training)
        x = self._act(ops.conv(x, self.kernel2, strides=self.strides, padding="valid") + self.bias2)
        return self._dropout(x, training)

    def _dropout(self, x, training):
        # Inverted dropout with per-example masks that do not depend on how a
        # strategy splits the batch (poecaps.distribute.per_example_draw).
        if not training or self.dropout == 0:
            return x
        # Drawn in float32, or float64 for a float64 layer, whatever `floatx` says.
        uniform = lambda shape, seed: keras.random.uniform(shape, dtype=distribute.full_precision_dtype(x), seed=seed)
        noise = distribute.per_example_draw(uniform, ops.shape(x), self.seed_generator)
        return ops.where(noise >= self.dropout, x / (1.0 - self.dropout), ops.zeros_like(x))

    def decode(self, code):
        if not self.built:
            raise InputError(f"{self.name} is not built: it learns its code's shape from images (call it on images "
                             f"or build it with their shape first)")
        shape = tuple(code.shape)
        if not shape_fits(shape, (None, *self.code_shape)):
            raise InputError(f"{self.name} decodes codes of shape [batch, {', '.join(map(str, self.code_shape))}]. "
                             f"Received: shape={shape}")
        # Tied weights: the encoder's kernels, used transposed.
        x = ops.conv_transpose(code, self.kernel2, strides=self.strides, padding="valid",
                               output_padding=self._output_padding)
        x = self._act(x + self.decoder_bias2)
        x = ops.conv_transpose(x, self.kernel1, strides=1, padding="valid")
        return ops.sigmoid(x + self.decoder_bias1)

    def call(self, images, training=False):
        return self.decode(self.encode(images, training=training))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update(filters=self.filters, kernel_size=self.kernel_size, strides=self.strides,
                      dropout=self.dropout, negative_slope=self.negative_slope, seed=self.seed)
        return config
