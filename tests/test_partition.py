"""The RBM's partition function: enumeration against a brute-force sum over (v, h), AIS against the exact value."""

import itertools

import keras
import numpy as np
import pytest
from scipy import special, stats

from poecaps import partition
from poecaps.errors import InputError
from poecaps.experiments.evaluation import rbm_likelihood
from poecaps.rbm import BernoulliRBM


def _rbm(visible, hidden, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    rbm = BernoulliRBM(hidden, seed=seed)
    rbm.build((None, visible))
    rbm.set_weights([rng.normal(0.0, scale, (visible, hidden)), rng.normal(0.0, scale, visible),
                     rng.normal(0.0, scale, hidden)])
    return rbm


def _brute_force_log_z(rbm):
    """log sum_{v, h} exp(v^T W h + b^T v + a^T h), every joint state visited one by one, in float64."""
    W, b, a = (np.asarray(w, np.float64) for w in rbm.get_weights())
    terms = [np.dot(v, W @ h) + np.dot(b, v) + np.dot(a, h)
             for v in itertools.product((0.0, 1.0), repeat=W.shape[0])
             for h in itertools.product((0.0, 1.0), repeat=W.shape[1])]
    terms = np.array(terms)
    return terms.max() + np.log(np.exp(terms - terms.max()).sum())


@pytest.mark.parametrize("visible, hidden", [(6, 4), (3, 7)])   # enumerated over h, then over v
def test_exact_log_partition_equals_the_brute_force_sum_over_both_layers(visible, hidden):
    rbm = _rbm(visible, hidden, seed=visible)
    expected = _brute_force_log_z(rbm)
    # float64 sums of 2^10 terms of size ~10: rounding ~1e-13; chunks of 3 states exercise the chunked sum.
    assert partition.exact_log_partition(rbm, chunk=3) == pytest.approx(expected, abs=1e-9)


def test_log_likelihood_is_a_distribution_over_binary_vectors():
    rbm = _rbm(5, 3, seed=1)
    log_z = partition.exact_log_partition(rbm)
    states = np.array(list(itertools.product((0.0, 1.0), repeat=5)))
    log_p = partition.log_likelihood(rbm, states, log_z)
    assert np.exp(log_p).sum() == pytest.approx(1.0, abs=1e-12)
    # One vector against the brute-force marginal sum_h exp(-E(v, h)) / Z.
    W, b, a = (np.asarray(w, np.float64) for w in rbm.get_weights())
    v = states[13]
    marginal = sum(np.exp(v @ W @ np.array(h) + b @ v + a @ np.array(h))
                   for h in itertools.product((0.0, 1.0), repeat=3))
    assert log_p[13] == pytest.approx(np.log(marginal) - _brute_force_log_z(rbm), abs=1e-9)


@pytest.mark.parametrize("base", ["uniform", "base_rate"])
def test_ais_estimate_is_within_four_standard_errors_of_the_exact_value(base):
    rbm = _rbm(10, 6, seed=0)
    rng = np.random.default_rng(1)
    data = (rng.uniform(size=(50, 10)) < 0.3).astype("float32")
    bias = None if base == "uniform" else partition.base_rate_bias(data)
    result = partition.ais_log_partition(rbm, chains=500, betas=1000, base_visible_bias=bias, seed=3)
    exact = partition.exact_log_partition(rbm)
    # The estimate's spread comes from its own weights; below 0.02 nats the check has power (log Z ~ 21).
    assert result.std_error < 0.02
    assert abs(result.log_partition - exact) < 4 * result.std_error
    assert result.log_weights.shape == (500,)
    v = data[:3]
    np.testing.assert_array_equal(partition.log_likelihood(rbm, v, result),
                                  partition.log_likelihood(rbm, v, result.log_partition))
    assert result.log_base_partition == pytest.approx(6 * np.log(2) + np.logaddexp(0, bias if bias is not None
                                                                                    else np.zeros(10)).sum())


def test_ais_with_one_step_is_plain_importance_sampling_from_the_base():
    """betas = [0, 1]: log w = -F(v) - log p_0*(v) at exact base draws, so the weights are known in closed form."""
    rbm = _rbm(4, 3, seed=2)
    result = partition.ais_log_partition(rbm, chains=4000, betas=[0.0, 1.0], seed=0)
    W, b, a = (np.asarray(w, np.float64) for w in rbm.get_weights())
    # Every chain's weight is f_1(v) / f_0(v) = exp(b^T v + sum softplus(a + v W)) / (2^H exp(0)) for some binary v.
    states = np.array(list(itertools.product((0.0, 1.0), repeat=4)))
    possible = states @ b + np.logaddexp(0, a + states @ W).sum(axis=1) - 3 * np.log(2)
    assert np.all(np.min(np.abs(result.log_weights[:, None] - possible[None]), axis=1) < 1e-9)
    # The estimate is Z_0 times the weights' mean, Z_0 = 2^H prod_i (1 + e^0) for the uniform base.
    assert result.log_partition == pytest.approx(7 * np.log(2) + np.log(np.mean(np.exp(result.log_weights))),
                                                 abs=1e-12)
    assert abs(result.log_partition - partition.exact_log_partition(rbm)) < 4 * result.std_error


def test_ais_repeats_with_its_seed_and_moves_with_another():
    rbm = _rbm(8, 5, seed=4)
    first, again, other = (partition.ais_log_partition(rbm, chains=20, betas=50, seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(first.log_weights, again.log_weights)
    assert not np.array_equal(first.log_weights, other.log_weights)


def test_binarise_turns_each_pixel_on_with_its_grey_value_and_repeats_with_its_seed():
    grey = np.array([0.0, 0.1, 0.5, 0.9, 1.0], np.float32)
    x = np.tile(grey, (40000, 1))
    v = partition.binarise(x, seed=5)
    assert v.dtype == np.float32 and set(np.unique(v)) <= {0.0, 1.0}
    # Each column's share of ones is a mean of 40,000 Bernoulli(p) draws: standard error sqrt(p (1 - p) / N).
    share, se = v.mean(axis=0), np.sqrt(grey * (1 - grey) / len(x))
    assert np.all(np.abs(share - grey) <= 4 * se + 1e-12)
    assert share[0] == 0.0 and share[-1] == 1.0
    np.testing.assert_array_equal(v, partition.binarise(x, seed=5))
    assert not np.array_equal(v, partition.binarise(x, seed=6))


def test_independent_log_likelihood_is_the_bernoulli_log_pmf_and_the_rbm_without_weights():
    rng = np.random.default_rng(3)
    bias = rng.normal(0.0, 2.0, 6)
    v = (rng.uniform(size=(9, 6)) < 0.4).astype("float32")
    expected = stats.bernoulli.logpmf(v, special.expit(bias)).sum(axis=1)
    np.testing.assert_allclose(partition.independent_log_likelihood(bias, v), expected, rtol=0, atol=1e-12)
    # An RBM whose weights and hidden biases are 0 is the same independent model (its hidden units add
    # H log 2 to both the numerator and log Z).
    rbm = _rbm(6, 3, seed=0)
    rbm.set_weights([np.zeros((6, 3)), bias, np.zeros(3)])
    np.testing.assert_allclose(partition.log_likelihood(rbm, v, partition.exact_log_partition(rbm, verbose=0)),
                               expected, rtol=0, atol=1e-6)   # the RBM's weights are float32: bias rounded ~1e-7


def test_log_partition_is_exact_up_to_max_units_and_ais_above_them():
    rbm = _rbm(10, 6, seed=0)
    exact = _brute_force_log_z(rbm)
    log_z, std_error, method = partition.log_partition(rbm)
    assert method == "exact" and std_error == 0.0 and log_z == pytest.approx(exact, abs=1e-9)
    log_z, std_error, method = partition.log_partition(rbm, max_units=5, chains=500, betas=1000, seed=3)
    assert method == "ais" and 0.0 < std_error < 0.02   # below 0.02 nats the next check has power (log Z ~ 21)
    assert abs(log_z - exact) < 4 * std_error


def test_the_evaluations_rbm_likelihood_equals_a_brute_force_sum_over_binary_images():
    rbm = _rbm(6, 4, seed=7, scale=0.7)
    rng = np.random.default_rng(0)
    train, test = rng.uniform(size=(30, 2, 3, 1)), rng.uniform(size=(25, 2, 3, 1))
    found = rbm_likelihood(rbm, train, test, seed=4)
    # The test images drawn as the function says, then log P(v) by summing exp(-E(v, h)) over every h.
    v = partition.binarise(test.reshape(25, 6), seed=4).astype(np.float64)
    W, b, a = (np.asarray(w, np.float64) for w in rbm.get_weights())
    hidden = np.array(list(itertools.product((0.0, 1.0), repeat=4)))
    energies = v @ W @ hidden.T + (v @ b)[:, None] + (hidden @ a)[None]          # [25, 16] = -E(v, h)
    log_p = special.logsumexp(energies, axis=1) - _brute_force_log_z(rbm)
    assert found["test_log_likelihood"] == pytest.approx(log_p.mean(), abs=1e-9)
    p = (train.reshape(30, 6).sum(axis=0) + 1.0) / 32.0                           # one pseudo-count each way
    independent = stats.bernoulli.logpmf(v, p).sum(axis=1).mean()
    assert found["independent_pixels_test_log_likelihood"] == pytest.approx(independent, abs=1e-6)
    assert (found["log_partition_method"], found["log_partition_std_error"], found["binarisation_seed"]) == (
        "exact", 0.0, 4)
    assert rbm_likelihood(rbm, train, test, seed=4, max_units=3)["log_partition_method"] == "ais"


def test_bad_inputs_are_refused_by_name():
    rbm = _rbm(5, 3, seed=0)
    with pytest.raises(InputError, match="binary"):
        partition.log_likelihood(rbm, np.full((2, 5), 0.5), 1.0)
    with pytest.raises(InputError, match=r"shape \[N, 5\]"):
        partition.log_likelihood(rbm, np.zeros((2, 4)), 1.0)
    with pytest.raises(InputError, match="log_partition must be a finite number"):
        partition.log_likelihood(rbm, np.zeros((2, 5)), float("nan"))
    with pytest.raises(InputError, match="ais_log_partition"):
        partition.exact_log_partition(rbm, max_units=2)
    for betas in (1, [0.0, 0.5], [0.0, 0.6, 0.4, 1.0], [0.1, 1.0]):
        with pytest.raises(InputError, match="betas"):
            partition.ais_log_partition(rbm, betas=betas)
    with pytest.raises(InputError, match="chains"):
        partition.ais_log_partition(rbm, chains=0)
    with pytest.raises(InputError, match="base_visible_bias"):
        partition.ais_log_partition(rbm, base_visible_bias=np.zeros(4))
    with pytest.raises(InputError, match="BernoulliRBM. Received: Dense"):
        partition.exact_log_partition(keras.layers.Dense(3))
    with pytest.raises(InputError, match="no weights"):
        partition.exact_log_partition(BernoulliRBM(3))
    with pytest.raises(InputError, match=r"x must lie in \[0.0, 1.0\]"):
        partition.binarise(np.full((2, 3), 255.0))
    with pytest.raises(InputError, match="visible_bias must be a vector"):
        partition.independent_log_likelihood(np.zeros((2, 3)), np.zeros((1, 3)))
    with pytest.raises(InputError, match="binary"):
        partition.independent_log_likelihood(np.zeros(3), np.full((1, 3), 0.5))
    # before, any other verbose ('x', 5, -1, None) silently showed no progress at all
    for verbose in ("x", 5, -1, None, True):
        for estimate in (partition.exact_log_partition, partition.ais_log_partition, partition.log_partition):
            with pytest.raises(InputError, match=rf"^verbose must be 0, 1 or 2\. Received: verbose={verbose!r}$"):
                estimate(rbm, verbose=verbose)
