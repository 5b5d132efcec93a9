"""The von Mises-Fisher distribution on the unit sphere S^(d-1), in TensorFlow: log-density and Wood's sampler.

    p(x; mu, kappa) = C_d(kappa) exp(kappa mu . x),
    log C_d(kappa) = (d/2 - 1) log kappa - (d/2) log(2 pi) - log I_(d/2-1)(kappa)

TensorFlow has no modified Bessel function of general order, so
`log_bessel_i` computes it in float64, whatever the input's dtype, two ways:

- for k <= `ASYMPTOTIC_FROM`, its power series in log space,

      I_v(k) = sum_m (k/2)^(2m+v) / (m! Gamma(m+v+1)),

  as one `logsumexp` over `SERIES_TERMS` terms. The terms peak near
  m = k/2 and fall geometrically beyond m ~ k, so the sum is exact to
  float64 rounding there; beyond k ~ 1.5 `SERIES_TERMS` the cut series
  falls short (by 1,100 nats at k = 5,000), so it is not used there.
- above it, the uniform asymptotic expansion (Debye's; DLMF 10.41.3), with
  r = sqrt(v^2 + k^2) and p = v / r,

      log I_v(k) = r + v log(k / (v + r)) - log(2 pi r) / 2
                   + log(1 + sum_(n=1..4) P_n(p) / r^n),

  P_n(p) = u_n(p) / p^n the DLMF's polynomials u_n divided by p^n. Its
  first omitted term is below 1e-15 at r >= 1000, for any order v >= 0.

Both are checked against scipy in the tests, from k = 1e-3 to 1e6.
"""

import math

import tensorflow as tf

from poecaps.errors import InputError
from poecaps.validation import check_integer, check_number, check_seed_pair, shape_fits

SERIES_TERMS = 1024
ASYMPTOTIC_FROM = 1000.0

# P_n(p) = u_n(p) / p^n of DLMF 10.41.10, coefficients of p^0, p^2, p^4, ... over a common denominator
_DEBYE = ((3.0, -5.0), 24.0), \
         ((81.0, -462.0, 385.0), 1152.0), \
         ((30375.0, -369603.0, 765765.0, -425425.0), 414720.0), \
         ((4465125.0, -94121676.0, 349922430.0, -446185740.0, 185910725.0), 39813120.0)


def _log_bessel_series(order, x):
    x = x[..., None]
    m = tf.range(SERIES_TERMS, dtype=tf.float64)
    log_terms = ((2.0 * m + order) * tf.math.log(x / 2.0) - tf.math.lgamma(m + 1.0)
                 - tf.math.lgamma(m + order + 1.0))
    return tf.reduce_logsumexp(log_terms, axis=-1)


def _log_bessel_debye(order, x):
    r = tf.sqrt(order ** 2 + tf.square(x))
    p2 = tf.square(order / r)
    correction = tf.zeros_like(x)
    for n, (coefficients, denominator) in enumerate(_DEBYE, start=1):
        polynomial = tf.math.polyval([tf.constant(c, tf.float64) for c in reversed(coefficients)], p2)
        correction += polynomial / denominator / r ** n
    return r + order * tf.math.log(x / (order + r)) - 0.5 * tf.math.log(2.0 * math.pi * r) + tf.math.log1p(correction)


def log_bessel_i(order, x):
    """`log I_order(x)` for `x >= 0` (any shape, float64 inside), `order >= 0` a Python number (an `InputError`
    otherwise: the series and Debye's expansion hold for orders >= 0 only; at -1.5 they gave 0.438 where
    `log I_-1.5(2)` is -0.015).

    At x = 0, `I_0(0) = 1` and `I_v(0) = 0` for v > 0, so the value is 0 or -inf (the series' first term,
    `0 log 0`, gave NaN); its gradient there is taken as 0, which is exact for order 0. A negative x gives NaN.
    """
    order = check_number(order, "order", minimum=0)
    dtype = x.dtype if hasattr(x, "dtype") else tf.float64
    x = tf.cast(x, tf.float64)
    large = x > ASYMPTOTIC_FROM
    zero = x == 0
    # each branch sees only inputs it is exact for, so neither gives a non-finite value or gradient
    series = _log_bessel_series(order, tf.minimum(tf.where(zero, tf.ones_like(x), x), ASYMPTOTIC_FROM))
    debye = _log_bessel_debye(order, tf.maximum(x, ASYMPTOTIC_FROM))
    at_zero = tf.constant(0.0 if order == 0 else -math.inf, tf.float64)
    return tf.cast(tf.where(zero, at_zero, tf.where(large, debye, series)), dtype)


def vmf_log_normalizer(kappa, d):
    """`log C_d(kappa)` of the vMF on S^(d-1) (kappa >= 0, any shape; `d` >= 2 an integer).

    At kappa = 0 the vMF is the uniform distribution on the sphere, and
    `log C_d(0) = log Gamma(d/2) - log 2 - (d/2) log pi`, minus the log of
    the sphere's area (the formula's limit; computed as written it is
    `0 log 0 - log I(0)`, NaN). Its gradient there is `-A_d(0) = 0`. A
    negative kappa gives NaN.
    """
    d = check_integer(d, "d", minimum=2)
    kappa = tf.convert_to_tensor(kappa)
    k64 = tf.cast(kappa, tf.float64)
    order = d / 2.0 - 1.0
    positive = k64 > 0
    safe = tf.where(positive, k64, tf.ones_like(k64))      # the other branch's value and gradient stay finite
    log_c = order * tf.math.log(safe) - (d / 2.0) * math.log(2.0 * math.pi) - log_bessel_i(order, safe)
    uniform = math.lgamma(d / 2.0) - math.log(2.0) - (d / 2.0) * math.log(math.pi)
    log_c = tf.where(positive, log_c, tf.where(k64 == 0, tf.constant(uniform, tf.float64), math.nan))
    return tf.cast(log_c, kappa.dtype)


def vmf_log_prob(x, mu, kappa):
    """`log p(x; mu, kappa)` for unit vectors `x`, `mu` `[..., d]` (the same d; the other axes broadcast) and
    `kappa` `[...]`, computed in `x`'s dtype (arrays and numbers alike)."""
    x = tf.convert_to_tensor(x)
    mu, kappa = tf.cast(mu, x.dtype), tf.cast(kappa, x.dtype)
    if len(x.shape) == 0 or len(mu.shape) == 0 or not shape_fits(x.shape[-1:], mu.shape[-1:]):
        raise InputError(f"x and mu must be vectors [..., d] of one d. Received: shapes {tuple(x.shape)} and "
                         f"{tuple(mu.shape)}")
    return vmf_log_normalizer(kappa, x.shape[-1]) + kappa * tf.reduce_sum(x * mu, axis=-1)


def mean_resultant_length(kappa, d):
    """`A_d(kappa) = I_(d/2)(kappa) / I_(d/2-1)(kappa)`, the mean of `mu . x` under the vMF (0 at kappa = 0,
    the uniform distribution; NaN for a negative kappa)."""
    kappa = tf.convert_to_tensor(kappa, tf.float64)
    safe = tf.where(kappa > 0, kappa, tf.ones_like(kappa))
    ratio = tf.exp(log_bessel_i(d / 2.0, safe) - log_bessel_i(d / 2.0 - 1.0, safe))
    return tf.where(kappa > 0, ratio, tf.where(kappa == 0, tf.zeros_like(kappa), math.nan))


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
    """One vMF draw per row: `mu` `[N, d]` unit vectors, `kappa` `[N]` >= 0, `seed` a pair of integers.

    Wood's (1994) rejection sampler: the component `w = mu . x` is drawn by
    rejection from a Beta-based proposal with

        b = (d - 1) / (2 kappa + sqrt(4 kappa^2 + (d - 1)^2)),
        x0 = (1 - b) / (1 + b),  c = kappa x0 + (d - 1) log(1 - x0^2),
        z ~ Beta((d-1)/2, (d-1)/2),  w = (1 - (1 + b) z) / (1 - (1 - b) z),
        accept if kappa w + (d - 1) log(1 - x0 w) - c >= log u,  u ~ U(0, 1),

    rows still rejected drawing again (a `tf.while_loop`); the rest of the
    direction is uniform on the sphere orthogonal to mu. Stateless: the same
    seed gives the same draws.

    Computed as written, x0 and w round to 1 once b is below the dtype's
    epsilon (kappa above about 1e7 in float32, 1e16 in float64), the test
    becomes NaN and no draw is ever accepted. So the sampler carries
    t = 1 - w and the test in the equivalent forms

        t = 2 b z / (1 - (1 - b) z),
        accept if kappa (2 b / (1 + b) - t) + (d - 1) log((1 + b) / (2 (1 - (1 - b) z))) >= log u,

    and returns `(1 - t, sqrt(t (2 - t)) e)` turned onto mu, which keeps the
    draw's spread about mu at any kappa. A row whose kappa is +inf is mu
    itself (the limit); a negative or NaN kappa gives a row of NaN; neither
    keeps the loop going.

    `mu` must be `[N, d]` and `kappa` `[N]` or a scalar (one for every row),
    `seed` a pair of integers (`validation.check_seed_pair`); else an
    `InputError`, where a `mu` of one row `[d]` was read as d rows and a
    float seed was truncated. `mu`'s unit length is the caller's: a row of
    zeros (an all-zero vote) is reflected as it is.

    Returns:
        `[N, d]` unit vectors.
    """
    mu = tf.convert_to_tensor(mu)
    dtype = mu.dtype
    kappa = tf.cast(tf.convert_to_tensor(kappa), dtype)
    if len(mu.shape) != 2 or not (len(kappa.shape) == 0 or shape_fits(tuple(kappa.shape), mu.shape[:1])):
        raise InputError(f"sample_vmf takes mu [N, d] and kappa [N] or a scalar. Received: shapes "
                         f"{tuple(mu.shape)} and {tuple(kappa.shape)}")
    check_integer(mu.shape[-1], "mu.shape[-1]", minimum=2)
    n, d = tf.shape(mu)[0], mu.shape[-1]
    kappa = tf.broadcast_to(kappa, [n])
    dm1 = tf.cast(d - 1, dtype)
    drawn = tf.math.is_finite(kappa) & (kappa >= 0.0)
    # finite kappa past a quarter of the dtype's largest number draws as that (2 kappa must not overflow)
    k = tf.where(drawn, tf.minimum(kappa, dtype.max / 4.0), tf.zeros_like(kappa))
    scale = tf.maximum(2.0 * k, dm1)                     # sqrt(4 k^2 + (d-1)^2) without overflowing the square
    b = dm1 / (2.0 * k + scale * tf.sqrt(tf.square(2.0 * k / scale) + tf.square(dm1 / scale)))
    mode_gap = 2.0 * b / (1.0 + b)                       # 1 - x0
    seed = check_seed_pair(seed)        # int64: the stateless draws depend on the values only
    half = tf.fill([n], dm1 / 2.0)

    def body(round_, t, done):
        s = tf.stack([seed[0], seed[1] + 3 * round_])
        g1 = tf.random.stateless_gamma([n], s, alpha=half, dtype=dtype)
        g2 = tf.random.stateless_gamma([n], s + [0, 1], alpha=half, dtype=dtype)
        z = g1 / (g1 + g2)
        u = tf.random.stateless_uniform([n], s + [0, 2], dtype=dtype)
        denominator = 1.0 - (1.0 - b) * z
        proposal = 2.0 * b * z / denominator
        accept = (k * (mode_gap - proposal) + dm1 * tf.math.log((1.0 + b) / (2.0 * denominator))
                  >= tf.math.log(u))
        take = tf.logical_and(accept, tf.logical_not(done))
        return round_ + 1, tf.where(take, proposal, t), tf.logical_or(done, accept)

    # rows not drawn start done: +inf at t = 0 (mu), negative or NaN at NaN
    at_mu = tf.math.is_inf(kappa) & (kappa > 0)
    start = tf.where(at_mu, tf.zeros([n], dtype), tf.fill([n], tf.constant(math.nan, dtype)))
    _, t, _ = tf.while_loop(lambda round_, t, done: tf.logical_not(tf.reduce_all(done)), body,
                            (tf.constant(0, tf.int64), start, tf.logical_not(drawn)))
    tangent = tf.random.stateless_normal([n, d - 1], seed + [1, 0], dtype=dtype)
    tangent = tangent / tf.norm(tangent, axis=-1, keepdims=True)
    x = tf.concat([(1.0 - t)[:, None], tf.sqrt(tf.maximum(t * (2.0 - t), 0.0))[:, None] * tangent], axis=-1)
    return _householder_to(mu, x)
