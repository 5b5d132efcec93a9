"""The vMF pieces against scipy, eq. 6 against NumPy, and the generative capsules' EM."""

import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from scipy import special, stats

from poecaps import vmf
from poecaps.errors import InputError
from poecaps.models import GenerativeCapsules
from poecaps.models.saving import load_component, save_component
from poecaps.routing import TopDownAttention

SETTINGS = [(d, kappa) for d in (3, 8, 16) for kappa in (0.1, 1.0, 10.0, 100.0)]


@pytest.mark.parametrize("d, kappa", SETTINGS)
def test_log_normaliser_matches_scipy(rng, d, kappa):
    mu = rng.normal(size=d)
    mu /= np.linalg.norm(mu)
    x = rng.normal(size=(7, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    reference = stats.vonmises_fisher(mu, kappa).logpdf(x)
    got = vmf.vmf_log_prob(tf.constant(x), tf.constant(mu[None]), tf.constant(kappa, tf.float64)).numpy()
    np.testing.assert_allclose(got, reference, atol=1e-5, rtol=0)
    # float32 in, float32 out, the series still summed in float64
    got32 = vmf.vmf_log_normalizer(tf.constant(kappa, tf.float32), d)
    assert got32.dtype == tf.float32
    np.testing.assert_allclose(float(got32), reference[0] - kappa * x[0] @ mu, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("d", [2, 3, 8, 16])
def test_at_zero_concentration_the_vmf_is_the_uniform_distribution_on_the_sphere(d):
    """kappa = 0 (a learned log-concentration below -103 in float32 reaches it) gave NaN for the normaliser
    and the mean resultant length. They are minus the log of the sphere's area 2 pi^(d/2) / Gamma(d/2), and 0,
    the limits of scipy's values at kappa -> 0; the normaliser's gradient there is -A_d(0) = 0, and a negative
    kappa stays NaN."""
    area = 2 * np.pi ** (d / 2) / special.gamma(d / 2)
    kappa = tf.constant([0.0, 1e-9, -1.0], tf.float64)
    with tf.GradientTape() as tape:
        tape.watch(kappa)
        log_c = vmf.vmf_log_normalizer(kappa, d)
    mu = np.eye(d)[0]
    near_zero = stats.vonmises_fisher(mu, 1e-9).logpdf(mu)             # e^(1e-9 mu.mu) = 1 + 1e-9
    np.testing.assert_allclose(log_c.numpy()[:2], [-np.log(area), near_zero - 1e-9], rtol=0, atol=1e-12)
    assert abs(log_c.numpy()[0] - log_c.numpy()[1]) < 1e-8 and np.isnan(log_c.numpy()[2])
    gradient = tape.gradient(log_c, kappa).numpy()
    assert gradient[0] == 0.0 and abs(gradient[1]) < 1e-8              # -A_d(kappa) ~ -kappa / d near 0
    a = vmf.mean_resultant_length(tf.constant([0.0, 1e-9, -1.0], tf.float64), d).numpy()
    np.testing.assert_allclose(a[:2], [0.0, 1e-9 / d], rtol=1e-6, atol=0)
    assert np.isnan(a[2])
    assert float(vmf.vmf_log_normalizer(tf.constant(0.0, tf.float32), d)) == pytest.approx(-np.log(area), rel=1e-6)


def test_the_likelihoods_refuse_children_and_parents_of_other_batches():
    """Children and parents of other batches or another count of children failed inside TensorFlow's einsum."""
    layer = GenerativeCapsules(3, 4, 5, seed=0, dtype="float64", kappa=20.0, sigma=0.2)
    rng = np.random.default_rng(0)
    children, v = rng.normal(size=(2, 6, 5)), rng.normal(size=(2, 3, 4))
    layer.infer(children)
    for use in (layer.child_log_likelihoods, layer.posterior):
        with pytest.raises(InputError, match=re.escape("v must be the parents' poses [batch = 2 (the children's), 3, "
                                                       "4]. Received: shape=(1, 3, 4)")):
            use(children, v[:1])
        with pytest.raises(InputError, match="children"):
            use(children[:, :1], v)
    assert layer.child_log_likelihoods(children, v).shape == (2, 6, 3)


def test_the_vmf_functions_refuse_what_they_would_misread():
    """Each of these gave a value without a word before: a negative Bessel order (0.438 where log I_-1.5(2) is
    -0.015, scipy's), one mu [d] read as d rows, a float seed truncated, a mu of another d broadcast; or failed
    inside TensorFlow: NumPy float64 vectors against a float kappa. The last now computes in x's dtype, and
    matches scipy's vonmises_fisher."""
    with pytest.raises(InputError, match="order must be a finite number >= 0"):
        vmf.log_bessel_i(-1.5, tf.constant(2.0, tf.float64))
    assert np.log(special.iv(-1.5, 2.0)) == pytest.approx(-0.01517, abs=1e-5)   # what the old value missed
    mu = np.eye(3)[[0, 1]]
    with pytest.raises(InputError, match=r"mu \[N, d\] and kappa \[N\]"):
        vmf.sample_vmf(mu[0], 5.0, [1, 2])
    with pytest.raises(InputError, match=r"mu \[N, d\] and kappa \[N\]"):
        vmf.sample_vmf(mu, np.full(3, 5.0), [1, 2])
    with pytest.raises(InputError, match="seed must be a pair of integers"):
        vmf.sample_vmf(mu, 5.0, [1.5, 2])
    with pytest.raises(InputError, match="one d"):
        vmf.vmf_log_prob(np.eye(3)[[0]], np.ones((1, 1)), 2.0)
    x = np.array([[0.6, 0.8, 0.0]])
    got = vmf.vmf_log_prob(x, np.eye(3)[[0]], 2.0)
    assert got.dtype == tf.float64
    np.testing.assert_allclose(got.numpy(), [stats.vonmises_fisher(np.eye(3)[0], 2.0).logpdf(x[0])], rtol=1e-12)
    # one kappa for every row, in a traced function too
    draws = tf.function(lambda m: vmf.sample_vmf(m, 5.0, [1, 2]))(tf.constant(mu))
    np.testing.assert_allclose(np.linalg.norm(draws.numpy(), axis=-1), 1.0, rtol=1e-12)


def test_log_bessel_at_zero_is_scipys_limit():
    """`log I_v(0)`: 0 for v = 0 and -inf for v > 0, as scipy's `iv(v, 0)` (1 and 0) gives; the series' first
    term `0 log 0` gave NaN. At 0 the gradient of `log I_0` is `I_1(0) / I_0(0) = 0`, and a zero beside other
    points leaves theirs as they were."""
    x = tf.constant([0.0, 0.5, 0.0, 3.0], tf.float64)
    for order in (0.0, 0.5, 1.5, 7.0):
        with tf.GradientTape() as tape:
            tape.watch(x)
            got = vmf.log_bessel_i(order, x)
        gradient = tape.gradient(got, x).numpy()
        with np.errstate(divide="ignore"):                      # log 0 = -inf is the reference's value
            reference = np.log(special.iv(order, x.numpy()))
        np.testing.assert_array_equal(got.numpy()[[0, 2]], reference[[0, 2]])
        # both sides are a few float64 roundings from the value (the series' leading terms, scipy's own):
        # 1e-13 is about 450 of them
        np.testing.assert_allclose(got.numpy()[[1, 3]], reference[[1, 3]], rtol=1e-13)
        slope = special.iv(order + 1, x.numpy()[[1, 3]]) / special.iv(order, x.numpy()[[1, 3]])
        np.testing.assert_allclose(gradient[[1, 3]], slope + order / x.numpy()[[1, 3]], rtol=1e-10)
        if order == 0:
            np.testing.assert_array_equal(gradient[[0, 2]], [0.0, 0.0])
    assert float(vmf.log_bessel_i(0, np.float32(0))) == 0.0


@pytest.mark.parametrize("d", [2, 3, 8, 16, 100])
def test_log_bessel_and_the_normaliser_hold_at_any_concentration(d):
    """`log I_(d/2-1)(kappa)` against scipy's scaled Bessel function (`log ive + kappa`) from kappa = 1e-3 to
    1e6, across the switch from the power series to the uniform asymptotic expansion, with its derivative;
    and the log-densities at the mode against `scipy.stats.vonmises_fisher` there. The tolerance is float64
    rounding of the largest intermediate, the series' terms (about 2 SERIES_TERMS |log(kappa/2)|) or kappa."""
    kappa = np.array([1e-3, 0.5, 7.0, 120.0, 999.0, 1000.0, 1001.0, 1500.0, 2000.0, 5000.0, 3e4, 1e6])
    order = d / 2 - 1
    x = tf.constant(kappa)
    with tf.GradientTape() as tape:
        tape.watch(x)
        got = vmf.log_bessel_i(order, x)
    reference = np.log(special.ive(order, kappa)) + kappa
    scale = np.maximum(kappa, (2 * vmf.SERIES_TERMS + order) * np.abs(np.log(kappa / 2)))
    error, tolerance = np.abs(got.numpy() - reference), 64 * np.finfo(float).eps * scale
    assert np.all(error <= tolerance), list(zip(kappa, error, tolerance))
    # autodiff against the closed form d/dk log I_v(k) = I_(v+1)(k) / I_v(k) + v / k (the softmax over the
    # series' terms carries their rounding, a few 1e-12 relative at most)
    slope = special.ive(order + 1, kappa) / special.ive(order, kappa) + order / kappa
    np.testing.assert_allclose(tape.gradient(got, x).numpy(), slope, rtol=1e-10)
    mu = np.eye(d)[0]
    for k in (2000.0, 3e4):
        log_c = float(vmf.vmf_log_normalizer(tf.constant(k, tf.float64), d))
        np.testing.assert_allclose(log_c + k, stats.vonmises_fisher(mu, k).logpdf(mu), rtol=0, atol=1e-8)
        a = special.ive(d / 2, k) / special.ive(d / 2 - 1, k)
        np.testing.assert_allclose(float(vmf.mean_resultant_length(k, d)), a, rtol=1e-9)
    # a float32 concentration inside a compiled function, as a layer's learned kappa: finite, with a gradient
    k32 = tf.constant(kappa, tf.float32)
    normaliser = tf.function(lambda k: vmf.vmf_log_normalizer(k, d))
    with tf.GradientTape() as tape:
        tape.watch(k32)
        log_c = normaliser(k32)
    assert log_c.dtype == tf.float32 and np.all(np.isfinite(log_c.numpy()))
    assert np.all(np.isfinite(tape.gradient(log_c, k32).numpy()))


@pytest.mark.parametrize("d, kappa", SETTINGS)
def test_samples_have_the_mean_resultant_length(rng, d, kappa):
    """E[x] = A_d(kappa) mu, A_d = I_(d/2) / I_(d/2-1) (scipy's Bessel functions here): within 2 % of A, or
    within 4 standard errors of 400,000 draws where 2 % of A is below their noise (small kappa, A ~ kappa/d)."""
    n = 400_000
    mu = rng.normal(size=d)
    mu /= np.linalg.norm(mu)
    x = vmf.sample_vmf(tf.constant(np.tile(mu, (n, 1))), tf.fill([n], tf.constant(kappa, tf.float64)), [3, 4])
    x = x.numpy()
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-12)
    a = special.ive(d / 2, kappa) / special.ive(d / 2 - 1, kappa)
    w = x @ mu
    tolerance = max(0.02 * a, 4 * w.std() / np.sqrt(n))
    assert abs(w.mean() - a) <= tolerance, (w.mean(), a)
    # the rest of the direction is uniform around mu: the mean is A mu, nothing orthogonal to it
    off = x.mean(0) - w.mean() * mu
    assert np.linalg.norm(off) <= 6 * np.sqrt(max(1 - np.mean(w ** 2), 1e-12) / n)
    np.testing.assert_allclose(float(vmf.mean_resultant_length(kappa, d)), a, rtol=1e-9)


@pytest.mark.parametrize("d", [3, 16])
def test_samples_keep_their_spread_at_any_concentration(d):
    """Where A ~ 1 the 2 % test on A says nothing; test the spread about mu instead: E|x - (mu . x) mu|^2
    = 1 - E[w^2] = (d - 1) A_d(kappa) / kappa, to 2 %, up to kappa where 1 - w is below the dtype's epsilon
    (1e8 in float32, 1e20 in float64; Wood's formulas as written never accept a draw there). For 100,000
    draws 2 % is above 4 standard errors of that mean (a relative spread of about sqrt(2 / (d - 1)) per
    draw); rounding the draws to float32 costs under 1e-3 of it. Past scipy's range (its ive gives NaN at
    1e20) A is 1 to within (d - 1) / (2 kappa)."""
    n = 100_000
    mu = np.random.default_rng(d).normal(size=d)
    mu /= np.linalg.norm(mu)
    for dtype, kappas in ((tf.float64, (1e4, 1e8, 1e20)), (tf.float32, (1e4, 1e8))):
        for kappa in kappas:
            x = vmf.sample_vmf(tf.constant(np.tile(mu, (n, 1)), dtype), tf.fill([n], tf.constant(kappa, dtype)),
                               [5, 6]).numpy().astype("float64")
            off = x - (x @ mu)[:, None] * mu
            a = special.ive(d / 2, kappa) / special.ive(d / 2 - 1, kappa) if kappa < 1e10 else 1.0  # A = 1 - O(1/kappa)
            np.testing.assert_allclose(np.mean(np.sum(off ** 2, axis=1)), (d - 1) * a / kappa, rtol=0.02)
    # concentrations that take no draw: +inf is mu itself, negative or NaN a row of NaN
    x = vmf.sample_vmf(tf.constant(np.tile(mu, (4, 1))), tf.constant([np.inf, -1.0, np.nan, 2.0]), [1, 2]).numpy()
    np.testing.assert_allclose(x[0], mu, rtol=0, atol=1e-15)
    assert np.all(np.isnan(x[1:3])) and np.all(np.isfinite(x[3]))
    with pytest.raises(InputError, match=r"mu.shape\[-1\]"):
        vmf.sample_vmf(tf.ones((3, 1)), tf.ones(3), [0, 1])


def numpy_top_down(children, predictions, iterations, beta, accumulate):
    """Eq. 6 with loops: V_i(k) = softmax_j(beta V_i(k-1) . U_ij) U_i (logits summed over rounds if accumulate)."""
    batch, num_in, num_out, _ = predictions.shape
    v = children.copy()
    logits = np.zeros((batch, num_in, num_out))
    for _ in range(iterations):
        new_v = np.zeros_like(v)
        c = np.zeros((batch, num_in, num_out))
        for b in range(batch):
            for i in range(num_in):
                step = beta * np.array([v[b, i] @ predictions[b, i, j] for j in range(num_out)])
                logits[b, i] = logits[b, i] + step if accumulate else step
                e = np.exp(logits[b, i] - logits[b, i].max())
                c[b, i] = e / e.sum()
                new_v[b, i] = sum(c[b, i, j] * predictions[b, i, j] for j in range(num_out))
        v = new_v
    return c, v


@pytest.mark.parametrize("iterations, beta, accumulate", [(1, 1.0, False), (3, 1.0, False), (3, 2.5, True),
                                                          (4, 0.3, True)])
def test_top_down_attention_matches_numpy_eq6(rng, iterations, beta, accumulate):
    children = rng.normal(size=(2, 5, 4))
    predictions = rng.normal(size=(2, 5, 3, 4))
    layer = TopDownAttention(iterations, beta, accumulate, dtype="float64")
    c, v = layer(children, predictions)
    np.testing.assert_allclose(float(layer.beta.numpy()), beta, rtol=1e-7)     # (set through float32)
    c_ref, v_ref = numpy_top_down(children, predictions, iterations, float(layer.beta.numpy()), accumulate)
    np.testing.assert_allclose(ops.convert_to_numpy(c), c_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ops.convert_to_numpy(v), v_ref, rtol=1e-10, atol=1e-12)


def _layer(seed=0, **kwargs):
    layer = GenerativeCapsules(3, 4, 5, seed=seed, dtype="float64", **{"kappa": 20.0, "sigma": 0.2, **kwargs})
    layer.build((None, 12, 5))
    return layer


@pytest.mark.parametrize("seed", range(4))
def test_the_em_bound_never_decreases(rng, seed):
    layer = _layer(seed, em_iterations=15)
    layer.mix_logits.assign(rng.normal(size=(12, 3)))
    children = rng.normal(size=(4, 12, 5))                 # not drawn from the model: the hard case
    activations = rng.uniform(0.1, 1, size=(4, 12))
    result, trace = layer.infer(children, activations, return_trace=True)
    trace = trace.numpy()
    assert trace.shape == (16, 4)
    assert np.all(np.diff(trace, axis=0) >= -1e-9 * np.abs(trace[:-1]))
    assert np.all(trace[-1] > trace[0])
    np.testing.assert_allclose(result.coefficients.numpy().sum(-1), 1.0, rtol=1e-12)
    # parent activations: the share of the (weighted) children each parent explains
    share = np.einsum("bi,bij->bj", activations, result.coefficients.numpy()) / activations.sum(-1, keepdims=True)
    np.testing.assert_allclose(result.activations.numpy(), share, rtol=1e-8)     # (a 1e-9 floor in the sum)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_inference_in_a_graph_is_the_eager_inference(rng, jit_compile):
    """`infer` traced (its iterations a `tf.while_loop`), by XLA or not, takes the eager path: float64, the
    same operations, so the poses, coefficients and bound trace agree to rounding (a step kept or refused
    alike at every iteration, else the poses would differ by a whole step)."""
    layer = _layer(0, em_iterations=6)
    children = tf.constant(rng.normal(size=(3, 12, 5)))
    activations = tf.constant(rng.uniform(0.1, 1, size=(3, 12)))
    eager, eager_trace = layer.infer(children, activations, return_trace=True)
    traced = tf.function(lambda x, a: layer.infer(x, a, return_trace=True), jit_compile=jit_compile)
    found, trace = traced(children, activations)
    assert trace.shape == (7, 3)
    np.testing.assert_allclose(trace.numpy(), eager_trace.numpy(), rtol=1e-10)
    for a, b in zip(found, eager):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-8, atol=1e-12)


def test_the_bound_at_the_posterior_is_the_marginal_log_joint(rng):
    """With r the exact posterior, L(v, r) = log p(V, v) = sum_i log sum_j pi_ij p(V_i | j, v) + log N(v)."""
    layer = _layer(1)
    children, v = rng.normal(size=(2, 12, 5)), rng.normal(size=(2, 3, 4))
    r = layer.posterior(tf.constant(children), tf.constant(v))
    bound = layer.log_joint(tf.constant(children), tf.constant(v), r).numpy()
    log_lik = layer.child_log_likelihoods(tf.constant(children), tf.constant(v)).numpy()
    log_pi = tf.nn.log_softmax(layer.mix_logits).numpy()
    marginal = (np.sum(np.log(np.sum(np.exp(log_pi + log_lik), -1)), -1)
                + np.sum(stats.norm.logpdf(v), (1, 2)))
    np.testing.assert_allclose(bound, marginal, rtol=1e-10)


def test_child_likelihood_is_a_density_in_the_plane():
    """d = 2: integrate p(V | s = j, v) over the plane numerically (polar grid) -> 1."""
    layer = GenerativeCapsules(1, 2, 2, kappa=3.0, sigma=0.3, seed=0, dtype="float64")
    layer.build((None, 1, 2))
    v = tf.constant([[[0.8, -0.4]]], tf.float64)
    radii = np.linspace(1e-4, 4, 1500)
    angles = np.linspace(0, 2 * np.pi, 720, endpoint=False)
    rr, aa = np.meshgrid(radii, angles, indexing="ij")
    points = np.stack([rr * np.cos(aa), rr * np.sin(aa)], -1).reshape(-1, 1, 2)
    density = np.exp(layer.child_log_likelihoods(tf.constant(points), tf.repeat(v, len(points), 0)).numpy()[:, 0, 0])
    integral = np.sum(density.reshape(rr.shape) * rr) * (radii[1] - radii[0]) * (angles[1] - angles[0])
    assert abs(integral - 1.0) < 2e-3


def test_config_round_trip_and_save_reload(tmp_path, rng):
    layer = GenerativeCapsules(4, 3, 6, em_iterations=7, pose_steps=2, kappa=5.0, sigma=0.3, seed=11)
    children = rng.normal(size=(2, 9, 6)).astype("float32")
    before = layer(children)
    clone = GenerativeCapsules.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()
    model = keras.Sequential([keras.Input((9, 6)), layer])
    # the symbolic call's shapes (compute_output_spec, no EM traced) are the eager call's
    assert [tuple(t.shape) for t in model.outputs] == [(None, *a.shape[1:]) for a in before]
    path = os.path.join(tmp_path, "generative.keras")
    save_component(model, path)
    again = load_component(path)
    after = again.layers[0](children)
    for a, b in zip(before, after):
        np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-6, atol=1e-6)
    attention = TopDownAttention(2, 0.5, True, trainable_beta=True)
    assert TopDownAttention.from_config(attention.get_config()).get_config() == attention.get_config()


def test_bad_arguments():
    with pytest.raises(InputError, match="Received: child_dim=1"):
        GenerativeCapsules(2, 3, 1)
    with pytest.raises(InputError, match="Received: kappa=0"):
        GenerativeCapsules(2, 3, 4, kappa=0)
    with pytest.raises(InputError, match="Received: d=1"):
        vmf.vmf_log_normalizer(1.0, 1)
    with pytest.raises(InputError, match="Received: beta=0"):
        TopDownAttention(beta=0)


@pytest.mark.parametrize("children, predictions", [((2, 5, 4), (2, 5, 3, 6)),      # D differs
                                                   ((2, 5, 4), (2, 7, 3, 4)),      # I differs
                                                   ((2, 5, 4), (2, 5, 4)),         # predictions without J
                                                   ((2, 5, 3, 4), (2, 5, 3, 4))])  # children with a J
def test_top_down_attention_refuses_children_and_predictions_that_do_not_fit(children, predictions):
    """Children `[B, I, D]` and predictions `[B, I, J, D]`: otherwise one `InputError` names both shapes
    (before, each of these failed inside einsum with TensorFlow's InvalidArgumentError)."""
    with pytest.raises(InputError, match=re.escape(f"Received: children {children}, predictions {predictions}")):
        TopDownAttention()(np.zeros(children, "float32"), np.zeros(predictions, "float32"))


@pytest.mark.parametrize("children, predictions", [((2, 5, 4), (2, 5, 3, 6)), ((2, 5, 4), (1, 5, 3, 4)),
                                                   ((5, 4), (2, 5, 3, 4))])
def test_built_top_down_attention_refuses_them_on_every_call(children, predictions):
    """Once built, the layer checked nothing: each of these failed inside einsum (InvalidArgumentError)."""
    attention = TopDownAttention()
    attention(np.zeros((2, 5, 4), "float32"), np.zeros((2, 5, 3, 4), "float32"))
    with pytest.raises(InputError, match=re.escape(f"Received: children {children}, predictions {predictions}")):
        attention(np.zeros(children, "float32"), np.zeros(predictions, "float32"))
    c, v = attention(np.zeros((2, 7, 4), "float32"), np.zeros((2, 7, 2, 4), "float32"))   # any I and J
    assert c.shape == (2, 7, 2) and v.shape == (2, 7, 4)


def test_inversion_takes_the_iterations_it_is_given_and_refuses_what_does_not_fit(rng):
    """`infer(iterations=0)` ran the layer's em_iterations (20 by default) without a word, and a string for
    `return_trace` read as True; activations, parents' poses and posteriors of another shape failed inside
    einsum (before). Now `iterations` is None (the layer's) or an integer >= 1, and the rest are refused by name."""
    layer = GenerativeCapsules(3, 4, 5, seed=0, em_iterations=2, pose_steps=1)
    children = rng.normal(size=(2, 6, 5)).astype("float32")
    assert layer.infer(children, return_trace=True)[1].shape == (3, 2)
    assert layer.infer(children, np.ones((2, 6)), iterations=1, return_trace=True)[1].shape == (2, 2)
    with pytest.raises(InputError, match=r"iterations must be an integer >= 1. Received: iterations=0"):
        layer.infer(children, iterations=0)
    with pytest.raises(InputError, match=r"return_trace must be True or False"):
        layer.infer(children, return_trace="no")
    for shape in [(2, 7), (2, 6, 1)]:
        message = re.escape(f"activations must be [batch, children] = [2, 6]. Received: shape={shape}")
        for use in (layer.infer, layer.bottom_up):
            with pytest.raises(InputError, match=message):
                use(children, np.ones(shape, "float32"))
    parents = np.zeros((2, 3, 4), "float32")
    with pytest.raises(InputError, match=re.escape("v must be the parents' poses [batch = 2 (the children's), 3, "
                                                   "4]. Received: shape=(2, 4, 4)")):
        layer.posterior(children, np.zeros((2, 4, 4), "float32"))
    with pytest.raises(InputError, match=re.escape("r must be the posterior over the parents [batch, children, "
                                                   "parents] = [2, 6, 3]. Received: shape=(2, 6, 4)")):
        layer.log_joint(children, parents, np.full((2, 6, 4), 0.25, "float32"))
    assert layer.log_joint(children, parents, np.full((2, 6, 3), 1 / 3, "float32")).shape == (2,)


def test_inference_builds_the_layer_and_wrong_children_are_refused(rng):
    """`infer` before any call builds the weights for its children (as calling the layer does); children of
    another size, or generating before the number of children is known, raise a clear error."""
    layer = GenerativeCapsules(3, 4, 4, seed=1)
    with pytest.raises(InputError, match="no weights yet"):
        layer.generate(tf.zeros((2, 3, 4)), [1, 2])
    children = tf.constant(rng.normal(size=(2, 24, 4)).astype("float32"))
    assert layer.infer(children).coefficients.shape == (2, 24, 3) and layer.maps.shape[0] == 24
    with pytest.raises(InputError, match="built for 24 children"):
        layer.infer(children[:, :23])
    with pytest.raises(InputError, match="built for 24 children"):        # a symbolic call too
        layer(keras.Input((23, 4)))
    with pytest.raises(InputError, match=r"children must be \[batch, children, 4\]"):
        layer.posterior(tf.zeros((2, 24, 5)), tf.zeros((2, 3, 4)))
    # generating: parents' poses [B, J, D_p] and a seed pair (before: einsum's and the stateless ops' errors)
    assert layer.generate(tf.zeros((2, 3, 4)), [1, 2])[0].shape == (2, 24, 4)
    for poses in [(2, 4, 4), (2, 3, 5), (3, 4)]:
        with pytest.raises(InputError, match=re.escape(f"v must be the parents' poses [batch, 3, 4]. Received: "
                                                       f"shape={poses}")):
            layer.generate(tf.zeros(poses), [1, 2])
    for seed in (3, [1, 2, 3]):
        with pytest.raises(InputError, match="seed must be a pair of integers"):
            layer.generate(tf.zeros((2, 3, 4)), seed)


def test_the_trainer_raises_the_bound_on_children_of_another_layer(rng):
    """Generalised EM: children drawn from a teacher; the student's bound at its inferred parents rises."""
    from poecaps.trainers.generative import GenerativeCapsuleTrainer

    teacher, student = _layer(seed=1), _layer(seed=2)
    children, _ = teacher.generate(rng.normal(size=(64, 3, 4)), seed=[3, 4])
    children = children.numpy()

    def bound():
        found = student.infer(children, iterations=5)
        return float(np.mean(student.log_joint(children, found.poses, found.coefficients).numpy()))

    before = bound()
    trainer = GenerativeCapsuleTrainer(student, iterations=5)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2))
    history = trainer.fit(children, batch_size=16, epochs=4, shuffle=False, verbose=0)
    assert np.all(np.isfinite(history.history["bound_per_child"]))
    assert bound() > before          # here about -155 -> -123 per set of children
    with pytest.raises(InputError, match="iterations"):
        GenerativeCapsuleTrainer(student, iterations=0)


@pytest.mark.parametrize("iterations", [1, 2])
def test_evaluate_and_a_call_infer_with_the_trainers_iterations(rng, iterations):
    """evaluate() reports the bound at the parents that `iterations` EM iterations find, as training does,
    not at the layer's own em_iterations (20 here); the bound computed here from the layer's own pieces."""
    from poecaps.trainers.generative import GenerativeCapsuleTrainer

    layer = _layer(seed=2, em_iterations=20)
    children = _layer(seed=1).generate(rng.normal(size=(8, 3, 4)), seed=[7, 8])[0].numpy()
    trainer = GenerativeCapsuleTrainer(layer, iterations=iterations, dtype="float64")
    trainer.compile(optimizer=keras.optimizers.SGD(0.0))

    def bound(k):
        found = layer.infer(children, iterations=k)
        return np.mean(layer.log_joint(children, found.poses, found.coefficients).numpy()) / children.shape[1]

    reported = trainer.evaluate(children, batch_size=len(children), verbose=0, return_dict=True)["bound_per_child"]
    # The inferences run in float64; Keras' Mean metric keeps its total in float32, so the reported bound
    # carries a float32 rounding or two (relative 2**-24 each). The bounds at `iterations` and at 20
    # iterations differ by far more (checked, so the test can tell them apart).
    assert abs(bound(iterations) - bound(20)) > 1e-3
    assert reported == pytest.approx(bound(iterations), rel=1e-6)
    called = trainer(children).poses.numpy()
    np.testing.assert_allclose(called, layer.infer(children, iterations=iterations).poses.numpy(), rtol=1e-9, atol=1e-12)


def test_the_trainer_weighs_each_child_by_its_length_when_asked(rng):
    """child_weights="lengths": a child of length 0 moves neither the M-step of G nor the inferred parents."""
    from poecaps.trainers.generative import GenerativeCapsuleTrainer

    children, _ = _layer(seed=1).generate(rng.normal(size=(16, 3, 4)), seed=[5, 6])
    children = children.numpy()
    children[:, 0] = 0.0                                   # child 0 absent from every set
    turned = children.copy()
    turned[:, 0] = 1e-9 * rng.normal(size=(16, 5))       # ... or present at length 1e-9, another direction
    for weights in ("uniform", "lengths"):
        student = _layer(seed=2)
        trainer = GenerativeCapsuleTrainer(student, iterations=20, child_weights=weights, dtype="float64")
        trainer.compile(optimizer=keras.optimizers.SGD(1e-3), run_eagerly=True)
        moved = np.abs(trainer(turned).poses.numpy() - trainer(children).poses.numpy()).max()
        before = student.maps.numpy()
        trainer.train_on_batch(children)
        change = np.abs(student.maps.numpy() - before).max(axis=(1, 2, 3))      # per child
        assert np.all(change[1:] > 0)
        if weights == "lengths":
            # a_0 = 0: child 0's term of the bound is 0 * (a finite number), so its maps get no gradient;
            # a_0 = 1e-9 shifts the bound by about 1e-9 * |kappa cos| ~ 2e-8 nats, the parents by a like amount
            assert change[0] == 0.0 and moved < 1e-6
        else:
            # every child counts alike: child 0's length term pulls on its maps, and its direction on the parents
            assert change[0] > 0.0 and moved > 1e-3
    with pytest.raises(InputError, match="child_weights must be one of 'uniform', 'lengths'. Received: child_weights='length'"):
        GenerativeCapsuleTrainer(student, child_weights="length")
