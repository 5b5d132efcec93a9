"""Primary capsules: a conv code reshaped into squashed capsules."""

import keras

from poecaps.capsules import check_code_shape, primary_capsules, squash
from poecaps.validation import check_flag, check_integer


@keras.saving.register_keras_serializable(package="poecaps")
class PrimaryCapsules(keras.layers.Layer):
    """Reshape a conv code `[B, H, W, C]` into `H*W*C/capsule_dim` squashed capsules.

    Hauser section 4.1: the 6 x 6 x 128 code becomes 576 capsules of 8
    dimensions, each squashed (eq. 4) so that its length is P(on).

    Args:
        capsule_dim: capsule dimension; must divide C.
        squash: whether to squash (False gives the raw reshape).

    Returns:
        `[B, H*W*C/capsule_dim, capsule_dim]`.
    """

    def __init__(self, capsule_dim=8, squash=True, **kwargs):
        super().__init__(**kwargs)
        self.capsule_dim = check_integer(capsule_dim, "capsule_dim")
        self.squash = check_flag(squash, "squash")

    def build(self, input_shape):
        check_code_shape(tuple(input_shape), self.capsule_dim)

    def call(self, code):
        capsules = primary_capsules(code, self.capsule_dim)
        return squash(capsules) if self.squash else capsules

    def compute_output_shape(self, input_shape):
        _, h, w, c = input_shape
        capsules = None if None in (h, w, c) else h * w * c // self.capsule_dim
        return (input_shape[0], capsules, self.capsule_dim)

    def get_config(self):
        config = super().get_config()
        config.update(capsule_dim=self.capsule_dim, squash=self.squash)
        return config
