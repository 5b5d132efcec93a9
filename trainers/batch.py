"""A batch as Keras hands it to a trainer's `train_step` and `test_step`."""

import keras

from poecaps.errors import InputError


def unpack(data, trainer):
    """`(x, y)` of a batch (`y` None if it has none), as `keras.utils.unpack_x_y_sample_weight` reads it.

    What the trainer would ignore or miss raises an `InputError` naming it, when Keras traces the step,
    before any weight moves:
    - sample weights (`fit(..., sample_weight=...)` or `class_weight=...`, or a dataset of `(x, y, w)`): the
      trainers' losses and CD statistics are batch means that weigh every example alike;
    - a `y` for a trainer that learns from `x` alone (`trainer.targets` None), e.g. the clean images of a
      denoising pair, which would be ignored;
    - no `y` for one that learns from `(x, y)` pairs (`trainer.targets` names what y holds).
    """
    x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
    check_batch(trainer, y, weights)
    return x, y


def weighted(trainer):
    """The `InputError` of sample weights given to `trainer`."""
    return InputError(f"{type(trainer).__name__} weighs every example alike; it takes no sample_weight or "
                      "class_weight.")


def check_batch(trainer, y, weights=None):
    """Raise the `InputError` of `unpack` for a batch's `y` and sample `weights` (None: none given)."""
    name = type(trainer).__name__
    if weights is not None:
        raise weighted(trainer)
    if y is not None and trainer.targets is None:
        raise InputError(f"{name} learns from x alone and would ignore a y; pass x only.")
    if y is None and trainer.targets is not None:
        raise InputError(f"{name} learns from (x, y) pairs, y the {trainer.targets}; pass both.")
