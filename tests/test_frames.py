"""The rigid frame of a weighted set of poses: hand cases and its behaviour under rigid motions."""

import math

import numpy as np
import pytest
import tensorflow as tf

from poecaps import frames


def _poses_at(positions):
    """Poses `[B, N, 6]` with the identity's linear part, placed at `positions [B, N, 2]`."""
    positions = np.asarray(positions, "float64")
    poses = np.zeros(positions.shape[:-1] + (6,))
    poses[..., 0] = poses[..., 4] = 1.0
    poses[..., 2], poses[..., 5] = positions[..., 0], positions[..., 1]
    return poses


def _homogeneous(pose):
    return np.vstack([np.reshape(pose, (2, 3)), [0.0, 0.0, 1.0]])


def _rigid(angle, shift):
    c, s = math.cos(angle), math.sin(angle)
    return np.array([[c, -s, shift[0]], [s, c, shift[1]], [0.0, 0.0, 1.0]])


def test_the_frame_of_points_on_a_line_by_hand():
    """x = 0, 2, -1: centre 1/3, axis along x; the deviations -1/3, 5/3, -4/3 have the third moment
    (-1 + 125 - 64) / 27 > 0, so the axis points along +x. The mirrored set (0, -2, 1) has the opposite one: the
    axis turns by pi. A weight of 3 on the last point moves the centre to (0 + 2 - 3) / 5 = -1/5; the deviations
    1/5, 11/5, -4/5 give (1 + 1331 - 3 * 64) / 125 > 0, so +x again."""
    poses = _poses_at([[[0, 0], [2, 0], [-1, 0]], [[0, 0], [-2, 0], [1, 0]], [[0, 0], [2, 0], [-1, 0]]])
    weights = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 3.0]])
    found = frames.rigid_frame(tf.constant(poses), tf.constant(weights)).numpy()
    expected = np.array([[1, 0, 1 / 3, 0, 1, 0], [-1, 0, -1 / 3, 0, -1, 0], [1, 0, -1 / 5, 0, 1, 0]], "float64")
    np.testing.assert_allclose(found, expected, atol=1e-12)


def test_a_frame_along_the_diagonal_by_hand():
    """Points (0, 0), (1, 1), (3, 3) lie on the diagonal: centre (4/3, 4/3), axis at 45 degrees; the deviations
    along it, (-4/3, -1/3, 5/3) sqrt(2), have a positive third moment."""
    poses = _poses_at([[[0, 0], [1, 1], [3, 3]]])
    found = frames.rigid_frame(tf.constant(poses), tf.ones((1, 3), tf.float64)).numpy()[0]
    r = math.sqrt(0.5)
    np.testing.assert_allclose(found, [r, -r, 4 / 3, r, r, 4 / 3], atol=1e-12)


@pytest.mark.parametrize("angle", [0.3, math.pi / 2, math.pi, -2.0])
def test_a_rigid_motion_of_the_set_moves_the_frame_with_it_and_leaves_the_poses_in_it(angle):
    """F(R P) = R F(P) and F(R P)^-1 R P = F(P)^-1 P, against NumPy matrix products; F Q moves by R too."""
    rng = np.random.default_rng(7)
    poses = rng.normal(0.0, 0.4, (5, 9, 6)) + np.array([1.0, 0, 0, 0, 1.0, 0])
    weights = rng.uniform(0.1, 1.0, (5, 9))
    motion = _rigid(angle, rng.normal(0.0, 0.3, 2))
    moved = np.stack([[(motion @ _homogeneous(p))[:2].ravel() for p in image] for image in poses])
    frame = frames.rigid_frame(tf.constant(poses), tf.constant(weights)).numpy()
    moved_frame = frames.rigid_frame(tf.constant(moved), tf.constant(weights)).numpy()
    for f, g in zip(frame, moved_frame):
        np.testing.assert_allclose(_homogeneous(g), motion @ _homogeneous(f), atol=1e-9)
    inside = frames.to_frame(tf.constant(frame), tf.constant(poses)).numpy()
    np.testing.assert_allclose(frames.to_frame(tf.constant(moved_frame), tf.constant(moved)).numpy(), inside,
                               atol=1e-9)
    for f, image, read in zip(frame, poses, inside):                 # F^-1 P by NumPy
        for p, q in zip(image, read):
            np.testing.assert_allclose(np.linalg.solve(_homogeneous(f), _homogeneous(p))[:2].ravel(), q, atol=1e-9)
    back = frames.from_frame(tf.constant(moved_frame), tf.constant(inside)).numpy()
    np.testing.assert_allclose(back, moved, atol=1e-9)


def test_the_weights_choose_which_poses_set_the_frame():
    """A part of weight 0 does not move the frame, wherever it is."""
    poses = _poses_at([[[0, 0], [2, 0], [-1, 0], [5, 7]], [[0, 0], [2, 0], [-1, 0], [-9, 1]]])
    weights = tf.constant([[1.0, 1.0, 1.0, 0.0]] * 2, tf.float64)
    found = frames.rigid_frame(tf.constant(poses), weights).numpy()
    np.testing.assert_allclose(found, [[1, 0, 1 / 3, 0, 1, 0]] * 2, atol=1e-12)


@pytest.mark.parametrize("call, message", [
    # weights [B, 1] weighed every pose fully: the frame's origin was the positions' sum, not their mean
    (lambda poses: frames.rigid_frame(poses, np.ones((2, 1))), "one weight per pose"),
    (lambda poses: frames.rigid_frame(poses, -np.ones((2, 3))), ">= 0"),     # divided by the floor of their sum
    (lambda poses: frames.rigid_frame(poses, np.array([[1, np.nan, 1], [1, 1, 1]])), "NaN"),
    (lambda poses: frames.rigid_frame(poses[..., :4], np.ones((2, 3))), r"\[B, N, 6\]"),
    # a single frame was broadcast over both sets of poses
    (lambda poses: frames.to_frame(_poses_at([[0.0, 0.0]])[:, 0], poses), "one frame per set"),
    (lambda poses: frames.from_frame(_poses_at([[0.0, 0.0]])[:, 0], poses), "one frame per set"),
])
def test_frames_refuse_weights_and_frames_that_do_not_fit_the_poses(call, message):
    """Shapes that would be broadcast and weights that are negative or NaN are InputErrors; each gave a frame
    without a word before."""
    poses = _poses_at([[[0.0, 0.0], [1.0, 0.0], [3.0, 0.0]], [[0.0, 1.0], [0.0, 2.0], [0.0, 4.0]]])
    with pytest.raises(ValueError, match=message):
        call(poses)
    # the weights' check keeps the hand case: equal weights on (0,0), (1,0), (3,0) put the origin at (4/3, 0)
    np.testing.assert_allclose(frames.rigid_frame(poses, np.ones((2, 3)))[0, 2], 4.0 / 3.0, rtol=1e-12)
