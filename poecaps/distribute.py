"""Strategies and precision policies for every trainer, by name.

Trainers are `keras.Model`s, so `fit()` runs them under any `tf.distribute`
strategy created around them (`with strategy.scope(): ...`). Keras sums the
gradients that replicas hand to `optimizer.apply`; the trainers therefore
divide their per-replica gradients (or losses) by `replica_scale()`, which
makes a step under N replicas equal to one device's step on the same
global batch.

Precision: "mixed_float16" and "mixed_bfloat16" set Keras' global policy;
routers, energy models and the generative capsule models are
`FullPrecision` layers, float32 weights and arithmetic, so routing, free
energies and CD statistics stay in float32 (reductions in low precision lose
the small differences CD is made of); likelihoods and variational bounds are
computed in float32 from the low-precision outputs of the networks that
parametrise them (`full_precision_dtype`); and the CD trainers apply those
statistics as they are, without mixed_float16's loss scaling (they are not
the gradients of a loss). Every other trainer scales its loss
(`replica_loss`). Under a float64 policy (`keras.config.set_floatx("float64")`)
every layer, router, energy model and trainer computes in float64.
"""

import contextlib

from poecaps.validation import check_choice

# Kept free of TensorFlow at import, so that command lines can check these names at once.
STRATEGIES = ("default", "mirrored", "multiworker")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")


def get_strategy(name="default"):
    """A `tf.distribute.Strategy` by name: "default" (one device), "mirrored", "multiworker"."""
    import tensorflow as tf

    check_choice(name, "strategy", STRATEGIES)
    if name == "mirrored":
        return tf.distribute.MirroredStrategy()
    if name == "multiworker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def check_precision(name):
    return check_choice(name, "precision", PRECISIONS)


@contextlib.contextmanager
def precision_policy(name="float32"):
    """Set Keras' global dtype policy to `name` inside the block (restored after)."""
    import keras

    check_precision(name)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(name)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def routing_dtype(dtype=None):
    """The dtype a `FullPrecision` layer is made with: "float32" under a mixed policy (float16 or bfloat16
    compute), the given `dtype`'s or else the global one, so that it neither stores nor reads its weights in low
    precision and casts what it is called on to float32; otherwise `dtype` as given (None: the global policy;
    float64 routes in float64)."""
    import keras

    policy = keras.config.dtype_policy() if dtype is None else keras.dtype_policies.get(dtype)
    if policy.compute_dtype in ("float16", "bfloat16"):
        return "float32"
    return dtype


class FullPrecision:
    """Mixin of a `keras.layers.Layer` that computes in float32 under a mixed policy, methods and all.

    Made with `routing_dtype`, and its weights are never autocast: other
    layers call its methods directly (not through `__call__`, which would
    enter its own float32 scope), and inside their low-precision calls Keras
    would read every weight rounded to float16 or bfloat16. Put it before the
    Keras base: `class Model(FullPrecision, keras.layers.Layer)`.
    """

    def __init__(self, *args, **kwargs):
        kwargs["dtype"] = routing_dtype(kwargs.get("dtype"))
        super().__init__(*args, **kwargs)

    def add_weight(self, *args, **kwargs):
        return super().add_weight(*args, **{**kwargs, "autocast": False})


def full_precision_dtype(tensor):
    """The dtype to route, or to compute a likelihood or bound, in for `tensor` (votes, a network's output; or
    anything with a `dtype`, such as a layer, whose `dtype` is its weights'): float64 stays float64; anything
    else (float32, or the float16 or bfloat16 of a mixed policy) is float32."""
    import keras

    return "float64" if keras.backend.standardize_dtype(tensor.dtype) == "float64" else "float32"


def num_replicas():
    """Replicas of the current strategy (1 outside any)."""
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def replica_loss(optimizer, loss):
    """The loss a replica differentiates: its batch `loss` times `replica_scale()` (Keras sums the replicas'
    gradients), through `optimizer.scale_loss` (a `LossScaleOptimizer` scales it under mixed_float16; any other
    optimizer returns it as is)."""
    return optimizer.scale_loss(loss * replica_scale())


def batch_normalization(**kwargs):
    """A `keras.layers.BatchNormalization` that normalises by the global batch's statistics.

    Made under a strategy of several replicas, it is `synchronized`: each
    replica's mean and variance are summed across replicas, so that a step
    under N replicas equals one device's step on the same global batch, as
    the trainers promise (unsynchronised, each replica would normalise by
    its own share of the batch). With one replica it is Keras' plain layer,
    whose moments Keras computes the same way as before this existed.
    """
    import keras

    return keras.layers.BatchNormalization(synchronized=num_replicas() > 1, **kwargs)


def replica_scale():
    """1 / number of replicas: the factor on per-replica gradients that Keras then sums."""
    return 1.0 / num_replicas()


def per_example_draw(draw, shape, seed):
    """Random draws for this replica's examples that equal one device's draws for the global batch.

    `draw(shape, seed=...)` is a `keras.random` function. Under N replicas each
    replica draws for the whole global batch (`N * shape[0]` rows, same seed
    state on every replica) and keeps its own contiguous slice, the slice of
    the batch that `tf.distribute` gave it; so stochastic steps (Gibbs
    sampling, random shifts) match one device up to float tolerance, and no
    two replicas share noise.
    """
    import tensorflow as tf
    from keras import ops

    replicas = num_replicas()
    context = tf.distribute.get_replica_context()
    if replicas == 1 or context is None:
        return draw(shape, seed=seed)
    rows = shape[0]
    full = draw((rows * replicas, *shape[1:]), seed=seed)
    start = ops.cast(context.replica_id_in_sync_group, "int32") * rows
    return ops.slice(full, (start, *([0] * (len(shape) - 1))), (rows, *shape[1:]))
