"""A batch as Keras hands it to a trainer's `train_step` and `test_step`."""

import keras
from keras import ops

from poecaps.errors import InputError


def unpack(data, trainer, dtype=None):
    """`(x, y)` of a batch (`y` None if it has none), as `keras.utils.unpack_x_y_sample_weight` reads it,
    their floating-point values cast to `dtype` if given (`to_dtype`).

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
    return to_dtype(x, dtype), to_dtype(y, dtype)


def to_dtype(values, dtype):
    """`values` (a tensor, array or None) cast to `dtype` if they are floating-point and `dtype` is given, as a
    Keras layer casts its inputs to its compute dtype; integers (class labels) and None as they are.

    A trainer computes its objective in its model's precision (`Trainer.data_dtype`), so that data of any
    float dtype trains it: float64 arrays a float32 model, float32 images a float64 one. Keras' own `fit`
    casts float arrays to `floatx` first; `fit_resumable` and datasets hand them on as they are.
    """
    if dtype is None or values is None:
        return values
    values = ops.convert_to_tensor(values)
    return ops.cast(values, dtype) if keras.backend.is_float_dtype(values.dtype) else values


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
