"""GenerativeRouting against references written here: NumPy EM, a numeric M-step, scipy's vMF, the bound."""

import keras
import numpy as np
import pytest
from keras import ops
from scipy import optimize, stats

from poecaps import routing
from poecaps.errors import InputError
from poecaps.models import RoutingCapsNet
from poecaps.routing import GenerativeRouting


def numpy_log_likelihoods(votes, v, kappa, sigma):
    """log p(V_ij | j, v) [B, I, J] with the vMF density from scipy (float64)."""
    b, i, j, d = votes.shape
    lengths = np.linalg.norm(votes, axis=-1)
    out = np.empty((b, i, j))
    for bb in range(b):
        for jj in range(j):
            mu = v[bb, jj] / np.linalg.norm(v[bb, jj])
            directions = votes[bb, :, jj] / lengths[bb, :, jj, None]
            log_vmf = stats.vonmises_fisher(mu, kappa[jj]).logpdf(directions)
            length = stats.norm(np.linalg.norm(v[bb, jj]), sigma[jj]).logpdf(lengths[bb, :, jj])
            out[bb, :, jj] = log_vmf + length - (d - 1) * np.log(lengths[bb, :, jj])
    return out


def numpy_bound(votes, a, v, r, kappa, sigma, log_pi):
    log_lik = numpy_log_likelihoods(votes, v, kappa, sigma)
    per_child = np.sum(r * (log_pi + log_lik - np.log(r)), -1)
    _, j, d = v.shape
    return np.sum(a * per_child, -1) - 0.5 * np.sum(v ** 2, (1, 2)) - 0.5 * j * d * np.log(2 * np.pi)


def numpy_em(votes, a, iterations, kappa, sigma, log_pi):
    """The router's EM written plainly: M-step of uniform r, then E/M rounds."""
    lengths = np.linalg.norm(votes, axis=-1)
    units = votes / lengths[..., None]

    def m_step(r):
        w = a[:, :, None] * r
        direction = np.einsum("bij,bijd->bjd", w, units)
        direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
        rho = np.sum(w * lengths, 1) / (sigma ** 2 + np.sum(w, 1))
        return rho[..., None] * direction

    r = np.full(lengths.shape, 1.0 / votes.shape[2])
    v = m_step(r)
    for _ in range(iterations):
        logits = log_pi + numpy_log_likelihoods(votes, v, kappa, sigma)
        r = np.exp(logits - logits.max(-1, keepdims=True))
        r /= r.sum(-1, keepdims=True)
        v = m_step(r)
    shares = np.einsum("bi,bij->bj", a, r) / a.sum(-1, keepdims=True)
    return v, shares, r


def _router(rng, iterations, num_out, dim=16):
    router = GenerativeRouting(iterations, kappa=4.0, sigma=0.3, dtype="float64")    # no cast of the votes
    router.build((None, None, num_out, dim))
    # Distinct parents: random concentrations, spreads and mixing weights.
    router.log_kappa.assign(np.log(rng.uniform(2.0, 12.0, num_out)))
    router.log_sigma.assign(np.log(rng.uniform(0.1, 0.5, num_out)))
    router.mix_logits.assign(rng.normal(size=num_out))
    return router


def _parameters(router):
    w = lambda x: ops.convert_to_numpy(x).astype("float64")
    logits = w(router.mix_logits)
    return np.exp(w(router.log_kappa)), np.exp(w(router.log_sigma)), logits - np.log(np.exp(logits).sum())


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_matches_numpy_em(rng, iterations):
    votes = rng.normal(size=(2, 7, 3, 16)) * 0.3
    activations = rng.uniform(0.1, 1.0, size=(2, 7))
    router = _router(rng, iterations, 3)
    got = router(votes, activations)
    want = numpy_em(votes, activations, iterations, *_parameters(router))
    for g, w in zip(got, want):
        # float64 throughout (scipy's vMF normaliser and the router's Bessel series agree to ~1e-15 here); the
        # router's 1e-9 floor inside each norm of size ~0.3-1.5 moves results by up to ~1e-8
        np.testing.assert_allclose(ops.convert_to_numpy(g), w, rtol=1e-7, atol=1e-8)


def test_coefficients_sum_to_one_over_the_parents(rng):
    votes = rng.normal(size=(3, 9, 4, 16)).astype("float32")
    result = routing.get("generative", iterations=3)(votes)
    np.testing.assert_allclose(ops.convert_to_numpy(ops.sum(result.coefficients, axis=2)), 1.0, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(ops.sum(result.activations, axis=1)), 1.0, atol=1e-6)


def test_the_bound_never_decreases_and_the_m_step_is_its_maximiser(rng):
    votes = rng.normal(size=(2, 8, 3, 4)) * 0.5
    activations = rng.uniform(0.2, 1.0, size=(2, 8))
    params = _parameters(_router(rng, 0, 3, dim=4))
    bounds = []
    for k in range(8):
        router = _router(np.random.default_rng(0), k, 3, dim=4)
        router.log_kappa.assign(np.log(params[0]))
        router.log_sigma.assign(np.log(params[1]))
        router.mix_logits.assign(params[2])
        v, _, r = (ops.convert_to_numpy(x) for x in router(votes, activations))
        bounds.append(numpy_bound(votes, activations, v, r, *params))
    bounds = np.array(bounds)
    # Each round's E and M steps are exact: the bound rises or stays, to rounding (values of order 10).
    assert np.all(np.diff(bounds, axis=0) > -1e-9), bounds
    assert np.all(bounds[-1] > bounds[0] + 1e-3)
    # The M-step against a numeric maximiser of L(., r) over v for one example, r fixed.
    r = r[0]
    fun = lambda flat: -numpy_bound(votes[:1], activations[:1], flat.reshape(1, 3, 4), r[None], *params)[0]
    found = optimize.minimize(fun, v[0].ravel() + 0.1, method="BFGS", options={"gtol": 1e-10})
    np.testing.assert_allclose(v[0].ravel(), found.x, atol=1e-5)


def test_log_joint_is_the_bound_written_here_and_refuses_what_it_would_misread(rng):
    """`log_joint` against `numpy_bound` (scipy's vMF). Before, it was checked by nothing: an unbuilt router
    failed with AttributeError 'log_kappa', a posterior r [B, I, 1] was broadcast over the J parents without a
    word, and votes, parents or activations of other shapes failed inside einsum or broadcasting."""
    router = _router(rng, 0, 3, dim=4)
    votes = rng.normal(size=(2, 5, 3, 4)) * 0.5
    activations = rng.uniform(0.2, 1.0, size=(2, 5))
    v = rng.normal(size=(2, 3, 4))
    r = rng.dirichlet(np.ones(3), size=(2, 5))
    # float64 throughout: scipy's normaliser and the router's Bessel series agree to ~1e-15 at these kappa;
    # the router's 1e-9 floor inside each norm of size ~0.5-2 moves terms of size ~10 by ~1e-8
    np.testing.assert_allclose(ops.convert_to_numpy(router.log_joint(votes, v, r, activations)),
                               numpy_bound(votes, activations, v, r, *_parameters(router)), rtol=1e-7, atol=1e-7)
    with pytest.raises(InputError, match=r"has no weights yet; call it on votes first"):
        GenerativeRouting().log_joint(votes, v, r)
    refused = [
        ((votes[..., :2, :], v, r), (r"votes must be \[B, I, J, D\] with J = 3, its parents\. Received: votes of "
                                   r"shape \[2, 5, 2, 4\]")),
        ((votes[0], v, r), r"votes must be \[B, I, J, D\] with J = 3"),
        ((votes, v[:, :2], r), (r"v must be \[B, J, D\] = \[2, 3, 4\] for votes of shape \[2, 5, 3, 4\]\. "
                               r"Received: v of shape \[2, 2, 4\]")),
        ((votes, v, r[..., :1]), r"r must be \[B, I, J\] = \[2, 5, 3\] .* Received: r of shape \[2, 5, 1\]"),
        ((votes, v, r, activations[:, :4]), r"activations must be \[B, I\] = \[2, 5\]"),
    ]
    for arguments, message in refused:
        with pytest.raises(InputError, match=message):
            router.log_joint(*arguments)


def test_config_round_trip_and_validation(rng):
    router = GenerativeRouting(2, kappa=7.0, sigma=0.2)
    votes = rng.normal(size=(2, 5, 3, 16)).astype("float32")
    before = router(votes)
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(router))
    assert clone.get_config() == router.get_config()
    if not clone.built:
        clone.build(votes.shape)
    clone.set_weights(router.get_weights())
    for a, b in zip(before, clone(votes)):
        np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))
    with pytest.raises(InputError, match="Received: kappa=0"):
        GenerativeRouting(kappa=0)
    with pytest.raises(InputError, match="Received: sigma=-1"):
        GenerativeRouting(sigma=-1)
    with pytest.raises(InputError, match=r"pose size D .* must be at least 2.*shape \[1, 2, 3, 1\]"):
        GenerativeRouting()(np.zeros((1, 2, 3, 1), "float32"))
    # once built too: before, the von Mises-Fisher normaliser's own check ("d must be an integer >= 2")
    with pytest.raises(InputError, match=r"pose size D .* must be at least 2.*shape \[2, 5, 3, 1\]"):
        router(votes[..., :1])


def test_every_weight_gets_a_gradient_in_the_table_1_network(rng):
    import tensorflow as tf

    model = RoutingCapsNet((28, 28, 1), 10, routing="generative")
    images = rng.uniform(size=(4, 28, 28, 1)).astype("float32")
    weights = [w for r in model.routers for w in r.trainable_weights]
    assert len(weights) == 9
    with tf.GradientTape() as tape:
        loss, _, _ = model.loss_terms(images, np.array([0, 3, 5, 9]), training=True)
    for w, g in zip(weights, tape.gradient(loss, weights)):
        assert g is not None and float(tf.reduce_max(tf.abs(g))) > 0, w.path
