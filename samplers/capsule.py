"""Sampling images from capsule space (Hauser section 4.2, Figure 2)."""

import numpy as np
from keras import ops

from poecaps.capsules import squash
from poecaps.errors import InputError
from poecaps.models.capsule_pipeline import CapsulePipeline
from poecaps.validation import check_choice, check_integer, check_seed

# Each domain's half of capsule space: the pipeline array that picks it (None: the whole space).
DOMAINS = {"full": None, "restricted": "mean_directions", "winning": "winning_axes"}


class CapsuleSampler:
    """Draws the Figure 2 grid: one column per upper capsule, `rows` draws each.

    For upper capsule j and each row: `y ~ N(0, I_D)`, all other capsules 0;
    `squash(y)`; route down with the capsule decoder U to the lower
    capsules; unsquash, reshape to the conv code and decode to an image
    (`CapsulePipeline.decode`). The domain says which half of each
    capsule's space the draws keep, by flipping `y` to `-y` where needed:

    - `"full"`: all of it (the paper's complete domain, Figure 2a and c);
    - `"restricted"`: `y . m_j >= 0` for the mean training direction `m_j`,
      the design's reading of "the half of S^15 that is visited during
      training" (Figure 2b and d);
    - `"winning"`: `y . a_j >= 0` for the capsule's principal axis signed
      toward the side most of its winning training poses lie on
      (`poecaps.metrics.winning_side_axes`). For poses on a line through
      the origin, on both sides, `m_j` picks a half close to a coin toss.

    Args:
        pipeline: a trained `poecaps.models.CapsulePipeline`.
        seed: seed of the draws.

    Returns (from `sample`):
        dict with `images [rows, J, H, W, C]` in [0, 1] and `draws [rows, J, D]`.
    """

    def __init__(self, pipeline, seed=0):
        if not isinstance(pipeline, CapsulePipeline):
            raise InputError(f"pipeline must be a poecaps.models.CapsulePipeline. Received: {type(pipeline).__name__}")
        self.pipeline = pipeline
        self.seed = check_seed(seed)

    def sample(self, rows=4, domain="full", batch_size=64):
        rows = check_integer(rows, "rows")
        check_choice(domain, "domain", DOMAINS)
        num_caps, dim = self.pipeline.num_upper, self.pipeline.upper_dim
        draws = np.random.default_rng(self.seed).standard_normal((rows, num_caps, dim)).astype("float32")
        if DOMAINS[domain] is not None:
            directions = getattr(self.pipeline, DOMAINS[domain])
            if directions is None:
                raise InputError(f"The {domain} domain needs models/{DOMAINS[domain]}.npy, which the "
                                 "decoder stage writes; train the decoder stage again.")
            sign = np.where(np.sum(draws * directions[None], axis=-1, keepdims=True) < 0, -1.0, 1.0)
            draws = draws * sign.astype("float32")
        upper = np.zeros((rows, num_caps, num_caps, dim), dtype="float32")
        for j in range(num_caps):
            upper[:, j, j] = draws[:, j]
        upper = ops.convert_to_numpy(squash(upper.reshape(rows * num_caps, num_caps, dim)))
        images = self.pipeline.decode(upper, batch_size)
        return {"images": images.reshape(rows, num_caps, *images.shape[1:]), "draws": draws}
