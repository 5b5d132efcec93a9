"""Trainer of a variational bound: the probabilistic capsule model (Smith et al., eq. 8) or the VAE baseline."""

import keras
import tensorflow as tf

from poecaps import distribute
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import unpack
from poecaps.validation import check_images, check_seed


class VariationalTrainer(Trainer):
    """Raises a model's variational bound jointly in its generative and encoder weights.

    The model gives `bound(images, seed, training)`, a dict of per-image terms `[B]`
    named by its `TERMS` (the first is the bound itself), and
    `model(images)["reconstructions"]`, the image decoded from the encoder's
    means: `poecaps.models.ProbabilisticCapsuleAutoencoder` and
    `poecaps.models.VariationalAutoencoder` do. Each step draws the
    stochastic latents once (a stateless seed from the trainer's seed and
    the step) and takes an optimizer step on `-mean(objective) / pixels`, where
    `objective` is the model's `objective` term if it gives one (a bound plus
    a training-only term, e.g. the capsule model's specialisation), else the
    bound.
    Metrics: every term per image, and `mse`, the reconstruction error of
    the encoder's means. Under a strategy of N replicas the step is the
    global batch's mean (each replica's loss over N, as Keras sums their
    gradients), and each replica draws its examples' latents as one device
    draws them for the global batch (`poecaps.distribute.per_example_draw`).

    Args:
        model: the model.
        seed: seed of the draws.

    Call arguments:
        images: `[B, H, W, 1]`; returns `model(images)`.
    """

    calls = ("bound", "TERMS")

    def __init__(self, model, seed=0, **kwargs):
        super().__init__(model, **kwargs)
        self.model = model
        self.seed = check_seed(seed)
        self.terms = tuple(model.TERMS)
        self.trackers = {name: keras.metrics.Mean(name=name) for name in (*self.terms, "mse")}
        # A Keras variable, so that checkpoints (`trainer.variables`) and `save_weights` hold it: a run resumed
        # from one goes on with the draws it would have made. One count for all replicas, as the optimizer's.
        self.draws = self.add_weight(shape=(), initializer="zeros", dtype="int64", trainable=False, name="draws",
                                     aggregation="only_first_replica")

    @property
    def metrics(self):
        return list(self.trackers.values())

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` are one-channel images `[N, H, W, 1]` in [0, 1] (the model checks their
        size; a y, which the bound would ignore, is refused by the steps)."""
        check_images(x, "x (images)", channels=1)

    def call(self, images, training=None):
        return self.model(images)

    def _update(self, images, terms):
        for name in self.terms:
            self.trackers[name].update_state(terms[name])
        recon = self.model(images)["reconstructions"]
        self.trackers["mse"].update_state(tf.reduce_mean(tf.square(recon - images)))
        return {name: m.result() for name, m in self.trackers.items()}

    def train_step(self, data):
        images, _ = unpack(data, self, self.data_dtype)
        seed = tf.stack([tf.constant(self.seed, tf.int64), self.draws.value])
        self.draws.assign_add(1)
        pixels = float(images.shape[1] * images.shape[2])
        with tf.GradientTape() as tape:
            terms = self.model.bound(images, seed=seed, training=True)
            loss = -tf.reduce_mean(terms.get("objective", terms["bound"])) / pixels
            scaled = distribute.replica_loss(self.optimizer, self.regularized(loss))
        weights = self.model.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, weights), weights)
        return self._update(images, terms)

    def test_step(self, data):
        images, _ = unpack(data, self, self.data_dtype)
        return self._update(images, self.model.bound(images, seed=tf.constant([self.seed, -1], tf.int64)))
