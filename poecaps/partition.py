"""The Bernoulli RBM's partition function and log-likelihood: exact by enumeration, or by AIS.

For the RBM of `poecaps.rbm` (energy `E(v, h) = -v^T W h - b^T v - a^T h`,
binary `v` and `h`),

    Z = sum_{v, h} exp(-E(v, h)) = sum_h exp(a^T h) prod_i (1 + exp(b_i + W_i: h))
                                 = sum_v exp(-F(v)),
    log P(v) = -F(v) - log Z,   F(v) = -b^T v - sum_j softplus(a_j + v^T W_:j).

`exact_log_partition` sums over the smaller layer's 2^n states (n at most
`max_units`). `ais_log_partition` estimates `log Z` by annealed importance
sampling (Neal 2001; Salakhutdinov and Murray 2008, "On the quantitative
analysis of deep belief networks", section 4), which scales to any size;
`log_partition` takes the first when it can. `binarise` draws binary data
from grey images; `independent_log_likelihood` is the independent-pixel
model an RBM should beat. Everything is computed in float64.

Example:

    log_z = partition.ais_log_partition(rbm, chains=100, betas=10000).log_partition
    # (or partition.exact_log_partition(rbm) for up to 22 hidden or visible units)
    nats = partition.log_likelihood(rbm, partition.binarise(x_test, seed=0), log_z).mean()
"""

import collections

import keras
import numpy as np
import tensorflow as tf
from scipy.special import logsumexp

from poecaps.errors import InputError
from poecaps.rbm import BernoulliRBM
from poecaps.validation import check_array, check_integer, check_number, check_verbose

AISResult = collections.namedtuple("AISResult", "log_partition std_error log_weights log_base_partition")
AISResult.__doc__ = """What `ais_log_partition` returns.

Attributes:
    log_partition: the estimate of `log Z`, `log Z_0 + log mean_m w_m`.
    std_error: its delta-method standard error, `std(w) / (sqrt(M) mean(w))`
        (itself estimated from the same weights).
    log_weights: `[M]` float64, the importance log weights `log w_m`.
    log_base_partition: `log Z_0` of the base model.
"""


def parameters(rbm):
    """`(W [V, H], b [V], a [H])` of a built `BernoulliRBM`, as float64 NumPy."""
    if not isinstance(rbm, BernoulliRBM):
        raise InputError(f"rbm must be a poecaps.rbm.BernoulliRBM. Received: {type(rbm).__name__}")
    rbm.require_weights()
    return tuple(np.asarray(w, dtype=np.float64) for w in (rbm.kernel, rbm.visible_bias, rbm.hidden_bias))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _binary_states(n, start, stop):
    """Rows `start .. stop - 1` of the 2^n binary states, `[stop - start, n]` float64 (bit k of the row index)."""
    index = np.arange(start, stop, dtype=np.int64)[:, None]
    return ((index >> np.arange(n, dtype=np.int64)) & 1).astype(np.float64)


def exact_log_partition(rbm, max_units=22, chunk=1 << 14, verbose=1):
    """`log Z` of a `BernoulliRBM`, summed exactly over the smaller layer's 2^n states.

    With `H <= V` hidden units: `log Z = logsumexp_h [a^T h + sum_i softplus(b_i + W_i: h)]`;
    otherwise the same over the visible states of `-F(v)`. The states are
    visited `chunk` at a time, so memory stays `chunk x max(V, H)`.

    Args:
        rbm: a built `poecaps.rbm.BernoulliRBM`.
        max_units: refuse layers with more units than this (2^n terms).
        chunk: states summed per step.
        verbose: 1 shows a progress bar over the states, 2 one line at the
            end, 0 nothing.

    Returns:
        `log Z` as a Python float.
    """
    max_units = check_integer(max_units, "max_units")
    chunk = check_integer(chunk, "chunk")
    verbose = check_verbose(verbose)
    W, b, a = parameters(rbm)
    n = min(W.shape)
    if n > max_units:
        raise InputError(f"Exact enumeration of the smaller layer's 2^{n} states is refused above max_units="
                         f"{max_units} units; estimate log Z with ais_log_partition instead.")
    # Enumerate the smaller layer (rows of `kernel`), the other one's softplus summed out.
    kernel, enumerated_bias, summed_bias = (W.T, a, b) if W.shape[1] <= W.shape[0] else (W, b, a)
    kernel, summed_bias = tf.constant(kernel, tf.float64), tf.constant(summed_bias, tf.float64)
    terms = []
    progress = keras.utils.Progbar(1 << n, verbose=verbose, unit_name="state")
    for start in range(0, 1 << n, chunk):
        s = _binary_states(n, start, min(start + chunk, 1 << n))
        # [S, n] x [n, m] -> [S, m]; TensorFlow's softplus uses every core, NumPy's logaddexp one
        summed = tf.reduce_sum(tf.math.softplus(summed_bias + tf.matmul(tf.constant(s), kernel)), axis=1)
        terms.append(float(logsumexp(s @ enumerated_bias + summed.numpy())))
        progress.update(min(start + chunk, 1 << n))
    return float(logsumexp(np.array(terms)))


def log_likelihood(rbm, v, log_partition):
    """`log P(v) = -F(v) - log Z` of binary visible vectors `v [B, V]`, float64 `[B]`.

    `log_partition` is `exact_log_partition(rbm)` or an AIS estimate (its
    `AISResult` or the float; then every log-likelihood carries its error,
    the same for every example). `v` must be 0 or 1: `P` is a distribution
    over binary vectors, so grey images are binarised first (for example
    `v > 0.5`, or a Bernoulli draw).
    """
    W, b, a = parameters(rbm)
    v = _binary(check_array(v, "v", shape=(W.shape[0],), low=0.0, high=1.0))
    if isinstance(log_partition, AISResult):
        log_partition = log_partition.log_partition
    if not np.isfinite(log_partition):
        raise InputError(f"log_partition must be a finite number. Received: log_partition={log_partition!r}")
    return v @ b + _softplus(a + v @ W).sum(axis=1) - float(log_partition)


def base_rate_bias(v, smoothing=1.0):
    """Visible biases of the base-rate model of `v [N, V]` in [0, 1]: `logit((sum_n v + s) / (N + 2 s))`.

    The independent-pixel model fitted to the data (with `s` pseudo-counts
    for each value), a base model for AIS closer to the data than the
    uniform one (Salakhutdinov and Murray 2008, section 4.2).
    """
    v = check_array(v, "v", low=0.0, high=1.0, dtype="float64")
    v = v.reshape(len(v), -1)
    smoothing = check_number(smoothing, "smoothing", above=0)
    p = (v.sum(axis=0) + smoothing) / (len(v) + 2.0 * smoothing)
    return np.log(p) - np.log1p(-p)


def independent_log_likelihood(visible_bias, v):
    """`log P(v) = b_0^T v - sum_i softplus(b_0i)` of binary `v [B, V]` under independent units, float64 `[B]`.

    The RBM with no hidden units and visible bias `b_0` (its `log Z` is
    `sum_i softplus(b_0i)`): with `base_rate_bias(train)`, the
    independent-pixel model that an RBM's log-likelihood should beat.
    """
    bias = np.asarray(visible_bias, dtype=np.float64)
    if bias.ndim != 1 or not np.isfinite(bias).all():
        raise InputError(f"visible_bias must be a vector of finite numbers. Received: shape {bias.shape}")
    v = _binary(check_array(v, "v", shape=(bias.shape[0],), low=0.0, high=1.0))
    return v @ bias - float(_softplus(bias).sum())


def binarise(x, seed=0):
    """One Bernoulli draw of each grey value of `x` in [0, 1] (pixel on with probability its value), float32.

    How grey images become the binary data whose likelihood an RBM defines
    (Salakhutdinov and Murray 2008, section 5: MNIST binarised
    stochastically). The same `seed` repeats the draw (NumPy's PCG64).
    """
    x = check_array(x, "x", low=0.0, high=1.0)
    seed = check_integer(seed, "seed", minimum=0)
    return (np.random.default_rng(seed).random(x.shape) < x).astype(np.float32)


def log_partition(rbm, max_units=22, chains=100, betas=10000, base_visible_bias=None, seed=0, verbose=0):
    """`log Z` exactly when the smaller layer has at most `max_units` units, else by AIS.

    Returns `(log_z, std_error, method)`: `std_error` 0.0 and method
    "exact" from `exact_log_partition`, or `ais_log_partition`'s estimate
    and standard error and "ais" (`chains`, `betas`, `base_visible_bias`,
    `seed` are AIS's).
    """
    W, _, _ = parameters(rbm)
    if min(W.shape) <= check_integer(max_units, "max_units"):
        return exact_log_partition(rbm, max_units=max_units, verbose=verbose), 0.0, "exact"
    found = ais_log_partition(rbm, chains, betas, base_visible_bias, seed, verbose)
    return found.log_partition, found.std_error, "ais"


def _binary(v):
    v = v.astype(np.float64)
    if not np.all((v == 0.0) | (v == 1.0)):
        raise InputError("v must be binary (0 or 1): the RBM's likelihood is over binary vectors; binarise grey "
                         f"values first (e.g. v > 0.5, or partition.binarise). Received: values between 0 and 1, "
                         f"e.g. {v[(v != 0.0) & (v != 1.0)][0]:g}")
    return v


def _check_betas(betas):
    if isinstance(betas, (int, np.integer)) and not isinstance(betas, bool):
        return np.linspace(0.0, 1.0, check_integer(betas, "betas", minimum=2))
    betas = np.asarray(betas, dtype=np.float64)
    if betas.ndim != 1 or len(betas) < 2 or betas[0] != 0.0 or betas[-1] != 1.0 or np.any(np.diff(betas) <= 0):
        raise InputError("betas must be a count >= 2 or a strictly increasing schedule from 0 to 1. "
                         f"Received: betas={np.asarray(betas)!r}")
    return betas


def _draw(p, seed, stream):
    """Bernoulli draws of probabilities `p`, from stateless stream `stream` of `seed` (int64 scalars)."""
    return tf.cast(tf.random.stateless_uniform(tf.shape(p), tf.stack([seed, stream]), dtype=tf.float64) < p,
                   tf.float64)


@tf.function(reduce_retracing=True)
def _anneal(W, b, a, base, betas, first, last, v, log_w, seed):
    """Steps `k = first .. last` of the AIS loop (float64 tensors): the chains `v [M, V]` and log weights `[M]`."""
    steps = tf.shape(betas)[0] - 1

    def log_f(v, beta):
        # log f_beta(v) = ((1 - beta) b_0 + beta b)^T v + sum_j softplus(beta (a_j + v^T W_:j)): the unnormalised
        # marginal of the RBM with visible bias (1 - beta) b_0 + beta b, weights beta W, hidden bias beta a.
        # [M, V] x [V, H] -> [M, H]
        return (tf.linalg.matvec(v, (1.0 - beta) * base + beta * b)
                + tf.reduce_sum(tf.math.softplus(beta * (tf.matmul(v, W) + a)), axis=1))

    def gibbs(v, beta, k):
        # One sweep of the intermediate RBM: h ~ P_beta(h | v), then v ~ P_beta(v | h).
        # Stream 2k for the hidden draws, 2k + 1 for the visible ones (0 drew the start): each draw its own.
        k = tf.cast(k, tf.int64)
        # [M, V] x [V, H] -> [M, H]
        h = _draw(tf.sigmoid(beta * (tf.matmul(v, W) + a)), seed, 2 * k)
        # [M, H] x [V, H]^T -> [M, V]
        return _draw(tf.sigmoid((1.0 - beta) * base + beta * (tf.matmul(h, W, transpose_b=True) + b)), seed,
                     2 * k + 1)

    def body(k, v, log_w):
        log_w = log_w + log_f(v, betas[k]) - log_f(v, betas[k - 1])
        v = tf.cond(k < steps, lambda: gibbs(v, betas[k], k), lambda: v)
        return k + 1, v, log_w

    _, v, log_w = tf.while_loop(lambda k, *_: k <= last, body, (first, v, log_w))
    return v, log_w


def ais_log_partition(rbm, chains=100, betas=10000, base_visible_bias=None, seed=0, verbose=1):
    """Estimate `log Z` of a `BernoulliRBM` by annealed importance sampling.

    The base model `p_0(v) ~ exp(b_0^T v)` has independent visible units and
    `log Z_0 = H log 2 + sum_i softplus(b_0i)`. The intermediate model at
    inverse temperature `beta` is the RBM with visible bias
    `(1 - beta) b_0 + beta b`, weights `beta W` and hidden bias `beta a`,
    whose unnormalised marginal `f_beta(v)` runs from `p_0`'s (`beta = 0`)
    to the target's `exp(-F(v))` (`beta = 1`). Each of `M = chains` chains
    starts at an exact draw of `p_0`, adds `log f_k(v) - log f_{k-1}(v)` at
    each `beta_k` and then takes one Gibbs sweep at `beta_k`; then
    `Z / Z_0 ~ mean_m w_m` (Neal 2001, eq. 4; Salakhutdinov and Murray 2008,
    Algorithm 2). The estimate of `Z` is unbiased; that of `log Z` is biased
    low by Jensen's inequality, which more chains and more `betas` shrink.

    Args:
        rbm: a built `poecaps.rbm.BernoulliRBM`.
        chains: number of independent annealing runs `M` (>= 1).
        betas: the number of inverse temperatures, evenly spaced from 0 to 1
            (>= 2), or the schedule itself (strictly increasing, from 0 to 1).
        base_visible_bias: `b_0 [V]`; None gives zeros (the uniform base).
            `base_rate_bias(data)` gives the data's independent-pixel model.
        seed: integer seed of the draws (stateless: the same seed repeats).
        verbose: 1 shows a progress bar over the temperatures, 2 one line
            at the end, 0 nothing.

    Returns:
        `AISResult(log_partition, std_error, log_weights, log_base_partition)`.
    """
    chains = check_integer(chains, "chains")
    verbose = check_verbose(verbose)
    seed = check_integer(seed, "seed", minimum=0)
    betas = _check_betas(betas)
    W, b, a = parameters(rbm)
    if base_visible_bias is None:
        base = np.zeros_like(b)
    else:
        base = np.asarray(base_visible_bias, dtype=np.float64)
        if base.shape != b.shape or not np.isfinite(base).all():
            raise InputError(f"base_visible_bias must be {b.shape[0]} finite numbers, one per visible unit. "
                             f"Received: shape {base.shape}")
    W_, b_, a_, base_, betas_ = (tf.constant(x, tf.float64) for x in (W, b, a, base, betas))
    seed_ = tf.constant(seed, tf.int64)
    v = _draw(tf.broadcast_to(tf.sigmoid(base_), [chains, W.shape[0]]), seed_, tf.constant(0, tf.int64))
    log_w = tf.zeros([chains], tf.float64)
    steps = len(betas) - 1
    segment = max(1, -(-steps // 100))          # at most 100 compiled segments, for the progress bar
    progress = keras.utils.Progbar(steps, verbose=verbose, unit_name="temperature")
    for first in range(1, steps + 1, segment):
        last = min(first + segment - 1, steps)
        v, log_w = _anneal(W_, b_, a_, base_, betas_, tf.constant(first), tf.constant(last), v, log_w, seed_)
        progress.update(last)
    log_w = log_w.numpy()
    log_z0 = W.shape[1] * np.log(2.0) + float(_softplus(base).sum())
    w = np.exp(log_w - log_w.max())
    std_error = float(w.std(ddof=1) / (np.sqrt(chains) * w.mean())) if chains > 1 else float("inf")
    return AISResult(log_z0 + float(logsumexp(log_w)) - np.log(chains), std_error, log_w, log_z0)
