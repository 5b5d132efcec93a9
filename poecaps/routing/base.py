"""The one routing interface shared by every routing procedure."""

import collections

import keras

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.validation import check_integer, shape_fits, sizes_fit

RoutingResult = collections.namedtuple("RoutingResult", ["poses", "activations", "coefficients"])
RoutingResult.__doc__ = """What a routing procedure returns.

poses:        [batch, num_out, pose_dim]  (squashed upper capsules)
activations:  [batch, num_out]            (probability each upper capsule is on)
coefficients: [batch, num_in, num_out]    (routing coefficients c_ij)
"""


def check_activations(router, votes_shape, activations_shape):
    """Raise `InputError` unless activations of `activations_shape` fit votes of `votes_shape`: `[B, I]` for
    `[B, I, J, D]` (sizes unknown while tracing, None, match any)."""
    if votes_shape is None or activations_shape is None or len(votes_shape) != 4:
        return      # not array-like, or votes of another rank, which Keras' input spec refuses
    if not shape_fits(activations_shape, votes_shape[:2]):
        raise InputError(f"{type(router).__name__}: activations must be [B, I] = {list(votes_shape[:2])} for votes "
                         f"[B, I, J, D] of shape {list(votes_shape)}. Received: activations of shape "
                         f"{list(activations_shape)}")


class Routing(distribute.FullPrecision, keras.layers.Layer):
    """Base class of routing procedures.

    Call arguments:
        votes: `[batch, num_in, num_out, pose_dim]`, the predictions u_{j|i}.
        activations: `[batch, num_in]` or None (treated as ones).
        training: Python bool or None.

    Returns:
        `RoutingResult(poses, activations, coefficients)`.

    `normalizes` names the axis the coefficients sum to 1 over: "parents"
    (sum_j c_ij = 1) or "children" (sum_i c_ij = 1); routing statistics
    (entropy) take that axis.

    Under a mixed-precision policy (float16 or bfloat16 compute; the global
    one, or a `dtype` given to the router or to the capsule layer that makes
    it) a router's dtype policy is float32: its weights are neither stored
    nor read in low precision, and the votes that a capsule layer computed
    in low precision are cast to float32 on the way in
    (`poecaps.distribute.FullPrecision`). Under any other policy it follows
    the one given, else the global one (float64 routes in float64).
    """

    normalizes = "parents"

    def __init__(self, iterations=3, **kwargs):
        super().__init__(**kwargs)
        self.iterations = check_integer(iterations, "iterations", minimum=0)
        # votes of another rank are refused by Keras with the layer's name and both ranks
        self.input_spec = keras.InputSpec(ndim=4)

    def weight_sizes(self):
        """`{axis: size}`: the sizes of the votes' axes (`[B, I, J, D]`: 2 for J, 3 for D) that the built
        router's weights fix; none for a router whose weights fit votes of any size."""
        return {}

    def __call__(self, votes, activations=None, *args, **kwargs):
        shape = getattr(votes, "shape", None)
        if self.built and shape is not None and len(shape) == 4:
            for axis, size in self.weight_sizes().items():
                if not sizes_fit(shape[axis], size):
                    raise InputError(f"{type(self).__name__} {self.name!r} was built for votes [B, I, J, D] with "
                                     f"{'BIJD'[axis]} = {size}, which its weights fix. Received: votes of shape "
                                     f"{list(shape)}")
        if activations is not None:
            check_activations(self, shape, getattr(activations, "shape", None))
        return super().__call__(votes, activations, *args, **kwargs)

    def compute_output_spec(self, votes, activations=None, training=None):
        b, _, j, d = votes.shape
        return RoutingResult(
            keras.KerasTensor((b, j, d), dtype=votes.dtype),
            keras.KerasTensor((b, j), dtype=votes.dtype),
            keras.KerasTensor(votes.shape[:3], dtype=votes.dtype),
        )

    def get_config(self):
        config = super().get_config()
        config["iterations"] = self.iterations
        return config
