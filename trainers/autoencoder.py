"""Trainer of the convolutional autoencoder front end (backprop)."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.layers import ConvAutoencoder
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import unpack
from poecaps.validation import check_images


class AutoencoderTrainer(Trainer):
    """Trains a `ConvAutoencoder` to reconstruct images (Hauser section 4.1).

    Loss: binary cross-entropy between images in [0, 1] and the sigmoid
    reconstruction (dropout on in training); metric `mse` is the pixel mean
    squared error.

    Args:
        autoencoder: a `poecaps.layers.ConvAutoencoder`.
    """

    trained_as = "autoencoder"
    trains = (ConvAutoencoder,)

    def __init__(self, autoencoder, **kwargs):
        super().__init__(autoencoder, **kwargs)
        self.autoencoder = autoencoder
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mse_tracker = keras.metrics.Mean(name="mse")

    @property
    def metrics(self):
        return [self.loss_tracker, self.mse_tracker]

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` are images in [0, 1] with the autoencoder's channels."""
        channels = self.autoencoder.kernel1.shape[2] if self.autoencoder.built else None
        check_images(x, "x (images)", channels=channels)

    def call(self, images, training=False):
        return self.autoencoder(images, training=training)

    def _reconstruction_losses(self, images, training):
        reconstruction = ops.cast(self.autoencoder(images, training=training), images.dtype)
        loss = ops.mean(keras.losses.binary_crossentropy(
            ops.reshape(images, (ops.shape(images)[0], -1)),
            ops.reshape(reconstruction, (ops.shape(images)[0], -1))))
        return loss, ops.mean(ops.square(images - reconstruction))

    def _report(self, loss, mse):
        self.loss_tracker.update_state(loss)
        self.mse_tracker.update_state(mse)
        return {"loss": self.loss_tracker.result(), "mse": self.mse_tracker.result()}

    def train_step(self, data):
        import tensorflow as tf

        images, _ = unpack(data, self, self.data_dtype)
        with tf.GradientTape() as tape:
            loss, mse = self._reconstruction_losses(images, training=True)
            scaled = distribute.replica_loss(self.optimizer, self.regularized(loss))
        weights = self.autoencoder.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, weights), weights)
        return self._report(loss, mse)

    def test_step(self, data):
        images, _ = unpack(data, self, self.data_dtype)
        return self._report(*self._reconstruction_losses(images, training=False))
