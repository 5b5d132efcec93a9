"""CapsNet and matrix capsules: shapes, masking, losses wired, tiny fit, save and reload."""

import keras
import numpy as np
import pytest
from keras import ops

from poecaps.errors import InputError
from poecaps.experiments.baselines import train_shards
from poecaps.experiments.configs import BaselineConfig
from poecaps.models import CapsNet, MatrixCapsNet, RoutingCapsNet
from poecaps.trainers.shards import default_shards
from poecaps.trainers.supervised import SupervisedTrainer


def _tiny_capsnet(**kwargs):
    args = {"image_shape": (14, 14, 3), "num_classes": 5, "routing_iterations": 2,
            "conv_filters": 8, "primary_types": 4, "primary_dim": 8, "class_dim": 16,
            "kernel_size": 3, "seed": 1}
    return CapsNet(**{**args, **kwargs})


def _tiny_em(**kwargs):
    args = {"image_shape": (20, 20, 1), "num_classes": 4, "routing_iterations": 2, "a": 8,
            "b": 2, "c": 3, "d": 3, "final_lambda": 0.05, "cost_normalization": "none",
            "margin_steps": 7, "chunk_capsules": 40}
    return MatrixCapsNet(**{**args, **kwargs})


def _trainer(network, optimizer=None, jit_compile="auto", run_eagerly=False, **kwargs):
    trainer = SupervisedTrainer(network, seed=3, **kwargs)
    trainer.compile(optimizer=optimizer or keras.optimizers.Adam(1e-3), jit_compile=jit_compile,
                    run_eagerly=run_eagerly)
    return trainer


def test_capsnet_shapes_follow_the_data(rng):
    model = _tiny_capsnet()
    out = model(rng.uniform(size=(2, 14, 14, 3)).astype("float32"))
    # 14 -3+1 = 12 -> (12-3)//2+1 = 5: 5*5*4 primary capsules
    assert out["scores"].shape == (2, 5) and out["poses"].shape == (2, 5, 16)
    assert out["coefficients"].shape == (2, 100, 5)
    assert out["reconstruction"].shape == (2, 14, 14, 3)


def test_capsnet_reconstruction_sees_only_the_masked_capsule(rng):
    model = _tiny_capsnet()
    poses = rng.normal(size=(1, 5, 16)).astype("float32")
    other = poses.copy()
    other[0, 1:] = rng.normal(size=(4, 16))
    a = ops.convert_to_numpy(model.reconstruct(poses, np.array([0])))
    b = ops.convert_to_numpy(model.reconstruct(other, np.array([0])))
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("reconstruction", [True, False])
def test_capsnet_tiny_fit_and_loss_terms(rng, reconstruction):
    network = _tiny_capsnet(reconstruction=reconstruction)
    trainer = _trainer(network, max_shift=1)
    x = rng.uniform(size=(16, 14, 14, 3)).astype("float32")
    y = rng.integers(0, 5, size=16)
    history = trainer.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert ("reconstruction_loss" in history) == reconstruction
    assert ("reconstruction" in network(x[:1])) == reconstruction
    assert np.all(np.isfinite(history["loss"]))
    expected = np.array(history["margin_loss"])
    if reconstruction:
        expected = expected + 0.0005 * np.array(history["reconstruction_loss"])
    np.testing.assert_allclose(history["loss"], expected, rtol=1e-4)


def _tiny_routing_capsnet():
    return RoutingCapsNet((17, 17, 1), 3, routing="dynamic", filters=4, primary_types=2, conv_types=2,
                          loss="spread", seed=0)


@pytest.mark.parametrize("make, image_shape", [(_tiny_capsnet, (14, 14, 3)), (_tiny_em, (20, 20, 1)),
                                               (_tiny_routing_capsnet, (17, 17, 1))])
def test_loss_terms_take_one_class_index_per_image(rng, make, image_shape):
    """Before, in the matrix and routing networks a label past the classes (or -1) was read as no class at all
    (an all-zero one-hot: no target, every class pushed down), 0.5 was cast to class 0, one label too many
    failed inside TensorFlow's broadcasting, and a NaN or negative step moved the spread loss's margin to NaN or
    below its start without a word; CapsNet named its labels 'classes' (its decoder's mask)."""
    network = make()
    k = network.num_classes
    images = rng.uniform(size=(2, *image_shape)).astype("float32")
    assert np.isfinite(float(network.loss_terms(images, np.array([0, k - 1]), step=3)[0]))
    refused = [
        ({"labels": np.array([0, k])}, rf"^labels must lie in \[0, {k}\)\. Received: 0 to {k}$"),
        ({"labels": np.array([-1, 0])}, rf"^labels must lie in \[0, {k}\)\. Received: -1 to 0$"),
        ({"labels": np.array([0.5, 0.0])}, r"^labels must be integers\. Received: dtype float64$"),
        ({"labels": np.array([0, 1, 1])}, r"^labels must be one class per image, shape \[2\]\. Received: shape=\(3,\)$"),
        ({"labels": np.eye(k)[[0, 1]]}, rf"^labels must be one class per image, shape \[2\]\. Received: shape=\(2, {k}\)$"),
        ({"labels": [0, 1], "step": float("nan")}, r"^step must be a finite number >= 0\. Received: step=nan$"),
        ({"labels": [0, 1], "step": -1}, r"^step must be a finite number >= 0\. Received: step=-1$"),
    ]
    for arguments, message in refused:
        with pytest.raises(InputError, match=message):
            network.loss_terms(images, **arguments)


def test_em_shapes_and_tiny_fit(rng):
    network = _tiny_em()
    x = rng.uniform(size=(8, 20, 20, 1)).astype("float32")
    out = network(x[:2])
    assert out["scores"].shape == (2, 4) and out["coefficients"].shape == (2, 3, 4)
    # eagerly: the compiled EM step is the sharding test's (below)
    history = _trainer(network, run_eagerly=True).fit(x, rng.integers(0, 4, size=8), batch_size=4, epochs=2,
                                                      verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    # the margin rises from 0.2 towards 0.9 over margin_steps=7 steps: 0.2 + 0.7 k / 7 after k steps
    # (the epoch means of steps 0, 1 and of steps 2, 3)
    np.testing.assert_allclose(history["margin"], [0.25, 0.45], rtol=1e-5)


def test_a_seeded_kernel_initializer_gives_each_capsule_layer_its_own_seed():
    """`MatrixCapsNet(kernel_initializer=NearIdentity(0.1, seed=3))`: capsule layer k starts as that initializer
    with seed 3 + k draws, so ConvCaps1 and ConvCaps2 of one shape do not start alike; the network's config keeps
    the initializer as given."""
    from poecaps.initializers import NearIdentity

    network = _tiny_em(b=3, kernel_initializer=NearIdentity(0.1, seed=3))
    layers = (network.conv_caps1, network.conv_caps2, network.class_capsules)
    first, second = (ops.convert_to_numpy(layer.kernel) for layer in layers[:2])
    assert first.shape == second.shape                       # one shape: alike before, when both used seed 3
    assert np.abs(first - second).max() > 1e-3
    for k, layer in enumerate(layers):
        expected = NearIdentity(0.1, seed=3 + k)(tuple(layer.kernel.shape), dtype="float32")
        np.testing.assert_array_equal(ops.convert_to_numpy(layer.kernel), ops.convert_to_numpy(expected))
    assert network.get_config()["kernel_initializer"]["config"]["seed"] == 3


# The shards are the trainer's, whatever the network: CapsNet is checked in 2 and in 4 shards, EM (the costliest
# to compile, once per shard count) in 4, whose last batch has empty shards.
@pytest.mark.parametrize("make, counts", [(_tiny_capsnet, (2, 4)), (_tiny_em, (4,))], ids=["_tiny_capsnet", "_tiny_em"])
def test_sharded_training_takes_the_same_steps_as_the_whole_batch(rng, make, counts):
    """An epoch of batches of 4, 4 and 2 images in `counts` shards (with 4 the last batch has two
    empty shards), random shifts on: the same weights and metrics as one XLA computation per batch.
    Plain SGD, so that rounding differences in the gradients stay as small in the weights."""
    x = rng.uniform(size=(10, *make().image_shape)).astype("float32")
    y = rng.integers(0, make().num_classes, size=10)
    weights, histories = {}, {}
    for n in (1, *counts):
        keras.utils.set_random_seed(0)     # the same initial weights
        trainer = _trainer(make(), keras.optimizers.SGD(0.1), jit_compile=True, max_shift=1, shards=n)
        histories[n] = trainer.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history
        weights[n] = [ops.convert_to_numpy(w) for w in trainer.network.trainable_weights]
    keras.utils.set_random_seed(0)
    start = [ops.convert_to_numpy(w) for w in make().trainable_weights]
    assert not all(np.allclose(a, b) for a, b in zip(weights[1], start))
    for shards in counts:
        for sharded, whole in zip(weights[shards], weights[1]):
            np.testing.assert_allclose(sharded, whole, rtol=1e-5, atol=1e-5)
        for key in histories[1]:
            np.testing.assert_allclose(histories[shards][key], histories[1][key], rtol=1e-5, atol=1e-7)


def test_baseline_runs_shard_only_xla_steps_by_default():
    assert train_shards(BaselineConfig(model="em")) == default_shards()      # XLA by default
    assert train_shards(BaselineConfig(model="em", jit_compile="false")) == 1
    assert train_shards(BaselineConfig(model="capsnet")) == 1                # no XLA by default
    assert train_shards(BaselineConfig(model="capsnet", jit_compile="true", shards=3)) == 3


@pytest.mark.parametrize("make", [_tiny_capsnet, _tiny_em])
def test_config_round_trip_and_reload_identical_predictions(tmp_path, rng, make):
    from poecaps.models.saving import load_component, save_component

    network = make(name="net")
    x = rng.uniform(size=(4, *network.image_shape)).astype("float32")
    # one step, eagerly (compiling EM's step under XLA was most of the test): weights that differ from the start
    _trainer(network, run_eagerly=True).fit(x, rng.integers(0, network.num_classes, size=4), epochs=1, verbose=0)
    config = network.get_config()
    assert type(network).from_config(config).get_config() == config
    path = str(tmp_path / "model.keras")
    save_component(network, path)
    again = load_component(path)
    assert type(again) is type(network) and again.get_config() == config
    np.testing.assert_array_equal(ops.convert_to_numpy(again(x)["scores"]),
                                  ops.convert_to_numpy(network(x)["scores"]))


@pytest.mark.parametrize("make, kwargs, message", [
    (CapsNet, {"image_shape": (28, 28), "num_classes": 10}, "image_shape must be"),
    # a float or a bool size: before, the first failed in Keras' Dense (units=784.0), the second built a model
    (CapsNet, {"image_shape": (28.0, 28, 1), "num_classes": 10},
     r"image_shape must be \(height, width, channels\), three integers >= 1\. Received: image_shape=\(28\.0, 28, 1\)"),
    (RoutingCapsNet, {"image_shape": (28, 28, True), "num_classes": 10}, r"Received: image_shape=\(28, 28, True\)"),
    (MatrixCapsNet, {"image_shape": 28, "num_classes": 10}, r"Received: image_shape=28"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 1}, "num_classes must be"),
    # before, taken as given: a negative weight trains toward worse reconstructions, a string fails in training
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "reconstruction_weight": -1.0},
     r"reconstruction_weight must be a finite number >= 0\. Received: reconstruction_weight=-1\.0"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "reconstruction_weight": "0.1"},
     r"Received: reconstruction_weight='0\.1'"),
    (MatrixCapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "routing_iterations": 0},
     r"routing_iterations must be an integer >= 1\. Received: routing_iterations=0"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "primary_dim": 0},
     r"primary_dim must be an integer >= 1\. Received: primary_dim=0"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "conv_filters": True},
     r"conv_filters must be an integer >= 1\. Received: conv_filters=True"),
    (RoutingCapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "chunk_capsules": 0},
     r"chunk_capsules must be an integer >= 1, or None\. Received: chunk_capsules=0"),
    # CapsNet: two unpadded 15 x 15 convolutions, the second of stride 2, need 15 + (15 - 1) = 29 pixels
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "kernel_size": 15},
     r"need at least 29 x 29 pixels\. Received: image_shape=\(28, 28, 1\)"),
    # conv1 5/2, primary 1/1, ConvCaps1 3/2, ConvCaps2 3/1: 16 -> 6 -> 6 -> 2 -> 0 positions
    (MatrixCapsNet, {"image_shape": (16, 16, 1), "num_classes": 10, "a": 4, "b": 2, "c": 2, "d": 2},
     r"need at least 17 x 17 pixels"),
    (RoutingCapsNet, {"image_shape": (28, 16, 1), "num_classes": 10, "filters": 4, "primary_types": 2,
                      "conv_types": 2}, r"need at least 17 x 17 pixels"),
])
def test_invalid_arguments(make, kwargs, message):
    with pytest.raises(InputError, match=message):
        make(**kwargs)


@pytest.mark.parametrize("make, kwargs", [
    # the smallest images the checks above let through: each network runs on them (one position left)
    (CapsNet, {"image_shape": (29, 29, 1), "kernel_size": 15, "conv_filters": 4, "primary_types": 2}),
    (MatrixCapsNet, {"image_shape": (17, 17, 1), "a": 4, "b": 2, "c": 2, "d": 2}),
    (RoutingCapsNet, {"image_shape": (17, 17, 1), "filters": 4, "primary_types": 2, "conv_types": 2}),
])
def test_the_smallest_image_allowed_runs_and_sizes_are_stored_as_int(make, kwargs):
    network = make(num_classes=np.int64(3), **kwargs)
    scores = ops.convert_to_numpy(network(np.zeros((2, *kwargs["image_shape"]), "float32"))["scores"])
    assert scores.shape == (2, 3) and np.isfinite(scores).all()
    assert type(network.get_config()["num_classes"]) is int


@pytest.mark.parametrize("kwargs, message", [({"shards": 0}, "shards=0"), ({"max_shift": -1}, "max_shift=-1")])
def test_invalid_trainer_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        SupervisedTrainer(_tiny_capsnet(), **kwargs)


def test_saved_network_loads_in_a_fresh_process(tmp_path, rng):
    import subprocess
    import sys

    from poecaps.models.saving import save_component

    network = _tiny_capsnet()
    x = rng.uniform(size=(4, *network.image_shape)).astype("float32")
    path = str(tmp_path / "model.keras")
    save_component(network, path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "scores.npy", ops.convert_to_numpy(network(x)["scores"]))
    code = ("import numpy as np; from poecaps.models.saving import load_component; "
            f"m = load_component({path!r}); x = np.load({str(tmp_path / 'x.npy')!r}); "
            f"np.testing.assert_array_equal(np.asarray(m(x)['scores']), np.load({str(tmp_path / 'scores.npy')!r}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("make, jit_compile", [(_tiny_capsnet, False), (_tiny_em, True)])
def test_compiled_batched_prediction_equals_the_eager_model(rng, make, jit_compile):
    from poecaps.experiments.baseline_evaluation import compiled_predictor, predict_in_batches

    model = make()
    x = rng.uniform(size=(7, *model.image_shape)).astype("float32")
    eager = model(x, training=False)
    # batches of 3: the last one holds 1 image and 2 zero images, dropped again
    scores, coefficients = predict_in_batches(compiled_predictor(model, jit_compile), x, 3)
    assert scores.shape == (7, model.num_classes)
    np.testing.assert_allclose(scores, ops.convert_to_numpy(eager["scores"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(coefficients, ops.convert_to_numpy(eager["coefficients"]),
                               rtol=1e-4, atol=1e-6)


def test_batched_prediction_refuses_a_batch_size_below_one_and_no_images():
    """Batches of 0 failed inside `range`; no images gave nothing to unpack (a ValueError from the caller).
    A batch size above the number of images takes them all in one batch."""
    from poecaps.experiments.baseline_evaluation import predict_in_batches

    calls = []

    def predict(batch):
        calls.append(len(batch))
        return batch.sum(axis=(1, 2)), batch[:, 0]

    images = np.arange(12, dtype="float32").reshape(3, 2, 2)
    sums, firsts = predict_in_batches(predict, images, 10)
    np.testing.assert_array_equal(sums, [6.0, 22.0, 38.0])
    np.testing.assert_array_equal(firsts, images[:, 0])
    assert calls == [3]
    for batch_size in (0, -1, 2.5):
        with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
            predict_in_batches(predict, images, batch_size)
    with pytest.raises(InputError, match="images is empty"):
        predict_in_batches(predict, images[:0], 4)


def test_coefficient_entropy_by_hand_and_its_refusals():
    """The mean entropy along the router's axis over its log, by hand: a uniform row over J = 4 parents gives
    log 4 and 1, a one-hot row 0; over the children axis a [2, 2] block of columns (0.5, 0.5) and (1, 0) gives
    (log 2 + 0) / 2. A `normalizes` other than the two names was read as "children"; coefficients that are not
    [N, I, J] or have one capsule on the axis (entropy over log 1 = 0/0) gave a number or NaN."""
    from poecaps.experiments.baseline_evaluation import coefficient_entropy

    # zeros are clipped to 1e-12 before the log: each adds 1e-12 * 27.6 nats, hence the tolerance
    rows = np.array([[[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]])          # [1, 2, 4]
    entropy, over_log = coefficient_entropy(rows, "parents")
    assert entropy == pytest.approx(np.log(4) / 2, abs=1e-10) and over_log == pytest.approx(0.5, abs=1e-10)
    columns = np.array([[[0.5, 1.0], [0.5, 0.0]]])                                # [1, I=2, J=2]
    entropy, over_log = coefficient_entropy(columns, "children")
    assert entropy == pytest.approx(np.log(2) / 2, abs=1e-10) and over_log == pytest.approx(0.5, abs=1e-10)
    with pytest.raises(InputError, match="normalizes must be 'parents' or 'children'"):
        coefficient_entropy(columns, "child")
    with pytest.raises(InputError, match=r"coefficients must be \[N, I, J\]"):
        coefficient_entropy(rows[0], "parents")
    with pytest.raises(InputError, match="at least two children"):
        coefficient_entropy(rows[:, :1], "children")
