"""Faria's learned routings against references written here: a numeric minimiser, NumPy routing, a NumPy LSTM."""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import optimize

from poecaps import routing
from poecaps.errors import InputError
from poecaps.routing import ConnectionistRouting, SimilarityRouting
from poecaps.routing.similarity import compatibility


def similarity_objective(c, kernel, activations, l1, l2):
    """Faria eq. 2 for one parent: -sum c K + l1 sum c log(I c) + l2 sum c log(c / a)."""
    n = len(c)
    return -c @ kernel + l1 * np.sum(c * np.log(n * c)) + l2 * np.sum(c * np.log(c / activations))


def numeric_minimiser(kernel, activations, l1, l2):
    """Minimise eq. 2 over the simplex numerically: c = softmax(z), BFGS on z with the chain-rule gradient."""
    n = len(kernel)

    def fun(z):
        c = np.exp(z - z.max())
        c /= c.sum()
        grad_c = -kernel + l1 * (np.log(n * c) + 1) + l2 * (np.log(c / activations) + 1)
        # d c / d z = diag(c) - c c^T
        return similarity_objective(c, kernel, activations, l1, l2), c * (grad_c - c @ grad_c)

    found = optimize.minimize(fun, np.zeros(n), jac=True, method="BFGS", options={"gtol": 1e-13, "maxiter": 10000})
    c = np.exp(found.x - found.x.max())
    return c / c.sum()


def test_compatibility_step_is_the_minimiser_of_the_objective():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(100):
        n = int(rng.integers(2, 12))
        kernel, activations = rng.uniform(0, 1, n), rng.uniform(0.05, 1, n)
        l1, l2 = rng.uniform(0.2, 5), rng.uniform(0, 5)
        c, log_c = compatibility(kernel[None, :, None], np.log(activations)[None], l1, l2)
        c = ops.convert_to_numpy(c)[0, :, 0]
        reference = numeric_minimiser(kernel, activations, l1, l2)
        worst = max(worst, np.abs(c - reference).max())
        np.testing.assert_allclose(np.exp(ops.convert_to_numpy(log_c))[0, :, 0], c, rtol=1e-12)
        # the closed form is no worse than the numeric minimum (float64 rounding aside)
        assert (similarity_objective(c, kernel, activations, l1, l2)
                <= similarity_objective(reference, kernel, activations, l1, l2) + 1e-12)
    assert worst < 1e-6


def numpy_similarity_routing(votes, activations, iterations, l1, l2, theta1, theta2, theta3, widths, mixture):
    """Section 4.1 with loops over the batch and parents: kernel clustering, then the activation."""
    batch, num_in, num_out, _ = votes.shape
    weights = np.exp(mixture) / np.exp(mixture).sum()
    kernel = lambda mu, v: sum(w * np.exp(-np.sum((mu - v) ** 2) / (2 * s * s)) for w, s in zip(weights, widths))
    poses, acts, coeffs = np.zeros((batch, num_out, votes.shape[-1])), np.zeros((batch, num_out)), np.zeros(
        votes.shape[:3])
    for b in range(batch):
        for j in range(num_out):
            c = np.full(num_in, 1.0 / num_in)
            mu = c @ votes[b, :, j]
            k = np.array([kernel(mu, votes[b, i, j]) for i in range(num_in)])
            for _ in range(iterations):
                k = np.array([kernel(mu, votes[b, i, j]) for i in range(num_in)])
                logits = (l2[j] * np.log(activations[b]) + k) / (l1[j] + l2[j])
                c = np.exp(logits - logits.max())
                c /= c.sum()
                mu = c @ votes[b, :, j]
            logit = abs(theta1[j]) * (c @ k) - abs(theta3[j]) * np.sum(c * np.log(c / activations[b])) + theta2[j]
            poses[b, j], acts[b, j], coeffs[b, :, j] = mu, 1 / (1 + np.exp(-logit)), c
    return poses, acts, coeffs


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_similarity_routing_matches_numpy_reference(rng, iterations):
    votes = rng.normal(size=(2, 7, 3, 4)) * 0.5
    activations = rng.uniform(0.1, 1, size=(2, 7))
    layer = SimilarityRouting(iterations, num_kernels=3, length_scales=[0.3, 0.8, 1.5], entropy_weight=0.7,
                              prior_weight=0.4, kernel_weight=2.0, activation_bias=-0.3, divergence_weight=0.5,
                              dtype="float64")   # float64 throughout, so the comparison is to rounding
    layer.build(votes.shape)
    layer.alpha.assign([0.7, -1.1, 0.3])     # lambda = |alpha|: signs must not matter
    layer.mixture_logits.assign([0.5, -0.2, 0.1])
    result = layer(votes, activations)
    value = lambda t: ops.convert_to_numpy(t).astype("float64")
    widths = value(ops.softplus(ops.cast(layer.length_scale_logits, "float64")))
    np.testing.assert_allclose(widths, [0.3, 0.8, 1.5], rtol=1e-7)      # the initial values (Constant: float32)
    np.testing.assert_allclose(value(layer.beta), 0.4, rtol=1e-7)
    poses, acts, coeffs = numpy_similarity_routing(
        votes, activations, iterations, np.abs(value(layer.alpha)), value(layer.beta), value(layer.theta1),
        value(layer.theta2), value(layer.theta3), widths, value(layer.mixture_logits))
    for got, want in zip(result, (poses, acts, coeffs)):
        np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-9, atol=1e-12)


def _routers():
    return [SimilarityRouting(3, num_kernels=4, seed=1),
            ConnectionistRouting(3, units=8, compatibility_hidden=(6,), activation_hidden=(5, 4), seed=2)]


@pytest.mark.parametrize("index", [0, 1])
def test_coefficients_sum_to_one_over_the_children(rng, index):
    result = _routers()[index](rng.normal(size=(3, 9, 4, 16)).astype("float32"),
                               rng.uniform(size=(3, 9)).astype("float32"))
    np.testing.assert_allclose(ops.convert_to_numpy(ops.sum(result.coefficients, axis=1)), 1.0, atol=1e-6)
    assert _routers()[index].normalizes == "children"


@pytest.mark.parametrize("index", [0, 1])
def test_permuting_the_children_permutes_the_coefficients_only(rng, index):
    votes = rng.normal(size=(3, 9, 4, 16)).astype("float32")
    activations = rng.uniform(size=(3, 9)).astype("float32")
    layer = _routers()[index]
    perm = rng.permutation(9)
    plain, permuted = layer(votes, activations), layer(votes[:, perm], activations[:, perm])
    # float32 sums over 9 children in another order: a few ulps
    np.testing.assert_allclose(ops.convert_to_numpy(permuted.coefficients),
                               ops.convert_to_numpy(plain.coefficients)[:, perm], rtol=1e-5, atol=1e-7)
    for name in ("poses", "activations"):
        np.testing.assert_allclose(ops.convert_to_numpy(getattr(permuted, name)),
                                   ops.convert_to_numpy(getattr(plain, name)), rtol=1e-5, atol=1e-6)
    # a real permutation, not the identity: the coefficients do differ by child
    assert not np.allclose(ops.convert_to_numpy(plain.coefficients)[:, perm],
                           ops.convert_to_numpy(plain.coefficients))


def test_a_very_large_entropy_weight_gives_uniform_coefficients(rng):
    votes = rng.normal(size=(2, 11, 3, 16))
    activations = rng.uniform(0.05, 1, size=(2, 11))
    loose = SimilarityRouting(3, entropy_weight=0.1, prior_weight=0.0)(votes, activations).coefficients
    tight = SimilarityRouting(3, entropy_weight=1e9, prior_weight=1.0)(votes, activations).coefficients
    # c = softmax((l2 log a + K) / (l1 + l2)): the logits' spread is below (|log a| + 1) / 1e9
    np.testing.assert_allclose(ops.convert_to_numpy(tight), 1 / 11, rtol=1e-7)
    assert np.abs(ops.convert_to_numpy(loose) - 1 / 11).max() > 0.01


def numpy_connectionist(votes, activations, iterations, router):
    """Algorithm 2 with an LSTM written out in NumPy, on the router's weights, one pair at a time."""
    w = lambda t: ops.convert_to_numpy(t).astype("float64")
    kernel, recurrent, bias = w(router.kernel), w(router.recurrent_kernel), w(router.bias)
    dense = lambda layers: [(w(layer.kernel), w(layer.bias), layer.activation) for layer in layers]
    f_c, f_a = dense(router.compatibility_layers), dense(router.activation_layers)

    def mlp(layers, x):
        for k, (kern, b, _) in enumerate(layers):
            x = x @ kern + b
            if k < len(layers) - 1:
                x = np.maximum(x, 0)
        return x[0]

    sigmoid = lambda x: 1 / (1 + np.exp(-x))
    batch, num_in, num_out, _ = votes.shape
    units = recurrent.shape[0]
    poses, acts, coeffs = np.zeros((batch, num_out, votes.shape[-1])), np.zeros((batch, num_out)), np.zeros(
        votes.shape[:3])
    for b in range(batch):
        for j in range(num_out):
            c = np.full(num_in, 1 / num_in)
            mu = c @ votes[b, :, j]
            h, m = np.zeros((num_in, units)), np.zeros((num_in, units))
            for _ in range(iterations):
                scores = np.zeros(num_in)
                for i in range(num_in):
                    x = np.concatenate([mu, votes[b, i, j], [c[i]], [activations[b, i]]])
                    z = x @ kernel + h[i] @ recurrent + bias
                    gi, gf, gg, go = np.split(z, 4)
                    m[i] = sigmoid(gf) * m[i] + sigmoid(gi) * np.tanh(gg)
                    h[i] = sigmoid(go) * np.tanh(m[i])
                    scores[i] = mlp(f_c, h[i])
                c = np.exp(scores - scores.max())
                c /= c.sum()
                mu = c @ votes[b, :, j]
            poses[b, j], acts[b, j], coeffs[b, :, j] = mu, sigmoid(mlp(f_a, c @ m)), c
    return poses, acts, coeffs


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_connectionist_routing_matches_numpy_lstm(rng, iterations):
    votes = rng.normal(size=(2, 6, 3, 16)).astype("float32")
    activations = rng.uniform(size=(2, 6)).astype("float32")
    router = ConnectionistRouting(iterations, units=8, compatibility_hidden=(7, 5), activation_hidden=(6,), seed=3)
    router.build(votes.shape)
    # A random bias, so every gate's bias is exercised (the initial one is 0 but for the forget gate).
    router.bias.assign(rng.normal(size=router.bias.shape).astype("float32"))
    result = router(votes, activations)
    reference = numpy_connectionist(votes.astype("float64"), activations.astype("float64"), iterations, router)
    for got, want in zip(result, reference):
        np.testing.assert_allclose(ops.convert_to_numpy(got), want, rtol=1e-5, atol=1e-5)


def test_registered_by_name_and_validated():
    assert isinstance(routing.get("similarity", iterations=2), SimilarityRouting)
    assert isinstance(routing.get("connectionist", units=4), ConnectionistRouting)
    with pytest.raises(InputError, match="Received: num_kernels=0"):
        SimilarityRouting(num_kernels=0)
    with pytest.raises(InputError, match="length_scales must be 2 positive"):
        SimilarityRouting(num_kernels=2, length_scales=[1.0])
    with pytest.raises(InputError, match="length_scales must be 2 positive.*Received: length_scales=1.0$"):
        SimilarityRouting(num_kernels=2, length_scales=1.0)     # one number, not one per kernel
    with pytest.raises(InputError, match="Received: entropy_weight=-1"):
        SimilarityRouting(entropy_weight=-1)
    with pytest.raises(InputError, match="Received: units=0"):
        ConnectionistRouting(units=0)
    with pytest.raises(InputError, match=r"compatibility_hidden\[1\] must be an integer >= 1. Received: compatibility_hidden\[1\]=0"):
        ConnectionistRouting(compatibility_hidden=(4, 0))


@pytest.mark.parametrize("router", [
    SimilarityRouting(2, num_kernels=3, length_scales=[0.5, 1.0, 3.0], entropy_weight=3.0, prior_weight=0.5,
                      kernel_weight=0.2, activation_bias=-1.0, divergence_weight=0.3, seed=9),
    ConnectionistRouting(4, units=5, compatibility_hidden=(3, 2), activation_hidden=(4,), seed=8),
])
def test_config_round_trip_with_non_default_arguments(rng, router):
    votes = rng.normal(size=(2, 5, 3, 16)).astype("float32")
    activations = rng.uniform(size=(2, 5)).astype("float32")
    before = router(votes, activations)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(router))
    assert clone.get_config() == router.get_config()
    if not clone.built:
        clone.build(votes.shape)
    clone.set_weights(router.get_weights())
    for a, b in zip(before, clone(votes, activations)):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
