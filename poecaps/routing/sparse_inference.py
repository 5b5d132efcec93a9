"""Sparse iterative inference in place of routing (Kiefer, Millidge et al., section 3.1, appendix C)."""

import keras
from keras import ops

from poecaps import distribute
from poecaps.capsules import norm, squash
from poecaps.errors import InputError
from poecaps.inference import descend
from poecaps.routing.base import Routing, RoutingResult, check_activations
from poecaps.validation import check_choice, check_number, shape_fits

NORMALIZATIONS = ("parents", "children")


@keras.saving.register_keras_serializable(package="poecaps")
class SparseInferenceRouting(Routing):
    """Parents as free states, moved by gradient descent on an energy, instead of routing by agreement.

    The parents start at the feed-forward prediction with the fixed uniform
    coefficients c0 (1/J over parents, as a CapsNet trained without routing,
    or 1/I over children),

        p_j = squash(sum_i c0_ij a_i u_{j|i}),

    and descend (`poecaps.inference.descend`) for `iterations` steps of size
    `learning_rate` on

        E(v) = sum_j |v_j - p_j|^2 + l1 sum_j |v_j|  (+ kappa sum_j (|v_j| - y_j)^2 with targets)

    the L1 term by its proximal step. The minimiser has a closed form: v_j
    points along p_j with length `max(0, (|p_j| + kappa y_j - l1 / 2) / (1 + kappa))`
    (without targets, |p_j| shrunk by l1 / 2); 500 steps at 0.01 reach it to
    float precision. With `training=True` the call returns the feed-forward
    prediction (no inference), so a network with this router trains as the
    uniform-routing network and infers at test time.

    The coefficients returned are the fixed uniform c0: inference moves the
    parents, not the coefficients, so they carry no routing decision; they
    are what the feed-forward prediction used.

    Args:
        iterations: gradient steps (500).
        learning_rate: step size (0.01).
        l1: weight lambda of the L1 penalty on the parents' lengths (1.0).
        normalize: the axis c0 sums to 1 over, "parents" or "children".

    Call arguments:
        votes: `[B, I, J, D]`; activations: `[B, I]` or None (ones).

    Returns:
        `RoutingResult(poses = v [B, J, D], activations = |v| [B, J],
        coefficients = c0 [B, I, J])`.
    """

    def __init__(self, iterations=500, learning_rate=0.01, l1=1.0, normalize="parents", **kwargs):
        super().__init__(iterations=iterations, **kwargs)
        self.learning_rate = check_number(learning_rate, "learning_rate", above=0)
        self.l1 = check_number(l1, "l1", minimum=0)
        check_choice(normalize, "normalize", NORMALIZATIONS)
        self.normalize = normalize

    @property
    def normalizes(self):
        return self.normalize

    def prediction(self, votes, activations=None):
        """`(p [B, J, D], c0 [B, I, J])`: the feed-forward parents with uniform coefficients.

        Called directly (as `infer` does), not through the layer, it checks what Keras' input spec would: votes of
        rank 4, arrays or tensors alike.
        """
        votes = ops.convert_to_tensor(votes)
        if len(votes.shape) != 4:
            raise InputError(f"{type(self).__name__}: votes must be [B, I, J, D]. Received: votes of shape "
                             f"{list(votes.shape)}")
        if activations is not None:
            activations = ops.convert_to_tensor(activations)
            check_activations(self, votes.shape, activations.shape)
        votes = ops.cast(votes, distribute.full_precision_dtype(votes))
        num_in, num_out = votes.shape[1], votes.shape[2]
        c0 = 1.0 / (num_out if self.normalize == "parents" else num_in)
        weighted = votes if activations is None else votes * ops.cast(activations, votes.dtype)[:, :, None, None]
        return squash(c0 * ops.sum(weighted, axis=1)), ops.full(ops.shape(votes)[:3], c0, dtype=votes.dtype)

    def infer(self, votes, activations=None, targets=None, label_weight=1.0):
        """`(v [B, J, D], energies [iterations + 1, B])`; `targets` `[B, J]` (e.g. one-hot) clamp the lengths
        with the weight `label_weight` (>= 0)."""
        votes = ops.convert_to_tensor(votes)
        if targets is not None:
            label_weight = check_number(label_weight, "label_weight", minimum=0)
            targets = ops.convert_to_tensor(targets)
            shape, expected = tuple(targets.shape), tuple(votes.shape[:1]) + tuple(votes.shape[2:3])
            if not shape_fits(shape, expected):
                raise InputError(f"targets must be [B, J] = {list(expected)}, one length per parent. Received: "
                                 f"targets of shape {list(shape)}")
        p, _ = self.prediction(votes, activations)

        def energy(states):
            v = states[0]
            e = ops.sum(ops.square(v - p), axis=(1, 2))
            if targets is not None:
                length = ops.sqrt(ops.sum(ops.square(v), axis=-1) + 1e-12)
                e = e + label_weight * ops.sum(ops.square(length - ops.cast(targets, v.dtype)), axis=-1)
            return e

        (v,), trace = descend(energy, [p], self.iterations, self.learning_rate, [self.l1])
        return v, trace

    def call(self, votes, activations=None, training=None):
        p, c0 = self.prediction(votes, activations)
        v = p if training else self.infer(votes, activations)[0]
        return RoutingResult(v, norm(v), c0)

    def get_config(self):
        config = super().get_config()
        config.update(learning_rate=self.learning_rate, l1=self.l1, normalize=self.normalize)
        return config

