"""A rigid frame read from a weighted set of 2-D poses: encoders made equivariant by canonicalisation.

Poses are `poecaps.compositing`'s six entries of `P = [[a, b, tx], [c, d, ty]]`;
a pose's position is its translation `x = (tx, ty)`, where it puts its
template's centre. Given poses `P_j` with weights `w_j >= 0` (`W = sum_j w_j`):

    m = sum_j w_j x_j / W,              S = sum_j w_j (x_j - m)(x_j - m)^T / W,
    theta = atan2(2 S_xy, S_xx - S_yy) / 2      (the principal axis, u = (cos theta, sin theta)),
    theta <- theta + pi   if   sum_j w_j ((x_j - m) . u)^3 < 0,
    F = [[cos theta, -sin theta, m_x], [sin theta, cos theta, m_y]].

The axis points to the side where the positions' third moment along it is
positive, which fixes the sign the second moments leave open. If every pose
is moved by one rigid map `R` (rotation by `phi`, then a translation), then
`m -> R m`, `S -> R S R^T`, `theta -> theta + phi` and the third moment
is unchanged, so `F -> R F`: the poses read in their frame, `F^-1 P_j`, do
not change, and a pose built in the frame, `F Q`, moves with the set. Exact
except where the frame is undefined: `S` isotropic (no axis) or the third
moment zero (no side); near there a small change of the poses can turn
the frame far.
"""

import math

import numpy as np
import tensorflow as tf

from poecaps import compositing
from poecaps.errors import InputError
from poecaps.validation import check_finite


def rigid_frame(poses, weights):
    """`F [B, 6]` of poses `[B, N, 6]` weighted by `weights [B, N] >= 0` (the module docstring).

    Shapes are checked always, the weights' values when run eagerly (in a traced step they are the model's
    presences, in [0, 1]); a mismatch is an `InputError`, where weights `[B, 1]` would weigh every pose fully
    (m the positions' sum, not their mean) and negative ones would be divided by the floor of their sum.
    """
    poses = compositing.check_shape(tf.convert_to_tensor(poses), (None, None, 6), "poses", "[B, N, 6]")
    weights = compositing.check_shape(tf.cast(weights, poses.dtype), poses.shape[:2], "weights",
                                      "[B, N] (one weight per pose)")
    if tf.executing_eagerly() and np.asarray(weights).size:
        values = check_finite(np.asarray(weights), "weights")
        if values.min() < 0:
            raise InputError(f"weights must be >= 0. Received: minimum {values.min():g}")
    weights = weights / tf.maximum(tf.reduce_sum(weights, -1, keepdims=True), tf.constant(1e-12, poses.dtype))
    x = tf.stack([poses[..., 2], poses[..., 5]], -1)                           # positions [B, N, 2]
    m = tf.reduce_sum(weights[..., None] * x, 1)                                # [B, 2]
    d = x - m[:, None]
    moment = lambda u, v: tf.reduce_sum(weights * u * v, -1)
    sxx, syy, sxy = moment(d[..., 0], d[..., 0]), moment(d[..., 1], d[..., 1]), moment(d[..., 0], d[..., 1])
    theta = 0.5 * tf.atan2(2.0 * sxy, sxx - syy)
    along = d[..., 0] * tf.cos(theta)[:, None] + d[..., 1] * tf.sin(theta)[:, None]
    theta = tf.where(tf.reduce_sum(weights * along ** 3, -1) < 0, theta + math.pi, theta)
    cos, sin = tf.cos(theta), tf.sin(theta)
    return tf.stack([cos, -sin, m[:, 0], sin, cos, m[:, 1]], -1)


def to_frame(frame, poses):
    """`F^-1 P_j [B, N, 6]`: poses `[B, N, 6]` read in the frames `[B, 6]`."""
    frame, poses = _frames_and_poses(frame, poses)
    inverse = compositing.homogeneous(compositing.invert(frame))[:, None]
    return compositing.flat(inverse @ compositing.homogeneous(poses))


def from_frame(frame, poses):
    """`F Q_j [B, N, 6]`: poses `[B, N, 6]` given in the frames `[B, 6]`, in the image's coordinates."""
    frame, poses = _frames_and_poses(frame, poses)
    return compositing.flat(compositing.homogeneous(frame)[:, None] @ compositing.homogeneous(poses))


def _frames_and_poses(frame, poses):
    """One frame `[B, 6]` per set of poses `[B, N, 6]`, as tensors of the poses' dtype, or an `InputError` (a single
    frame would otherwise be broadcast over every set)."""
    poses = compositing.check_shape(tf.convert_to_tensor(poses), (None, None, 6), "poses", "[B, N, 6]")
    frame = compositing.check_shape(tf.cast(frame, poses.dtype), (poses.shape[0], 6), "frame",
                                    "[B, 6] (one frame per set of poses)")
    return frame, poses
