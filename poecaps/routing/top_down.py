"""Routing read as top-down attention (Kiefer, Millidge et al., section 4, eq. 6)."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.validation import check_flag, check_integer, check_number, sizes_fit


@keras.saving.register_keras_serializable(package="poecaps")
class TopDownAttention(distribute.FullPrecision, keras.layers.Layer):
    """Each child queries its parents' top-down predictions of it (eq. 6), with an inverse temperature.

    Children `V_i` (`[B, I, D]`) and the parents' predictions of each child
    `U^_ij = W~_ij v_j` (`[B, I, J, D]`). Each of `iterations` rounds

        logits_ij = beta V_i(k-1) . U^_ij          (accumulate: added to the last round's logits)
        c_ij = softmax_j(logits_ij)                (one parent per child: over the parents)
        V_i(k) = sum_j c_ij U^_ij

    Eq. 6 is `beta = 1`. With unit-scale poses the dot product favours the
    parent whose prediction is both aligned and long, and over rounds the
    child can drift to it; `beta` sets how sharply a child commits.

    Like every router, it attends in float32 under a mixed-precision policy,
    global or given (`poecaps.distribute.FullPrecision`).

    Args:
        iterations: rounds k (>= 1).
        beta: inverse temperature (1.0: eq. 6 as printed).
        accumulate: add each round's logits to the previous ones.
        trainable_beta: learn beta (its initial value `beta`).

    Call arguments:
        children: `[B, I, D]`, the V_i(0).
        predictions: `[B, I, J, D]`, the U^_ij.

    Returns:
        `(attention [B, I, J], children [B, I, D])`: the last round's c and V(k).
    """

    def __init__(self, iterations=3, beta=1.0, accumulate=False, trainable_beta=False, **kwargs):
        super().__init__(**kwargs)
        iterations = check_integer(iterations, "iterations")
        self.iterations = iterations
        self.beta_value = check_number(beta, "beta", above=0)
        self.accumulate = check_flag(accumulate, "accumulate")
        self.trainable_beta = check_flag(trainable_beta, "trainable_beta")

    def _check_shapes(self, children_shape, predictions_shape):
        """Children `[B, I, D]` and predictions `[B, I, J, D]` of one B, I and D (unknown sizes fit), or an
        `InputError` naming both shapes; any J (the layer's one weight, beta, is a scalar)."""
        children_shape, predictions_shape = tuple(children_shape), tuple(predictions_shape or ())
        if not (len(children_shape) == 3 and len(predictions_shape) == 4
                and all(sizes_fit(children_shape[k], predictions_shape[k]) for k in (0, 1, -1))):
            raise InputError(f"{type(self).__name__} {self.name!r}: children must be [B, I, D] and predictions "
                             f"[B, I, J, D] with the same B, I and D. Received: children {children_shape}, "
                             f"predictions {predictions_shape}")

    def build(self, children_shape, predictions_shape=None):
        self._check_shapes(children_shape, predictions_shape)
        self.beta = self.add_weight(name="beta", shape=(), trainable=self.trainable_beta,
                                    initializer=keras.initializers.Constant(self.beta_value))

    def call(self, children, predictions):
        self._check_shapes(children.shape, predictions.shape)
        beta = ops.cast(self.beta, predictions.dtype)
        logits = 0.0
        v = children
        c = None
        for _ in range(self.iterations):
            # [B, I, D] x [B, I, J, D] -> [B, I, J]
            step = beta * ops.einsum("bid,bijd->bij", v, predictions)
            logits = logits + step if self.accumulate else step
            c = ops.softmax(logits, axis=-1)
            # [B, I, J] x [B, I, J, D] -> [B, I, D]
            v = ops.einsum("bij,bijd->bid", c, predictions)
        return c, v

    def compute_output_spec(self, children, predictions):
        return (keras.KerasTensor(predictions.shape[:3], dtype=predictions.dtype),
                keras.KerasTensor(children.shape, dtype=children.dtype))

    def get_config(self):
        config = super().get_config()
        config.update(iterations=self.iterations, beta=self.beta_value, accumulate=self.accumulate,
                      trainable_beta=self.trainable_beta)
        return config
