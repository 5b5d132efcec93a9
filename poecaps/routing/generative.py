"""Routing as inversion of a generative capsule model: MAP-EM over parents in vote space (Kiefer et al., section 4).

The model of `poecaps.models.GenerativeCapsules` (spec
`../shared/specs/generative-capsules.md`) with the top-down maps taken as
the identity in the space of the votes, so that it fits the one routing
interface: the router sees each child's vote for each parent, not the
child's own pose.
"""

import math

import keras
import tensorflow as tf

from poecaps import distribute, vmf
from poecaps.errors import InputError
from poecaps.routing.base import Routing, RoutingResult, check_activations
from poecaps.validation import check_number, shape_fits, sizes_fit

_TINY = 1e-9


@keras.saving.register_keras_serializable(package="poecaps")
class GenerativeRouting(Routing):
    """Parents explain their children's votes; each child picks one parent. Inverted by exact MAP-EM.

    Parents `v_j ~ N(0, I)` (`[J, D]`). Each child picks a parent,
    `s_i ~ Cat(pi)`; given `s_i = j`, its vote for that parent, `V_ij`, has
    a von Mises-Fisher direction around the parent's and a Gaussian length
    around the parent's:

        log p(V_ij | s_i = j, v) = log C_D(kappa_j) + kappa_j cos(V_ij, v_j)
                                   - (|V_ij| - |v_j|)^2 / (2 sigma_j^2) - log(sqrt(2 pi) sigma_j)
                                   - (D - 1) log |V_ij|

    (`GenerativeCapsules` with `G_ij = I` in vote space: the layer's
    transformation matrices play the part of the inverse top-down maps).
    Inversion maximises, children weighted by their activations `a_i`,

        L(v, r) = sum_i a_i sum_j r_ij (log pi_j + log p(V_ij | j, v) - log r_ij) + log N(v; 0, I),

    by EM, every step exact:

        E-step:  r_ij = softmax_j(log pi_j + log p(V_ij | j, v))
        M-step:  v_j = rho_j u_j,   u_j = normalise(sum_i a_i r_ij V_ij / |V_ij|),
                 rho_j = sum_i a_i r_ij |V_ij| / (sigma_j^2 + sum_i a_i r_ij)

    (direction and length decouple: the cosine term does not depend on
    `|v_j|`, the length terms and the prior not on its direction), so `L`
    never decreases. It starts from the M-step of uniform `r = 1/J` (the
    bottom-up mean votes) and runs `iterations` E/M rounds (0: the mean
    votes and uniform coefficients). A parent's activation is the share of
    the children it explains, `sum_i a_i r_ij / sum_i a_i`. The
    coefficients are the last E-step's `r`, normalised over the parents.

    Weights, per parent type j: `log kappa_j`, `log sigma_j` and the mixing
    logits (zeros: equal weights); `kappa` and `sigma` are their initial
    values.

    Args:
        iterations: E/M rounds (>= 0).
        kappa: initial concentration of every parent's directions.
        sigma: initial spread of every parent's lengths.

    Call arguments:
        votes: `[B, I, J, D]` (D >= 2).
        activations: `[B, I]` or None (ones).

    Returns:
        `RoutingResult(poses = v [B, J, D], activations = shares [B, J],
        coefficients = r [B, I, J])`, r summing to 1 over j.
    """

    normalizes = "parents"

    def __init__(self, iterations=3, kappa=5.0, sigma=0.25, **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        self.kappa = check_number(kappa, "kappa", above=0)
        self.sigma = check_number(sigma, "sigma", above=0)

    @staticmethod
    def _check_pose_size(votes_shape):
        if votes_shape[-1] is not None and votes_shape[-1] < 2:
            raise InputError("GenerativeRouting: votes' pose size D (the last axis of [B, I, J, D]) must be at least "
                             f"2, for their directions on the sphere. Received: votes of shape {list(votes_shape)}")

    def build(self, votes_shape, activations_shape=None):
        self._check_pose_size(votes_shape)
        per_parent = lambda name, value: self.add_weight(name=name, shape=(votes_shape[2],),
                                                         initializer=keras.initializers.Constant(value))
        self.log_kappa = per_parent("log_kappa", math.log(self.kappa))
        self.log_sigma = per_parent("log_sigma", math.log(self.sigma))
        self.mix_logits = per_parent("mix_logits", 0.0)

    def weight_sizes(self):
        return {2: self.log_kappa.shape[0]}    # kappa, sigma, mixing: one per parent

    def parameters(self, dim, dtype="float32"):
        """`{kappa, log_c, sigma, log_sigma, log_pi}`, each `[J]`."""
        kappa = tf.exp(tf.cast(self.log_kappa, dtype))
        log_sigma = tf.cast(self.log_sigma, dtype)
        return {"kappa": kappa, "log_c": vmf.vmf_log_normalizer(kappa, dim), "sigma": tf.exp(log_sigma),
                "log_sigma": log_sigma, "log_pi": tf.nn.log_softmax(tf.cast(self.mix_logits, dtype))}

    @staticmethod
    def _polar(votes):
        """`(|V_ij| [B, I, J], V_ij / |V_ij| [B, I, J, D])`."""
        lengths = tf.sqrt(tf.reduce_sum(tf.square(votes), -1) + _TINY)
        return lengths, votes / lengths[..., None]

    @staticmethod
    def log_likelihoods(lengths, units, v, params):
        """`log p(V_ij | s_i = j, v)` `[B, I, J]` from the votes' `_polar` form."""
        rho = tf.sqrt(tf.reduce_sum(tf.square(v), -1) + _TINY)                    # [B, J]
        # [B, I, J, D] x [B, J, D] -> [B, I, J]
        cos = tf.einsum("bijd,bjd->bij", units, v / rho[..., None])
        return (params["log_c"] + params["kappa"] * cos
                - tf.square(lengths - rho[:, None]) / (2.0 * tf.square(params["sigma"]))
                - params["log_sigma"] - 0.5 * math.log(2.0 * math.pi) - (units.shape[-1] - 1) * tf.math.log(lengths))

    @staticmethod
    def maximise(lengths, units, r, a, params):
        """The M-step: the exact maximiser `v [B, J, D]` of `L(., r)` (votes in their `_polar` form)."""
        w = a[:, :, None] * r                                                       # [B, I, J]
        # [B, I, J] x [B, I, J, D] -> [B, J, D]
        direction = tf.einsum("bij,bijd->bjd", w, units)
        direction = direction / tf.sqrt(tf.reduce_sum(tf.square(direction), -1, keepdims=True) + _TINY)
        total = tf.reduce_sum(w, 1)                                                  # [B, J]
        rho = tf.reduce_sum(w * lengths, 1) / (tf.square(params["sigma"]) + total)
        return rho[..., None] * direction

    def posterior(self, lengths, units, v, params):
        """The E-step: `r_ij = softmax_j(log pi_j + log p(V_ij | j, v))`."""
        return tf.nn.softmax(params["log_pi"] + self.log_likelihoods(lengths, units, v, params), axis=-1)

    def log_joint(self, votes, v, r, activations=None):
        """The bound `L(v, r)` `[B]` of the built router, for votes `[B, I, J, D]`, parents `v [B, J, D]`, a
        posterior `r [B, I, J]` and activations `[B, I]` (None: ones); other shapes are an `InputError`."""
        if not self.built:
            raise InputError(f"{type(self).__name__} {self.name!r} has no weights yet; call it on votes first.")
        votes = tf.convert_to_tensor(votes)
        v, r = tf.cast(v, votes.dtype), tf.cast(r, votes.dtype)
        shape = tuple(votes.shape)
        if len(shape) != 4 or not sizes_fit(shape[2], self.log_kappa.shape[0]):
            raise InputError(f"{type(self).__name__}: votes must be [B, I, J, D] with J = {self.log_kappa.shape[0]}, "
                             f"its parents. Received: votes of shape {list(shape)}")
        self._check_pose_size(shape)
        for name, value, expected, axes in (("v", v, (shape[0], shape[2], shape[3]), "[B, J, D]"),
                                             ("r", r, shape[:3], "[B, I, J]")):
            if not shape_fits(tuple(value.shape), expected):
                raise InputError(f"{type(self).__name__}: {name} must be {axes} = {list(expected)} for votes of shape "
                                 f"{list(shape)}. Received: {name} of shape {list(value.shape)}")
        if activations is not None:
            activations = tf.convert_to_tensor(activations)
            check_activations(self, shape, tuple(activations.shape))
        params = self.parameters(votes.shape[-1], votes.dtype)
        a = tf.ones(tf.shape(votes)[:2], votes.dtype) if activations is None else tf.cast(activations, votes.dtype)
        per_child = tf.reduce_sum(r * (params["log_pi"] + self.log_likelihoods(*self._polar(votes), v, params)
                                       - tf.math.log(r + 1e-30)), -1)
        prior = (-0.5 * tf.reduce_sum(tf.square(v), (1, 2))
                 - 0.5 * v.shape[1] * v.shape[2] * math.log(2.0 * math.pi))
        return tf.reduce_sum(a * per_child, -1) + prior

    def call(self, votes, activations=None, training=None):
        self._check_pose_size(votes.shape)
        dtype = distribute.full_precision_dtype(votes)
        votes = tf.cast(votes, dtype)
        a = tf.ones(tf.shape(votes)[:2], dtype) if activations is None else tf.cast(activations, dtype)
        params = self.parameters(votes.shape[-1], dtype)
        lengths, units = self._polar(votes)
        r = tf.ones_like(lengths) / votes.shape[2]
        v = self.maximise(lengths, units, r, a, params)
        for _ in range(self.iterations):
            r = self.posterior(lengths, units, v, params)
            v = self.maximise(lengths, units, r, a, params)
        # [B, I] x [B, I, J] -> [B, J]: the activation-weighted share of children each parent explains
        shares = tf.einsum("bi,bij->bj", a, r) / (tf.reduce_sum(a, -1, keepdims=True) + _TINY)
        return RoutingResult(v, shares, r)

    def get_config(self):
        config = super().get_config()
        config.update(kappa=self.kappa, sigma=self.sigma)
        return config
