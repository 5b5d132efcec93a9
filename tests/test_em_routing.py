"""EM routing against a plain NumPy reference written here."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import routing
from poecaps.errors import InputError
from poecaps.routing import EMRouting


def numpy_em_routing(votes, activations, iterations, final_lambda, floor, beta_u, beta_a,
                     standardize=False):
    """Hinton et al. 2018, Procedure 1, with loops over upper capsules, in plain densities."""
    batch, num_in, num_out, dim = votes.shape
    r = np.full((batch, num_in, num_out), 1.0 / num_out)
    for t in range(iterations):
        lam = final_lambda * (1 - 0.95 ** (t + 1))
        mu = np.zeros((batch, num_out, dim))
        var = np.zeros((batch, num_out, dim))
        costs = np.zeros((batch, num_out))
        for n in range(batch):
            for j in range(num_out):
                rw = r[n, :, j] * activations[n]
                total = rw.sum() + 1e-8
                mu[n, j] = (rw[:, None] * votes[n, :, j]).sum(0) / total
                var[n, j] = (rw[:, None] * (votes[n, :, j] - mu[n, j]) ** 2).sum(0) / total + floor
                costs[n, j] = ((beta_u[j] + np.log(np.sqrt(var[n, j]))) * total).sum()
        if standardize:
            costs = (costs - costs.mean(1, keepdims=True)) / np.sqrt(costs.var(1, keepdims=True) + 1e-8)
        a_out = 1 / (1 + np.exp(-lam * (beta_a[None] - costs)))
        if t == iterations - 1:
            break
        for n in range(batch):
            for i in range(num_in):
                p = np.array([
                    np.prod(1 / np.sqrt(2 * math.pi * var[n, j]))
                    * np.exp(-np.sum((votes[n, i, j] - mu[n, j]) ** 2 / (2 * var[n, j])))
                    for j in range(num_out)])
                r[n, i] = a_out[n] * p / np.sum(a_out[n] * p)
    return mu, a_out, r


@pytest.mark.parametrize("implementation", ["moments", "direct"])
@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("normalization", ["none", "standardize"])
def test_matches_numpy_reference(rng, iterations, normalization, implementation):
    votes = rng.normal(size=(2, 6, 3, 4)) * 0.5
    activations = rng.uniform(0.1, 1.0, size=(2, 6))
    layer = EMRouting(iterations, final_lambda=0.5, variance_floor=1e-3,
                      cost_normalization=normalization, implementation=implementation)
    layer.build(votes.shape)
    beta_u, beta_a = rng.normal(size=3), rng.normal(size=3)
    layer.beta_u.assign(beta_u)
    layer.beta_a.assign(beta_a)
    result = layer(votes.astype("float32"), activations.astype("float32"))
    mu, a_out, r = numpy_em_routing(votes, activations, iterations, 0.5, 1e-3, beta_u, beta_a,
                                    standardize=normalization == "standardize")
    np.testing.assert_allclose(ops.convert_to_numpy(result.poses), mu, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(result.activations), a_out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), r, rtol=1e-4, atol=1e-5)


def _routing_pair(iterations, normalization, num_out, rng):
    """The two implementations with the same random betas."""
    layers = [EMRouting(iterations, final_lambda=0.7, variance_floor=1e-3,
                        cost_normalization=normalization, implementation=kind)
              for kind in ("moments", "direct")]
    betas = rng.normal(size=(2, num_out))
    for layer in layers:
        layer.build((None, 1, num_out, 16))
        layer.beta_u.assign(betas[0])
        layer.beta_a.assign(betas[1])
    return layers


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("normalization", ["none", "standardize"])
@pytest.mark.parametrize("with_activations", [True, False])
def test_moments_gradient_equals_autodiff_of_direct(rng, iterations, normalization,
                                                    with_activations):
    # The written-out gradient of the moment implementation against autodiff through
    # every step of the direct one, for a loss on all three outputs.
    votes = tf.constant(rng.normal(0.3, 0.6, size=(3, 9, 4, 16)), "float32")
    activations = (tf.constant(rng.uniform(0.1, 1.0, size=(3, 9)), "float32")
                   if with_activations else None)
    weights = [rng.normal(size=shape) for shape in ((3, 4, 16), (3, 4), (3, 9, 4))]
    grads = []
    for layer in _routing_pair(iterations, normalization, 4, rng):
        with tf.GradientTape() as tape:
            tape.watch(votes)
            if activations is not None:
                tape.watch(activations)
            result = layer(votes, activations)
            loss = sum(tf.reduce_sum(tf.cast(w, "float32") * out)
                       for w, out in zip(weights, result))
        sources = [votes, layer.beta_u, layer.beta_a] + ([activations] if with_activations else [])
        grads.append([g.numpy() for g in tape.gradient(loss, sources)])
    for moments, direct in zip(*grads):
        scale = np.abs(direct).max()
        assert scale > 0
        np.testing.assert_allclose(moments, direct, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_moments_inside_compiled_function(rng, jit_compile):
    # Graph and XLA builds of the written-out gradient give what eager autodiff gives.
    votes = tf.constant(rng.normal(size=(2, 8, 3, 16)), "float32")
    moments, direct = _routing_pair(3, "standardize", 3, rng)

    def poses_and_gradient(layer):
        with tf.GradientTape() as tape:
            tape.watch(votes)
            result = layer(votes)
            loss = tf.reduce_sum(tf.square(result.poses)) + tf.reduce_sum(result.activations)
        return result.poses, tape.gradient(loss, votes)

    compiled = tf.function(lambda: poses_and_gradient(moments), jit_compile=jit_compile)
    for got, expected in zip(compiled(), poses_and_gradient(direct)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("implementation", ["moments", "direct"])
def test_log_space_survives_far_votes(rng, implementation):
    # Votes far from every Gaussian underflow plain densities to 0/0; log space stays finite.
    votes = rng.normal(size=(1, 4, 2, 16)).astype("float32")
    votes[0, 0] += 200.0
    result = EMRouting(3, implementation=implementation)(votes)
    for tensor in result:
        assert np.all(np.isfinite(ops.convert_to_numpy(tensor)))
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients).sum(-1), 1.0, rtol=1e-5)


def test_agreeing_votes_activate_more_than_scattered_ones(rng):
    tight = np.repeat(rng.normal(size=(1, 1, 1, 16)), 32, axis=1) + 0.01 * rng.normal(size=(1, 32, 1, 16))
    loose = rng.normal(size=(1, 32, 1, 16)) * 3.0
    layer = EMRouting(3, final_lambda=0.01)
    tight_a = ops.convert_to_numpy(layer(tight.astype("float32")).activations)
    loose_a = ops.convert_to_numpy(layer(loose.astype("float32")).activations)
    assert tight_a[0, 0] > 0.5 > loose_a[0, 0]


@pytest.mark.parametrize("kwargs, message", [
    ({"iterations": 0}, "at least one M-step"),
    ({"final_lambda": 0.0}, r"final_lambda must be a finite number > 0\. Received: final_lambda=0\.0"),
    ({"variance_floor": -1.0}, r"variance_floor must be a finite number > 0\. Received: variance_floor=-1\.0"),
    ({"cost_normalization": "zscore"}, "cost_normalization must be one of"),
    ({"implementation": "fast"}, "implementation must be one of"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):      # a ValueError that the command lines print as one line
        EMRouting(**kwargs)


def test_config_round_trip_and_get():
    layer = routing.get("em", iterations=2, final_lambda=0.3, variance_floor=1e-2,
                        cost_normalization="standardize", implementation="direct")
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(layer))
    assert isinstance(again, EMRouting)
    assert (again.iterations, again.final_lambda, again.variance_floor,
            again.cost_normalization, again.implementation) == (2, 0.3, 1e-2, "standardize", "direct")
