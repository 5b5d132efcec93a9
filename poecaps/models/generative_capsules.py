"""A generative capsule layer with a von Mises-Fisher part model, inverted by MAP-EM (Kiefer et al., section 4).

Spec: `../shared/specs/generative-capsules.md` (the proper model behind eq. 7-8).
"""

import math

import keras
import tensorflow as tf

from poecaps import distribute, vmf
from poecaps.errors import InputError
from poecaps.routing.base import RoutingResult
from poecaps.validation import (
    check_flag,
    check_integer,
    check_number,
    check_seed,
    check_seed_pair,
    shape_fits,
)

_TINY = 1e-9


@keras.saving.register_keras_serializable(package="poecaps")
class GenerativeCapsules(distribute.FullPrecision, keras.layers.Layer):
    """Parents generate children: each child picks a parent, its direction is vMF, its length Gaussian.

    With parents `v_j ~ N(0, I)` (`[J, D_p]`) and learned top-down maps
    `G_ij` (`[I, J, D_c, D_p]`), the prediction of child i by parent j is
    `U_ij = G_ij v_j`. Each child picks a parent `s_i ~ Cat(pi_i)`; given
    `s_i = j` its direction is `vMF(U_ij / |U_ij|, kappa_ij)` on S^(D_c-1)
    and its length `N(|U_ij|, sigma_ij^2)`, so (the Jacobian of polar
    coordinates included)

        log p(V_i | s_i = j, v) = log C(kappa_ij) + kappa_ij cos(V_i, U_ij)
                                  - (|V_i| - |U_ij|)^2 / (2 sigma_ij^2) - log(sqrt(2 pi) sigma_ij)
                                  - (D_c - 1) log |V_i|.

    The posterior over the parent, `softmax_j(log pi_ij + log p(V_i | j, v))`,
    is eq. 7's attention made a proper density.

    Inversion (`infer`) is MAP-EM on the bound, each child weighted by its
    activation a_i,

        L(v, r) = sum_i a_i sum_j r_ij (log pi_ij + log p(V_i | j, v) - log r_ij) + log N(v; 0, I):

    it starts from the bottom-up mean votes (the Gaussian closed form of the
    spec with uniform r,
    `v_j = (I + sum_i a_i G_ij^T G_ij / (J s^2))^-1 sum_i a_i G_ij^T V_i / (J s^2)`,
    s^2 the mean sigma^2); each iteration sets r exactly (E-step) and then
    takes `pose_steps` gradient steps on v, each kept only if it raises the
    bound of its example (its step halves otherwise, grows by 1.5 when kept),
    so the bound never decreases. `G`, `kappa`, `sigma` and the mixing
    weights are learned on the same bound at the inferred (v, r)
    (generalised EM; `poecaps.trainers.generative.GenerativeCapsuleTrainer`).

    Args:
        num_parents: J.
        parent_dim: D_p.
        child_dim: D_c (>= 2).
        em_iterations: E/M iterations of `infer`.
        pose_steps: gradient steps on v per M-step.
        kappa: initial concentration of every (child, parent) pair.
        sigma: initial length noise of every pair.
        seed: seed of the initial G (N(0, 1 / D_p): |U_ij| ~ |v_j|).

    Call arguments:
        children: `[B, I, D_c]`; activations `[B, I]` or None (ones).

    Returns (call = `infer`):
        `RoutingResult(poses = v [B, J, D_p], activations = the share of the
        children each parent explains [B, J], coefficients = r [B, I, J],
        summing to 1 over the parents)`.
    """

    normalizes = "parents"

    def __init__(self, num_parents, parent_dim, child_dim, em_iterations=20, pose_steps=5, kappa=10.0,
                 sigma=0.1, seed=None, **kwargs):
        super().__init__(**kwargs)
        num_parents, parent_dim, child_dim, em_iterations, pose_steps = (
            check_integer(value, name, minimum=low) for name, value, low in (
                ("num_parents", num_parents, 1), ("parent_dim", parent_dim, 1), ("child_dim", child_dim, 2),
                ("em_iterations", em_iterations, 1), ("pose_steps", pose_steps, 0)))
        self.num_parents = num_parents
        self.parent_dim = parent_dim
        self.child_dim = child_dim
        self.em_iterations = em_iterations
        self.pose_steps = pose_steps
        self.kappa = check_number(kappa, "kappa", above=0)
        self.sigma = check_number(sigma, "sigma", above=0)
        self.seed = check_seed(seed, allow_none=True)

    def build(self, children_shape, activations_shape=None):
        num_in = children_shape[1]
        if children_shape[-1] != self.child_dim:
            raise InputError(f"children must have {self.child_dim} dimensions. Received: shape={children_shape}")
        pairs = (num_in, self.num_parents)
        self.maps = self.add_weight(
            name="maps", shape=(*pairs, self.child_dim, self.parent_dim),
            initializer=keras.initializers.RandomNormal(stddev=1.0 / math.sqrt(self.parent_dim), seed=self.seed))
        self.log_kappa = self.add_weight(name="log_kappa", shape=pairs,
                                         initializer=keras.initializers.Constant(math.log(self.kappa)))
        self.log_sigma = self.add_weight(name="log_sigma", shape=pairs,
                                         initializer=keras.initializers.Constant(math.log(self.sigma)))
        self.mix_logits = self.add_weight(name="mix_logits", shape=pairs, initializer="zeros")

    def _children(self, children):
        """`children` as a tensor `[B, I, D_c]`, in float32 or float64 (`poecaps.distribute.full_precision_dtype`:
        a mixed policy's low precision is cast up); the layer is built for them on first use (`I` fixes `G_ij`)."""
        children = tf.convert_to_tensor(children)
        children = tf.cast(children, distribute.full_precision_dtype(children))
        self._check_children_shape(children.shape)
        if not self.built:
            self.build(children.shape)
        return children

    def _check_children_shape(self, shape):
        if len(shape) != 3 or shape[-1] != self.child_dim:
            raise InputError(f"children must be [batch, children, {self.child_dim}]. Received: shape={shape}")
        if self.built and shape[1] is not None and shape[1] != self.maps.shape[0]:
            raise InputError(f"this layer was built for {self.maps.shape[0]} children. Received: shape={shape}")

    def _activations(self, children, activations):
        """The children's activations `[B, I]` in their dtype (ones for None); `InputError` for another shape."""
        if activations is None:
            return tf.ones(tf.shape(children)[:2], children.dtype)
        activations = tf.convert_to_tensor(activations)
        shape = tuple(activations.shape)
        if not shape_fits(shape, children.shape[:2]):
            raise InputError(f"activations must be [batch, children] = {list(children.shape[:2])}. Received: "
                             f"shape={shape}")
        return tf.cast(activations, children.dtype)

    def _check_parents(self, v, batch=None):
        """`InputError` unless `v` holds the parents' poses `[B, J, D_p]`, of the children's batch B if given."""
        shape = tuple(v.shape)
        if not shape_fits(shape, (batch, self.num_parents, self.parent_dim)):
            size = "batch" if batch is None else f"batch = {batch} (the children's)"
            raise InputError(f"v must be the parents' poses [{size}, {self.num_parents}, {self.parent_dim}]. "
                             f"Received: shape={shape}")

    def _require_built(self):
        if not self.built:
            raise InputError("GenerativeCapsules has no weights yet: the number of children fixes them. Call the "
                             "layer (or `infer`) on children, or `build((None, children, child_dim))`, first.")

    # --- the model ---------------------------------------------------------------------------

    def predictions(self, v):
        """`U_ij = G_ij v_j`: `[B, J, D_p]` -> `[B, I, J, D_c]`."""
        self._require_built()
        self._check_parents(v)
        # [I, J, D_c, D_p] x [B, J, D_p] -> [B, I, J, D_c]
        return tf.einsum("ijcp,bjp->bijc", tf.cast(self.maps, v.dtype), v)

    def _parameters(self, dtype):
        kappa = tf.exp(tf.cast(self.log_kappa, dtype))
        return {"kappa": kappa, "log_c": vmf.vmf_log_normalizer(kappa, self.child_dim),
                "log_sigma": tf.cast(self.log_sigma, dtype),
                "log_pi": tf.nn.log_softmax(tf.cast(self.mix_logits, dtype), axis=-1)}

    def child_log_likelihoods(self, children, v, params=None):
        """`log p(V_i | s_i = j, v)` `[B, I, J]` (`params`: `_parameters`, computed once per inference).

        Children `[B, I, D_c]` and parents `v [B, J, D_p]` of one batch, else an `InputError` (it failed inside
        TensorFlow's einsum)."""
        children = self._children(children)
        self._check_parents(v, children.shape[0])
        params = params or self._parameters(children.dtype)
        u = self.predictions(v)
        u_len = tf.sqrt(tf.reduce_sum(tf.square(u), -1) + _TINY)
        x_len = tf.sqrt(tf.reduce_sum(tf.square(children), -1) + _TINY)[:, :, None]
        # [B, I, C] x [B, I, J, C] -> [B, I, J]
        cos = tf.einsum("bic,bijc->bij", children, u) / (x_len * u_len)
        sigma = tf.exp(params["log_sigma"])
        return (params["log_c"] + params["kappa"] * cos - tf.square(x_len - u_len) / (2.0 * tf.square(sigma))
                - params["log_sigma"] - 0.5 * math.log(2.0 * math.pi) - (self.child_dim - 1) * tf.math.log(x_len))

    def log_joint(self, children, v, r, activations=None, params=None):
        """The bound `L(v, r)` `[B]` (equal to `log p(V, v)` when r is the posterior over the parents)."""
        children = self._children(children)
        params = params or self._parameters(children.dtype)
        a = self._activations(children, activations)
        log_lik = self.child_log_likelihoods(children, v, params)
        if not shape_fits(r.shape, log_lik.shape):
            raise InputError(f"r must be the posterior over the parents [batch, children, parents] = "
                             f"{list(log_lik.shape)}. Received: shape={tuple(r.shape)}")
        per_child = tf.reduce_sum(r * (params["log_pi"] + log_lik - tf.math.log(r + 1e-30)), -1)
        prior = -0.5 * tf.reduce_sum(tf.square(v), (1, 2)) - 0.5 * self.num_parents * self.parent_dim * math.log(
            2.0 * math.pi)
        return tf.reduce_sum(a * per_child, -1) + prior

    def posterior(self, children, v, params=None):
        """The E-step: `r_ij = softmax_j(log pi_ij + log p(V_i | j, v))`."""
        children = self._children(children)
        params = params or self._parameters(children.dtype)
        return tf.nn.softmax(params["log_pi"] + self.child_log_likelihoods(children, v, params), axis=-1)

    def bottom_up(self, children, activations=None):
        """The start of inversion: the Gaussian closed form of the spec with uniform r (mean votes)."""
        children = self._children(children)
        dtype = children.dtype
        a = self._activations(children, activations)
        g = tf.cast(self.maps, dtype)
        weight = a / (self.num_parents * tf.reduce_mean(tf.exp(2.0 * tf.cast(self.log_sigma, dtype))))
        # sum_i w_i G_ij^T G_ij: [B, I] x [I, J, D_c, D_p] x [I, J, D_c, D_q] -> [B, J, D_p, D_q]
        precision = tf.eye(self.parent_dim, dtype=dtype) + tf.einsum("bi,ijcp,ijcq->bjpq", weight, g, g)
        # sum_i w_i G_ij^T V_i: -> [B, J, D_p]
        rhs = tf.einsum("bi,ijcp,bic->bjp", weight, g, children)
        return tf.linalg.solve(precision, rhs[..., None])[..., 0]

    # --- inversion ---------------------------------------------------------------------------

    def infer(self, children, activations=None, iterations=None, return_trace=False):
        """MAP-EM from the bottom-up mean votes; see the class docstring.

        Returns:
            `RoutingResult(v, parent activations, r)`; with `return_trace`,
            also the bound after the start and after each iteration
            (`[iterations + 1, B]`).
        """
        children = self._children(children)
        dtype = children.dtype
        iterations = self.em_iterations if iterations is None else check_integer(iterations, "iterations")
        return_trace = check_flag(return_trace, "return_trace")
        a = self._activations(children, activations)
        params = {k: tf.stop_gradient(t) for k, t in self._parameters(dtype).items()}
        bound = lambda v, r: self.log_joint(children, v, r, a, params)
        v = tf.stop_gradient(self.bottom_up(children, a))
        trace = tf.TensorArray(dtype, size=iterations + 1).write(0, bound(v, self.posterior(children, v, params)))
        step = tf.fill(tf.shape(children)[:1], tf.constant(0.1, dtype))

        def iteration(k, v, step, trace):
            r = self.posterior(children, v, params)
            current = bound(v, r)
            for _ in range(self.pose_steps):
                with tf.GradientTape() as tape:
                    tape.watch(v)
                    value = bound(v, r)
                grad = tape.gradient(value, v)
                trial = v + step[:, None, None] * grad
                trial_bound = bound(trial, r)
                better = trial_bound >= current
                v = tf.where(better[:, None, None], trial, v)
                current = tf.where(better, trial_bound, current)   # the bound at the new v: its own or the trial's
                step = tf.where(better, step * 1.5, step * 0.5)
            return k + 1, v, step, trace.write(k + 1, current)

        # The iterations as a loop, not unrolled: a graph (and an XLA computation) of one iteration whatever
        # their number; eagerly it runs the same operations in the same order.
        _, v, _, trace = tf.while_loop(lambda k, *_: k < iterations, iteration, (tf.constant(0), v, step, trace))
        r = self.posterior(children, v, params)
        # [B, I] x [B, I, J] -> [B, J]: the activation-weighted share of children each parent explains
        explained = tf.einsum("bi,bij->bj", a, r) / (tf.reduce_sum(a, -1, keepdims=True) + _TINY)
        result = RoutingResult(v, explained, r)
        return (result, trace.stack()) if return_trace else result

    def call(self, children, activations=None):
        return self.infer(children, activations)

    def compute_output_spec(self, children, activations=None):
        """The shapes of `call`'s `RoutingResult`, without tracing EM's unrolled iterations."""
        self._check_children_shape(children.shape)
        b, i = children.shape[:2]
        return RoutingResult(keras.KerasTensor((b, self.num_parents, self.parent_dim), dtype=children.dtype),
                             keras.KerasTensor((b, self.num_parents), dtype=children.dtype),
                             keras.KerasTensor((b, i, self.num_parents), dtype=children.dtype))

    # --- generation --------------------------------------------------------------------------

    def generate(self, v, seed):
        """Children `[B, I, D_c]` and their parents `s [B, I]` drawn given parents `v [B, J, D_p]`.

        `seed`: a pair of integers (stateless draws). It is split into three
        independent keys (`tf.random.experimental.stateless_split`): the
        parents `s`, the vMF directions, and the length noise.
        """
        self._require_built()
        v = tf.convert_to_tensor(v)
        self._check_parents(v)
        dtype = v.dtype
        params = self._parameters(dtype)
        parent_key, direction_key, length_key = tf.unstack(
            tf.random.experimental.stateless_split(check_seed_pair(seed), 3))
        batch, num_in = tf.shape(v)[0], self.maps.shape[0]
        logits = tf.broadcast_to(params["log_pi"], (batch, num_in, self.num_parents))
        s = tf.random.stateless_categorical(tf.reshape(logits, (-1, self.num_parents)), 1, parent_key)[:, 0]
        s = tf.reshape(tf.cast(s, tf.int32), (batch, num_in))
        pick = lambda t: tf.gather(t, s, axis=2, batch_dims=2)
        u = self.predictions(v)                                                     # [B, I, J, D_c]
        u_s = pick(u)                                                               # [B, I, D_c]
        u_len = tf.sqrt(tf.reduce_sum(tf.square(u_s), -1) + _TINY)
        kappa = pick(tf.broadcast_to(params["kappa"], (batch, num_in, self.num_parents)))
        sigma = pick(tf.broadcast_to(tf.exp(params["log_sigma"]), (batch, num_in, self.num_parents)))
        flat = lambda t: tf.reshape(t, (-1, self.child_dim))
        direction = vmf.sample_vmf(flat(u_s / u_len[..., None]), tf.reshape(kappa, (-1,)), direction_key)
        length = u_len + sigma * tf.random.stateless_normal(tf.shape(u_len), length_key, dtype=dtype)
        children = tf.reshape(direction, (batch, num_in, self.child_dim)) * tf.abs(length)[..., None]
        return children, s

    def get_config(self):
        config = super().get_config()
        config.update(num_parents=self.num_parents, parent_dim=self.parent_dim, child_dim=self.child_dim,
                      em_iterations=self.em_iterations, pose_steps=self.pose_steps, kappa=self.kappa,
                      sigma=self.sigma, seed=self.seed)
        return config
