"""A learning rate that training machinery can lower: a schedule times a scale variable."""

import keras
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_number


@keras.saving.register_keras_serializable(package="poecaps")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule times a scale variable: `lr(step) = scale * schedule(step)`.

    The scale starts at `scale` and is a non-trainable variable, so that
    `NonFiniteGuard` can halve the learning rate of a compiled step and a
    checkpoint can store it.

    Args:
        schedule: a `LearningRateSchedule` (or any callable of the step) or a learning rate (> 0).
        scale: the starting scale (> 0).
    """

    def __init__(self, schedule, scale=1.0):
        scale = check_number(scale, "scale", above=0)
        if isinstance(schedule, dict):
            schedule = keras.saving.deserialize_keras_object(schedule)
        if not callable(schedule):
            schedule = check_number(schedule, "learning_rate", above=0)
        self.schedule = schedule
        self.scale = keras.Variable(scale, trainable=False, dtype="float32",
                                    name="learning_rate_scale")

    def __call__(self, step):
        base = self.schedule(step) if callable(self.schedule) else self.schedule
        return ops.cast(base, "float32") * ops.convert_to_tensor(self.scale)

    def get_config(self):
        schedule = self.schedule
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            schedule = keras.saving.serialize_keras_object(schedule)
        return {"schedule": schedule, "scale": float(ops.convert_to_numpy(self.scale))}


def learning_rate_scale(optimizer):
    """The scale variable of an optimizer whose learning rate is a `ScaledSchedule`, else None."""
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)   # LossScaleOptimizer
    schedule = getattr(optimizer, "_learning_rate", None)
    return schedule.scale if isinstance(schedule, ScaledSchedule) else None


def lowerable_rate(optimizer):
    """The variable that lowers an optimizer's learning rate: a `ScaledSchedule`'s scale, or a constant rate.

    A plain `LearningRateSchedule` has none; wrap it in `ScaledSchedule`.
    """
    scale = learning_rate_scale(optimizer)
    if scale is not None:
        return scale
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if isinstance(getattr(inner, "_learning_rate", None), keras.optimizers.schedules.LearningRateSchedule):
        raise InputError("A plain learning-rate schedule cannot be lowered; wrap it in "
                         "poecaps.trainers.schedule.ScaledSchedule.")
    return inner.learning_rate
