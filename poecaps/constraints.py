"""Constraints on capsule transformation matrices."""

import keras
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_number


@keras.saving.register_keras_serializable(package="poecaps")
class IsometricPoses(keras.constraints.Constraint):
    """Gives each upper capsule's linear map all its singular values equal.

    For `W [I, J, D_out, D_in]` the pose of upper capsule j at uniform
    coefficients is `z_j = c sum_i W_ij x_i = c M_j x`, with
    `M_j = [W_1j ... W_Ij]` of shape `[D_out, I * D_in]` and `x` all lower
    capsules stacked. The constraint replaces it by

        M_j <- a_j (M_j M_j^T)^(-1/2) M_j,    a_j^2 = trace(M_j M_j^T) / D_out,

    the nearest map (the polar factor) whose `D_out` singular values all
    equal their root mean square `a_j`; `||M_j||_F` is unchanged.

    Why (not in Hauser 2019): `F(x)` (eq. 10) depends on `W_j` only through
    `M_j^T M_j`, and eq. 18's Hebbian positive phase `z_j x^T` grows the
    leading singular direction fastest, as in Oja's rule, so unconstrained
    poses end up near one line through the origin and one capsule carries
    one number, not 16. With equal
    singular values, CD still chooses which `D_out`-dimensional subspace of
    the lower code capsule j reads (its row space), but cannot let one
    direction of it outgrow the others.

    Every `D_out` singular value can be equal only if `M_j` has as many:
    kernels with `I * D_in < D_out` are refused (the inverse square root
    would blow rounding noise in `M_j M_j^T`'s null space up into the map).

    Applied by the optimizer after every update (Keras applies variable
    constraints in `optimizer.apply`). Vector poses only (`CapsuleDense`
    refuses it with `pose="matrix"`).

    Args:
        epsilon: floor on the eigenvalues of `M_j M_j^T` before the inverse
            square root.
    """

    def __init__(self, epsilon=1e-12):
        self.epsilon = check_number(epsilon, "epsilon", above=0)

    @staticmethod
    def check_kernel_shape(shape):
        """Raise `InputError` unless `shape` is a kernel `[I, J, D_out, D_in]` with `I * D_in >= D_out`."""
        shape = tuple(shape)
        if len(shape) != 4:
            raise InputError(f"IsometricPoses needs a kernel [I, J, D_out, D_in]. Received shape {shape}")
        num_in, _, out_dim, in_dim = shape
        if num_in * in_dim < out_dim:
            raise InputError(f"IsometricPoses gives each map M_j [D_out, I * D_in] D_out equal singular values, "
                             f"so it needs I * D_in >= D_out. Received a kernel of shape {shape}: "
                             f"I * D_in = {num_in * in_dim} < D_out = {out_dim}")

    def __call__(self, kernel):
        self.check_kernel_shape(kernel.shape)
        kernel = ops.convert_to_tensor(kernel)
        gram = ops.einsum("ijod,ijpd->jop", kernel, kernel)                   # M_j M_j^T
        eigenvalues, vectors = ops.eigh(gram)
        scale = ops.sqrt(ops.trace(gram, axis1=1, axis2=2) / kernel.shape[2])  # a_j
        weights = scale[:, None] / ops.sqrt(ops.maximum(eigenvalues, self.epsilon))
        polar = ops.einsum("jop,jp,jqp->joq", vectors, weights, vectors)       # a_j (M_j M_j^T)^(-1/2)
        # [J, D_out, D_out] x [I, J, D_out, D_in] -> [I, J, D_out, D_in]
        return ops.einsum("joq,ijqd->ijod", polar, kernel)

    def get_config(self):
        return {"epsilon": self.epsilon}
