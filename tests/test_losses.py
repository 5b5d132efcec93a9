"""Margin and spread losses against hand computations."""

import numpy as np
import pytest
from keras import ops

from poecaps import losses


def test_margin_loss_hand_computed():
    lengths = np.array([[0.95, 0.3, 0.05], [0.5, 0.2, 0.7]], dtype="float32")
    labels = np.array([0, 2])
    # example 0: present 0 (0.95 > 0.9); absent 0.5*(0.3-0.1)^2 = 0.02; 0.05 < 0.1 -> 0
    # example 1: present (0.9-0.7)^2 = 0.04; absent 0.5*(0.4^2 + 0.1^2) = 0.085
    expected = [0.02, 0.04 + 0.085]
    np.testing.assert_allclose(ops.convert_to_numpy(losses.margin_loss(labels, lengths)),
                               expected, rtol=1e-5)
    one_hot = np.eye(3, dtype="float32")[labels]
    np.testing.assert_allclose(ops.convert_to_numpy(losses.margin_loss(one_hot, lengths)),
                               expected, rtol=1e-5)


def test_spread_loss_hand_computed():
    a = np.array([[0.9, 0.6, 0.1], [0.2, 0.5, 0.4]], dtype="float32")
    labels = np.array([0, 2])
    # m = 0.5. example 0: (0.5 - 0.3)^2 = 0.04, (0.5 - 0.8) < 0 -> 0.
    # example 1: target 0.4: (0.5 - 0.2)^2 = 0.09, (0.5 + 0.1)^2 = 0.36.
    np.testing.assert_allclose(ops.convert_to_numpy(losses.spread_loss(labels, a, 0.5)),
                               [0.04, 0.45], rtol=1e-5)


@pytest.mark.parametrize("step, expected", [(0, 0.2), (50, 0.55), (100, 0.9), (500, 0.9)])
def test_spread_margin_schedule(step, expected):
    assert float(losses.spread_margin(step, 100)) == pytest.approx(expected)


def test_reconstruction_loss_is_summed_squared_error():
    x = np.zeros((2, 2, 2, 1), "float32")
    y = np.full((2, 2, 2, 1), 0.5, "float32")
    np.testing.assert_allclose(ops.convert_to_numpy(losses.reconstruction_loss(x, y)), [1.0, 1.0])


def test_softmax_cross_entropy_is_scipys_negative_log_softmax_even_for_large_logits():
    """-log softmax(logits)[label] against scipy, float64; the logits of the second row differ by 1000, whose
    exponentials overflow unless the log-sum-exp is shifted (the loss is then exactly 0 and 1000)."""
    from scipy.special import log_softmax

    logits = np.array([[0.3, -1.2, 2.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]])
    labels = np.array([1, 0, 1])
    expected = -log_softmax(logits, axis=-1)[np.arange(3), labels]
    found = ops.convert_to_numpy(losses.softmax_cross_entropy(labels, logits))
    np.testing.assert_allclose(found, expected, rtol=1e-14, atol=0)
    assert found[1] == 0.0 and found[2] == 1000.0
    np.testing.assert_array_equal(ops.convert_to_numpy(losses.softmax_cross_entropy(np.eye(4)[labels], logits)), found)
