"""A training batch cut into shards that run as concurrent XLA computations, and joined again.

XLA on a CPU runs one computation's element-wise work on one core. Cutting
a batch into consecutive shards, each computed by its own XLA-compiled
function, lets TensorFlow's executor run them at the same time on different
cores. A batch mean is the size-weighted mean of the shards' means, so the
joined gradients equal the whole batch's up to rounding.
"""

import itertools

from keras import ops


def batch_size(x):
    """The leading dimension of `x`: a Python int when known, else a scalar tensor."""
    return x.shape[0] if x.shape[0] is not None else ops.shape(x)[0]


def shard_bounds(n, shards):
    """`[(start, end)]` of `shards` consecutive, near-equal parts of `n` rows (the first get one more).

    `n` may be a Python int or a scalar tensor (a batch size known only at run time).
    """
    size, extra = n // shards, n % shards
    smaller = min if isinstance(n, int) else ops.minimum
    starts = [k * size + smaller(k, extra) for k in range(shards + 1)]
    return list(itertools.pairwise(starts))


def nonempty(bounds, n):
    """Indices of the shards to run: all of them when `n` is a tensor, else those with rows."""
    if isinstance(n, int):
        return [k for k, (a, b) in enumerate(bounds) if b > a]
    return list(range(len(bounds)))


def size_weighted_mean(means, bounds, n):
    """The whole batch's mean from the shards' means over rows `bounds[k]` of `n`.

    `means` may hold None (a weight without gradient), which stays None. A
    shard without rows (batch smaller than the shard count, known only at
    run time) has a NaN mean (0 / 0) and weighs 0.
    """
    if any(m is None for m in means):
        return None

    def weighted(m, a, b):
        if isinstance(n, int):
            return m * ((b - a) / n)
        return ops.where(b > a, m, 0.0) * (ops.cast(b - a, m.dtype) / ops.cast(n, m.dtype))

    return sum(weighted(m, a, b) for m, (a, b) in zip(means, bounds))


def default_shards():
    """2 where TensorFlow sees no GPU, else 1.

    Two shards let XLA use both cores of a 2-core machine (`bench/cd_step.py`
    and `bench/em_step.py` time them against one computation). On a GPU one
    computation is meant to fill the device already (not measured).
    """
    import tensorflow as tf

    return 1 if tf.config.list_physical_devices("GPU") else 2
