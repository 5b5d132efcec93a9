"""Losses of the supervised capsule baselines: margin, spread, reconstruction.

All take one-hot or integer labels and return one value per example (`[B]`);
the trainers average over the batch. Labels and scores are checked against
each other (`_targets`), so a label past the classes, a one-hot of another
width or a batch of another size is an `InputError` rather than a label of no
class or a broadcast.
"""

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_labels, check_setting, shape_fits, sizes_fit


def _targets(labels, scores):
    """The targets `[B, K]` of `labels` for class scores `[B, K]`, or an `InputError`.

    `labels` are `[B]` integer classes or `[B, K]` one-hot rows. Shapes are checked always; values when run
    eagerly (in a traced training step they are the labels the trainer checked): classes must be integers in
    [0, K), and one-hot rows must lie in [0, 1] and sum to 1. Otherwise a class past K would be read as an
    all-zero one-hot (no class: a margin loss without its present term, a cross-entropy of 0), a float class
    would be truncated, and a one-hot `[B, 1]` or a batch of one would be broadcast.
    """
    labels = labels if hasattr(labels, "shape") else np.asarray(labels)
    if len(scores.shape) != 2:
        raise InputError(f"class scores must have shape [B, K]. Received: shape={tuple(scores.shape)}")
    batch, classes = scores.shape
    eager = tf.executing_eagerly() and not isinstance(labels, keras.KerasTensor)
    if len(labels.shape) == 1 and sizes_fit(labels.shape[0], batch):
        if eager:
            check_labels(np.asarray(labels), classes, labels.shape[0])
        return ops.one_hot(ops.cast(labels, "int32"), classes, dtype=scores.dtype)
    if len(labels.shape) == 2 and shape_fits(labels.shape, (batch, classes)):
        if eager:
            _check_one_hot(np.asarray(labels))
        return ops.cast(labels, scores.dtype)
    raise InputError(f"labels must be [B] integer classes or [B, K] one-hot rows for class scores of shape "
                     f"[{batch}, {classes}]. Received: shape={tuple(labels.shape)}")


def _check_one_hot(rows):
    """One-hot (or soft) label rows `[B, K]`: numbers in [0, 1] summing to 1 in each row, up to float32 rounding."""
    if not (np.issubdtype(rows.dtype, np.number) or rows.dtype == bool):
        raise InputError(f"one-hot labels must hold numbers. Received: dtype {rows.dtype}")
    rows = rows.astype("float64")
    sums = rows.sum(axis=-1)
    # float32 rows (a softmax's among them) sum to 1 within a few ulps per entry: K * 2^-24 for rounding the
    # entries, as much again for a normalising sum's rounding; K * 2^-22 leaves room beyond both.
    if (not np.isfinite(rows).all() or rows.min() < 0 or rows.max() > 1
            or np.abs(sums - 1).max() > rows.shape[-1] * 2.0 ** -22):
        raise InputError(f"one-hot labels must lie in [0, 1] and sum to 1 in each row. Received: entries from "
                         f"{rows.min():g} to {rows.max():g}, row sums from {sums.min():g} to {sums.max():g}")


def margin_loss(labels, lengths, m_plus=0.9, m_minus=0.1, down_weight=0.5):
    """Margin loss of CapsNet (Sabour et al. 2017, eq. 4), summed over classes.

        L_k = T_k max(0, m+ - |v_k|)^2 + lambda (1 - T_k) max(0, |v_k| - m-)^2

    Args:
        labels: `[B]` integer classes or `[B, K]` one-hot.
        lengths: `[B, K]` class-capsule lengths |v_k|.
        m_plus, m_minus, down_weight: m+, m- and lambda (0.9, 0.1, 0.5).

    Returns:
        `[B]`, `sum_k L_k`.
    """
    for name, value in (("m_plus", m_plus), ("m_minus", m_minus)):
        check_setting(value, name)
    check_setting(down_weight, "down_weight", minimum=0)
    t = _targets(labels, lengths)
    present = t * ops.square(ops.relu(m_plus - lengths))
    absent = down_weight * (1.0 - t) * ops.square(ops.relu(lengths - m_minus))
    return ops.sum(present + absent, axis=-1)


def spread_loss(labels, activations, margin):
    """Spread loss of matrix capsules (Hinton et al. 2018, section 3.1).

        L = sum_{i != t} max(0, m - (a_t - a_i))^2

    with the margin m raised from 0.2 to 0.9 during training.

    Args:
        labels: `[B]` integer classes or `[B, K]` one-hot.
        activations: `[B, K]` class-capsule activations a_i.
        margin: the current m (a float or a scalar tensor).

    Returns:
        `[B]`.
    """
    check_setting(margin, "margin")
    t = _targets(labels, activations)
    a_target = ops.sum(t * activations, axis=-1, keepdims=True)
    margin = ops.cast(margin, activations.dtype)
    return ops.sum((1.0 - t) * ops.square(ops.relu(margin - (a_target - activations))), axis=-1)


def softmax_cross_entropy(labels, logits):
    """Softmax cross-entropy of integer `labels` `[B]` under `logits` `[B, K]`; returns `[B]`.

    Faria's learned-routing network uses its class activations as the logits.
    """
    log_p = logits - ops.logsumexp(logits, axis=-1, keepdims=True)
    return -ops.sum(_targets(labels, logits) * log_p, axis=-1)


def reconstruction_loss(images, reconstructions):
    """Summed squared error per example (CapsNet weighs it by 0.0005); returns `[B]`.

    `images` and `reconstructions` hold the same batch of the same number of values per example, in any layout
    (images `[B, H, W, C]` against a decoder's `[B, H*W*C]`); else an `InputError`, where a batch of one would
    be broadcast against the other.
    """
    images, reconstructions = (x if hasattr(x, "shape") else np.asarray(x) for x in (images, reconstructions))
    size = lambda shape: None if None in shape[1:] else int(np.prod(shape[1:]))
    shapes = tuple(images.shape), tuple(reconstructions.shape)
    if (min(map(len, shapes)) < 2 or not sizes_fit(shapes[0][0], shapes[1][0])
            or not sizes_fit(*map(size, shapes))):
        raise InputError(f"images and reconstructions must hold the same batch of the same number of values per "
                         f"example. Received: shapes {shapes[0]} and {shapes[1]}")
    flat = lambda x: ops.reshape(x, (ops.shape(x)[0], -1))
    return ops.sum(ops.square(flat(images) - flat(reconstructions)), axis=-1)


def spread_margin(step, total_steps, start=0.2, end=0.9):
    """The spread-loss margin, raised linearly from `start` to `end` over `total_steps` (>= 0; 0 gives `end`
    from the first step). A `step` given as a Python number must be >= 0; a tensor is a trainer's counter."""
    check_setting(step, "step", minimum=0)
    check_setting(total_steps, "total_steps", minimum=0)
    check_setting(start, "start")
    check_setting(end, "end")
    fraction = ops.minimum(ops.cast(step, "float32") / max(float(total_steps), 1.0), 1.0)
    return start + (end - start) * fraction
