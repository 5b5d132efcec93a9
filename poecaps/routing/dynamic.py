"""Dynamic routing by agreement (Sabour et al. 2017; Hauser 2019, section 2.2)."""

import keras
import tensorflow as tf
from keras import ops

from poecaps import distribute
from poecaps.capsules import norm, ratio, squash
from poecaps.errors import InputError
from poecaps.routing.base import Routing, RoutingResult, check_activations
from poecaps.validation import check_choice, shape_fits

AGREEMENTS = ("dot", "cosine")
NORMALIZATIONS = ("parents", "children")


def _softmax(logits, axis):
    """Softmax written out, so that it needs no transpose along a leading axis (TF's does). The shift is
    `tf.reduce_max`, which takes an empty batch (`ops.max` refuses any empty tensor when run eagerly)."""
    e = ops.exp(logits - tf.reduce_max(logits, axis=axis, keepdims=True))
    return e / ops.sum(e, axis=axis, keepdims=True)


@keras.saving.register_keras_serializable(package="poecaps")
class DynamicRouting(Routing):
    """Routing by agreement with dot-product (Sabour) or cosine (Hauser) agreement.

    With votes `u_{j|i}` (`[B, I, J, D]`), logits start at `b_ij = 0`; each
    of `iterations` rounds computes

        c = softmax(b)                         (over parents j or children i)
        z_j = sum_i c_ij a_i u_{j|i}           (Hauser eq. 3)
        v_j = squash(z_j)                      (Hauser eq. 4)
        b_ij += agreement(u_{j|i}, v_j)        (dot: u.v;  cosine: u.v/|u||v|, exactly;
                                               0 where u or v is 0)

    except that the last round makes no update: its `c`, `z` and `v` are the
    result. So `iterations` counts rounds as Sabour's Procedure 1 counts its
    r (`iterations=3`: three softmax passes, two agreement updates), and
    `iterations=0` and `1` both give uniform coefficients (the "no routing"
    ablation).

    `normalize="parents"` makes each lower capsule spread one unit of vote
    over its parents (sum_j c_ij = 1, Sabour's procedure and Hauser's text);
    `normalize="children"` normalises over the lower capsules (sum_i c_ij = 1,
    as Hauser eq. 3 is written).

    Args:
        iterations: routing rounds (Sabour's r), >= 0.
        agreement: "dot" or "cosine".
        normalize: "parents" or "children".

    Call arguments:
        votes: `[B, I, J, D]`.
        activations: `[B, I]` or None (ones).

    Returns:
        `RoutingResult(poses [B, J, D], activations [B, J] = |poses|,
        coefficients [B, I, J])`.

    Example:
    >>> routing = DynamicRouting(iterations=3, agreement="cosine")
    >>> result = routing(keras.random.normal((2, 6, 3, 4)))
    >>> tuple(result.poses.shape)
    (2, 3, 4)

    `route_linear(x, W)` gives the same result for linear votes
    `u_{j|i} = W_ij x_i` without ever forming the `[B, I, J, D]` votes: every
    contraction becomes one matmul per upper capsule.
    """

    def __init__(self, iterations=3, agreement="dot", normalize="parents", **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        check_choice(agreement, "agreement", AGREEMENTS)
        check_choice(normalize, "normalize", NORMALIZATIONS)
        self.agreement = agreement
        self.normalize = normalize

    @property
    def normalizes(self):
        return self.normalize

    def _loop(self, logits, softmax_axis, weighted_sum, dot_with_votes, vote_norms, v_norm,
              uniform_sum=None):
        """The routing loop, written once for both vote layouts; returns (c, z).

        `uniform_sum()`, where given, is `weighted_sum` of the first round's
        uniform coefficients (the logits start at 0), computed without them.
        """
        softmax = lambda b: _softmax(b, softmax_axis)
        updates = max(self.iterations - 1, 0)
        norms = vote_norms() if self.agreement == "cosine" and updates else None
        for t in range(updates):
            z = uniform_sum() if t == 0 and uniform_sum else weighted_sum(softmax(logits))
            v = squash(z)
            agreement = dot_with_votes(v)
            if norms is not None:
                # exact: cosine is the same at every length (an epsilon under the root would damp
                # it where |v| is small, as squash makes it early in training); 0 at a zero vote
                agreement = ratio(agreement, norms * v_norm(v))
            logits = logits + agreement
        c = softmax(logits)
        return c, weighted_sum(c)

    @staticmethod
    def _result(c, z):
        poses = squash(z)
        return RoutingResult(poses, norm(poses), c)

    def call(self, votes, activations=None, training=None):
        dtype = distribute.full_precision_dtype(votes)
        votes = ops.cast(votes, dtype)
        weight = 1.0 if activations is None else ops.cast(activations, dtype)[:, :, None]
        c, z = self._loop(
            ops.zeros(ops.shape(votes)[:3], dtype=dtype),
            2 if self.normalize == "parents" else 1,
            # [B, I, J] x [B, I, J, D] -> [B, J, D]
            lambda c: ops.einsum("bij,bijd->bjd", c * weight, votes),
            # [B, I, J, D] x [B, J, D] -> [B, I, J]
            lambda v: ops.einsum("bijd,bjd->bij", votes, v),
            lambda: norm(votes),
            lambda v: norm(v)[:, None, :],
        )
        return self._result(c, z)

    def uniform_coefficient(self, num_in, num_out):
        """The first round's coefficients, all equal: 1/J over parents or 1/I over children."""
        return 1.0 / (num_out if self.normalize == "parents" else num_in)

    def route_linear_j(self, x, kernel, activations=None):
        """`route_linear` in the upper-capsule-major layout: `(cj [J, B, I], zj [J, B, D_out])`.

        `zj` is the pre-activation of the final poses (eq. 3), which the CD
        trainer reuses. Shapes as `route_linear`'s, checked: an `InputError`
        otherwise, where activations `[B, 1]` or `[1, I]` were broadcast and
        capsules of one example `[I, D_in]` were read as a batch.
        """
        from poecaps import energy

        x, kernel = ops.convert_to_tensor(x), ops.convert_to_tensor(kernel)
        if len(kernel.shape) != 4 or not shape_fits(tuple(x.shape), (None, kernel.shape[0], kernel.shape[3])):
            raise InputError(f"{type(self).__name__}: route_linear takes lower capsules x [B, I, D_in] and a kernel "
                             f"[I, J, D_out, D_in] of the same I and D_in. Received: x of shape {list(x.shape)}, "
                             f"kernel of shape {list(kernel.shape)}")
        if activations is not None:
            activations = ops.convert_to_tensor(activations)
            check_activations(self, (x.shape[0], *kernel.shape[:3]), tuple(activations.shape))
        dtype = distribute.full_precision_dtype(x)
        x, kernel = ops.cast(x, dtype), ops.cast(kernel, dtype)
        weight = 1.0 if activations is None else ops.cast(activations, dtype)[None]
        wr, wt = energy.kernel_views(kernel)
        num_in, num_out = kernel.shape[:2]
        uniform = self.uniform_coefficient(num_in, num_out)
        return self._loop(
            ops.zeros((num_out, ops.shape(x)[0], num_in), dtype=dtype),
            0 if self.normalize == "parents" else 2,
            lambda cj: energy.routed_sum_j(x, wr, cj * weight),
            lambda vj: energy.vote_agreement_j(vj, wt, x),
            lambda: energy.vote_norms_j(x, kernel),
            lambda vj: norm(vj)[:, :, None],
            uniform_sum=lambda: energy.uniform_sum_j(
                x if activations is None else x * ops.cast(activations, dtype)[:, :, None],
                kernel, uniform),
        )

    def route_linear(self, x, kernel, activations=None):
        """Route linear votes `u_{j|i} = W_ij x_i` without materialising them.

        Args:
            x: `[B, I, D_in]` lower capsules.
            kernel: `[I, J, D_out, D_in]` transformation matrices W.
            activations: `[B, I]` or None.
        """
        from poecaps import energy

        cj, zj = self.route_linear_j(x, kernel, activations)
        return self._result(energy.from_j_major(cj), ops.transpose(zj, (1, 0, 2)))

    def get_config(self):
        config = super().get_config()
        config.update(agreement=self.agreement, normalize=self.normalize)
        return config
