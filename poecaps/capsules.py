"""Capsule primitives: squash, unsquash, norms (Hauser eq. 4 and 6).

All functions are pure and work on any leading shape; `axis` is the capsule
(pose) axis.
"""

import math

from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_integer, check_setting

EPSILON = 1e-7


def norm(x, axis=-1, keepdims=False):
    """Euclidean norm `|x|`, exact, with the gradient 0 at `x = 0` (where sqrt's is infinite)."""
    return root(ops.sum(ops.square(x), axis=axis, keepdims=keepdims))


def root(sq):
    """`sqrt(sq)` for `sq >= 0`, exact, with the gradient 0 at `sq = 0` (where sqrt's is infinite)."""
    positive = sq > 0
    return ops.where(positive, ops.sqrt(ops.where(positive, sq, 1.0)), 0.0)


def ratio(numerator, denominator):
    """`numerator / denominator`, and 0 where the denominator is 0, with finite gradients there too."""
    nonzero = denominator != 0
    return ops.where(nonzero, numerator / ops.where(nonzero, denominator, 1.0), 0.0)


def squash(z, axis=-1):
    """Squash a capsule (Hauser eq. 4, Sabour eq. 1).

    squash(z) = |z|^2 / (1 + |z|^2) * z / |z| = z |z| / (1 + |z|^2)

    computed in the second form, which needs no epsilon: exact at every
    length whose square the dtype holds (|z| below about 1.8e19 in float32;
    beyond it `|z|^2` overflows and the result is NaN), 0 at 0 with
    gradient 0. The length of the result is
    `P(capsule on)` (Hauser eq. 5, 12-13).
    """
    sq = ops.sum(ops.square(z), axis=axis, keepdims=True)
    return z * norm(z, axis=axis, keepdims=True) / (1.0 + sq)


def unsquash(x, axis=-1, max_length=1.0 - 1e-6):
    """Inverse of `squash` (Hauser eq. 6).

    unsquash(x) = sqrt(|x| / (1 - |x|)) * x / |x|

    Lengths at or above `max_length` are clipped to it first, so the result
    is always finite (its length at most `sqrt(max_length / (1 - max_length))`,
    about 1000). Below the clip `unsquash(squash(z)) == z` up to rounding:
    for `D` coordinates the relative error is at most about
    `4 u (1 + |z|^2) + 8 u + 2 D tiny / |z|^4`, with the dtype's unit
    roundoff `u` (`1 - |x| = 1 / (1 + |z|^2)` is computed from `|x|`) and
    smallest normal number `tiny` (squares of the coordinates of `squash(z)`,
    of length `|z|^2`, that flush to zero): in float32 below 1e-6 for
    `1e-7 <= |z| <= 1`, 2.4e-3 at `|z| = 100`. Unsquash of 0 is 0. `max_length`
    lies in (0, 1): 1 and beyond give infinite lengths, 0 and below zero ones.
    """
    check_setting(max_length, "max_length", above=0, below=1)
    length_ = norm(x, axis=axis, keepdims=True)
    clipped = ops.minimum(length_, max_length)
    positive = length_ > 0
    direction = ops.where(positive, x / ops.where(positive, length_, 1.0), 0.0)
    return direction * ops.sqrt(clipped / (1.0 - clipped))


def length(x, axis=-1):
    """Capsule length `|x|`, the probability a capsule is on."""
    return norm(x, axis=axis)


def with_length(x, axis=-1):
    """`(x, |x|) / sqrt(2)`: a capsule with its length appended as one more coordinate.

    The result has the same length as `x`, so it is on with the same
    probability. A map linear in it is linear in the pose and in the length
    apart, so `x` and `-x` (the two sides of a capsule's line) can map to
    different outputs: `U' (x, |x|) = U x + |x| b`. Not in the paper; its
    section 4.2 leaves a capsule on "S^m x R^n x (0, 1)" to future work.
    """
    if axis != -1:
        raise InputError(f"with_length works on the last axis. Received: axis={axis}")
    return ops.concatenate([x, length(x)[..., None]], axis=-1) / math.sqrt(2.0)    # a Python float: x's dtype


def check_code_shape(shape, capsule_dim):
    """Raise `InputError` unless `shape` is a conv code's `[B, H, W, C]` with `capsule_dim` dividing `C` (unknown
    while tracing: fits); returns `capsule_dim`."""
    if len(shape) != 4:
        raise InputError(f"A conv code must be [batch, height, width, channels]. Received: shape={shape}")
    if shape[-1] is not None and shape[-1] % capsule_dim:
        raise InputError(f"capsule_dim must divide the number of channels ({shape[-1]}). "
                         f"Received: capsule_dim={capsule_dim}")
    return capsule_dim


def primary_capsules(code, capsule_dim):
    """Reshape a conv code `[B, H, W, C]` to `[B, H*W*C/capsule_dim, capsule_dim]`.

    Each spatial position's channels are split into `C / capsule_dim`
    consecutive groups (Hauser section 4.1: 6 x 6 x 128/8 = 576 capsules).
    A height, width or channel count unknown while tracing gives a capsule
    count known only when run.
    """
    capsule_dim = check_code_shape(tuple(code.shape), check_integer(capsule_dim, "capsule_dim"))
    h, w, channels = code.shape[1:]
    if None in (h, w, channels):
        return ops.reshape(code, (ops.shape(code)[0], -1, capsule_dim))
    return ops.reshape(code, (-1, h * w * channels // capsule_dim, capsule_dim))


def capsules_to_code(capsules, code_shape):
    """Inverse of `primary_capsules`: `[B, I, D] -> [B, H, W, C]`; `I * D` must equal `H * W * C`."""
    shape = tuple(capsules.shape)
    if len(shape) != 3 or (None not in shape[1:] and shape[1] * shape[2] != math.prod(code_shape)):
        raise InputError(f"capsules [B, I, D] must hold I * D = {math.prod(code_shape)} values per example for a "
                         f"code of shape {tuple(code_shape)}. Received: capsules of shape {shape}")
    return ops.reshape(capsules, (-1, *code_shape))
