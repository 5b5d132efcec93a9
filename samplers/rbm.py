"""Per-unit samples from a Bernoulli RBM, the counterpart of the capsule grid."""

import numpy as np
from keras import ops

from poecaps.errors import InputError
from poecaps.rbm import BernoulliRBM
from poecaps.validation import check_image_shape, check_integer, check_seed


class RBMSampler:
    """One column per hidden unit: turn unit j on, the others off, and sample.

    For each unit j and row: `v ~ Bernoulli(P(v | h = e_j))`, then one Gibbs
    step with `h_j` clamped on gives `P(v | h)`, the image. This mirrors the
    capsule grid (one hidden cause at a time) for the RBM baseline.

    Args:
        rbm: a trained `poecaps.rbm.BernoulliRBM`.
        image_shape: `(H, W, C)` of the visible units (`H W C = V`).
        seed: seed of the draws.

    Returns (from `sample(rows)`):
        dict with `images [rows, num_hidden, H, W, C]`, the visible probabilities.
    """

    def __init__(self, rbm, image_shape, seed=0):
        if not isinstance(rbm, BernoulliRBM):
            raise InputError(f"rbm must be a poecaps.rbm.BernoulliRBM. Received: {type(rbm).__name__}")
        self.rbm = rbm
        self.image_shape = check_image_shape(image_shape)
        self.seed = check_seed(seed)

    def sample(self, rows=4):
        rows = check_integer(rows, "rows")
        rng = np.random.default_rng(self.seed)
        units = self.rbm.num_hidden
        one_hot = np.eye(units, dtype="float32")
        p_v = ops.convert_to_numpy(self.rbm.visible_probabilities(one_hot))
        if int(np.prod(self.image_shape)) != p_v.shape[-1]:
            raise InputError(f"image_shape {self.image_shape} must hold the RBM's {p_v.shape[-1]} visible units. "
                             f"Received: image_shape={self.image_shape}")
        v = (rng.random((rows, units, p_v.shape[-1])) < p_v[None]).astype("float32")
        v = v.reshape(rows * units, -1)
        p_h = ops.convert_to_numpy(self.rbm.p_on(v))
        h = (rng.random(p_h.shape) < p_h).astype("float32")
        h[np.arange(rows * units), np.tile(np.arange(units), rows)] = 1.0
        images = ops.convert_to_numpy(self.rbm.visible_probabilities(h))
        return {"images": images.reshape(rows, units, *self.image_shape)}
