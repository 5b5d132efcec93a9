"""Evaluate a batch function chunk by chunk, each chunk recomputed for its gradient (TensorFlow)."""

import tensorflow as tf

from poecaps.errors import InputError
from poecaps.validation import check_integer, sizes_fit


def _split(x, num_chunks, chunk_size, pad):
    """`[N, ...]` -> `[num_chunks, chunk_size, ...]`, zero rows appended."""
    x = tf.pad(x, [[0, pad]] + [[0, 0]] * (x.shape.rank - 1))
    return tf.reshape(x, tf.concat([[num_chunks, chunk_size], tf.shape(x)[1:]], axis=0))


def _join(x, n):
    """`[num_chunks, chunk_size, ...]` -> `[N, ...]`, the appended rows dropped."""
    return tf.reshape(x, tf.concat([[-1], tf.shape(x)[2:]], axis=0))[:n]


def map_in_chunks(fn, inputs, chunk_size, output_dtypes):
    """`fn(*inputs)` computed `chunk_size` rows at a time, forward and backward.

    `fn` maps tensors with a leading batch axis to a tuple of float tensors
    with the same leading axis, row by row (no row sees another). The batch
    is cut into chunks (the last one padded with zero rows, dropped again;
    an empty batch is one chunk of zero rows);
    a `tf.map_fn` runs `fn` on one chunk after another, and the gradient
    runs it again on each chunk under its own tape, summing the gradients
    of the variables `fn` reads. Nothing of one chunk is kept for the
    backward pass, so the large intermediates of `fn` (capsule votes) only
    ever exist for one chunk, small enough to stay in the CPU's caches:
    memory traffic instead of memory-bound passes over the whole batch.

    Args:
        fn: function of `len(inputs)` tensors returning a tuple of tensors.
        inputs: a non-empty list of tensors `[N, ...]`, one N for all (an
            `InputError` otherwise; they are cut into the same chunks).
        chunk_size: rows per chunk (> 0).
        output_dtypes: the dtype of each of `fn`'s outputs.

    Returns:
        the tuple `fn(*inputs)` would return.
    """
    chunk_size = check_integer(chunk_size, "chunk_size")
    inputs = [tf.convert_to_tensor(x) for x in inputs]
    if not inputs or any(x.shape.rank == 0 or not sizes_fit(x.shape[0], inputs[0].shape[0]) for x in inputs):
        raise InputError(f"map_in_chunks takes one or more inputs [N, ...] of one batch size N. Received: shapes "
                         f"{[tuple(x.shape) for x in inputs]}")
    n = tf.shape(inputs[0])[0]
    # At least one chunk: an empty batch runs one chunk of padding (map_fn fails on none).
    num_chunks = tf.maximum((n + chunk_size - 1) // chunk_size, 1)
    pad = num_chunks * chunk_size - n
    split = lambda x: _split(x, num_chunks, chunk_size, pad)

    @tf.custom_gradient
    def run(*xs):
        outputs = tf.map_fn(lambda chunk: tuple(fn(*chunk)), tuple(split(x) for x in xs),
                            fn_output_signature=tuple(output_dtypes))

        def grad(*upstream, variables=None):
            variables = list(variables or [])

            def chunk_gradient(args):
                chunk, chunk_upstream = args
                with tf.GradientTape() as tape:
                    tape.watch(chunk)
                    chunk_outputs = tuple(fn(*chunk))
                return tuple(tape.gradient(
                    chunk_outputs, list(chunk) + variables, output_gradients=list(chunk_upstream),
                    unconnected_gradients=tf.UnconnectedGradients.ZERO))

            signature = tuple(tf.TensorSpec(None, x.dtype) for x in list(xs) + variables)
            grads = tf.map_fn(chunk_gradient, (tuple(split(x) for x in xs),
                                               tuple(split(u) for u in upstream)),
                              fn_output_signature=signature)
            return ([_join(g, n) for g in grads[:len(xs)]],
                    [tf.reduce_sum(g, axis=0) for g in grads[len(xs):]])

        return tuple(_join(o, n) for o in outputs), grad

    return run(*inputs)

