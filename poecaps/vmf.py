"""The von Mises-Fisher distribution on the unit sphere S^(d-1), in TensorFlow: log-density and Wood's sampler.

    p(x; mu, kappa) = C_d(kappa) exp(kappa mu . x),
    log C_d(kappa) = (d/2 - 1) log kappa - (d/2) log(2 pi) - log I_(d/2-1)(kappa)

TensorFlow has no modified Bessel function of general order, so
`log_bessel_i` sums its power series in log space,

    I_v(k) = sum_m (k/2)^(2m+v) / (m! Gamma(m+v+1)),

as one `logsumexp` over `SERIES_TERMS` terms, in float64 whatever the
input's dtype. The terms peak near m = k/2 and fall geometrically beyond
m ~ k, so the sum is exact to float64 rounding for kappa up to about
`SERIES_TERMS` (checked against `scipy.stats.vonmises_fisher` in the tests).
"""

import math

import tensorflow as tf

from poecaps.validation import check_integer

SERIES_TERMS = 1024


def log_bessel_i(order, x):
    """`log I_order(x)` for `x > 0` (any shape, float64 inside), `order >= 0` a Python number."""
    dtype = x.dtype if hasattr(x, "dtype") else tf.float64
    x = tf.cast(x, tf.float64)[..., None]
    m = tf.range(SERIES_TERMS, dtype=tf.float64)
    log_terms = ((2.0 * m + order) * tf.math.log(x / 2.0) - tf.math.lgamma(m + 1.0)
                 - tf.math.lgamma(m + order + 1.0))
    return tf.cast(tf.reduce_logsumexp(log_terms, axis=-1), dtype)


def vmf_log_normalizer(kappa, d):
    """`log C_d(kappa)` of the vMF on S^(d-1) (kappa > 0, any shape; `d` >= 2 an integer)."""
    d = check_integer(d, "d", minimum=2)
    kappa = tf.convert_to_tensor(kappa)
    k64 = tf.cast(kappa, tf.float64)
    order = d / 2.0 - 1.0
    log_c = order * tf.math.log(k64) - (d / 2.0) * math.log(2.0 * math.pi) - log_bessel_i(order, k64)
    return tf.cast(log_c, kappa.dtype)


def vmf_log_prob(x, mu, kappa):
    """`log p(x; mu, kappa)` for unit vectors `x`, `mu` `[..., d]` and `kappa` `[...]`."""
    return vmf_log_normalizer(kappa, x.shape[-1]) + kappa * tf.reduce_sum(x * mu, axis=-1)


def mean_resultant_length(kappa, d):
    """`A_d(kappa) = I_(d/2)(kappa) / I_(d/2-1)(kappa)`, the mean of `mu . x` under the vMF."""
    kappa = tf.convert_to_tensor(kappa, tf.float64)
    return tf.exp(log_bessel_i(d / 2.0, kappa) - log_bessel_i(d / 2.0 - 1.0, kappa))


def _householder_to(mu, x):
    """Reflect `x` by the Householder map that takes e_1 to `mu` (both `[..., d]`, `mu` unit)."""
    e1 = tf.one_hot(0, mu.shape[-1], dtype=mu.dtype)
    u = e1 - mu
    norm2 = tf.reduce_sum(tf.square(u), axis=-1, keepdims=True)
    # mu = e1 needs no reflection (u = 0)
    safe = tf.where(norm2 > 1e-12, norm2, tf.ones_like(norm2))
    reflected = x - 2.0 * u * tf.reduce_sum(u * x, axis=-1, keepdims=True) / safe
    return tf.where(norm2 > 1e-12, reflected, x)


def sample_vmf(mu, kappa, seed):
    """One vMF draw per row: `mu` `[N, d]` unit vectors, `kappa` `[N]` > 0, `seed` a pair of integers.

    Wood's (1994) rejection sampler: the component `w = mu . x` is drawn by
    rejection from a Beta-based proposal with

        b = (d - 1) / (2 kappa + sqrt(4 kappa^2 + (d - 1)^2)),
        x0 = (1 - b) / (1 + b),  c = kappa x0 + (d - 1) log(1 - x0^2),
        z ~ Beta((d-1)/2, (d-1)/2),  w = (1 - (1 + b) z) / (1 - (1 - b) z),
        accept if kappa w + (d - 1) log(1 - x0 w) - c >= log u,  u ~ U(0, 1),

    rows still rejected drawing again (a `tf.while_loop`); the rest of the
    direction is uniform on the sphere orthogonal to mu. Stateless: the same
    seed gives the same draws.

    Returns:
        `[N, d]` unit vectors.
    """
    mu = tf.convert_to_tensor(mu)
    dtype = mu.dtype
    kappa = tf.cast(tf.convert_to_tensor(kappa), dtype)
    n, d = tf.shape(mu)[0], mu.shape[-1]
    dm1 = tf.cast(d - 1, dtype)
    b = dm1 / (2.0 * kappa + tf.sqrt(4.0 * tf.square(kappa) + tf.square(dm1)))
    x0 = (1.0 - b) / (1.0 + b)
    c = kappa * x0 + dm1 * tf.math.log(1.0 - tf.square(x0))
    seed = tf.convert_to_tensor(seed, tf.int32)
    half = tf.fill([n], dm1 / 2.0)

    def body(k, w, done):
        s = tf.stack([seed[0], seed[1] + 3 * k])
        g1 = tf.random.stateless_gamma([n], s, alpha=half, dtype=dtype)
        g2 = tf.random.stateless_gamma([n], s + [0, 1], alpha=half, dtype=dtype)
        z = g1 / (g1 + g2)
        u = tf.random.stateless_uniform([n], s + [0, 2], dtype=dtype)
        proposal = (1.0 - (1.0 + b) * z) / (1.0 - (1.0 - b) * z)
        accept = kappa * proposal + dm1 * tf.math.log(1.0 - x0 * proposal) - c >= tf.math.log(u)
        take = tf.logical_and(accept, tf.logical_not(done))
        return k + 1, tf.where(take, proposal, w), tf.logical_or(done, accept)

    _, w, _ = tf.while_loop(lambda k, w, done: tf.logical_not(tf.reduce_all(done)), body,
                            (tf.constant(0), tf.zeros([n], dtype), tf.zeros([n], tf.bool)))
    tangent = tf.random.stateless_normal([n, d - 1], seed + [1, 0], dtype=dtype)
    tangent = tangent / tf.norm(tangent, axis=-1, keepdims=True)
    x = tf.concat([w[:, None], tf.sqrt(tf.maximum(1.0 - tf.square(w), 0.0))[:, None] * tangent], axis=-1)
    return _householder_to(mu, x)
