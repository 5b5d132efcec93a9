"""A batch as Keras hands it to a trainer's `train_step` and `test_step`."""

import keras

from poecaps.errors import InputError


def unpack(data, trainer):
    """`(x, y)` of a batch (`y` None if it has none), as `keras.utils.unpack_x_y_sample_weight` reads it.

    The trainers' losses and CD statistics are batch means that weigh every example alike, so a batch that
    carries sample weights (`fit(..., sample_weight=...)` or `class_weight=...`, or a dataset of `(x, y, w)`)
    raises an `InputError` naming the trainer, where it would otherwise be ignored. Raised when Keras traces
    the step, before any weight moves.
    """
    x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
    if weights is not None:
        raise InputError(f"{type(trainer).__name__} weighs every example alike; it takes no sample_weight or "
                         "class_weight.")
    return x, y
