"""Set-transformer blocks (Lee et al., 2019): attention over an unordered set, as Smith et al.'s top encoder uses.

    MAB(X, Y) = LN(H + rFF(H)),   H = LN(X + MultiHead(X, Y, Y))
    ISAB(X)   = MAB(X, MAB(I, X))            I: m learned inducing points
    PMA(X)    = MAB(S, rFF(X))               S: k learned seed vectors

An ISAB costs O(n m) instead of O(n^2); PMA pools a set of any size to k
vectors. Every block is permutation-equivariant in X (PMA invariant).
"""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="poecaps")
class MultiheadAttentionBlock(keras.layers.Layer):
    """`MAB(X, Y)`: `[B, n, d]` attending to `[B, m, d]` -> `[B, n, d]`, with layer norm (d = `units`)."""

    def __init__(self, units=128, heads=4, **kwargs):
        super().__init__(**kwargs)
        if units % heads:
            raise ValueError(f"units must be a multiple of heads. Received: units={units}, heads={heads}")
        self.units, self.heads = units, heads
        self.attention = keras.layers.MultiHeadAttention(heads, units // heads, name="attention")
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.norm2 = keras.layers.LayerNormalization(name="norm2")
        self.feed_forward = keras.layers.Dense(units, activation="relu", name="feed_forward")

    def call(self, x, y):
        h = self.norm1(x + self.attention(x, y, y))
        return self.norm2(h + self.feed_forward(h))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads}


@keras.saving.register_keras_serializable(package="poecaps")
class InducedSetAttention(keras.layers.Layer):
    """`ISAB(X)` with `inducing` learned points: `[B, n, units]` -> `[B, n, units]`."""

    def __init__(self, units=128, heads=4, inducing=32, **kwargs):
        super().__init__(**kwargs)
        self.units, self.heads, self.inducing = units, heads, inducing
        self.summarise = MultiheadAttentionBlock(units, heads, name="summarise")
        self.broadcast = MultiheadAttentionBlock(units, heads, name="broadcast")

    def build(self, input_shape):
        self.points = self.add_weight(name="inducing_points", shape=(1, self.inducing, self.units),
                                      initializer="glorot_uniform")

    def call(self, x):
        points = ops.repeat(self.points, ops.shape(x)[0], axis=0)
        return self.broadcast(x, self.summarise(points, x))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads, "inducing": self.inducing}


@keras.saving.register_keras_serializable(package="poecaps")
class AttentionPooling(keras.layers.Layer):
    """`PMA(X)` with `seeds` learned seed vectors: `[B, n, units]` -> `[B, seeds, units]`."""

    def __init__(self, units=128, heads=4, seeds=1, **kwargs):
        super().__init__(**kwargs)
        self.units, self.heads, self.seeds = units, heads, seeds
        self.feed_forward = keras.layers.Dense(units, activation="relu", name="feed_forward")
        self.block = MultiheadAttentionBlock(units, heads, name="block")

    def build(self, input_shape):
        self.seed_vectors = self.add_weight(name="seed_vectors", shape=(1, self.seeds, self.units),
                                            initializer="glorot_uniform")

    def call(self, x):
        seeds = ops.repeat(self.seed_vectors, ops.shape(x)[0], axis=0)
        return self.block(seeds, self.feed_forward(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units, "heads": self.heads, "seeds": self.seeds}
