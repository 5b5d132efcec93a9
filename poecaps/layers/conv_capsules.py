"""Convolutional capsule layers: positions folded into the batch, routing delegated.

Capsule maps are `[B, H, W, T, D]` (T capsule types of D dimensions at each
position) with activations `[B, H, W, T]`.
"""

import keras
import tensorflow as tf
from keras import ops

from poecaps import distribute
from poecaps import routing as routing_lib
from poecaps.chunks import map_in_chunks
from poecaps.errors import InputError
from poecaps.layers.capsule_dense import (
    capsule_votes,
    check_capsule_inputs,
    frobenius_normalized,
    input_pose_dim,
    kernel_shape,
    pose_size,
)
from poecaps.routing.base import RoutingResult
from poecaps.validation import check_flag, check_integer, check_integers, sizes_fit


def _check_capsule_map(input_shape, layer):
    if len(input_shape) != 5:
        raise InputError(
            f"{layer} expects capsule maps of shape [batch, height, width, types, dim]. "
            f"Received: input_shape={tuple(input_shape)}")


def capsule_patches(x, kernel_size, strides):
    """`[B, H, W, T, ...]` -> `[B, H', W', K*K*T, ...]`, the K x K receptive fields (valid).

    `kernel_size` K and `strides` are integers >= 1, else an `InputError` (0 divided by zero, a float failed in
    `range`)."""
    kernel_size, strides = check_integers(kernel_size=kernel_size, strides=strides)
    if len(x.shape) < 4:
        raise InputError(f"capsule_patches takes capsule maps [B, H, W, T, ...]. Received: shape={tuple(x.shape)}")
    h, w = x.shape[1], x.shape[2]
    out_h, out_w = (h - kernel_size) // strides + 1, (w - kernel_size) // strides + 1
    if out_h < 1 or out_w < 1:
        raise InputError(
            f"kernel_size {kernel_size} does not fit a {h}x{w} capsule map. "
            f"Received: kernel_size={kernel_size}")
    patches = [x[:, dy:dy + strides * (out_h - 1) + 1:strides,
                 dx:dx + strides * (out_w - 1) + 1:strides]
               for dy in range(kernel_size) for dx in range(kernel_size)]
    # K*K x [B, H', W', T, ...] -> [B, H', W', K*K, T, ...] -> [B, H', W', K*K*T, ...]
    stacked = ops.stack(patches, axis=3)
    return ops.reshape(stacked, (-1, out_h, out_w, kernel_size * kernel_size * x.shape[3],
                                 *x.shape[4:]))


class _CapsuleMapLayer(keras.layers.Layer):
    """Shared arguments and config of the capsule layers that read capsule maps."""

    def __init__(self, num_capsules, capsule_dim, routing, pose, kernel_initializer, frobenius_votes=False,
                 **kwargs):
        super().__init__(**kwargs)
        num_capsules, capsule_dim = check_integers(num_capsules=num_capsules, capsule_dim=capsule_dim)
        pose_size(capsule_dim, pose)
        self.num_capsules = num_capsules
        self.capsule_dim = capsule_dim
        self.pose = pose
        self.routing = routing_lib.get(routing, dtype=self.dtype_policy)
        self.frobenius_votes = check_flag(frobenius_votes, "frobenius_votes")
        self.kernel_initializer = keras.initializers.get(
            kernel_initializer
            or keras.initializers.RandomNormal(stddev=0.01 if pose == "vector" else 0.5))

    def voting_kernel(self):
        """The matrices the votes use: `W`, or `W_ij / |W_ij|_F` with `frobenius_votes`."""
        return frobenius_normalized(self.kernel) if self.frobenius_votes else self.kernel

    def _build_kernel(self, num_in, in_dim, num_votes):
        self.kernel = self.add_weight(
            name="kernel", initializer=self.kernel_initializer,
            shape=kernel_shape(num_in, self.num_capsules, self.capsule_dim, in_dim, self.pose))
        if not self.routing.built:
            self.routing.build((None, num_votes, self.num_capsules, self.capsule_dim))

    def call(self, inputs, activations=None, training=None):
        return self.route(inputs, activations, training).poses

    def get_config(self):
        config = super().get_config()
        config.update(
            num_capsules=self.num_capsules, capsule_dim=self.capsule_dim, pose=self.pose,
            routing=keras.saving.serialize_keras_object(self.routing),
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            frobenius_votes=self.frobenius_votes)
        return config


@keras.saving.register_keras_serializable(package="poecaps")
class ConvCapsules(_CapsuleMapLayer):
    """Convolutional capsules: each K x K x T_in receptive field routes to T_out parents.

    Every output position sees `I = K*K*T_in` lower capsules; the votes
    `V_ij = M_i W_ij` (matrix poses) or `W_ij x_i` (vector poses) use one
    `W` per (kernel offset, input type, output type), shared over positions
    (Hinton et al. 2018, section 4: ConvCaps1 K=3 stride 2, ConvCaps2 K=3
    stride 1). Positions are folded into the batch, so any routing object
    (EM, dynamic, ...) serves the local receptive fields unchanged.

    Args:
        num_capsules: T_out, capsule types per output position.
        capsule_dim: pose size (16 for 4x4 matrices).
        kernel_size: K.
        strides: stride.
        routing: routing name, config or instance (default EM).
        pose: "matrix" or "vector".
        kernel_initializer: initializer of W.
        frobenius_votes: vote with `W_ij / |W_ij|_F` (Faria eq. 1).
        chunk_size: None (votes and routing for the whole folded batch at
            once) or the number of receptive fields whose votes and routing
            are computed together (`poecaps.chunks.map_in_chunks`, the
            gradient recomputing each chunk): the `[chunk, I, J, D]` votes
            stay in the CPU's caches. Same result to rounding (float32).
            Only inside a `tf.function`: run eagerly, the chunks would be a
            Python loop, so the whole batch is routed at once.

    Call arguments:
        inputs: `[B, H, W, T_in, D]`; activations: `[B, H, W, T_in]` or None.

    Returns:
        poses `[B, H', W', T_out, D]`; `route()` gives the `RoutingResult`
        with activations `[B, H', W', T_out]` and coefficients
        `[B, H', W', K*K*T_in, T_out]`.
    """

    def __init__(self, num_capsules, capsule_dim=16, kernel_size=3, strides=1, routing="em",
                 pose="matrix", kernel_initializer=None, chunk_size=None, **kwargs):
        super().__init__(num_capsules, capsule_dim, routing, pose, kernel_initializer, **kwargs)
        self.kernel_size, self.strides = check_integers(kernel_size=kernel_size, strides=strides)
        self.chunk_size = check_integer(chunk_size, "chunk_size", allow_none=True)

    def build(self, inputs_shape, activations_shape=None):
        input_shape = inputs_shape
        _check_capsule_map(input_shape, "ConvCapsules")
        num_in = self.kernel_size * self.kernel_size * input_shape[3]
        self._build_kernel(num_in, input_shape[4], num_in)

    def route(self, inputs, activations=None, training=None):
        if not self.built:
            self.build(tuple(inputs.shape))
        types = self.kernel.shape[0] // (self.kernel_size * self.kernel_size)
        check_capsule_inputs(self, inputs.shape, (None, None, None, types, input_pose_dim(self.kernel, self.pose)),
                             activations)
        patches = capsule_patches(inputs, self.kernel_size, self.strides)
        _, out_h, out_w, num_in, dim = patches.shape
        folded = ops.reshape(patches, (-1, num_in, dim))
        folded_act = None
        if activations is not None:
            folded_act = ops.reshape(
                capsule_patches(activations, self.kernel_size, self.strides), (-1, num_in))

        def route_folded(poses, act=None):
            return self.routing(capsule_votes(poses, self.voting_kernel(), self.pose), act,
                                training=training)

        inputs = [folded] + ([] if folded_act is None else [folded_act])
        if self.chunk_size is None or tf.executing_eagerly():
            result = route_folded(*inputs)
        else:
            # Chunks return the routing's dtype: float32, or float64 under a float64 policy.
            dtype = distribute.full_precision_dtype(folded)
            as_routed = lambda *chunk: tuple(ops.cast(t, dtype) for t in route_folded(*chunk))
            result = map_in_chunks(as_routed, inputs, self.chunk_size, [dtype] * 3)
        unfold = lambda t: ops.reshape(t, (-1, out_h, out_w, *t.shape[1:]))
        return RoutingResult(*(unfold(t) for t in result))

    def compute_output_shape(self, inputs_shape, activations_shape=None):
        input_shape = inputs_shape
        b, h, w = input_shape[:3]
        out = lambda n: (n - self.kernel_size) // self.strides + 1
        return (b, out(h), out(w), self.num_capsules, self.capsule_dim)

    def get_config(self):
        config = super().get_config()
        config.update(kernel_size=self.kernel_size, strides=self.strides,
                      chunk_size=self.chunk_size)
        return config


@keras.saving.register_keras_serializable(package="poecaps")
class ClassCapsules(_CapsuleMapLayer):
    """Class capsules over a whole capsule map, weights shared across positions.

    Every position's capsule of type t votes with the same `W_tj` (Hinton et
    al. 2018, section 3.2), so `I = H*W*T` lower capsules route to `J`
    classes. Coordinate addition adds the scaled (row, column) of each
    position's centre, `((r + 0.5)/H, (c + 0.5)/W)`, to the first two
    entries of the right-hand column of each matrix vote (for vector poses,
    to its first two entries).

    Args:
        num_capsules: J, the number of classes.
        capsule_dim: pose size (16 for 4x4 matrices).
        routing, pose, kernel_initializer, frobenius_votes: as `ConvCapsules`.
        coordinate_addition: whether to add the scaled coordinates.

    Call arguments:
        inputs: `[B, H, W, T, D]`; activations: `[B, H, W, T]` or None.

    Returns:
        poses `[B, J, D]`; `route()` gives the `RoutingResult`.
    """

    def __init__(self, num_capsules, capsule_dim=16, routing="em", pose="matrix",
                 coordinate_addition=True, kernel_initializer=None, **kwargs):
        super().__init__(num_capsules, capsule_dim, routing, pose, kernel_initializer, **kwargs)
        self.coordinate_addition = check_flag(coordinate_addition, "coordinate_addition")

    def build(self, inputs_shape, activations_shape=None):
        input_shape = inputs_shape
        _check_capsule_map(input_shape, "ClassCapsules")
        h, w, types, dim = input_shape[1:]
        self._build_kernel(types, dim, h * w * types)

    def _coordinates(self, h, w, types, dtype):
        """`[H*W*T, D]` in `dtype`: the scaled coordinates placed where coordinate addition adds them."""
        side = pose_size(self.capsule_dim, self.pose)
        rows = (ops.arange(h, dtype=dtype) + 0.5) / h
        cols = (ops.arange(w, dtype=dtype) + 0.5) / w
        grid_r = ops.repeat(ops.repeat(rows[:, None], w, axis=1)[..., None], types, axis=2)
        grid_c = ops.repeat(ops.repeat(cols[None, :], h, axis=0)[..., None], types, axis=2)
        first, second = (side - 1, 2 * side - 1) if self.pose == "matrix" else (0, 1)
        onehot = lambda k: ops.one_hot(k, self.capsule_dim, dtype=dtype)
        coords = (ops.reshape(grid_r, (-1, 1)) * onehot(first)[None]
                  + ops.reshape(grid_c, (-1, 1)) * onehot(second)[None])
        return coords

    def route(self, inputs, activations=None, training=None):
        if not self.built:
            self.build(tuple(inputs.shape))
        check_capsule_inputs(self, inputs.shape, (None, None, None, self.kernel.shape[0],
                                                     input_pose_dim(self.kernel, self.pose)),
                             activations)
        _, h, w, types, dim = inputs.shape
        flat = ops.reshape(inputs, (-1, h * w, types, dim))
        # [B, P, T, D] with W [T, J, ...]: every position votes with its type's matrices.
        votes = capsule_votes(ops.reshape(flat, (-1, types, dim)), self.voting_kernel(), self.pose)
        votes = ops.reshape(votes, (-1, h * w * types, self.num_capsules, self.capsule_dim))
        if self.coordinate_addition:
            coordinates = self._coordinates(h, w, types, distribute.full_precision_dtype(votes))
            votes = votes + ops.cast(coordinates, votes.dtype)[None, :, None]
        flat_act = None if activations is None else ops.reshape(activations, (-1, h * w * types))
        return self.routing(votes, flat_act, training=training)

    def compute_output_shape(self, inputs_shape, activations_shape=None):
        input_shape = inputs_shape
        return (input_shape[0], self.num_capsules, self.capsule_dim)

    def get_config(self):
        config = super().get_config()
        config.update(coordinate_addition=self.coordinate_addition)
        return config


@keras.saving.register_keras_serializable(package="poecaps")
class PrimaryMatrixCapsules(keras.layers.Layer):
    """Primary matrix capsules: a 1x1 convolution to T poses (P x P) and T activations.

    Hinton et al. 2018, section 4: from the ReLU conv layer's A channels,
    each position gets B capsule types, each a 4x4 pose matrix (linear) and
    a logistic activation.

    Args:
        num_capsules: T, capsule types per position.
        pose_side: P (4 for 4x4 poses).
        kernel_size: of the convolution (1 in the paper).

    Returns:
        `(poses [B, H, W, T, P*P], activations [B, H, W, T])`.
    """

    def __init__(self, num_capsules, pose_side=4, kernel_size=1, **kwargs):
        super().__init__(**kwargs)
        num_capsules, pose_side, kernel_size = check_integers(num_capsules=num_capsules, pose_side=pose_side,
                                                              kernel_size=kernel_size)
        self.num_capsules, self.pose_side, self.kernel_size = num_capsules, pose_side, kernel_size
        self.pose_conv = keras.layers.Conv2D(num_capsules * pose_side * pose_side, kernel_size,
                                             name="pose_conv", dtype=self.dtype_policy)
        self.activation_conv = keras.layers.Conv2D(num_capsules, kernel_size, activation="sigmoid",
                                                   name="activation_conv", dtype=self.dtype_policy)

    def _check_inputs(self, shape):
        """Refuse, by name, inputs that are not `[B, H, W, A]`, or (once built) of another `A`."""
        channels = self.pose_conv.kernel.shape[2] if self.built else None
        if len(shape) != 4 or not sizes_fit(shape[-1], channels):
            raise InputError(f"{self.name} takes feature maps [batch, height, width, channels"
                             f"{'' if channels is None else ' = ' + str(channels)}]. Received: shape={shape}")

    def build(self, input_shape):
        self._check_inputs(tuple(input_shape))
        self.pose_conv.build(input_shape)
        self.activation_conv.build(input_shape)

    def call(self, inputs):
        self._check_inputs(tuple(inputs.shape))
        poses = self.pose_conv(inputs)
        h, w = poses.shape[1], poses.shape[2]
        poses = ops.reshape(poses, (-1, h, w, self.num_capsules, self.pose_side ** 2))
        return poses, self.activation_conv(inputs)

    def compute_output_shape(self, input_shape):
        b, h, w, _ = input_shape
        h, w = h - self.kernel_size + 1, w - self.kernel_size + 1
        return (b, h, w, self.num_capsules, self.pose_side ** 2), (b, h, w, self.num_capsules)

    def get_config(self):
        config = super().get_config()
        config.update(num_capsules=self.num_capsules, pose_side=self.pose_side,
                      kernel_size=self.kernel_size)
        return config
