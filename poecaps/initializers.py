"""Initializers of capsule transformation matrices."""

import keras
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_number, check_seed


@keras.saving.register_keras_serializable(package="poecaps")
class NearIdentity(keras.initializers.Initializer):
    """Identity matrices in the last two axes plus uniform noise: `W = I + U(-noise, noise)`.

    For transformation matrices `[..., D_out, D_in]` (rectangular ones get
    ones on the main diagonal). Faria's learned-routing network starts its
    4x4 pose maps this way, so every vote starts near its child's pose.

    Args:
        noise: half-width of the uniform noise (0.1).
        seed: seed of the noise.
    """

    def __init__(self, noise=0.1, seed=None):
        self.noise = check_number(noise, "noise", minimum=0)
        self.seed = check_seed(seed, allow_none=True)

    def __call__(self, shape, dtype=None):
        if len(shape) < 2:
            raise InputError(f"NearIdentity needs matrices (at least 2 axes). Received: shape={shape}")
        eye = ops.eye(shape[-2], shape[-1], dtype=dtype)
        noise = keras.random.uniform(shape, -self.noise, self.noise, dtype=dtype, seed=self.seed)
        return eye + noise

    def get_config(self):
        return {"noise": self.noise, "seed": self.seed}
