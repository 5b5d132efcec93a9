"""Similarity routing: routing as kernel fuzzy clustering with learned weights (Faria, section 4.1)."""

import math

import keras
import numpy as np
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.routing.base import Routing, RoutingResult
from poecaps.validation import check_integer, check_number, check_seed

# Frobenius-normalised votes have |V| <= 1, so vote-to-pose distances are of order 1: the
# default length scales spread around this distance (spec: {0.25, 0.5, 1, 2} times it).
TYPICAL_VOTE_DISTANCE = 1.0
# Floors that keep logarithms and divisions finite: child activations, and lambda1 + lambda2.
_TINY = 1e-12


def default_length_scales(num_kernels):
    """Q widths spaced geometrically from 0.25 to 2 typical vote distances ({0.25, 0.5, 1, 2} for Q = 4)."""
    if num_kernels == 1:
        return [TYPICAL_VOTE_DISTANCE]
    return list(np.geomspace(0.25, 2.0, num_kernels) * TYPICAL_VOTE_DISTANCE)


def compatibility(kernel_values, log_activations, entropy_weight, prior_weight):
    """The closed-form minimiser of the similarity objective over the children (the compatibility step).

    Minimises, for each parent j, subject to `sum_i c_ij = 1` and `c >= 0`,

        -sum_i c_ij K_ij + l1 sum_i c_ij log(I c_ij) + l2 sum_i c_ij log(c_ij / a_i),

    whose stationary point is `c_ij ∝ a_i^(l2/(l1+l2)) exp(K_ij/(l1+l2))`:
    a softmax over i of `(l2 log a_i + K_ij) / (l1 + l2)`, computed in log
    space.

    Args:
        kernel_values: `K [B, I, J]`.
        log_activations: `log a [B, I]`.
        entropy_weight, prior_weight: `l1`, `l2` (>= 0), broadcastable to `[J]`.

    Returns:
        `(c, log c)`, both `[B, I, J]`, `c` summing to 1 over i.
    """
    temperature = entropy_weight + prior_weight + _TINY
    logits = (prior_weight * log_activations[:, :, None] + kernel_values) / temperature
    log_c = logits - ops.logsumexp(logits, axis=1, keepdims=True)
    return ops.exp(log_c), log_c


@keras.saving.register_keras_serializable(package="poecaps")
class SimilarityRouting(Routing):
    """Routing as kernel fuzzy clustering, every weight learned (Faria, section 4.1, eq. 2-15).

    With votes `V_ij` (`[B, I, J, D]`) and child activations `a_i`, each parent
    j is the weighted mean of its votes, `mu_j = sum_i c_ij V_ij`, with
    coefficients normalised over the children (`sum_i c_ij = 1`, as in EM's
    M-step). Starting from `c_ij = 1/I`, each of `iterations` rounds runs the
    compatibility step, the exact minimiser of

        -sum_i c_ij K(mu_j, V_ij) + l1 sum_i c_ij log(I c_ij) + l2 sum_i c_ij log(c_ij / a_i)

    (a kernel-weighted clustering; the second term is the KL divergence to
    the uniform coefficients, the third to the child activations):

        c_ij = softmax_i( (l2 log a_i + K_ij) / (l1 + l2) )       (`compatibility`)
        mu_j = sum_i c_ij V_ij

    After the loop each parent's activation, from the kernel values and
    coefficients of the last compatibility step (of `c = 1/I` when
    `iterations=0`):

        a_j = sigmoid(|theta1_j| sum_i c_ij K_ij - |theta3_j| sum_i c_ij log(c_ij / a_i) + theta2_j)

    The kernel (eq. 15) is a mixture of Q Gaussians,
    `K(mu, V) = sum_q softmax(b)_q exp(-|mu - V|^2 / (2 l_q^2))`.

    Weights: per parent type j, `lambda1 = |alpha_j|`, `lambda2 = |beta_j|`,
    theta1, theta2, theta3; per layer, the Q length scales (through a
    softplus, so they stay positive) and the mixture logits b (zeros: an
    equal mixture). Every constructor value below is the initial value of its
    weight. Two departures from the author's code, which leaves routing
    inert (spec, "decision"): length scales start at {0.25, 0.5, 1, 2} times
    a typical vote distance (near 0 there, which makes every K ~ exp(-300)),
    and every initial value is an argument.

    Args:
        iterations: compatibility steps T (3 in the paper), >= 0.
        num_kernels: Q, Gaussians in the kernel (4 in the convolutional
            capsule layers, 10 in the class layer).
        length_scales: the Q initial widths; None: geometric from 0.25 to 2
            (`default_length_scales`).
        entropy_weight: initial lambda1 (the author's 12).
        prior_weight: initial lambda2 (1).
        kernel_weight: initial theta1; None: N(0, 0.1) per parent type.
        activation_bias: initial theta2 (1).
        divergence_weight: initial theta3; None: N(0, 0.1) per parent type.
        seed: seed of the N(0, 0.1) initial values.

    Call arguments:
        votes: `[B, I, J, D]`.
        activations: `[B, I]` in (0, 1], or None (ones).

    Returns:
        `RoutingResult(poses = mu [B, J, D] (not squashed), activations = a
        [B, J], coefficients = c [B, I, J])`, c summing to 1 over i.

    Example:
    >>> routing = SimilarityRouting(iterations=3, num_kernels=4)
    >>> tuple(routing(keras.random.normal((2, 18, 5, 16))).poses.shape)
    (2, 5, 16)
    """

    normalizes = "children"

    def __init__(self, iterations=3, num_kernels=4, length_scales=None, entropy_weight=12.0,
                 prior_weight=1.0, kernel_weight=None, activation_bias=1.0, divergence_weight=None,
                 seed=None, **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        num_kernels = check_integer(num_kernels, "num_kernels")
        if length_scales is not None:
            if isinstance(length_scales, (str, bytes)) or not hasattr(length_scales, "__len__") \
                    or len(length_scales) != num_kernels:
                raise InputError(f"length_scales must be {num_kernels} positive widths, one per kernel. "
                                 f"Received: length_scales={length_scales}")
            length_scales = [check_number(x, f"length_scales[{k}]", above=0) for k, x in enumerate(length_scales)]
        self.num_kernels = num_kernels
        self.length_scales = length_scales
        self.entropy_weight = check_number(entropy_weight, "entropy_weight", minimum=0)
        self.prior_weight = check_number(prior_weight, "prior_weight", minimum=0)
        # initial values of learned weights: any finite number (None draws N(0, 0.1) per parent type)
        self.kernel_weight = None if kernel_weight is None else check_number(kernel_weight, "kernel_weight")
        self.activation_bias = check_number(activation_bias, "activation_bias")
        self.divergence_weight = (None if divergence_weight is None
                                  else check_number(divergence_weight, "divergence_weight"))
        self.seed = check_seed(seed, allow_none=True)

    def build(self, votes_shape, activations_shape=None):
        num_out = votes_shape[2]

        def initial(value, offset):
            if value is not None:
                return keras.initializers.Constant(value)
            seed = None if self.seed is None else self.seed + offset
            return keras.initializers.RandomNormal(stddev=0.1, seed=seed)

        per_parent = lambda name, init: self.add_weight(name=name, shape=(num_out,), initializer=init)
        self.alpha = per_parent("alpha", initial(self.entropy_weight, 0))
        self.beta = per_parent("beta", initial(self.prior_weight, 0))
        self.theta1 = per_parent("theta1", initial(self.kernel_weight, 1))
        self.theta2 = per_parent("theta2", initial(self.activation_bias, 0))
        self.theta3 = per_parent("theta3", initial(self.divergence_weight, 2))
        widths = self.length_scales or default_length_scales(self.num_kernels)
        # softplus(w) = l  <=>  w = l + log(1 - exp(-l))
        raw = [w + math.log(-math.expm1(-w)) for w in widths]
        self.length_scale_logits = self.add_weight(
            name="length_scale_logits", shape=(self.num_kernels,), initializer=keras.initializers.Constant(raw))
        self.mixture_logits = self.add_weight(name="mixture_logits", shape=(self.num_kernels,),
                                              initializer="zeros")

    def weight_sizes(self):
        return {2: self.alpha.shape[0]}        # alpha, beta, theta: one per parent

    def kernel(self, squared_distances):
        """`K = sum_q softmax(b)_q exp(-d2 / (2 l_q^2))` of squared distances `d2` (any shape)."""
        dtype = squared_distances.dtype
        widths = ops.softplus(ops.cast(self.length_scale_logits, dtype))
        mixture = ops.softmax(ops.cast(self.mixture_logits, dtype))
        # [..., 1] / [Q] -> [..., Q], mixed over Q
        scaled = squared_distances[..., None] / (2.0 * ops.square(widths))
        return ops.sum(mixture * ops.exp(-scaled), axis=-1)

    def call(self, votes, activations=None, training=None):
        dtype = distribute.full_precision_dtype(votes)
        votes = ops.cast(votes, dtype)
        num_in = votes.shape[1]
        if activations is None:
            log_a = ops.zeros(ops.shape(votes)[:2], dtype=dtype)
        else:
            log_a = ops.log(ops.maximum(ops.cast(activations, dtype), _TINY))
        cast = lambda w: ops.cast(w, dtype)
        l1, l2 = ops.abs(cast(self.alpha)), ops.abs(cast(self.beta))
        vote_sq = ops.sum(ops.square(votes), axis=-1)                                   # [B, I, J]

        def kernel_values(mu):
            # |mu_j - V_ij|^2 = |V_ij|^2 - 2 V_ij . mu_j + |mu_j|^2, never forming [B, I, J, D] differences
            # [B, I, J, D] x [B, J, D] -> [B, I, J]
            cross = ops.einsum("bijd,bjd->bij", votes, mu)
            d2 = ops.maximum(vote_sq - 2.0 * cross + ops.sum(ops.square(mu), axis=-1)[:, None, :], 0.0)
            return self.kernel(d2)

        # [B, I, J] x [B, I, J, D] -> [B, J, D]
        weighted_mean = lambda c: ops.einsum("bij,bijd->bjd", c, votes)
        c = ops.ones_like(vote_sq) / num_in
        log_c = ops.log(c)
        mu = weighted_mean(c)
        k = None
        for _ in range(self.iterations):
            k = kernel_values(mu)
            c, log_c = compatibility(k, log_a, l1, l2)
            mu = weighted_mean(c)
        if k is None:  # no compatibility step: the kernel of the uniform coefficients' mean
            k = kernel_values(mu)
        agreement = ops.sum(c * k, axis=1)                                              # [B, J]
        divergence = ops.sum(c * (log_c - log_a[:, :, None]), axis=1)                   # [B, J]
        logits = (ops.abs(cast(self.theta1)) * agreement - ops.abs(cast(self.theta3)) * divergence
                  + cast(self.theta2))
        return RoutingResult(mu, ops.sigmoid(logits), c)

    def get_config(self):
        config = super().get_config()
        config.update(num_kernels=self.num_kernels, length_scales=self.length_scales,
                      entropy_weight=self.entropy_weight, prior_weight=self.prior_weight,
                      kernel_weight=self.kernel_weight, activation_bias=self.activation_bias,
                      divergence_weight=self.divergence_weight, seed=self.seed)
        return config
