"""Batch functions traced once: a layer or pipeline method over a large array, batch by batch."""

import functools
import weakref

import numpy as np
import tensorflow as tf
from keras import ops

from poecaps.errors import InputError
from poecaps.validation import check_integer


def batched(fn, array, batch_size=256, jit_compile=False):
    """Apply `fn` to `array` in batches and concatenate the NumPy results.

    `fn` runs as one traced graph (`tf.function`, compiled by XLA with
    `jit_compile`), not op by op: the capsule layers' contractions loop over
    the upper capsules (`poecaps.energy`), which eagerly costs one Python
    step per capsule. A bound method's graph is kept between calls
    (`traced`). Under XLA the last batch is padded with zeros to the full
    size (and the padding dropped), so that one compiled shape serves all.
    `array` needs at least one row and `batch_size` must be an integer >= 1
    (else an `InputError`). A graph is kept per shape and dtype of the rows,
    so only the batch axis is ever traced as unknown: `fn`'s static checks
    of the other axes hold on every call.
    """
    batch_size = check_integer(batch_size, "batch_size")
    if len(array) == 0:
        raise InputError(f"batched needs at least one row to apply {getattr(fn, '__name__', 'fn')} to. "
                         f"Received: {len(array)} rows")
    first = np.asarray(array[:1])
    graph = traced(fn, jit_compile, rows=(first.shape[1:], first.dtype.str))
    outputs = []
    for k in range(0, len(array), batch_size):
        batch = np.asarray(array[k:k + batch_size])
        rows = len(batch)
        if jit_compile and rows < batch_size:
            batch = np.concatenate([batch, np.zeros((batch_size - rows, *batch.shape[1:]), batch.dtype)])
        outputs.append(ops.convert_to_numpy(graph(batch))[:rows])
    return np.concatenate(outputs)


def graph(fn, **options):
    """`tf.function(fn, **options)`, its traces counted apart from those of every other graph.

    TensorFlow warns that a function "triggered tf.function retracing" when
    one Python function is traced five times within its recent calls, and
    it counts by the function's code: every graph made from one `lambda` or
    nested `def` (one per owner, per model, per setting) would count as one
    function, so a few of them tracing once or twice each would set off the
    warning though none retraces. Given its own `functools.partial`, each
    graph is counted alone; one that does retrace still warns.
    """
    return tf.function(functools.partial(fn), **options)


# owner -> {function: (the owner's attributes when traced, graph)}. The owner
# and every attribute that allows it are held weakly (`_Snapshot`), so a kept
# graph keeps neither its owner nor an old layer or array alive.
_GRAPHS = weakref.WeakKeyDictionary()


class _Snapshot:
    """Which objects an owner's attributes are bound to, without keeping them alive."""

    def __init__(self, owner):
        self.refs = [_ref(value) for value in getattr(owner, "__dict__", {}).values()]

    def matches(self, owner):
        values = list(getattr(owner, "__dict__", {}).values())
        return len(values) == len(self.refs) and all(ref() is value for ref, value in zip(self.refs, values))


def _ref(value):
    try:
        return weakref.ref(value)
    except TypeError:  # numbers, strings, None, lists...: compared by identity as well
        return lambda: value


def kept(owner, key, make):
    """`make(ref)` for `owner` and `key`, made once and kept while the owner's attributes stay bound as they were.

    `ref` is a weak reference to `owner`: what `make` builds (a traced
    graph that calls `ref()`) must reach its owner through it, so that
    keeping it does not keep the owner alive. Owners that cannot be weakly
    referenced get a new `make(ref)` each call.
    """
    try:
        found = _GRAPHS.setdefault(owner, {})
        ref = weakref.ref(owner)
    except TypeError:  # not weakly referenceable or not hashable
        return make(lambda: owner)
    old = found.get(key)
    if old is not None and old[0].matches(owner):
        return old[1]
    made = make(ref)
    found[key] = (_Snapshot(owner), made)
    return made


def traced(fn, jit_compile=False, rows=None):
    """`fn` as a `tf.function` of one argument (`graph`), kept across calls when `fn` is a bound method.

    A graph reads variables as they are when it runs, but takes every other
    object (a layer, a NumPy mean) as it was when traced. So a kept graph is
    traced again once any attribute of the method's owner has been rebound
    since (`pipeline.decoder = other` retraces; arrays changed in place, or
    the attributes of the owner's layers rebound, are not seen). Functions
    that are not bound methods are traced anew each call. `rows` (hashable,
    e.g. the shape and dtype of one row) keeps one graph per value: a graph
    retraced for another shape relaxes the axes that differ to unknown,
    which would let arrays of other row shapes pass checks of static shapes.
    """
    owner, func = getattr(fn, "__self__", None), getattr(fn, "__func__", None)
    if owner is None or func is None:
        return graph(fn, reduce_retracing=True, jit_compile=jit_compile)
    return kept(owner, (func, jit_compile, rows),
                lambda ref: graph(lambda x: func(ref(), x), reduce_retracing=True, jit_compile=jit_compile))
