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
from poecaps.validation import check_integers


def _check_width(shape, units, layer):
    """The queries X must have `units` features: the residual adds X to the attention's output."""
    if shape[-1] is not None and shape[-1] != units:
        raise InputError(f"{type(layer).__name__} {layer.name!r}: x must have `units` = {units} features "
                         f"(the residual adds it to the attention's output). Received: shape={tuple(shape)}")


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
        _check_width(x_shape, self.units, self)
        self.attention.build(x_shape, y_shape, y_shape)
        self.norm1.build(x_shape)
        self.feed_forward.build(x_shape)
        self.norm2.build(x_shape)

    def call(self, x, y):
        _check_width(x.shape, self.units, self)
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
        _check_width(input_shape, self.units, self)
        self.points = self.add_weight(name="inducing_points", shape=(1, self.inducing, self.units),
                                      initializer="glorot_uniform")
        summary_shape = (input_shape[0], self.inducing, self.units)
        self.summarise.build(summary_shape, input_shape)
        self.broadcast.build(input_shape, summary_shape)

    def call(self, x):
        _check_width(x.shape, self.units, self)
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
        self.seed_vectors = self.add_weight(name="seed_vectors", shape=(1, self.seeds, self.units),
                                            initializer="glorot_uniform")
        self.feed_forward.build(input_shape)
        self.block.build((input_shape[0], self.seeds, self.units), (*input_shape[:-1], self.units))

    def call(self, x):
        seeds = ops.repeat(self.seed_vectors, ops.shape(x)[0], axis=0)
        return self.block(seeds, self.feed_forward(x))

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.seeds, self.units)

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads, "seeds": self.seeds}
