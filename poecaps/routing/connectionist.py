"""Connectionist routing: an LSTM cell shared by every (child, parent) pair learns to route (Faria, 4.2)."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.routing.base import Routing, RoutingResult
from poecaps.validation import check_integer, check_seed


def _mlp(hidden, name, seed, dtype):
    """ReLU layers of sizes `hidden`, then one linear output unit, in the router's `dtype`: float32 under a
    mixed policy, as the routing around them is (the policy would make them compute in float16)."""
    init = lambda k: keras.initializers.GlorotUniform(seed=None if seed is None else seed + k)
    layers = [keras.layers.Dense(units, activation="relu", kernel_initializer=init(k), name=f"{name}_{k}",
                                 dtype=dtype)
              for k, units in enumerate(hidden)]
    layers.append(keras.layers.Dense(1, kernel_initializer=init(len(hidden)), name=f"{name}_out", dtype=dtype))
    return layers


def _rows_times(x, w):
    """`x [..., K] @ w [K, N]` as one 2-D matmul (a broadcast batch matmul is far slower under XLA)."""
    out = ops.matmul(ops.reshape(x, (-1, x.shape[-1])), w)
    return ops.reshape(out, (*ops.shape(x)[:-1], w.shape[-1]))


def _check_hidden(name, hidden):
    return tuple(check_integer(units, f"{name}[{i}]") for i, units in enumerate(hidden))


@keras.saving.register_keras_serializable(package="poecaps")
class ConnectionistRouting(Routing):
    """Routing learned by an LSTM cell and two small networks (Faria, section 4.2, Algorithm 2, eq. 14).

    One LSTM cell of `units` units, shared by every (child i, parent j) pair,
    reads per pair the previous parent pose, the vote, the previous
    coefficient and the child's activation,

        x_ij(t) = [mu_j(t-1), V_ij, c_ij(t-1), a_i]                (2D + 2 values)

    with its hidden state h and cell state m starting at zero and carried
    over the iterations (gates i, f, g, o as Keras' `LSTMCell`):

        [i, f, g, o] = x W + h W_h + b
        m <- sigmoid(f) m + sigmoid(i) tanh(g);   h <- sigmoid(o) tanh(m)

    Starting from `c_ij = 1/I`, `mu_j = sum_i c_ij V_ij`, each of `iterations`
    rounds steps the cell once for every pair, then

        c_ij = softmax_i f_c(h_ij),        mu_j = sum_i c_ij V_ij

    and after the last round (eq. 14) `a_j = sigmoid(f_a(sum_i c_ij m_ij))`.
    `f_c` and `f_a` are ReLU networks with a linear scalar output, shared
    over pairs (Table 2: hidden sizes none / none in the first
    convolutional capsule layer, [32, 32] / [64, 64] in the second,
    [64, 64] / [124, 124] in the class layer). The coefficients are
    normalised over the children (`sum_i c_ij = 1`).

    The input projection `x W` is split by the input's parts: the votes'
    share `V_ij W_V` is computed once, the poses' `mu_j W_mu` once per parent
    and round, so no `[B, I, J, 2D + 2]` input is ever formed.

    Args:
        iterations: rounds T (3 in the paper), >= 0.
        units: LSTM units (16 in the paper).
        compatibility_hidden: hidden sizes of f_c.
        activation_hidden: hidden sizes of f_a.
        seed: seed of the initial weights (Glorot uniform kernels, an
            orthogonal recurrent kernel, forget-gate bias 1, as Keras' LSTM).

    Call arguments:
        votes: `[B, I, J, D]`.
        activations: `[B, I]` or None (ones).

    Returns:
        `RoutingResult(poses = mu [B, J, D], activations = a [B, J],
        coefficients = c [B, I, J])`, c summing to 1 over i.

    Example:
    >>> routing = ConnectionistRouting(iterations=3, units=16, compatibility_hidden=(32, 32))
    >>> tuple(routing(keras.random.normal((2, 18, 5, 16))).poses.shape)
    (2, 5, 16)
    """

    normalizes = "children"

    def __init__(self, iterations=3, units=16, compatibility_hidden=(), activation_hidden=(), seed=None,
                 **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        self.units = check_integer(units, "units")
        self.compatibility_hidden = _check_hidden("compatibility_hidden", compatibility_hidden)
        self.activation_hidden = _check_hidden("activation_hidden", activation_hidden)
        self.seed = seed = check_seed(seed, allow_none=True)
        offset = lambda k: None if seed is None else seed + k
        self.compatibility_layers = _mlp(self.compatibility_hidden, "compatibility", offset(10), self.dtype_policy)
        self.activation_layers = _mlp(self.activation_hidden, "activation", offset(20), self.dtype_policy)

    def build(self, votes_shape, activations_shape=None):
        dim = votes_shape[3]
        seeded = lambda cls, k: cls(seed=None if self.seed is None else self.seed + k)
        self.kernel = self.add_weight(name="kernel", shape=(2 * dim + 2, 4 * self.units),
                                      initializer=seeded(keras.initializers.GlorotUniform, 0))
        self.recurrent_kernel = self.add_weight(name="recurrent_kernel", shape=(self.units, 4 * self.units),
                                                initializer=seeded(keras.initializers.Orthogonal, 1))
        forget_one = [0.0] * self.units + [1.0] * self.units + [0.0] * 2 * self.units
        self.bias = self.add_weight(name="bias", shape=(4 * self.units,),
                                    initializer=keras.initializers.Constant(forget_one))
        for layers, width in ((self.compatibility_layers, self.units), (self.activation_layers, self.units)):
            for layer in layers:
                layer.build((None, width))
                width = layer.units

    def weight_sizes(self):
        return {3: (self.kernel.shape[0] - 2) // 2}    # the LSTM reads 2 D + 2 values per pair

    @staticmethod
    def _apply(layers, x):
        """The network `layers` on the last axis of `x`, as one 2-D matmul per layer; drops the unit axis."""
        lead = ops.shape(x)[:-1]
        x = ops.reshape(x, (-1, x.shape[-1]))
        for layer in layers:
            x = layer(x)
        return ops.reshape(x, lead)

    def call(self, votes, activations=None, training=None):
        dtype = distribute.full_precision_dtype(votes)
        votes = ops.cast(votes, dtype)
        num_in, dim, units = votes.shape[1], votes.shape[3], self.units
        a = ops.ones(ops.shape(votes)[:2], dtype) if activations is None else ops.cast(activations, dtype)
        # Each gate's own columns of the weights: the gates are computed as four [B, I, J, U] tensors, not
        # one [B, I, J, 4U] split along its last axis (whose slices and their gradient's concatenation
        # made the backward pass nearly twice as slow under XLA, bench/learned_step.py).
        columns = lambda w: [w[..., k * units:(k + 1) * units] for k in range(4)]
        kernel = ops.cast(self.kernel, dtype)
        k_mu, k_vote = columns(kernel[:dim]), columns(kernel[dim:2 * dim])
        k_c, k_a = columns(kernel[2 * dim]), columns(kernel[2 * dim + 1])
        recurrent, bias = columns(ops.cast(self.recurrent_kernel, dtype)), columns(ops.cast(self.bias, dtype))
        # The parts of x W that do not change over the rounds: the vote's and the child activation's.
        # [B, I, J, D] x [D, U] -> [B, I, J, U], per gate
        fixed = [_rows_times(votes, k_vote[k]) + a[:, :, None, None] * k_a[k] + bias[k] for k in range(4)]
        # [B, I, J] x [B, I, J, D] -> [B, J, D]
        weighted_mean = lambda c: ops.einsum("bij,bijd->bjd", c, votes)
        c = ops.ones(ops.shape(votes)[:3], dtype) / num_in
        mu = weighted_mean(c)
        h = m = None                    # zero states: the first round skips their terms
        for _ in range(self.iterations):
            # [B, J, D] x [D, U] -> [B, 1, J, U];  [B, I, J, U] x [U, U] -> [B, I, J, U]
            gates = [fixed[k] + ops.matmul(mu, k_mu[k])[:, None] + c[..., None] * k_c[k] for k in range(4)]
            if h is not None:
                gates = [g + _rows_times(h, r) for g, r in zip(gates, recurrent)]
            i, f, g, o = gates
            m = ops.sigmoid(i) * ops.tanh(g) + (0.0 if m is None else ops.sigmoid(f) * m)
            h = ops.sigmoid(o) * ops.tanh(m)
            c = ops.softmax(self._apply(self.compatibility_layers, h), axis=1)
            mu = weighted_mean(c)
        if m is None:
            m = ops.zeros((*ops.shape(votes)[:3], units), dtype)
        # [B, I, J] x [B, I, J, U] -> [B, J, U]
        pooled = ops.einsum("bij,biju->bju", c, m)
        return RoutingResult(mu, ops.sigmoid(self._apply(self.activation_layers, pooled)), c)

    def get_config(self):
        config = super().get_config()
        config.update(units=self.units, compatibility_hidden=list(self.compatibility_hidden),
                      activation_hidden=list(self.activation_hidden), seed=self.seed)
        return config
