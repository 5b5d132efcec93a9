"""EM routing of matrix capsules (Hinton, Sabour, Frosst 2018)."""

import math

import keras
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.routing.base import Routing, RoutingResult
from poecaps.routing.em_moments import activation_logits, em_by_moments
from poecaps.validation import check_choice, check_number

COST_NORMALIZATIONS = ("none", "standardize")
IMPLEMENTATIONS = ("moments", "direct")


@keras.saving.register_keras_serializable(package="poecaps")
class EMRouting(Routing):
    """Routing by expectation-maximisation: each upper capsule is a Gaussian over votes.

    With votes `V [B, I, J, D]` (flattened 4x4 pose matrices) and lower
    activations `a_i`, the responsibilities start at `R_ij = 1/J` (Gebotys
    eq. 20) and each of `iterations` rounds runs

        M-step  R'_ij = R_ij a_i                                       (21)
                mu_j = sum_i R'_ij V_ij / sum_i R'_ij                   (22)
                var_j = sum_i R'_ij (V_ij - mu_j)^2 / sum_i R'_ij + floor
                cost_j^h = (beta_u + log sigma_j^h) sum_i R'_ij          (26)
                a_j = logistic(lambda_t (beta_a - sum_h cost_j^h))       (27)
        E-step  log p_ij = - sum_h (V_ij^h - mu_j^h)^2 / (2 var_j^h)
                           - sum_h log sqrt(2 pi var_j^h)                (28)
                R_ij = a_j p_ij / sum_k a_k p_ik                         (29)

    (no E-step after the last M-step). Eq. 29 shares each child's unit of
    vote among the parents, so `normalizes = "parents"` (the design's list of
    axes says children for EM; the equation says parents). Everything runs
    in log space: `log a_j = log_sigmoid(...)` and the normalisation of (29)
    is a `logsumexp` over j, so no responsibility underflows to 0/0. The
    inverse temperature rises over the rounds, `lambda_t = final_lambda *
    (1 - 0.95^(t+1))`. `beta_u` and `beta_a` are learned, one per upper
    capsule type. Routing runs in float32 under mixed precision.

    Args:
        iterations: EM rounds (M-steps), >= 1.
        final_lambda: scale of the inverse temperature. Round t (0-based)
            uses `lambda_t = final_lambda * (1 - 0.95^(t+1))`, a schedule
            that rises toward `final_lambda` without reaching it: with 3
            rounds, 0.05, 0.0975 and 0.1426 of it.
        variance_floor: added to every variance.
        cost_normalization: "none" (the paper's eq. 27) or "standardize":
            the costs of the J parents are standardised (minus their mean,
            over their standard deviation) before eq. 27, as widely used
            reimplementations do; the logistic's argument is then of order
            `lambda_t`, so use `final_lambda` near 1. The paper's costs grow
            with the number of inputs, which saturates the logistic of every
            parent together unless `final_lambda` is small (0.01).
        implementation: "moments" (default; `em_by_moments`: each round's
            sums as batched matrix-vector products over `[V, V*V]` with a
            written-out gradient) or "direct" (the equations above as
            written, autodiff through every step). They agree to rounding,
            gradients included (tests/test_em_routing.py).

    Call arguments:
        votes: `[B, I, J, D]`.
        activations: `[B, I]` or None (ones).

    Returns:
        `RoutingResult(poses = mu [B, J, D], activations = a [B, J],
        coefficients = R [B, I, J])`, R summing to 1 over j.

    Example:
    >>> routing = EMRouting(iterations=3)
    >>> tuple(routing(keras.random.normal((2, 18, 5, 16))).poses.shape)
    (2, 5, 16)
    """

    def __init__(self, iterations=3, final_lambda=0.01, variance_floor=1e-4,
                 cost_normalization="none", implementation="moments", **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        if iterations < 1:
            raise InputError(f"EM routing needs at least one M-step. Received: iterations={iterations}")
        final_lambda = check_number(final_lambda, "final_lambda", above=0)
        variance_floor = check_number(variance_floor, "variance_floor", above=0)
        check_choice(cost_normalization, "cost_normalization", COST_NORMALIZATIONS)
        check_choice(implementation, "implementation", IMPLEMENTATIONS)
        self.cost_normalization = cost_normalization
        self.implementation = implementation
        self.final_lambda = final_lambda
        self.variance_floor = variance_floor

    def build(self, votes_shape, activations_shape=None):
        num_out = votes_shape[2]
        self.beta_u = self.add_weight(name="beta_u", shape=(num_out,), initializer="zeros")
        self.beta_a = self.add_weight(name="beta_a", shape=(num_out,), initializer="zeros")

    def weight_sizes(self):
        return {2: self.beta_u.shape[0]}       # beta_u and beta_a: one per parent

    def inverse_temperature(self, t):
        return self.final_lambda * (1.0 - 0.95 ** (t + 1))

    def call(self, votes, activations=None, training=None):
        dtype = distribute.full_precision_dtype(votes)
        votes = ops.cast(votes, dtype)
        num_out, dim = votes.shape[2], votes.shape[3]
        a_in = (ops.ones_like(votes[:, :, 0, 0]) if activations is None
                else ops.cast(activations, dtype))
        beta_u = ops.cast(self.beta_u, dtype)
        beta_a = ops.cast(self.beta_a, dtype)
        temperatures = [self.inverse_temperature(t) for t in range(self.iterations)]
        standardize = self.cost_normalization == "standardize"
        if self.implementation == "moments":
            mu, logit_a, r = em_by_moments(ops.transpose(votes, (0, 2, 1, 3)), a_in, beta_u, beta_a,
                                           temperatures, self.variance_floor, standardize)
            return RoutingResult(mu, ops.sigmoid(logit_a), ops.transpose(r, (0, 2, 1)))
        r = ops.ones_like(votes[..., 0]) / num_out
        for t, temperature in enumerate(temperatures):
            # M-step. Weighted sums over i as multiply-and-reduce: an einsum here would
            # transpose the [B, I, J, D] votes on every call.
            rw = (r * a_in[:, :, None])[..., None]                              # [B, I, J, 1]
            r_sum = ops.sum(rw, axis=1) + 1e-8                                  # [B, J, 1]
            mu = ops.sum(rw * votes, axis=1) / r_sum                            # [B, J, D]
            sq_dev = ops.square(votes - mu[:, None])                            # [B, I, J, D]
            var = ops.sum(rw * sq_dev, axis=1) / r_sum + self.variance_floor
            log_sigma = 0.5 * ops.log(var)
            logit_a = activation_logits(r_sum[..., 0], log_sigma, beta_u, beta_a, temperature,
                                        standardize)
            if t == self.iterations - 1:
                break
            # E-step: log-densities of each vote under each Gaussian, normalised over j.
            log_p = (-0.5 * ops.sum(sq_dev / var[:, None], axis=-1)
                     - ops.sum(log_sigma, axis=-1)[:, None] - 0.5 * dim * math.log(2 * math.pi))
            log_ap = ops.log_sigmoid(logit_a)[:, None] + log_p
            r = ops.exp(log_ap - ops.logsumexp(log_ap, axis=-1, keepdims=True))
        return RoutingResult(mu, ops.sigmoid(logit_a), r)

    def get_config(self):
        config = super().get_config()
        config.update(final_lambda=self.final_lambda, variance_floor=self.variance_floor,
                      cost_normalization=self.cost_normalization,
                      implementation=self.implementation)
        return config
