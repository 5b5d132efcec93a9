"""The one base of the trainers: a `keras.Model` that trains by its own objective."""

import inspect

import keras
import numpy as np
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.trainers.batch import check_batch, weighted

# `keras.Model.compile`'s arguments that a trainer's own `train_step` and `test_step` never read.
OWN_OBJECTIVE = ("loss", "loss_weights", "metrics", "weighted_metrics")


def _is_array(value):
    """Whether `value` is a NumPy array or a tensor (which `check_inputs` reads), not a dataset or generator."""
    return isinstance(value, np.ndarray) or keras.ops.is_tensor(value)


class Trainer(keras.Model):
    """A `keras.Model` whose `train_step` raises its own objective and reports its own `metrics`.

    Its loss is fixed by the model it trains (a bound, CD's statistics, a
    network's `loss_terms`), so `compile` takes the optimizer and Keras'
    execution settings alone: a `loss`, `loss_weights`, `metrics` or
    `weighted_metrics` given to it would be ignored by `train_step` and
    missing from the history, and raises an `InputError` naming them.
    `fit` and `evaluate` refuse a `sample_weight` or `class_weight` at once,
    as the steps refuse the weights of a dataset's batches
    (`poecaps.trainers.batch.unpack`): Keras would read a `class_weight`'s y
    as class labels, which for most trainers it is not, and drops a
    `sample_weight` given without y. Arrays given to them (x, y and
    `validation_data`; NumPy or tensors, not datasets, which are read batch
    by batch) are checked by the trainer's `check_inputs`, if it has one,
    as `fit_resumable` checks them: images outside [0, 1] or of the wrong
    shape, or labels outside the classes, are an `InputError` before any step.

    The trained model's `losses` (weight regularizers such as a
    `kernel_regularizer`, and `add_loss` terms) join the objective, as Keras
    adds them to a compiled loss: `regularized(loss)` for the trainers that
    differentiate a loss, `regularized_gradients` for the CD trainers, whose
    update is not a loss's gradient. The reported metrics are the model's
    objective alone.

    A trainer is not saved whole (`save`, `ModelCheckpoint` of a `.keras`
    file): it holds the model it trains and settings such as a preprocessing
    function. `get_config` raises an `InputError` that names what to save
    instead: the model (`keras.saving.save_model(trainer.<model>, path)`),
    the trainer's weights (`save_weights`,
    `ModelCheckpoint(..., save_weights_only=True)`), or a run's whole state
    (`poecaps.trainers.resumable.fit_resumable`'s checkpoints, which also
    hold the seed generators' states that Keras' weight files leave out).

    `targets` names what a batch's y holds for a trainer that learns from
    `(x, y)` pairs, and is None for one that learns from x alone
    (`poecaps.trainers.batch.unpack` holds each to it).

    A trainer takes its model's dtype policy, so that a call (`predict`)
    hands the model its inputs in the model's precision, and its steps cast
    a batch's floating-point values to `data_dtype`: data of any float dtype
    trains a model of any precision. A `dtype` other than the model's (the
    one it was made with) is an `InputError`: the model's weights and
    computations fix the precision (build the model with that `dtype`).

    A trainer refuses, with an `InputError` when made, a model that is not
    one of its `trains` types or lacks one of its `calls` (what its steps
    read of the model).

    Args:
        trained: the model (a Keras layer) the trainer trains.
        **kwargs: `keras.Model`'s (`name`, `dtype`: the model's policy if given).
    """

    targets = None
    trained_as = "model"    # the attribute that holds the trained model, named by `get_config`'s advice
    trains = (keras.layers.Layer,)   # the types of model the trainer takes
    calls = ()                       # what its steps read of the model, beyond a layer's own

    def __init__(self, trained, **kwargs):
        missing = [name for name in self.calls if not hasattr(trained, name)]
        if not isinstance(trained, self.trains) or missing:
            kinds = ("a Keras layer" if self.trains == (keras.layers.Layer,)
                     else "a model of type " + " or ".join(kind.__name__ for kind in self.trains))
            reads = f" with {', '.join(self.calls)}" if self.calls else ""
            lacks = f", which has no {', '.join(missing)}" if missing and isinstance(trained, self.trains) else ""
            raise InputError(f"{type(self).__name__} trains {kinds}{reads}. Received: {type(trained).__name__}"
                             f"{lacks}")
        policy = trained.dtype_policy
        given = kwargs.pop("dtype", None)
        # a full-precision model given a mixed policy computes in float32 (`distribute.routing_dtype`)
        wanted = given if not isinstance(trained, distribute.FullPrecision) else distribute.routing_dtype(given)
        if given is not None and keras.dtype_policies.get(wanted).name != policy.name:
            raise InputError(f"{type(self).__name__} computes in the precision of the model it trains, "
                             f"{type(trained).__name__}'s {policy.name!r}; build the model with the dtype to train in. "
                             f"Received: dtype={given!r}")
        super().__init__(dtype=policy, **kwargs)

    @property
    def data_dtype(self):
        """The dtype of a batch's floating-point values in the steps: float64 under a float64 policy, else
        float32 (a mixed policy's objectives are float32)."""
        return distribute.full_precision_dtype(self)

    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None, metrics=None, weighted_metrics=None,
                **kwargs):
        given = {name: value for name, value in zip(OWN_OBJECTIVE, (loss, loss_weights, metrics, weighted_metrics))
                 if value is not None}
        if given:
            raise InputError(f"{type(self).__name__} trains by its own objective and reports its own metrics; "
                             f"compile takes no {', '.join(given)}. "
                             f"Received: {', '.join(f'{name}={value!r}' for name, value in given.items())}")
        super().compile(optimizer=optimizer, **kwargs)

    def get_config(self):
        raise InputError(
            f"{type(self).__name__} is not saved whole: it holds the model it trains and its training settings. "
            f"Save that model (keras.saving.save_model(trainer.{self.trained_as}, path)), the trainer's weights (save_weights, or "
            "ModelCheckpoint(..., save_weights_only=True)), or train with poecaps.trainers.resumable.fit_resumable, "
            "whose checkpoints hold the whole training state.")

    def regularized(self, loss):
        """`loss` plus the trainer's `losses` (each cast to `loss`'s dtype)."""
        for term in self.losses:
            loss = loss + ops.cast(term, loss.dtype)
        return loss

    def regularized_gradients(self, gradients, weights):
        """`gradients` of `weights` plus the gradients of the trainer's `losses` in them."""
        import tensorflow as tf

        with tf.GradientTape() as tape:
            terms = self.losses         # weight regularizers are computed here, from the watched weights
            penalty = sum(ops.cast(term, gradients[0].dtype) for term in terms)
        if not terms:
            return gradients
        extra = tape.gradient(penalty, weights)
        return [g if e is None else g + ops.cast(e, g.dtype) for g, e in zip(gradients, extra)]

    def _check_call(self, method, args, kwargs):
        """Refuse sample or class weights, and arrays (x, y and validation arrays) that the steps' `check_batch`
        (a y given or missing) or the trainer's `check_inputs` refuse; `predict`'s x meets `check_inputs` alone
        (it takes no y)."""
        given = inspect.signature(method).bind(self, *args, **kwargs).arguments
        if given.get("sample_weight") is not None or given.get("class_weight") is not None:
            raise weighted(self)
        check = getattr(self, "check_inputs", None)
        if check is None:
            return
        if method is keras.Model.predict:
            if _is_array(given.get("x")):
                check(given["x"])
            return
        validation = given.get("validation_data")
        validation = (*validation, None)[:2] if isinstance(validation, (tuple, list)) else (validation, None)
        for x, y in ((given.get("x"), given.get("y")), validation):
            if _is_array(x) and (y is None or _is_array(y)):
                check_batch(self, y)        # a y given or missing, as the steps would refuse it once traced
                check(x, y)

    def fit(self, *args, **kwargs):
        self._check_call(keras.Model.fit, args, kwargs)
        return super().fit(*args, **kwargs)

    def evaluate(self, *args, **kwargs):
        self._check_call(keras.Model.evaluate, args, kwargs)
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        self._check_call(keras.Model.predict, args, kwargs)
        return super().predict(*args, **kwargs)
