"""Set-transformer blocks (Lee et al., 2019, section 3): attention over an unordered set, as Smith et al.'s top
encoder uses.

    MAB(X, Y) = LN(H + rFF(H)),   H = LN(X + MultiHead(X, Y, Y))
    ISAB(X)   = MAB(X, MAB(I, X))            I: m learned inducing points
    PMA(X)    = MAB(S, rFF(X))               S: k learned seed vectors

An ISAB costs O(n m) instead of O(n^2); PMA pools a set of any size to k
vectors. Every block is permutation-equivariant in X (PMA invariant).
"""

import keras
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_integers, sizes_fit


def _check_sets(layer, x_shape, y_shape=None, x_width=None, width_text=None):
    """Refuse, naming `layer`, a set `x` (and `y`) that is not `[B, n, e]`, sets of two batch sizes, or an `x`
    whose feature size is not `x_width` (unknown sizes fit any; `width_text` says which width, and why)."""
    sets = {"x": tuple(x_shape)} if y_shape is None else {"x": tuple(x_shape), "y": tuple(y_shape)}
    for name, shape in sets.items():
        if len(shape) != 3:
            raise InputError(f"{type(layer).__name__} {layer.name!r}: {name} must be a set [batch, elements, "
                             f"features]. Received: shape={shape}")
    if y_shape is not None and not sizes_fit(sets["x"][0], sets["y"][0]):
        raise InputError(f"{type(layer).__name__} {layer.name!r}: x and y must share one batch size. "
                         f"Received: shapes {sets['x']} and {sets['y']}")
    if x_width is not None and not sizes_fit(sets["x"][-1], x_width):
        raise InputError(f"{type(layer).__name__} {layer.name!r}: x must have {width_text}. "
                         f"Received: shape={sets['x']}")


def _check_width(layer, x_shape, y_shape=None):
    """The queries X must have `units` features: the residual adds X to the attention's output."""
    _check_sets(layer, x_shape, y_shape, layer.units,
                f"`units` = {layer.units} features (the residual adds it to the attention's output)")


@keras.saving.register_keras_serializable(package="poecaps")
class MultiheadAttentionBlock(keras.layers.Layer):
    """The multihead attention block `MAB(X, Y)`: a set attends to another, with residuals and layer norm.

        H        = LN_1(X + MultiHead(X, Y, Y))
        MAB(X,Y) = LN_2(H + relu(H W + b))

    `MultiHead` is `keras.layers.MultiHeadAttention` with `heads` heads of
    size `units / heads` (scaled dot products, softmax over the `m`
    elements of Y); `LN` normalises each element's `units` features.
    Permuting the elements of X permutes the output alike; permuting Y
    leaves it unchanged.

    Args:
        units: the feature size d of X and of the output.
        heads: the number of attention heads; must divide `units`.

    Call arguments:
        x: `[B, n, units]`, the queries.
        y: `[B, m, e]`, the set attended to (any feature size e).

    Returns:
        `[B, n, units]`.

    Example:
        >>> block = MultiheadAttentionBlock(units=8, heads=2)
        >>> tuple(block(ops.ones((3, 5, 8)), ops.ones((3, 7, 4))).shape)
        (3, 5, 8)
    """

    def __init__(self, units=128, heads=4, **kwargs):
        super().__init__(**kwargs)
        units, heads = check_integers(units=units, heads=heads)
        if units % heads:
            raise InputError(f"units must be a multiple of heads. Received: units={units}, heads={heads}")
        self.units, self.heads = units, heads
        dtype = self.dtype_policy
        self.attention = keras.layers.MultiHeadAttention(heads, units // heads, name="attention", dtype=dtype)
        self.norm1 = keras.layers.LayerNormalization(name="norm1", dtype=dtype)
        self.norm2 = keras.layers.LayerNormalization(name="norm2", dtype=dtype)
        self.feed_forward = keras.layers.Dense(units, activation="relu", name="feed_forward", dtype=dtype)

    def build(self, x_shape, y_shape):
        _check_width(self, x_shape, y_shape)
        self.attention.build(x_shape, y_shape, y_shape)
        self.norm1.build(x_shape)
        self.feed_forward.build(x_shape)
        self.norm2.build(x_shape)

    def call(self, x, y):
        _check_width(self, x.shape, y.shape)
        h = self.norm1(x + self.attention(x, y, y))
        return self.norm2(h + self.feed_forward(h))

    def compute_output_shape(self, x_shape, y_shape):
        return (*x_shape[:-1], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads}


@keras.saving.register_keras_serializable(package="poecaps")
class InducedSetAttention(keras.layers.Layer):
    """The induced set attention block `ISAB(X) = MAB(X, MAB(I, X))`: self-attention through m inducing points.

    The `inducing` learned points `I [m, units]` first summarise the set
    (`MAB(I, X)`, `[B, m, units]`), then each element attends to the
    summary. The cost is O(n m) where full self-attention's is O(n^2).
    Permutation-equivariant in the elements of X.

    Args:
        units: the feature size of X and of the output.
        heads: the number of attention heads; must divide `units`.
        inducing: m, the number of learned inducing points.

    Call arguments:
        x: `[B, n, units]`, a set of n elements (n may vary between calls).

    Returns:
        `[B, n, units]`.

    Example:
        >>> tuple(InducedSetAttention(units=8, heads=2, inducing=3)(ops.ones((2, 5, 8))).shape)
        (2, 5, 8)
    """

    def __init__(self, units=128, heads=4, inducing=32, **kwargs):
        super().__init__(**kwargs)
        self.units, self.heads, self.inducing = check_integers(units=units, heads=heads, inducing=inducing)
        self.summarise = MultiheadAttentionBlock(units, heads, name="summarise", dtype=self.dtype_policy)
        self.broadcast = MultiheadAttentionBlock(units, heads, name="broadcast", dtype=self.dtype_policy)

    def build(self, input_shape):
        _check_width(self, input_shape)
        self.points = self.add_weight(name="inducing_points", shape=(1, self.inducing, self.units),
                                      initializer="glorot_uniform")
        summary_shape = (input_shape[0], self.inducing, self.units)
        self.summarise.build(summary_shape, input_shape)
        self.broadcast.build(input_shape, summary_shape)

    def call(self, x):
        _check_width(self, x.shape)
        points = ops.repeat(self.points, ops.shape(x)[0], axis=0)
        return self.broadcast(x, self.summarise(points, x))

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads, "inducing": self.inducing}


@keras.saving.register_keras_serializable(package="poecaps")
class AttentionPooling(keras.layers.Layer):
    """Pooling by multihead attention `PMA(X) = MAB(S, relu(X W + b))`: a set of any size to k vectors.

    The `seeds` learned vectors `S [k, units]` attend to the set after a
    row-wise feed-forward layer. Invariant to permutations of X.

    Args:
        units: the feature size of the output.
        heads: the number of attention heads; must divide `units`.
        seeds: k, the number of output vectors.

    Call arguments:
        x: `[B, n, e]`, a set of n elements of any feature size e.

    Returns:
        `[B, seeds, units]`.

    Example:
        >>> tuple(AttentionPooling(units=8, heads=2, seeds=1)(ops.ones((2, 5, 3))).shape)
        (2, 1, 8)
    """

    def __init__(self, units=128, heads=4, seeds=1, **kwargs):
        super().__init__(**kwargs)
        self.units, self.heads, self.seeds = check_integers(units=units, heads=heads, seeds=seeds)
        self.feed_forward = keras.layers.Dense(units, activation="relu", name="feed_forward", dtype=self.dtype_policy)
        self.block = MultiheadAttentionBlock(units, heads, name="block", dtype=self.dtype_policy)

    def build(self, input_shape):
        _check_sets(self, input_shape)
        self.seed_vectors = self.add_weight(name="seed_vectors", shape=(1, self.seeds, self.units),
                                            initializer="glorot_uniform")
        self.feed_forward.build(input_shape)
        self.block.build((input_shape[0], self.seeds, self.units), (*input_shape[:-1], self.units))

    def call(self, x):
        width = self.feed_forward.kernel.shape[0] if self.built else None
        _check_sets(self, x.shape, x_width=width, width_text=f"the {width} features it was built for")
        seeds = ops.repeat(self.seed_vectors, ops.shape(x)[0], axis=0)
        return self.block(seeds, self.feed_forward(x))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.seeds, self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads, "seeds": self.seeds}
