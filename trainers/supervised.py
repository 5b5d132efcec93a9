"""Supervised training of a classifier network (CapsNet, matrix capsules): shifts, shards, metrics."""

import keras
import tensorflow as tf
from keras import ops

from poecaps import distribute, transforms
from poecaps.graphs import graph
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import unpack
from poecaps.trainers.shards import batch_size, nonempty, shard_bounds, size_weighted_mean
from poecaps.validation import check_images, check_integer, check_labels, check_seed


class SupervisedTrainer(Trainer):
    """Trains a classifier network by its own loss, `network.loss_terms(images, labels, training, step)`.

    `train_step` shifts each image by up to `max_shift` whole pixels (Sabour's
    augmentation), computes the loss's gradient and applies it through the
    compiled optimizer; metrics are the loss, the accuracy of the network's
    scores and each of its loss terms (`network.loss_term_names`).

    Args:
        network: a `poecaps.models.CapsNet` or `MatrixCapsNet` (any
            `keras.Model` with `image_shape`, `num_classes`, `loss_terms`
            and `loss_term_names`).
        max_shift: random shifts in pixels while training (0: none).
        seed: seed of the shifts.
        shards: compute each training batch's gradients in this many
            consecutive parts, each its own XLA computation, which
            TensorFlow runs at the same time (XLA runs one computation's
            element-wise work on one CPU core); the joined gradients equal
            the whole batch's. With `shards > 1` the train step itself is
            never XLA-compiled, whatever `compile(jit_compile=...)` says.

    Call arguments:
        images: `[B, H, W, C]`; returns the network's outputs.
    """

    targets = "class labels"
    trained_as = "network"
    calls = ("loss_terms", "loss_term_names", "image_shape", "num_classes")

    def __init__(self, network, max_shift=0, seed=0, shards=1, **kwargs):
        super().__init__(network, **kwargs)
        shards = check_integer(shards, "shards")
        max_shift = check_integer(max_shift, "max_shift", minimum=0)
        self.network = network
        self.max_shift = max_shift
        self.seed = seed = check_seed(seed, allow_none=True)
        self.shards = shards
        self._shard_gradients = graph(self._gradients, jit_compile=True) if shards > 1 else None
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy_tracker = keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        self.term_trackers = {name: keras.metrics.Mean(name=name) for name in network.loss_term_names}

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy_tracker, *self.term_trackers.values()]

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` are `[N, *image_shape]` images in [0, 1] and `y` class labels."""
        check_images(x, "x (images)", image_shape=self.network.image_shape)
        if y is not None:
            check_labels(y, self.network.num_classes, len(x), "y (labels)")

    def call(self, images, training=None):
        return self.network(images, training=training)

    def compile(self, *args, jit_compile="auto", **kwargs):
        # With shards, each shard is its own XLA computation (see the class docstring).
        super().compile(*args, jit_compile=False if self.shards > 1 else jit_compile, **kwargs)

    def _step(self):
        return None if self.optimizer is None else self.optimizer.iterations

    def train_step(self, data):
        images, labels = unpack(data, self, self.data_dtype)
        # Shifted here, outside the shards, which would otherwise share the seed generator.
        if self.max_shift:
            images = transforms.random_shift(images, self.max_shift, seed=self.seed_generator)
        if self._shard_gradients is None:
            grads, loss, scores, terms = self._gradients(images, labels)
        else:
            grads, loss, scores, terms = self._sharded_gradients(images, labels)
        self.optimizer.apply(grads, self.network.trainable_weights)
        return self._update_metrics(loss, labels, scores, terms)

    def _gradients(self, images, labels):
        """`(gradients, loss, scores, {name: term})` of one batch (or shard)."""
        with tf.GradientTape() as tape:
            loss, scores, terms = self.network.loss_terms(images, labels, training=True, step=self._step())
            scaled = distribute.replica_loss(self.optimizer, self.regularized(loss))
        return tape.gradient(scaled, self.network.trainable_weights), loss, scores, terms

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
        images, labels = unpack(data, self, self.data_dtype)
        loss, scores, terms = self.network.loss_terms(images, labels, training=False)
        return self._update_metrics(loss, labels, scores, terms)

    def _update_metrics(self, loss, labels, scores, terms):
        self.loss_tracker.update_state(loss)
        self.accuracy_tracker.update_state(labels, scores)
        for name, value in terms.items():
            self.term_trackers[name].update_state(value)
        return {m.name: m.result() for m in self.metrics}
