"""`poecaps.graphs`: `batched` keeps a bound method's traced graph and never runs a stale one;
TensorFlow's retracing warning counts each graph's traces apart."""

import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

from poecaps.errors import InputError
from poecaps.graphs import batched
from poecaps.layers import ConvAutoencoder
from poecaps.models import CapsulePipeline


class Scale:
    """`apply` records each trace: its Python body runs only while TensorFlow traces it."""

    def __init__(self, factor):
        self.factor = factor
        self.traces = []

    def apply(self, x):
        self.traces.append(x.shape)
        return x * self.factor

    def shift(self, x):
        self.traces.append(x.shape)
        return x + self.factor


def test_a_bound_methods_graph_is_kept_between_calls():
    x = np.arange(30, dtype="float32").reshape(10, 3)
    scale = Scale(2.0)
    np.testing.assert_allclose(batched(scale.apply, x, batch_size=4), 2 * x)
    traces = len(scale.traces)
    assert 1 <= traces <= 2  # the full batches, then perhaps the relaxed shape of the last one
    np.testing.assert_allclose(batched(scale.apply, x, batch_size=4), 2 * x)
    np.testing.assert_allclose(batched(scale.apply, x[:7], batch_size=4), 2 * x[:7])
    assert len(scale.traces) == traces
    np.testing.assert_allclose(batched(scale.shift, x, batch_size=4), x + 2)  # its own graph
    assert len(scale.traces) > traces


class Rows:
    """`width` checks the static width of the rows, as a layer checks its inputs while traced."""

    def width(self, x):
        if x.shape[-1] is not None and x.shape[-1] != 3:
            raise InputError(f"rows must have 3 values. Received: shape={tuple(x.shape)}")
        return x * 1.0


def test_a_kept_graph_never_relaxes_the_axes_of_a_row():
    """Each row shape gets its own graph, traced with its sizes: before, the graph kept from rows of 3 values
    was retraced for rows of 2 with the last axis unknown, so the check saw None and the rows passed."""
    rows = Rows()
    np.testing.assert_allclose(batched(rows.width, np.ones((5, 3), "float32"), batch_size=2), np.ones((5, 3)))
    # raised while traced: TensorFlow re-raises it as its own StagingError, with the check's message
    with pytest.raises(Exception, match=r"rows must have 3 values\. Received: shape=\((None|2|1), 2\)"):
        batched(rows.width, np.ones((5, 2), "float32"), batch_size=2)


@pytest.mark.parametrize("rows, batch_size, message", [
    (4, 0, r"^batch_size must be an integer >= 1. Received: batch_size=0$"),
    (4, -2, r"batch_size=-2$"),
    (4, 2.0, r"batch_size=2.0$"),
    (0, 4, r"^batched needs at least one row to apply apply to. Received: 0 rows$"),
])
def test_batched_refuses_batch_sizes_and_arrays_it_cannot_split(rows, batch_size, message):
    """Before, a batch size of 0 or a float failed in range(), and a negative one or an empty array in
    np.concatenate ('need at least one array to concatenate')."""
    with pytest.raises(InputError, match=message):
        batched(Scale(2.0).apply, np.ones((rows, 3), "float32"), batch_size=batch_size)


def test_rebinding_an_attribute_of_the_owner_traces_again():
    x = np.arange(12, dtype="float32").reshape(4, 3)
    scale = Scale(2.0)
    batched(scale.apply, x)
    scale.factor = 3.0
    np.testing.assert_allclose(batched(scale.apply, x), 3 * x)
    scale.factor = np.float32(-1.0)
    np.testing.assert_allclose(batched(scale.apply, x), -x)


def test_a_kept_graph_does_not_keep_its_owner_alive():
    scale = Scale(2.0)
    batched(scale.apply, np.ones((4, 3), "float32"))
    owner = weakref.ref(scale)
    del scale
    gc.collect()
    assert owner() is None


def test_a_pipeline_with_a_new_code_mean_or_autoencoder_decodes_with_it():
    autoencoder = ConvAutoencoder(filters=8, kernel_size=3, dropout=0.0, seed=0)
    images = np.random.default_rng(0).random((5, 12, 12, 1), dtype="float32")
    autoencoder(images)
    pipeline = CapsulePipeline(autoencoder, capsule_dim=4)
    lower = batched(pipeline.lower_capsules, images)
    outputs = [batched(pipeline.decode_lower, lower)]
    np.testing.assert_allclose(outputs[-1], pipeline.decode_lower(lower), atol=1e-6)
    pipeline.code_mean = np.full(autoencoder.code_shape, 0.5, "float32")
    outputs.append(batched(pipeline.decode_lower, lower))
    np.testing.assert_allclose(outputs[-1], pipeline.decode_lower(lower), atol=1e-6)
    pipeline.autoencoder = ConvAutoencoder(filters=8, kernel_size=3, dropout=0.0, seed=1)
    pipeline.autoencoder(images)
    outputs.append(batched(pipeline.decode_lower, lower))
    np.testing.assert_allclose(outputs[-1], pipeline.decode_lower(lower), atol=1e-6)
    # each change shows in the output, so a stale graph would fail the checks above
    assert np.abs(outputs[1] - outputs[0]).max() > 1e-3 and np.abs(outputs[2] - outputs[1]).max() > 1e-3


def test_a_pipeline_without_an_encoder_or_decoder_names_the_stage_to_train():
    # A pipeline loaded from a run whose capsule stages have not run yet has only its autoencoder. Before, its
    # capsule methods failed with "'NoneType' object is not callable" or "has no attribute".
    autoencoder = ConvAutoencoder(filters=8, kernel_size=3, dropout=0.0, seed=0)
    images = np.random.default_rng(0).random((2, 12, 12, 1), dtype="float32")
    autoencoder(images)
    pipeline = CapsulePipeline(autoencoder, capsule_dim=4)
    upper = np.zeros((2, 3, 16), "float32")
    for call, stage in [(lambda: pipeline.encode(images), "encoder"), (lambda: pipeline.num_upper, "encoder"),
                        (lambda: pipeline.decode_upper(upper), "decoder"), (lambda: pipeline.decode(upper), "decoder"),
                        (lambda: pipeline.reconstruct(images), "encoder")]:
        with pytest.raises(InputError, match=f"no {stage}; train the '{stage}' stage first"):
            call()



RETRACING_PROGRAM = """
import logging

import numpy as np
import tensorflow as tf
from poecaps.graphs import batched, graph

warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append("triggered tf.function retracing" in record.getMessage())
tf.get_logger().addHandler(handler)

class Scale:
    def __init__(self, factor):
        self.factor = factor
    def apply(self, x):
        return x * self.factor

x = np.ones((10, 3), "float32")
for k in range(8):      # sixteen graphs from two functions' code, each traced twice (full batches, the last)
    batched(Scale(float(k)).apply, x, batch_size=4)
    batched(lambda y, k=k: y + k, x, batch_size=4)
print("distinct graphs", sum(warnings))
one = graph(lambda y: y + 1.0)
for rank in range(1, 8):  # one graph traced at seven ranks: it does retrace
    one(tf.ones([1] * rank))
print("one graph", sum(warnings))
"""


def test_graphs_made_from_one_function_do_not_set_off_tensorflows_retracing_warning():
    """TensorFlow's retracing warning counts traces by the Python function's code: graphs made from one
    function, each traced once or twice, set it off though none retraces. One graph that retraces still does.
    A new process, since TensorFlow gives each function's count at most five warnings per process."""
    done = subprocess.run([sys.executable, "-c", RETRACING_PROGRAM], check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    counts = {name: int(count) for name, count in (line.rsplit(" ", 1) for line in done.stdout.splitlines())}
    assert counts["distinct graphs"] == 0, done.stdout
    assert counts["one graph"] >= 1, done.stdout  # the warning is live in this process
