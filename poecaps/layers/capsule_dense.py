"""Fully connected capsule layer: votes by one einsum, routing delegated."""

import keras
from keras import ops

from poecaps import routing as routing_lib
from poecaps.constraints import IsometricPoses
from poecaps.errors import InputError
from poecaps.validation import check_choice, check_flag, check_integers, check_setting, shape_fits

POSES = ("vector", "matrix")


def pose_size(capsule_dim, pose):
    """Side P of a matrix pose (`capsule_dim = P * P`); checks the pose kind."""
    check_choice(pose, "pose", POSES)
    side = round(capsule_dim ** 0.5)
    if pose == "matrix" and side * side != capsule_dim:
        raise InputError(
            f"matrix poses need a square capsule_dim (16 for 4x4). Received: capsule_dim={capsule_dim}")
    return side


def kernel_shape(num_in, num_out, out_dim, in_dim, pose):
    """Shape of the transformation matrices: `[I, J, D_out, D_in]` or `[I, J, P, P]`."""
    if pose == "matrix":
        if in_dim != out_dim:
            raise InputError(
                f"matrix capsules keep their pose size; input capsules have {in_dim} dimensions. "
                f"Received: capsule_dim={out_dim}")
        side = pose_size(in_dim, pose)
        return (num_in, num_out, side, side)
    return (num_in, num_out, out_dim, in_dim)


def check_capsule_inputs(layer, inputs_shape, expected, activations=None, what="inputs"):
    """Raise `InputError` unless a built capsule layer's inputs fit its kernel.

    `expected` is the inputs' shape the kernel was built for, None where any
    size fits (the batch; a map's height and width); the activations, when
    given, must be the inputs' shape without the pose axis (`[B, I]` for
    `[B, I, D]`, `[B, H, W, T]` for `[B, H, W, T, D]`). Sizes unknown while
    tracing (None) fit any; `what` names the capsules in the message.
    Without this check a kernel of another size fails inside TensorFlow's
    einsum, and activations of a transposed map (`[B, W, H, T]` for
    `H != W`) are reshaped into place without a word.
    """
    inputs_shape = tuple(inputs_shape)
    if not shape_fits(inputs_shape, expected):
        raise InputError(f"{layer.name} was built for {what} of shape {list(expected)} (None: any size). "
                         f"Received: {what} of shape {list(inputs_shape)}")
    if activations is None:
        return
    activations_shape = tuple(activations.shape)
    if not shape_fits(activations_shape, inputs_shape[:-1]):
        raise InputError(f"{layer.name}: activations must have the inputs' shape without the pose axis, "
                         f"{list(inputs_shape[:-1])}. Received: activations of shape {list(activations_shape)}")


def frobenius_normalized(kernel, epsilon=1e-7):
    """Each transformation matrix over its Frobenius norm: `W_ij / sqrt(|W_ij|_F^2 + epsilon)` (last two axes).

    `epsilon` (> 0) keeps a zero matrix zero, where 0/0 would be NaN.
    """
    check_setting(epsilon, "epsilon", above=0)
    return kernel / ops.sqrt(ops.sum(ops.square(kernel), axis=(-2, -1), keepdims=True) + epsilon)


def input_pose_dim(kernel, pose):
    """D_in, the pose size of the capsules a kernel reads: `W`'s last axis, squared for matrix poses."""
    return kernel.shape[-1] ** (2 if pose == "matrix" else 1)


def capsule_votes(inputs, kernel, pose="vector"):
    """Votes `u_{j|i}` of lower capsules `[B, I, D_in]` for `J` parents: `[B, I, J, D_out]`.

    Vector poses (Sabour eq. 2): `u_{j|i} = W_ij x_i`. Matrix poses (Hinton
    et al. 2018): `V_ij = M_i W_ij` with 4x4 (P x P) matrices, flattened.
    `pose` is one of `POSES` and the inputs fit the kernel (`[B, I, D_in]`
    for `[I, J, D_out, D_in]`, `[B, I, P * P]` for `[I, J, P, P]`), else an
    `InputError`: any other pose name was read as "matrix", and other
    sizes failed inside TensorFlow's einsum.
    """
    check_choice(pose, "pose", POSES)
    inputs, kernel = ops.convert_to_tensor(inputs), ops.convert_to_tensor(kernel)
    expected = (None, kernel.shape[0], input_pose_dim(kernel, pose)) if len(kernel.shape) == 4 else None
    if expected is None or not shape_fits(tuple(inputs.shape), expected):
        raise InputError(f"capsule_votes of {pose} poses takes inputs [B, I, D_in] that fit the kernel "
                         f"{list(kernel.shape)}. Received: inputs of shape {list(inputs.shape)}")
    if pose == "vector":
        # [B, I, D_in] x [I, J, D_out, D_in] -> [B, I, J, D_out]
        return ops.einsum("bie,ijoe->bijo", inputs, kernel)
    side = kernel.shape[-1]
    matrices = ops.reshape(inputs, (-1, inputs.shape[1], side, side))
    # [B, I, P, P] x [I, J, P, P] -> [B, I, J, P, P]
    votes = ops.einsum("bipq,ijqr->bijpr", matrices, kernel)
    return ops.reshape(votes, (-1, inputs.shape[1], kernel.shape[1], side * side))


@keras.saving.register_keras_serializable(package="poecaps")
class CapsuleDense(keras.layers.Layer):
    """Maps `I` capsules of `D_in` dimensions to `J` capsules of `D_out` dimensions.

    Votes are `u_{j|i} = W_ij x_i` (Sabour eq. 2, Hauser eq. 3) with
    `W [I, J, D_out, D_in]`; a routing procedure (any object behind
    `poecaps.routing`'s interface) turns them into upper capsules. For
    routings that offer `route_linear` and at most as many upper capsules as
    lower ones the votes are never materialised (`route_linear` loops over
    the J upper capsules); with more upper capsules than lower ones (the
    capsule decoder: 20 -> 576) one einsum forms the votes, which is
    faster there. Both give the same result to rounding.

    Args:
        num_capsules: J, number of upper capsules (> 0).
        capsule_dim: D_out, dimension of each upper capsule (> 0).
        routing: routing name, config dict or `Routing` instance.
        kernel_initializer: initializer of W; Hauser uses N(0, 0.01) (the
            default for vector poses; N(0, 0.5) for matrix poses).
        kernel_regularizer: optional regularizer of W.
        kernel_constraint: optional constraint on W, applied after each
            optimizer update (e.g. `poecaps.constraints.IsometricPoses`).
        pose: "vector" (`W_ij` is D_out x D_in) or "matrix" (4x4 pose
            matrices flattened to 16-D, `V_ij = M_i W_ij`, Hinton et al.).
        frobenius_votes: vote with `W_ij / |W_ij|_F` (Faria eq. 1), so a
            vote is never longer than its child's pose.

    Call arguments:
        inputs: `[B, I, D_in]` lower capsules.
        activations: `[B, I]` or None.

    Returns:
        `[B, J, D_out]` upper capsule poses; `route()` returns the whole
        `RoutingResult`.

    Example:
    >>> layer = CapsuleDense(10, 16, routing="dynamic")
    >>> tuple(layer(keras.random.normal((2, 32, 8))).shape)
    (2, 10, 16)
    """

    def __init__(self, num_capsules, capsule_dim, routing="dynamic",
                 kernel_initializer=None, kernel_regularizer=None, pose="vector", kernel_constraint=None,
                 frobenius_votes=False, **kwargs):
        super().__init__(**kwargs)
        self.num_capsules, self.capsule_dim = check_integers(num_capsules=num_capsules, capsule_dim=capsule_dim)
        pose_size(self.capsule_dim, pose)
        self.pose = pose
        self.routing = routing_lib.get(routing, dtype=self.dtype_policy)
        self.kernel_initializer = keras.initializers.get(
            kernel_initializer
            or keras.initializers.RandomNormal(stddev=0.01 if pose == "vector" else 0.5))
        self.kernel_regularizer = keras.regularizers.get(kernel_regularizer)
        self.kernel_constraint = keras.constraints.get(kernel_constraint)
        self.frobenius_votes = check_flag(frobenius_votes, "frobenius_votes")
        if pose == "matrix" and isinstance(self.kernel_constraint, IsometricPoses):
            raise InputError("IsometricPoses constrains vector-pose maps [I, J, D_out, D_in]. "
                             "Received: pose='matrix'")

    def build(self, input_shape):
        if len(input_shape) != 3:
            raise InputError(
                f"CapsuleDense expects inputs of shape [batch, num_in, in_dim]. "
                f"Received: input_shape={input_shape}")
        _, num_in, in_dim = input_shape
        shape = kernel_shape(num_in, self.num_capsules, self.capsule_dim, in_dim, self.pose)
        if isinstance(self.kernel_constraint, IsometricPoses):
            self.kernel_constraint.check_kernel_shape(shape)   # at build, not at the first update
        self.kernel = self.add_weight(
            name="kernel", shape=shape,
            initializer=self.kernel_initializer, regularizer=self.kernel_regularizer,
            constraint=self.kernel_constraint)
        # The routing's own weights (EM's beta_u, beta_a) exist before any call.
        if not self.routing.built:
            self.routing.build((None, num_in, self.num_capsules, self.capsule_dim))

    def voting_kernel(self):
        """The matrices the votes use: `W`, or `W_ij / |W_ij|_F` with `frobenius_votes`."""
        return frobenius_normalized(self.kernel) if self.frobenius_votes else self.kernel

    def _check_inputs(self, inputs, activations=None):
        """Build for the first inputs given; refuse inputs (and activations) that do not fit the kernel."""
        if not self.built:
            self.build(tuple(inputs.shape))
        check_capsule_inputs(self, inputs.shape, (None, self.kernel.shape[0], input_pose_dim(self.kernel, self.pose)),
                             activations)

    def votes(self, inputs):
        """The votes `u_hat [B, I, J, D_out]` (`capsule_votes`) of `inputs [B, I, D_in]`."""
        self._check_inputs(inputs)
        return capsule_votes(inputs, self.voting_kernel(), self.pose)

    def route(self, inputs, activations=None, training=None):
        """The whole `RoutingResult` (poses, activations, coefficients)."""
        self._check_inputs(inputs, activations)
        if (self.pose == "vector" and hasattr(self.routing, "route_linear")
                and self.num_capsules <= self.kernel.shape[0]):
            return self.routing.route_linear(inputs, self.voting_kernel(), activations)
        return self.routing(capsule_votes(inputs, self.voting_kernel(), self.pose), activations, training=training)

    def call(self, inputs, activations=None, training=None):
        return self.route(inputs, activations, training).poses

    def compute_output_shape(self, input_shape):
        return (input_shape[0], self.num_capsules, self.capsule_dim)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_capsules=self.num_capsules,
            capsule_dim=self.capsule_dim,
            routing=keras.saving.serialize_keras_object(self.routing),
            kernel_initializer=keras.initializers.serialize(self.kernel_initializer),
            kernel_regularizer=keras.regularizers.serialize(self.kernel_regularizer),
            pose=self.pose,
            kernel_constraint=keras.constraints.serialize(self.kernel_constraint),
            frobenius_votes=self.frobenius_votes,
        )
        return config
