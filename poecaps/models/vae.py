"""A variational autoencoder (Kingma and Welling), the baseline of Smith et al.'s probe table.

    q(z | X) = N(mu(X), diag sigma(X)^2),   p(z) = N(0, I_L),   p(X | z) = N(decoder(z), s^2 I)

with one hidden layer of `hidden` ELU units on each side, `L = latent`, and
the same Gaussian pixel likelihood as `ProbabilisticCapsules` (`s` =
`pixel_sigma`, 0.2), so that the two bounds are in the same units. The
bound per image, one reparameterised draw `z = mu + sigma eps`:

    L = log p(X | z) - KL(q(z | X) || p(z)),   KL = 1/2 sum_l (mu_l^2 + sigma_l^2 - 1 - 2 log sigma_l).

Args:
    image_size: (H, W) of the images (one channel).
    latent: L (10).
    hidden: hidden units of the encoder and of the decoder (128).
    pixel_sigma: `s`.
    seed: seed of the initial weights.

Call arguments:
    images: `[B, H, W, 1]` in [0, 1].

Returns (call): dict of `mu [B, L]`, `sigma [B, L]` and `reconstructions`
(the decoder's mean at `z = mu`). Under a mixed precision policy the layers
compute in float16 or bfloat16, and these and the bound's terms are float32
(`poecaps.distribute.full_precision_dtype`).
"""

import math

import keras
import tensorflow as tf

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.validation import (
    check_image_batch,
    check_image_size,
    check_integers,
    check_number,
    check_seed,
    check_seed_pair,
    shape_fits,
    static_shape,
)

_LOG_2PI = math.log(2.0 * math.pi)


@keras.saving.register_keras_serializable(package="poecaps")
class VariationalAutoencoder(keras.Model):
    __doc__ = __doc__
    TERMS = ("bound", "image", "kl")

    def __init__(self, image_size=(28, 28), latent=10, hidden=128, pixel_sigma=0.2, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.image_size = check_image_size(image_size)
        latent, hidden = check_integers(latent=latent, hidden=hidden)
        pixel_sigma = check_number(pixel_sigma, "pixel_sigma", above=0)
        seed = check_seed(seed)
        self.latent, self.hidden, self.pixel_sigma, self.seed = latent, hidden, pixel_sigma, seed
        init = lambda i: keras.initializers.GlorotUniform(seed=seed + i)
        pixels = self.image_size[0] * self.image_size[1]
        dtype = self.dtype_policy  # every layer's, as Keras layers hand theirs on
        dense = lambda units, i, activation=None: keras.layers.Dense(units, activation, kernel_initializer=init(i),
                                                                     dtype=dtype)
        self.encoder = keras.Sequential([keras.layers.Flatten(dtype=dtype), dense(hidden, 0, "elu"), dense(2 * latent, 1)],
                                        name="encoder")
        self.decoder = keras.Sequential([dense(hidden, 2, "elu"), dense(pixels, 3, "sigmoid"),
                                         keras.layers.Reshape((*self.image_size, 1), dtype=dtype)],
                                        name="decoder")
        self.build((None, *self.image_size, 1))

    def build(self, input_shape=None):
        self.call(tf.zeros((1, *self.image_size, 1)))

    def encode(self, images):
        """`(mu, sigma)`, each `[B, L]`."""
        check_image_batch(images, self.image_size, type(self).__name__)
        h = self.encoder(images)
        h = tf.cast(h, distribute.full_precision_dtype(h))
        return h[:, :self.latent], tf.nn.softplus(h[:, self.latent:]) + 1e-4

    def decode(self, z):
        """The decoder's mean image `[B, H, W, 1]` at `z [B, L]`, in `z`'s dtype."""
        shape = static_shape(z)
        if not shape_fits(shape, (None, self.latent)):
            raise InputError(f"z must be latents [batch, {self.latent}]. Received: shape={shape}")
        return tf.cast(self.decoder(z), z.dtype)

    def call(self, images):
        mu, sigma = self.encode(images)
        return {"mu": mu, "sigma": sigma, "reconstructions": self.decode(mu)}

    def bound(self, images, seed=None, training=False):
        """The bound's terms per image `[B]`: `bound`, `image` (log p(X | z)), `kl`; `seed` a stateless seed or None.

        `training` changes nothing (no layer here acts differently in training); the trainer passes it to
        every model it trains.
        """
        seed = check_seed_pair(seed, allow_none=True)
        mu, sigma = self.encode(images)
        # Seeded: under a strategy, one device's draws for the global batch, this replica's rows of them.
        normal = lambda size, seed: tf.random.stateless_normal(size, seed, dtype=mu.dtype)
        eps = (tf.random.normal(tf.shape(mu), dtype=mu.dtype) if seed is None
               else distribute.per_example_draw(normal, (tf.shape(mu)[0], self.latent), seed))
        mean = self.decode(mu + sigma * eps)
        pixels = self.image_size[0] * self.image_size[1]
        squares = tf.reduce_sum(tf.reshape(tf.square(tf.cast(images, mean.dtype) - mean), [-1, pixels]), -1)
        image = -0.5 * squares / self.pixel_sigma ** 2 - pixels * (math.log(self.pixel_sigma) + 0.5 * _LOG_2PI)
        kl = 0.5 * tf.reduce_sum(tf.square(mu) + tf.square(sigma) - 1.0 - 2.0 * tf.math.log(sigma), -1)
        return {"bound": image - kl, "image": image, "kl": kl}

    def get_config(self):
        return {**super().get_config(),  # name, trainable, dtype
                "image_size": list(self.image_size), "latent": self.latent, "hidden": self.hidden,
                "pixel_sigma": self.pixel_sigma, "seed": self.seed}
