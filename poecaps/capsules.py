"""Capsule primitives: squash, unsquash, safe_norm (Hauser eq. 4 and 6).

All functions are pure and work on any leading shape; `axis` is the capsule
(pose) axis.
"""

from keras import ops

EPSILON = 1e-7


def safe_norm(x, axis=-1, keepdims=False, epsilon=EPSILON):
    """Euclidean norm `sqrt(|x|^2 + eps)`: finite gradient at zero."""
    return ops.sqrt(ops.sum(ops.square(x), axis=axis, keepdims=keepdims) + epsilon)


def squash(z, axis=-1, epsilon=EPSILON):
    """Squash a capsule (Hauser eq. 4, Sabour eq. 1).

    squash(z) = |z|^2 / (1 + |z|^2) * z / |z|

    The length of the result is `P(capsule on)` (Hauser eq. 5, 12-13).
    """
    sq = ops.sum(ops.square(z), axis=axis, keepdims=True)
    return z * (sq / (1.0 + sq)) / ops.sqrt(sq + epsilon)


def unsquash(x, axis=-1, epsilon=EPSILON, max_length=1.0 - 1e-6):
    """Inverse of `squash` (Hauser eq. 6).

    unsquash(x) = sqrt(|x| / (1 - |x|)) * x / |x|

    Lengths at or above 1 are clipped to `max_length` first, so the result is
    always finite; below the clip `unsquash(squash(z)) == z`.
    """
    norm = safe_norm(x, axis=axis, keepdims=True, epsilon=epsilon * epsilon)
    clipped = ops.minimum(norm, max_length)
    return x / norm * ops.sqrt(clipped / (1.0 - clipped))


def length(x, axis=-1):
    """Capsule length `|x|` (without epsilon), the probability a capsule is on."""
    return ops.sqrt(ops.maximum(ops.sum(ops.square(x), axis=axis), 0.0))


def with_length(x, axis=-1):
    """`(x, |x|) / sqrt(2)`: a capsule with its length appended as one more coordinate.

    The result has the same length as `x`, so it is on with the same
    probability. A map linear in it is linear in the pose and in the length
    apart, so `x` and `-x` (the two sides of a capsule's line) can map to
    different outputs: `U' (x, |x|) = U x + |x| b`. Not in the paper; its
    section 4.2 leaves a capsule on "S^m x R^n x (0, 1)" to future work.
    """
    if axis != -1:
        raise ValueError(f"with_length works on the last axis. Received: axis={axis}")
    return ops.concatenate([x, length(x)[..., None]], axis=-1) / ops.sqrt(2.0)


def primary_capsules(code, capsule_dim):
    """Reshape a conv code `[B, H, W, C]` to `[B, H*W*C/capsule_dim, capsule_dim]`.

    Each spatial position's channels are split into `C / capsule_dim`
    consecutive groups (Hauser section 4.1: 6 x 6 x 128/8 = 576 capsules).
    """
    channels = code.shape[-1]
    if channels % capsule_dim:
        raise ValueError(
            f"capsule_dim must divide the number of channels ({channels}). "
            f"Received: capsule_dim={capsule_dim}"
        )
    h, w = code.shape[1], code.shape[2]
    return ops.reshape(code, (-1, h * w * channels // capsule_dim, capsule_dim))


def capsules_to_code(capsules, code_shape):
    """Inverse of `primary_capsules`: `[B, I, D] -> [B, H, W, C]`."""
    return ops.reshape(capsules, (-1, *code_shape))
