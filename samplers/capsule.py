"""Sampling images from capsule space (Hauser section 4.2, Figure 2)."""

import numpy as np
from keras import ops

from poecaps.capsules import squash
from poecaps.runs import batched

# How the restricted domain picks each capsule's half: the pipeline array it reads.
HALVES = {"mean": "mean_directions", "winning": "winning_axes"}


class CapsuleSampler:
    """Draws the Figure 2 grid: one column per upper capsule, `rows` draws each.

    For upper capsule j and each row: `y ~ N(0, I_D)`, all other capsules 0;
    `squash(y)`; route down with the capsule decoder U to the lower
    capsules; unsquash, reshape to the conv code and decode to an image
    (`CapsulePipeline.decode_upper`). With `restricted=True` each draw is
    flipped into the half of the sphere that training data visited:
    `y . m_j >= 0` for the mean training direction `m_j` (`half="mean"`, the
    design's reading), or `y . a_j >= 0` for the capsule's principal axis
    signed toward the side most of its winning training poses lie on
    (`half="winning"`, `poecaps.metrics.winning_side_axes`; for poses on a
    line through the origin, on both sides, `m_j` picks a half close to a
    coin toss).

    With `moments` (each capsule's pose second moment `M_j = E[z_j z_j^T]`
    on training data, `poecaps.metrics.pose_second_moments`) the draws are
    `y ~ N(0, M_j)` instead, the "fitted" domain. This is not the paper's
    sampler: it asks whether one capsule alone, drawn from where its own
    training poses lie, decodes to a specific object, when the capsule uses
    only a few of its D directions and isotropic draws mostly miss them.
    `poecaps.metrics.longest_pose_second_moments` gives the moments on the
    images where capsule j is the longest, the poses it takes when it, more
    than any other capsule, claims the image.

    Args:
        pipeline: a trained `poecaps.runs.CapsulePipeline`.
        seed: seed of the draws.

    Returns (from `sample`):
        dict with `images [rows, J, H, W, C]` in [0, 1] and `draws [rows, J, D]`.
    """

    def __init__(self, pipeline, seed=0):
        self.pipeline = pipeline
        self.seed = seed

    def sample(self, rows=4, restricted=False, moments=None, half="mean", batch_size=64):
        if rows < 1:
            raise ValueError(f"rows must be >= 1. Received: rows={rows}")
        if half not in HALVES:
            raise ValueError(f"half must be one of {sorted(HALVES)}. Received: half={half!r}")
        num_caps, dim = self.pipeline.num_upper, self.pipeline.upper_dim
        draws = np.random.default_rng(self.seed).standard_normal((rows, num_caps, dim))
        if moments is not None:
            draws = np.einsum("rjd,jed->rje", draws, _square_roots(moments, num_caps, dim))
        draws = draws.astype("float32")
        if restricted:
            directions = getattr(self.pipeline, HALVES[half])
            if directions is None:
                raise ValueError(f"Restricted sampling with half={half!r} needs models/{HALVES[half]}.npy; "
                                 "train the decoder stage again or run scripts/evaluate.py, which stores it.")
            sign = np.where(np.sum(draws * directions[None], axis=-1, keepdims=True) < 0, -1.0, 1.0)
            draws = draws * sign.astype("float32")
        upper = np.zeros((rows, num_caps, num_caps, dim), dtype="float32")
        for j in range(num_caps):
            upper[:, j, j] = draws[:, j]
        upper = ops.convert_to_numpy(squash(upper.reshape(rows * num_caps, num_caps, dim)))
        images = batched(self.pipeline.decode_upper, upper, batch_size)
        return {"images": images.reshape(rows, num_caps, *images.shape[1:]), "draws": draws}


def _square_roots(moments, num_caps, dim):
    """Symmetric square roots `S_j` with `S_j S_j^T = M_j`, `[J, D, D]`."""
    moments = np.asarray(moments, "float64")
    if moments.shape != (num_caps, dim, dim):
        raise ValueError(f"moments must be [J, D, D] = {(num_caps, dim, dim)}. Received shape {moments.shape}")
    if not np.allclose(moments, np.swapaxes(moments, 1, 2), rtol=1e-5, atol=1e-8):
        raise ValueError("moments must be symmetric (second moments of the capsule poses).")
    eigenvalues, vectors = np.linalg.eigh(moments)
    if np.any(eigenvalues < -1e-6 * np.abs(eigenvalues).max(axis=-1, keepdims=True)):
        raise ValueError("moments must be positive semi-definite (second moments of the capsule poses).")
    return np.einsum("jde,je,jfe->jdf", vectors, np.sqrt(np.maximum(eigenvalues, 0.0)), vectors)
