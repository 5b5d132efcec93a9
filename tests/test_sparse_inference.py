"""Routing as inference: the toy against hand-derived minimisers, the router against its closed form."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import inference
from poecaps.errors import InputError
from poecaps.inference import descend, shrink
from poecaps.models import CapsNet
from poecaps.routing import DynamicRouting, SparseInferenceRouting

U = np.array([-1.0, 5.0, 2.0])

# Minimisers derived by hand (target 2, W1 = I, W2 = [1, 1, 1]); S = sum(x), d = S - 2.
#   output-only, L2:  grad 2d + 2x = 0    -> every x = -d, S = -3d -> x = 1/2 each
#   full, none:       2d + 2(x - u) = 0   -> x = u - d, S = 6 - 3d = 2 + d -> d = 1
#   full, L2:         2d + 2(x - u) + 4x  -> x = (u - d)/3, S = (6 - 3d)/3 = 2 + d -> d = 0
#   full, L1:         x = soft(u - d, 1) (strictly convex); d in (0, 1) gives x = (-d, 4 - d, 1 - d),
#                     S = 5 - 3d = 2 + d -> d = 3/4
UNIQUE = {("output_only", "l2"): [0.5, 0.5, 0.5], ("full", "none"): U - 1,
          ("full", "l2"): U / 3, ("full", "l1"): [-0.75, 3.25, 0.25]}


@pytest.mark.parametrize("reading, penalty", sorted(UNIQUE))
def test_toy_reaches_the_unique_minimiser(reading, penalty):
    trajectory, _ = inference.toy_states(penalty, reading)
    # slowest contraction 1 - 0.01 * 2 per step: 0.98^500 * (distance <= 5) < 2e-4
    np.testing.assert_allclose(trajectory[-1].numpy(), UNIQUE[reading, penalty], atol=1e-3)


@pytest.mark.parametrize("kwargs, message", [
    ({"learning_rate": -0.1}, "learning_rate must be a finite number > 0"),     # climbed the energy
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number > 0"),   # energies of NaN
    ({"l1": [-1.0]}, "l1 must be a finite number >= 0"),                         # lengthened every capsule
    ({"l1": [1.0, 1.0]}, "one L1 weight per state"),                            # the second weight was dropped
    ({"steps": -1}, "steps must be an integer >= 0"),                            # failed in a TensorArray
    ({"steps": 2.5}, "steps must be an integer >= 0"),
])
def test_descent_refuses_settings_that_would_not_minimise(kwargs, message):
    """Each setting gave energies without a word (or failed inside TensorFlow) before; the proximal step refuses
    a negative amount too. Zero steps still return the start."""
    energy = lambda xs: tf.reduce_sum(tf.square(xs[0]), -1)
    settings = {"steps": 3, "learning_rate": 0.1, **kwargs}
    with pytest.raises(InputError, match=message):
        descend(energy, [tf.ones((2, 3))], settings["steps"], settings["learning_rate"], settings.get("l1"))
    with pytest.raises(InputError, match="amount must be a finite number >= 0"):
        shrink(tf.ones((2, 3)), -1.0)
    (start,), trace = descend(energy, [tf.ones((2, 3))], 0, 0.1)
    np.testing.assert_array_equal(start.numpy(), 1.0)
    np.testing.assert_array_equal(trace.numpy(), [[3.0, 3.0]])


def test_toy_output_only_without_penalty_keeps_the_start_off_the_plane():
    """Not unique (any x with sum 2): the gradient is along (1, 1, 1), so descent projects u onto the plane."""
    trajectory, energy = inference.toy_states("none", "output_only")
    np.testing.assert_allclose(trajectory[-1].numpy(), U - (U.sum() - 2) / 3, atol=1e-9)
    assert float(energy[-1]) < 1e-20


def test_toy_output_only_l1_reaches_a_minimiser_with_one_unit_on():
    """Not unique (any x >= 0 with sum 3/2, energy 7/4); equal L1 pulls leave the largest input on."""
    trajectory, energy = inference.toy_states("l1", "output_only")
    x = trajectory[-1].numpy()
    assert abs(float(energy[-1]) - 1.75) < 1e-6
    # subgradient steps of 0.01 leave the zero units jittering around 0 (here by ~1e-6)
    assert np.all(x >= -1e-4) and abs(x.sum() - 1.5) < 1e-4
    assert np.count_nonzero(np.abs(x) > 1e-3) == 1 and np.argmax(x) == 1      # the others at 0, to ~1e-6


def test_toy_script_prints_the_librarys_states(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "scripts", "toy_routing.py")
    done = subprocess.run([sys.executable, script, "--json", "--run-dir", str(tmp_path / "toy"), "--steps", "120",
                           "--learning-rate", "0.02"], capture_output=True, text=True, check=True)
    printed = json.loads(done.stdout)                   # the JSON alone on stdout; the readable lines on stderr
    assert "output_only  l1    x = (" in done.stderr
    for reading in ("output_only", "full"):
        for penalty in ("none", "l1", "l2"):
            trajectory, _ = inference.toy_states(penalty, reading, steps=120, learning_rate=0.02)
            np.testing.assert_allclose(printed[reading][penalty], trajectory[-1].numpy(), atol=1e-9)
    assert os.path.exists(tmp_path / "toy" / "toy_routing.png")


def closed_form(p, l1, targets=None, kappa=1.0):
    """argmin_v |v - p|^2 + kappa (|v| - y)^2 + l1 |v|, per parent: along p, length
    r = max(0, (|p| + kappa y - l1/2) / (1 + kappa)) (derivative in r of the 1-D problem)."""
    length = np.linalg.norm(p, axis=-1, keepdims=True)
    if targets is None:
        r = np.maximum(length - l1 / 2, 0)
    else:
        r = np.maximum((length + kappa * targets[..., None] - l1 / 2) / (1 + kappa), 0)
    return p / length * r


def numpy_prediction(votes, activations, normalize):
    c0 = 1 / (votes.shape[2] if normalize == "parents" else votes.shape[1])
    z = c0 * np.einsum("bi,bijd->bjd", activations, votes)
    n2 = np.sum(z * z, -1, keepdims=True)
    return n2 / (1 + n2) * z / np.sqrt(n2)


@pytest.mark.parametrize("normalize", ["parents", "children"])
@pytest.mark.parametrize("clamped", [False, True])
def test_router_reaches_the_closed_form(rng, normalize, clamped):
    votes = (rng.normal(size=(4, 12, 5, 8)) * (1 if normalize == "parents" else 3)).astype("float32")
    activations = rng.uniform(size=(4, 12)).astype("float32")
    router = SparseInferenceRouting(l1=0.5, normalize=normalize)
    p = numpy_prediction(votes.astype("float64"), activations.astype("float64"), normalize)
    targets = np.eye(5)[rng.integers(0, 5, 4)] if clamped else None
    if clamped:
        v, _ = router.infer(votes, activations, targets=targets)
    else:
        v = router(votes, activations).poses
    np.testing.assert_allclose(ops.convert_to_numpy(v), closed_form(p, 0.5, targets), atol=1e-3)
    # the L1 term does put some parents exactly at 0, others not
    lengths = np.linalg.norm(closed_form(p, 0.5, targets), axis=-1)
    assert 0 < np.count_nonzero(lengths == 0) < lengths.size


@pytest.mark.parametrize("clamped", [False, True])
def test_energy_never_rises_at_the_default_learning_rate(rng, clamped):
    for _ in range(5):
        votes = rng.normal(size=(3, 10, 4, 16)).astype("float32") * rng.uniform(0.2, 3)
        targets = np.eye(4)[rng.integers(0, 4, 3)] if clamped else None
        _, energy = SparseInferenceRouting(l1=float(rng.uniform(0, 2))).infer(votes, targets=targets)
        energy = ops.convert_to_numpy(energy)
        assert energy.shape == (501, 3)
        # float32 rounding of an energy of order 10: a few 1e-6
        assert np.all(np.diff(energy, axis=0) <= 1e-5 * (1 + np.abs(energy[:-1])))
        assert np.all(energy[-1] < energy[0])


def test_training_returns_the_uniform_feed_forward_prediction(rng):
    votes = rng.normal(size=(2, 9, 3, 4)).astype("float32")
    activations = rng.uniform(size=(2, 9)).astype("float32")
    for normalize in ("parents", "children"):
        inferred = SparseInferenceRouting(normalize=normalize)(votes, activations, training=True)
        uniform = DynamicRouting(1, normalize=normalize)(votes, activations)
        for a, b in zip(inferred, uniform):
            np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-5, atol=1e-7)


def test_config_round_trip_and_bad_arguments():
    router = SparseInferenceRouting(iterations=40, learning_rate=0.05, l1=0.3, normalize="children")
    clone = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(router))
    assert clone.get_config() == router.get_config()
    with pytest.raises(InputError, match="Received: learning_rate=0"):
        SparseInferenceRouting(learning_rate=0)
    with pytest.raises(InputError, match="Received: l1=-1"):
        SparseInferenceRouting(l1=-1)
    with pytest.raises(InputError, match="Received: penalty='l3'"):
        inference.toy_states("l3", "full")


def test_the_routers_inference_refuses_targets_weights_and_activations_that_do_not_fit(rng):
    """`infer`'s targets must be `[B, J]` and its label weight a finite number >= 0, and `prediction` and `infer`
    check the activations as the router's call does (before: TensorFlow's broadcasting errors, and a negative or
    NaN label weight pushed the lengths away from the targets or made them NaN without a word)."""
    router = SparseInferenceRouting(iterations=3)
    votes = rng.normal(size=(2, 6, 3, 4)).astype("float32")
    targets = np.eye(3, dtype="float32")[[0, 1]]
    assert tuple(router.infer(votes, targets=targets)[0].shape) == (2, 3, 4)
    for shape in [(2, 4), (3, 3), (2,)]:
        with pytest.raises(InputError, match=re.escape(f"targets must be [B, J] = [2, 3], one length per parent. "
                                                       f"Received: targets of shape {list(shape)}")):
            router.infer(votes, targets=np.ones(shape, "float32"))
    for weight in (-1.0, float("nan")):
        with pytest.raises(InputError, match="label_weight must be a finite number >= 0"):
            router.infer(votes, targets=targets, label_weight=weight)
    message = re.escape("activations must be [B, I] = [2, 6] for votes [B, I, J, D] of shape [2, 6, 3, 4]")
    for use in (router.infer, router.prediction):
        with pytest.raises(InputError, match=message):
            use(votes, np.ones((2, 7), "float32"))
    # Called directly, not through the layer, they check the votes' rank as Keras' input spec does, and take
    # lists as arrays (before: 'Invalid reduction dimension' inside TensorFlow, and "'list' object has no
    # attribute 'shape'")
    for use in (router.infer, router.prediction):
        with pytest.raises(InputError, match=re.escape("SparseInferenceRouting: votes must be [B, I, J, D]. "
                                                       "Received: votes of shape [6, 3, 4]")):
            use(votes[0])
    found = router.infer(votes.tolist(), activations=np.ones((2, 6)).tolist(), targets=targets.tolist())[0]
    np.testing.assert_array_equal(found, router.infer(votes, np.ones((2, 6), "float32"), targets)[0])


def _tiny_capsnet():
    return CapsNet((12, 12, 1), 3, routing_iterations=0, reconstruction=False, conv_filters=8, primary_types=2,
                   primary_dim=4, class_dim=6, kernel_size=3, seed=1)


def test_whole_network_inference_starts_at_the_feed_forward_pass(rng):
    model = _tiny_capsnet()
    images = rng.uniform(size=(5, 12, 12, 1)).astype("float32")
    result = inference.infer(model, images, steps=0)
    np.testing.assert_allclose(ops.convert_to_numpy(result["lengths"]),
                               ops.convert_to_numpy(model(images)["scores"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(result["energy"])[0],
                               ops.convert_to_numpy(ops.sum(result["lengths"], -1)), rtol=1e-5)


def test_the_compiled_inference_does_not_keep_a_model_alive(rng):
    """`infer` compiles once per model and settings; the compiled graph was kept in a cache of 32 that held the
    model itself, so a model the caller let go stayed in memory. The graph now reaches it weakly: gone once
    dropped. A second call with the same settings uses the same graph and gives the same answer."""
    import gc
    import weakref

    model = _tiny_capsnet()
    images = rng.uniform(size=(2, 12, 12, 1)).astype("float32")
    first = inference.infer(model, images, steps=2)
    compiled = inference._compiled_inference(model, 2, 0.01, 1.0, 1.0, False, False)     # infer's defaults
    again = inference.infer(model, images, steps=2)
    assert inference._compiled_inference(model, 2, 0.01, 1.0, 1.0, False, False) is compiled
    np.testing.assert_array_equal(ops.convert_to_numpy(first["lengths"]), ops.convert_to_numpy(again["lengths"]))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_capsnet_energy_is_appendix_cs_formula_in_numpy(rng):
    """E(u, v) = |u - squash(primary(h))|^2 + sum_j |v_j - squash(c0 sum_i W_ij u_i)|^2 + kappa sum_j (|v_j| - y_j)^2
    at states away from the feed-forward pass, against the formula written in float64 NumPy from the model's
    kernel and primary capsules (c0 = 1/J, the uniform first round over the parents). float32 sums of a few
    hundred terms of size ~1: rtol 1e-4 is about 100 ulps."""
    model = _tiny_capsnet()
    images = rng.uniform(size=(4, 12, 12, 1)).astype("float32")
    h = model.conv1(images)
    labels = np.array([0, 2, 1, 2])
    energy, u0, predict = inference.capsnet_energy(model, h, tf.constant(labels), label_weight=0.7)
    u = ops.convert_to_numpy(u0).astype("float64") + 0.3 * rng.normal(size=u0.shape)
    v = 0.5 * rng.normal(size=(4, 3, 6))
    found = ops.convert_to_numpy(energy([tf.constant(u, tf.float32), tf.constant(v, tf.float32)]))

    def np_squash(z):
        n2 = np.sum(z * z, -1, keepdims=True)
        return z * np.sqrt(n2) / (1.0 + n2)

    kernel = ops.convert_to_numpy(model.class_capsules.kernel).astype("float64")      # [I, J, D_out, D_in]
    predicted = np_squash(np.einsum("ijoe,bie->bjo", kernel, u) / 3.0)
    target = ops.convert_to_numpy(model.primary(model.primary_conv(h))).astype("float64")
    expected = (np.sum((u - target) ** 2, axis=(1, 2)) + np.sum((v - predicted) ** 2, axis=(1, 2))
                + 0.7 * np.sum((np.linalg.norm(v, axis=-1) - np.eye(3)[labels]) ** 2, axis=-1))
    np.testing.assert_allclose(found, expected, rtol=1e-4)
    # each prediction is a float32 sum of I * D_in = 128 products whose magnitudes add to below 1: in any order
    # within 128 * 2^-24 of it (7.6e-6), and squash changes a pose by no more than its pre-activation
    np.testing.assert_allclose(ops.convert_to_numpy(predict(tf.constant(u, tf.float32))), predicted,
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("settings, message", [
    ({"steps": -2}, r"steps must be an integer >= 0. Received: steps=-2"),
    ({"steps": 2.5}, r"steps must be an integer >= 0"),
    ({"learning_rate": float("nan")}, r"learning_rate must be a finite number > 0"),
    ({"learning_rate": -1.0}, r"learning_rate must be a finite number > 0. Received: learning_rate=-1.0"),
    ({"l1": -1.0}, r"l1 must be a finite number >= 0"),
    ({"label_weight": -1.0}, r"label_weight must be a finite number >= 0"),
    ({"labels": np.array([0, 1, 2, 5, 0])}, r"labels must lie in \[0, 3\). Received: 0 to 5"),
    ({"labels": np.array([0, 1])}, r"labels must be one integer per example, shape \[5\]"),
    ({"labels": np.eye(3)[[0, 1, 2, 0, 1]]}, r"labels must be one integer per example, shape \[5\]"),
    ({"images": np.zeros((5, 14, 14, 1), "float32")}, r"images must have shape \[N, 12, 12, 1\]"),
    ({"images": np.full((5, 12, 12, 1), 255.0, "float32")}, r"images must lie in \[0.0, 1.0\]"),
    ({"record_lengths": "yes"}, r"record_lengths must be True or False"),
])
def test_whole_network_inference_refuses_bad_settings_and_inputs(rng, settings, message):
    """Before, a NaN or negative learning rate and negative weights ran without a word (a negative rate climbs
    the energy: lengths of about 13), a label outside the classes clamped toward a zero vector, and the rest
    failed inside the compiled loop (an XLA error for steps < 0)."""
    model = _tiny_capsnet()
    arguments = {"images": rng.uniform(size=(5, 12, 12, 1)).astype("float32"), "steps": 2, **settings}
    with pytest.raises(InputError, match=message):
        inference.infer(model, **arguments)


def test_only_a_capsnet_is_freed_and_the_toy_checks_its_settings():
    from poecaps.models import MatrixCapsNet

    with pytest.raises(InputError, match="infer frees the primary and class capsules of a CapsNet. Received: model "
                                         "of type MatrixCapsNet"):
        inference.infer(MatrixCapsNet((28, 28, 1), 3, a=8, b=2, c=2, d=2), np.zeros((2, 28, 28, 1), "float32"))
    for settings, message in [({"steps": -1}, "steps must be an integer >= 0"),
                              ({"learning_rate": 0}, "learning_rate must be a finite number > 0"),
                              ({"u": (1.0, 2.0)}, "u must be the network's three inputs"),
                              ({"target": float("nan")}, "target must be a finite number")]:
        with pytest.raises(InputError, match=message):
            inference.toy_states("l1", "full", **settings)


def test_whole_network_inference_lowers_the_energy_and_obeys_a_clamped_label(rng):
    model = _tiny_capsnet()
    images = rng.uniform(size=(6, 12, 12, 1)).astype("float32")
    labels = np.array([0, 1, 2, 0, 1, 2])
    free = inference.infer(model, images, steps=200, l1=0.0, learning_rate=0.01)
    energy = ops.convert_to_numpy(free["energy"])
    np.testing.assert_allclose(energy[0], 0.0, atol=1e-6)         # no L1, no label: the start is a minimum
    clamped = inference.infer(model, images, labels, steps=500, l1=0.0)
    energy = ops.convert_to_numpy(clamped["energy"])
    assert np.all(energy[-1] < energy[0])
    assert np.all(np.argmax(ops.convert_to_numpy(clamped["lengths"]), -1) == labels)


def test_inference_in_batches_keeps_every_example_on_its_own_column(rng):
    """Energies are `[steps + 1, N]` whichever the batch size: batches join along the examples, not the steps."""
    from poecaps.experiments.capsnet_inference import batched_infer

    model = _tiny_capsnet()
    images = rng.uniform(size=(7, 12, 12, 1)).astype("float32")
    whole = batched_infer(model, images, None, 7, steps=20, l1=0.5)
    split = batched_infer(model, images, None, 3, steps=20, l1=0.5)
    assert whole["energy"].shape == split["energy"].shape == (21, 7)
    assert split["lengths"].shape == (7, 3)
    # float32 through two conv layers and 20 steps: a few ulps of each energy (~1) per step
    np.testing.assert_allclose(split["energy"], whole["energy"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(split["lengths"], whole["lengths"], rtol=1e-4, atol=1e-5)


def test_the_largest_harmless_weight_is_the_first_in_order_not_below_the_feed_forward_pass():
    from poecaps.experiments.capsnet_inference import largest_harmless_weight

    assert largest_harmless_weight({1.0: 0.90, 0.7: 0.95, 0.5: 0.96, 0.3: 0.97}, 0.96) == 0.5
    assert largest_harmless_weight({1.0: 0.90, 0.5: 0.95}, 0.96) is None
    assert largest_harmless_weight({}, 0.96) is None


def test_calibration_stops_at_the_first_weight_that_keeps_the_feed_forward_answers(rng):
    """Labels are the feed-forward answers: L1 0 keeps them all (the start is a minimum), a huge L1 zeroes every
    capsule so the argmax falls on class 0."""
    from poecaps.experiments.capsnet_inference import calibrate_l1

    model = _tiny_capsnet()
    images = rng.uniform(size=(8, 12, 12, 1)).astype("float32")
    answers = np.argmax(ops.convert_to_numpy(inference.infer(model, images, steps=1, l1=0.0)["initial_lengths"]), -1)
    assert np.any(answers != 0), "a draw whose answers are all class 0 could not tell the weights apart"
    weight, record = calibrate_l1(model, images, answers, grid=(100.0, 0.0), batch_size=4, steps=20)
    assert weight == 0.0 and record["feed_forward_accuracy"] == 1.0
    assert record["accuracy_by_l1"]["100.0"] < 1.0 and record["accuracy_by_l1"]["0.0"] == 1.0
    weight, record = calibrate_l1(model, images, answers, grid=(0.0, 100.0), batch_size=4, steps=20)
    assert weight == 0.0 and list(record["accuracy_by_l1"]) == ["0.0"]


@pytest.mark.parametrize("grid", [(), (1.0, -0.5), (float("nan"),)])
def test_calibration_refuses_an_empty_or_negative_grid(grid):
    from poecaps.errors import InputError
    from poecaps.experiments.capsnet_inference import calibrate_l1

    with pytest.raises(InputError, match="grid must hold"):
        calibrate_l1(_tiny_capsnet(), np.zeros((2, 12, 12, 1), "float32"), np.zeros(2, "int64"), grid=grid)
