"""Trainer of a generative capsule layer: generalised EM on its bound."""

import keras
import tensorflow as tf

from poecaps import distribute
from poecaps.trainers import CHILD_WEIGHTS
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import unpack
from poecaps.validation import check_array, check_choice, check_integer


def check_child_weights(child_weights):
    """`child_weights` if it names one of `CHILD_WEIGHTS`, else an `InputError` (a `ValueError`)."""
    return check_choice(child_weights, "child_weights", CHILD_WEIGHTS)


def child_activations(children, child_weights):
    """Each child's weight `a_i` `[B, I]` for `GenerativeCapsules`: None (every child alike) for "uniform",
    the child's length `|V_i|` for "lengths" (a capsule's length is its activation)."""
    if check_child_weights(child_weights) == "uniform":
        return None
    return tf.norm(children, axis=-1)


class GenerativeCapsuleTrainer(Trainer):
    """Learns `GenerativeCapsules`' G, kappa, sigma and mixing weights by generalised EM (Kiefer et al., spec).

    `train_step` infers the parents of a batch of children (`layer.infer`
    with `iterations` EM iterations, no gradient through it: the E- and
    M-steps of the parents), then takes one optimizer step on the layer's
    weights that raises the bound `layer.log_joint` at those (v, r): the M-step
    of the parameters. Both steps weigh child i by `a_i` (`child_activations`):
    alike, or by its length. Metrics: `bound_per_child` (the bound over the
    batch's children, weighted) and `coefficient_entropy` (of r over the
    parents, over log J, every child alike). `test_step` (`evaluate`) and a
    call infer the parents as `train_step` does, with `iterations` EM
    iterations (not the layer's own `em_iterations`), so the bound they
    report is the one training raises.

    Args:
        layer: a `poecaps.models.GenerativeCapsules`.
        iterations: EM iterations of every inference: training steps, `evaluate` and calls.
        child_weights: "uniform" or "lengths" (`CHILD_WEIGHTS`).

    Call arguments:
        children: `[B, I, D_c]`; returns `layer.infer(children, a, iterations)`.
    """

    trained_as = "layer"

    def __init__(self, layer, iterations=10, child_weights="uniform", **kwargs):
        super().__init__(layer, **kwargs)
        self.layer = layer
        self.iterations = check_integer(iterations, "iterations")
        self.child_weights = check_child_weights(child_weights)
        self.bound_tracker = keras.metrics.Mean(name="bound_per_child")
        self.entropy_tracker = keras.metrics.Mean(name="coefficient_entropy")

    @property
    def metrics(self):
        return [self.bound_tracker, self.entropy_tracker]

    def check_inputs(self, x, y=None):
        """Raise `InputError` unless `x` are finite children `[N, I, D_c]` of the layer's child dimension (a y,
        which EM would ignore, is refused by the steps)."""
        check_array(x, "x (children)", (None, self.layer.child_dim))

    def call(self, children, training=None):
        # Under a mixed policy Keras hands the call its low precision; EM infers in float32.
        children = tf.cast(children, distribute.full_precision_dtype(children))
        a = child_activations(children, self.child_weights)
        return self.layer.infer(children, a, iterations=self.iterations)

    def _statistics(self, children, a, v, r):
        bound = self.layer.log_joint(children, v, r, a)
        per_child = tf.reduce_mean(bound) / children.shape[1]
        entropy = -tf.reduce_mean(tf.reduce_sum(r * tf.math.log(r + 1e-30), -1)) / tf.math.log(
            tf.cast(self.layer.num_parents, r.dtype))
        return per_child, entropy

    def train_step(self, data):
        children, _ = unpack(data, self, self.data_dtype)
        a = child_activations(children, self.child_weights)
        found = self.layer.infer(children, a, iterations=self.iterations)
        v, r = tf.stop_gradient(found.poses), tf.stop_gradient(found.coefficients)
        with tf.GradientTape() as tape:
            per_child, entropy = self._statistics(children, a, v, r)
            scaled = distribute.replica_loss(self.optimizer, self.regularized(-per_child))
        weights = self.layer.trainable_weights
        self.optimizer.apply(tape.gradient(scaled, weights), weights)
        self.bound_tracker.update_state(per_child)
        self.entropy_tracker.update_state(entropy)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        children, _ = unpack(data, self, self.data_dtype)
        a = child_activations(children, self.child_weights)
        found = self.layer.infer(children, a, iterations=self.iterations)
        per_child, entropy = self._statistics(children, a, found.poses, found.coefficients)
        self.bound_tracker.update_state(per_child)
        self.entropy_tracker.update_state(entropy)
        return {m.name: m.result() for m in self.metrics}
