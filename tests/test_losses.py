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


SCORES = np.array([[0.9, 0.2, 0.1], [0.3, 0.8, 0.4]], "float32")


@pytest.mark.parametrize("loss", [
    lambda labels: losses.margin_loss(labels, SCORES),
    lambda labels: losses.spread_loss(labels, SCORES, 0.5),
    lambda labels: losses.softmax_cross_entropy(labels, SCORES),
], ids=["margin", "spread", "cross_entropy"])
@pytest.mark.parametrize("labels, message", [
    (np.array([0, 3]), r"\[0, 3\)"),                     # past the classes: was an all-zero one-hot (no class)
    (np.array([0, -1]), r"\[0, 3\)"),                    # -1: likewise (a cross-entropy of 0)
    (np.array([0.0, 1.7]), "integers"),                  # truncated to 1 before
    (np.ones((2, 1), "float32"), r"\[B\] integer"),      # broadcast over the 3 classes before
    (np.eye(3, dtype="float32")[[0]], r"\[B\] integer"),  # one row broadcast over the batch of 2 before
    (np.array([0]), r"\[B\] integer"),                   # likewise, as a class
    (np.array([[1, 0, 0], [0, 0, 0]], "float32"), "sum to 1"),   # a row of no class
    (np.array([[1, 0, 0], [0, 2, -1]], "float32"), r"\[0, 1\]"),
])
def test_losses_refuse_labels_that_do_not_fit_the_scores(loss, labels, message):
    """A label the losses cannot read as one class of the scores is an InputError; each was read as no class,
    truncated or broadcast before. A softmax's soft row passes, within its rounding."""
    with pytest.raises(ValueError, match=message):
        loss(labels)
    soft = ops.convert_to_numpy(ops.softmax(ops.convert_to_tensor(np.float32([[5, 1, -3], [0.1, 0.2, 0.3]]))))
    assert np.all(np.isfinite(ops.convert_to_numpy(loss(soft))))


def test_loss_settings_and_reconstruction_batches_are_checked():
    """A setting that is not a finite number, a negative step or a batch of another size is an InputError (NaN
    settings gave NaN losses, and a batch of one was broadcast against the other); other layouts of the same
    values still pass."""
    labels = np.array([0, 1])
    for call in (lambda: losses.margin_loss(labels, SCORES, m_plus=float("nan")),
                 lambda: losses.margin_loss(labels, SCORES, down_weight=-1.0),
                 lambda: losses.spread_loss(labels, SCORES, "0.5"),
                 lambda: losses.spread_margin(-1, 10),
                 lambda: losses.spread_margin(0, float("inf")),
                 lambda: losses.reconstruction_loss(np.zeros((1, 4)), np.zeros((3, 4))),
                 lambda: losses.reconstruction_loss(np.zeros((2, 4)), np.zeros((2, 5)))):
        with pytest.raises(ValueError):
            call()
    flat = ops.convert_to_numpy(losses.reconstruction_loss(np.zeros((2, 2, 2, 1)), np.full((2, 4), 0.5)))
    np.testing.assert_allclose(flat, [1.0, 1.0])
    assert float(losses.spread_margin(3, 0)) == pytest.approx(0.9)
