"""Losses of the supervised capsule baselines: margin, spread, reconstruction.

All take one-hot or integer labels and return one value per example (`[B]`);
the trainers average over the batch.
"""

from keras import ops


def _one_hot(labels, num_classes, dtype):
    if len(labels.shape) == 1:
        return ops.one_hot(ops.cast(labels, "int32"), num_classes, dtype=dtype)
    return ops.cast(labels, dtype)


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
    t = _one_hot(labels, lengths.shape[-1], lengths.dtype)
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
    t = _one_hot(labels, activations.shape[-1], activations.dtype)
    a_target = ops.sum(t * activations, axis=-1, keepdims=True)
    margin = ops.cast(margin, activations.dtype)
    return ops.sum((1.0 - t) * ops.square(ops.relu(margin - (a_target - activations))), axis=-1)


def softmax_cross_entropy(labels, logits):
    """Softmax cross-entropy of integer `labels` `[B]` under `logits` `[B, K]`; returns `[B]`.

    Faria's learned-routing network uses its class activations as the logits.
    """
    log_p = logits - ops.logsumexp(logits, axis=-1, keepdims=True)
    return -ops.sum(_one_hot(labels, logits.shape[-1], logits.dtype) * log_p, axis=-1)


def reconstruction_loss(images, reconstructions):
    """Summed squared error per example (CapsNet weighs it by 0.0005); returns `[B]`."""
    flat = lambda x: ops.reshape(x, (ops.shape(x)[0], -1))
    return ops.sum(ops.square(flat(images) - flat(reconstructions)), axis=-1)


def spread_margin(step, total_steps, start=0.2, end=0.9):
    """The spread-loss margin, raised linearly from `start` to `end` over `total_steps`."""
    fraction = ops.minimum(ops.cast(step, "float32") / max(float(total_steps), 1.0), 1.0)
    return start + (end - start) * fraction
