"""map_in_chunks against the same function on the whole batch."""

import numpy as np
import pytest
import tensorflow as tf

from poecaps.chunks import map_in_chunks
from poecaps.errors import InputError


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("rows, chunk_size", [(10, 3), (10, 5), (4, 9), (1, 1), (0, 3)])
def test_values_and_gradients_equal_whole_batch(rng, mode, rows, chunk_size):
    # Row-wise fn with two inputs, two outputs and a variable it reads.
    kernel = tf.Variable(rng.normal(size=(4, 3)).astype("float32"))
    x = tf.constant(rng.normal(size=(rows, 4)).astype("float32"))
    s = tf.constant(rng.uniform(0.5, 1.5, size=(rows,)).astype("float32"))
    upstream = [tf.constant(rng.normal(size=shape).astype("float32")) for shape in ((rows, 3), (rows,))]

    def fn(x, s):
        h = tf.tanh(tf.matmul(x, kernel)) * s[:, None]
        return h, tf.reduce_sum(h * h, axis=-1)

    def outputs_and_grads(chunked):
        with tf.GradientTape() as tape:
            tape.watch([x, s])
            out = map_in_chunks(fn, [x, s], chunk_size, ["float32", "float32"]) if chunked else fn(x, s)
            loss = sum(tf.reduce_sum(u * o) for u, o in zip(upstream, out))
        return [*out, *tape.gradient(loss, [x, s, kernel])]

    run = outputs_and_grads if mode == "eager" else tf.function(
        outputs_and_grads, jit_compile=mode == "xla")
    for got, expected in zip(run(True), outputs_and_grads(False)):
        assert got.shape == expected.shape
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [0, -2, 1.5, None])
def test_bad_chunk_size(chunk_size):
    with pytest.raises(InputError, match="chunk_size must be an integer >= 1"):
        map_in_chunks(lambda x: (x,), [tf.zeros((2, 1))], chunk_size, ["float32"])


@pytest.mark.parametrize("inputs", [
    [],                                                            # IndexError before
    [tf.zeros([5, 2]), tf.zeros([4])],                             # failed in a TensorFlow reshape
    [tf.zeros([5, 2]), tf.zeros([])],
])
def test_inputs_of_no_common_batch_are_refused(inputs):
    with pytest.raises(InputError, match="one batch size N"):
        map_in_chunks(lambda *xs: (xs[0],), inputs, 2, ["float32"])
