"""The part-whole generative capsule model of Smith, Schut, Gal and van der Wilk (section 2, supplement A-B).

Two layers of capsules above the pixels. Per image:

    t_i ~ Bern(p_i),  A_i ~ N(0, I_6)                                  top capsules i = 1..K   (eq. 1-2)
    s_j ~ Cat(rho_ij t_i / sum_i' rho_i'j t_i'),  i = 0..K                parent of part j         (eq. 3)
    t_j | s_j = i ~ Bern(gamma_ij)                                                                 (eq. 4)
    P_j | s_j = i, t_j = 1 ~ N(P_i M_ij, c_ij^2 I_6),  P_j | t_j = 0 ~ N(I, lambda_off^2 I_6)      (eq. 5-6)
    X ~ N(composite_j(T_j warped by P_j, alpha_j warped by P_j times t_j), sigma^2)               (eq. 7)

A pose `P = I + A` is a 2-D affine map taking template to image
coordinates, held as the six free entries of its top two rows
(`poecaps.compositing`); eq. 5's mean is the parent's pose composed with
the learned offset `M_ij` (the paper's indices are mixed up there: the
mean comes from the parent, the condition is on the child). Parent 0 is
the dummy: always on, `rho_0j = rho_dummy`, pose mean I with
`c_0j = c_dummy`; it explains clutter and keeps eq. 3 defined when every
top capsule is off. Templates (intensity and alpha, `template_size`
pixels each) are drawn front to back in the order of the parts.

**Relaxed presences.** Inference relaxes every presence to a binary
Concrete variable in (0, 1) (`poecaps.concrete`, temperature `temperature`):
`log_prob` takes relaxed presences, gives `t_i` and `t_j | s_j = i` binary
Concrete densities with the logits of `p_i` and `gamma_ij`, and mixes
eq. 5 and 6 by the relaxed presence,
`p(P_j | s_j = i, t_j) = t_j N(P_i M_ij, c_ij^2) + (1 - t_j) N(I, lambda_off^2)`,
which is eq. 5 at t_j = 1 and eq. 6 at t_j = 0. `generate` samples the
discrete model.

**Exact E-step** (supplement eq. 9). Given both layers, the parent choices
are independent across parts and are summed out:

    p(t_j, P_j | top) = sum_i pi_ij f_ij,   pi_ij = rho_ij t_i / sum_i' rho_i'j t_i',
    f_ij = p(t_j | s_j = i) p(P_j | s_j = i, t_j),
    r_ij = pi_ij f_ij / sum_i' pi_i'j f_i'j     (the posterior over parents),

`r` being this model's routing coefficients (`route`).

Constraints: `c_ij = c_min + softplus(.) >= c_min` (0.1), `rho_ij =
softplus(.)`, `p_i`, `gamma_ij` and the templates through a sigmoid; the
pixel noise `sigma` (0.2), `lambda_off` (1), `rho_dummy` (0.05), `c_dummy`
(1) and the temperature (1) are fixed (the spec's decisions).

Args:
    image_size: (H, W) of the images (one channel).
    num_top: K top capsules (16).
    num_parts: N template capsules (16).
    template_size: side of the square templates (12).
    part_scale: the offsets `M_ij` start as scalings by this factor with
        translations drawn uniformly in [-0.5, 0.5] (parts smaller than a
        digit, scattered over it).
    sigma, lambda_off, rho_dummy, c_dummy, c_min, temperature: as above.
    seed: seed of the initial weights.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from poecaps import compositing, concrete, distribute
from poecaps.errors import InputError
from poecaps.routing.base import RoutingResult
from poecaps.validation import (
    check_image_size,
    check_integer,
    check_integers,
    check_number,
    check_seed,
    shape_fits,
    static_shape,
)

_IDENTITY = compositing.IDENTITY
_LOG_2PI = math.log(2.0 * math.pi)


def _gaussian_log_prob(x, mean, std):
    """`log N(x; mean, std^2 I)` summed over the last axis (std broadcast over it)."""
    d = x.shape[-1]
    return (-0.5 * tf.reduce_sum(tf.square((x - mean) / std[..., None]), axis=-1)
            - d * tf.math.log(std) - 0.5 * d * _LOG_2PI)


@keras.saving.register_keras_serializable(package="poecaps")
class ProbabilisticCapsules(distribute.FullPrecision, keras.layers.Layer):
    __doc__ = __doc__

    def __init__(self, image_size=(28, 28), num_top=16, num_parts=16, template_size=12, part_scale=0.5,
                 sigma=0.2, lambda_off=1.0, rho_dummy=0.05, c_dummy=1.0, c_min=0.1, temperature=1.0, seed=0,
                 **kwargs):
        super().__init__(**kwargs)
        image_size = check_image_size(image_size)
        num_top, num_parts, template_size = check_integers(num_top=num_top, num_parts=num_parts,
                                                           template_size=template_size)
        positive = lambda value, name: check_number(value, name, above=0)
        self.image_size, self.num_top, self.num_parts, self.template_size = image_size, num_top, num_parts, template_size
        self.part_scale, self.sigma = positive(part_scale, "part_scale"), positive(sigma, "sigma")
        self.lambda_off, self.rho_dummy = positive(lambda_off, "lambda_off"), positive(rho_dummy, "rho_dummy")
        self.c_dummy, self.c_min = positive(c_dummy, "c_dummy"), positive(c_min, "c_min")
        self.temperature, self.seed = positive(temperature, "temperature"), check_seed(seed)
        self.build()

    def build(self, input_shape=None):
        if self.built:
            return
        rng = np.random.default_rng(self.seed)
        k, n, s = self.num_top, self.num_parts, self.template_size
        const = lambda value: keras.initializers.Constant(np.asarray(value, "float32"))
        offsets = np.zeros((k, n, 6), "float32")
        offsets[..., 0] = offsets[..., 4] = self.part_scale
        offsets[..., 2], offsets[..., 5] = rng.uniform(-0.5, 0.5, (2, k, n))
        self.template_logits = self.add_weight(name="template_logits", shape=(n, s, s, 2),
                                               initializer=const(rng.normal(0.0, 1.0, (n, s, s, 2))))
        self.top_logits = self.add_weight(name="top_logits", shape=(k,), initializer="zeros")
        self.offsets = self.add_weight(name="offsets", shape=(k, n, 6), initializer=const(offsets))
        self.binding_raw = self.add_weight(name="binding_raw", shape=(k, n),
                                           initializer=const(np.full((k, n), math.log(math.e - 1.0))))  # rho = 1
        self.presence_logits = self.add_weight(name="presence_logits", shape=(k + 1, n), initializer="zeros")
        spread = math.log(math.expm1(0.2))                                                   # c = c_min + 0.2
        self.spread_raw = self.add_weight(name="spread_raw", shape=(k, n), initializer=const(np.full((k, n), spread)))
        self.built = True

    def _check_latents(self, **latents):
        """Refuse, with an `InputError`, latents or images whose static shapes do not fit the model.

        `top_presence [B, K]`, `top_pose [B, K, 6]`, `part_presence [B, N]`,
        `part_pose [B, N, 6]`, `images [B, H, W, 1]`, one batch size B for
        all. Sizes unknown while tracing (None) fit any.
        """
        k, n = self.num_top, self.num_parts
        expected = {"top_presence": (k,), "top_pose": (k, 6), "part_presence": (n,), "part_pose": (n, 6),
                    "images": (*self.image_size, 1)}
        batches = {}
        for name, value in latents.items():
            shape = static_shape(value)
            want = expected[name]
            if not shape_fits(shape, (None, *want)):
                raise InputError(f"{name} must be [batch, {', '.join(map(str, want))}] (K = {k} top capsules, "
                                 f"N = {n} parts). Received: shape={shape}")
            if shape[0] is not None:
                batches[name] = shape[0]
        if len(set(batches.values())) > 1:
            raise InputError(f"the latents and images must share one batch size. Received: batch sizes {batches}")

    # -- the global parameters, constrained ------------------------------------------------------------
    def templates(self):
        """Intensities and alphas `[N, s, s, 2]` in (0, 1)."""
        return tf.sigmoid(self.template_logits)

    def spreads(self):
        """`c_ij [K, N] >= c_min`."""
        return self.c_min + tf.nn.softplus(self.spread_raw)

    def bindings(self):
        """`rho_ij [K + 1, N]`, row 0 the dummy's."""
        rho = tf.nn.softplus(self.binding_raw)
        return tf.concat([tf.fill([1, self.num_parts], tf.constant(self.rho_dummy, rho.dtype)), rho], axis=0)

    # -- the layers of the model ---------------------------------------------------------------------------
    def parent_log_weights(self, top_presence):
        """`log pi_ij [B, N, K + 1]` of eq. 3 (the dummy, index 0, always on)."""
        self._check_latents(top_presence=top_presence)
        on = tf.concat([tf.ones_like(top_presence[:, :1]), top_presence], axis=1)        # [B, K + 1]
        weights = self.bindings()[None] * on[:, :, None]                               # [B, K + 1, N]
        log_w = tf.math.log(tf.maximum(weights, 1e-30))
        return tf.transpose(log_w - tf.reduce_logsumexp(log_w, axis=1, keepdims=True), (0, 2, 1))

    def predicted_part_poses(self, top_pose):
        """Eq. 5's means `[B, N, K + 1, 6]`: `(I + A_i) M_ij` for each top capsule, I for the dummy."""
        self._check_latents(top_pose=top_pose)
        identity = tf.constant(_IDENTITY, top_pose.dtype)
        parents = compositing.homogeneous(top_pose + identity)                                 # [B, K, 3, 3]
        # [B, K, 3, 3] x [K, N, 3, 3] -> [B, N, K, 3, 3]: P_i M_ij
        means = compositing.flat(tf.einsum("bkxy,knyz->bnkxz", parents, compositing.homogeneous(self.offsets)))
        dummy = tf.broadcast_to(identity, tf.concat([tf.shape(means)[:2], [1, 6]], 0))
        return tf.concat([dummy, means], axis=2)

    def part_log_likelihoods(self, top_pose, part_presence, part_pose):
        """`log f_ij [B, N, K + 1]`: each part's presence and pose under each parent choice (eq. 4-6)."""
        self._check_latents(top_pose=top_pose, part_presence=part_presence, part_pose=part_pose)
        t = part_presence[:, :, None]
        presence = concrete.log_prob(t, tf.transpose(self.presence_logits)[None], self.temperature)
        pose = (part_pose + tf.constant(_IDENTITY, part_pose.dtype))[:, :, None, :]             # P_j [B, N, 1, 6]
        c_dummy = tf.fill([self.num_parts, 1], tf.constant(self.c_dummy, part_pose.dtype))
        spreads = tf.concat([c_dummy, tf.transpose(self.spreads())], axis=1)
        on = _gaussian_log_prob(pose, self.predicted_part_poses(top_pose), spreads[None])
        off = _gaussian_log_prob(part_pose[:, :, None, :], 0.0, tf.constant(self.lambda_off, part_pose.dtype)[None])
        t = tf.clip_by_value(t, 1e-6, 1.0 - 1e-6)
        return presence + concrete.logaddexp(tf.math.log(t) + on, tf.math.log1p(-t) + off)

    def route(self, top_presence, top_pose, part_presence, part_pose):
        """The exact E-step as routing: `RoutingResult` whose coefficients are the posterior `r [B, N, K + 1]`.

        Poses `[B, K + 1, 6]` and activations `[B, K + 1]` are the parents'
        (index 0 the dummy: identity pose, always on); coefficients sum to 1
        over the parents.
        """
        self._check_latents(top_presence=top_presence, top_pose=top_pose, part_presence=part_presence,
                           part_pose=part_pose)
        joint = self.parent_log_weights(top_presence) + self.part_log_likelihoods(top_pose, part_presence, part_pose)
        posterior = tf.nn.softmax(joint, axis=-1)
        poses = tf.concat([tf.zeros_like(top_pose[:, :1]), top_pose], axis=1) + tf.constant(_IDENTITY, top_pose.dtype)
        activations = tf.concat([tf.ones_like(top_presence[:, :1]), top_presence], axis=1)
        return RoutingResult(poses, activations, posterior)

    def part_marginal_log_likelihood(self, top_presence, top_pose, part_presence, part_pose):
        """`log p(t_j, P_j | top) [B, N]` with the parent choice summed out (supplement eq. 9)."""
        self._check_latents(top_presence=top_presence, top_pose=top_pose, part_presence=part_presence,
                           part_pose=part_pose)
        return tf.reduce_logsumexp(self.parent_log_weights(top_presence)
                                   + self.part_log_likelihoods(top_pose, part_presence, part_pose), axis=-1)

    def render(self, part_presence, part_pose):
        """The mean image `[B, H, W, 1]`: templates warped by `I + A_j`, alphas times `t_j`, composited."""
        self._check_latents(part_presence=part_presence, part_pose=part_pose)
        pose = part_pose + tf.constant(_IDENTITY, part_pose.dtype)
        drawn = compositing.warp(self.templates(), pose, self.image_size)               # [B, N, H, W, 2]
        alphas = drawn[..., 1:] * part_presence[:, :, None, None, None]
        return compositing.composite(drawn[..., :1], alphas)

    def top_log_prior(self, top_presence, top_pose):
        """`log p(t_i) + log N(A_i; 0, I)` summed over the top capsules: `[B]`."""
        self._check_latents(top_presence=top_presence, top_pose=top_pose)
        presence = concrete.log_prob(top_presence, self.top_logits[None], self.temperature)
        return tf.reduce_sum(presence, -1) + tf.reduce_sum(_gaussian_log_prob(top_pose, 0.0, tf.ones_like(top_presence)), -1)

    def image_log_likelihood(self, images, part_presence, part_pose):
        """`log N(X; render, sigma^2)` over the pixels: `[B]` (eq. 7)."""
        self._check_latents(images=images, part_presence=part_presence, part_pose=part_pose)
        mean = self.render(part_presence, part_pose)
        std = tf.fill(tf.shape(images)[:1], tf.constant(self.sigma, images.dtype))
        pixels = self.image_size[0] * self.image_size[1]
        flat = lambda x: tf.reshape(x, [-1, pixels])
        return _gaussian_log_prob(flat(images), flat(mean), std)

    def log_prob(self, images, top_presence, top_pose, part_presence, part_pose):
        """The joint `log p(X, t, A) [B]` of relaxed presences and poses, parent choices summed out.

        Args:
            images: `[B, H, W, 1]`.
            top_presence: `[B, K]` in (0, 1); top_pose: `A_i [B, K, 6]`.
            part_presence: `[B, N]` in (0, 1); part_pose: `A_j [B, N, 6]` (pose `I + A_j`).
        """
        self._check_latents(images=images, top_presence=top_presence, top_pose=top_pose,
                           part_presence=part_presence, part_pose=part_pose)
        return (self.top_log_prior(top_presence, top_pose)
                + tf.reduce_sum(self.part_marginal_log_likelihood(top_presence, top_pose, part_presence, part_pose), -1)
                + self.image_log_likelihood(images, part_presence, part_pose))

    def call(self, part_presence, part_pose):
        return self.render(part_presence, part_pose)

    def generate(self, batch_size, seed=0):
        """Sample the discrete model: dict of `images` (with noise), `means`, and every latent.

        Keys: `top_presence [B, K]` and `part_presence [B, N]` in {0, 1},
        `top_pose`, `part_pose` (the `A`s), `parents [B, N]` (0 the dummy).
        """
        batch_size = check_integer(batch_size, "batch_size")
        seeds = tf.random.experimental.stateless_split(tf.constant([self.seed, check_seed(seed)], tf.int64), 7)
        k, n, dtype = self.num_top, self.num_parts, self.top_logits.dtype
        top_presence = tf.cast(tf.random.stateless_uniform([batch_size, k], seeds[0], dtype=dtype)
                               < tf.sigmoid(self.top_logits), dtype)
        top_pose = tf.random.stateless_normal([batch_size, k, 6], seeds[1], dtype=dtype)
        log_pi = self.parent_log_weights(top_presence)                                            # [B, N, K + 1]
        parents = tf.reshape(tf.random.stateless_categorical(tf.reshape(log_pi, [-1, k + 1]), 1, seeds[2]),
                             [batch_size, n])
        chosen = tf.one_hot(parents, k + 1, dtype=dtype)                                           # [B, N, K + 1]
        gamma = tf.reduce_sum(chosen * tf.sigmoid(tf.transpose(self.presence_logits))[None], -1)
        part_presence = tf.cast(tf.random.stateless_uniform([batch_size, n], seeds[3], dtype=dtype) < gamma, dtype)
        means = tf.gather(self.predicted_part_poses(top_pose), parents, axis=2, batch_dims=2)        # [B, N, 6]
        spreads = tf.concat([tf.fill([n, 1], tf.constant(self.c_dummy, dtype)), tf.transpose(self.spreads())],
                            axis=1)                                                                # [N, K + 1]
        spread = tf.reduce_sum(chosen * spreads[None], -1)
        on = means + spread[..., None] * tf.random.stateless_normal([batch_size, n, 6], seeds[4], dtype=dtype)
        on = on - tf.constant(_IDENTITY, dtype)
        off = self.lambda_off * tf.random.stateless_normal([batch_size, n, 6], seeds[5], dtype=dtype)
        part_pose = tf.where(part_presence[..., None] > 0.5, on, off)
        mean = self.render(part_presence, part_pose)
        images = mean + self.sigma * tf.random.stateless_normal(tf.shape(mean), seeds[6], dtype=dtype)
        return {"images": images, "means": mean, "top_presence": top_presence, "top_pose": top_pose,
                "parents": parents, "part_presence": part_presence, "part_pose": part_pose}

    def get_config(self):
        config = super().get_config()
        config.update(image_size=list(self.image_size), num_top=self.num_top, num_parts=self.num_parts,
                      template_size=self.template_size, part_scale=self.part_scale, sigma=self.sigma,
                      lambda_off=self.lambda_off, rho_dummy=self.rho_dummy, c_dummy=self.c_dummy,
                      c_min=self.c_min, temperature=self.temperature, seed=self.seed)
        return config
