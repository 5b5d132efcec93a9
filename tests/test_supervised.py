"""CapsNet and matrix capsules: shapes, masking, losses wired, tiny fit, save and reload."""

import os

import keras
import numpy as np
import pytest
from keras import ops

from poecaps.configs import BaselineConfig
from trainers.shards import default_shards
from trainers.supervised import CapsNet, MatrixCapsNet


def _tiny_capsnet(**kwargs):
    args = {"image_shape": (14, 14, 3), "num_classes": 5, "routing_iterations": 1,
            "conv_filters": 8, "primary_types": 4, "primary_dim": 8, "class_dim": 16,
            "kernel_size": 3, "seed": 1}
    return CapsNet(**{**args, **kwargs})


def _tiny_em(**kwargs):
    args = {"image_shape": (20, 20, 1), "num_classes": 4, "routing_iterations": 2, "a": 8,
            "b": 2, "c": 3, "d": 3, "final_lambda": 0.05, "cost_normalization": "none",
            "margin_steps": 7, "chunk_capsules": 40, "max_shift": 1, "seed": 2}
    return MatrixCapsNet(**{**args, **kwargs})


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
    model = _tiny_capsnet(reconstruction=reconstruction)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    x = rng.uniform(size=(16, 14, 14, 3)).astype("float32")
    y = rng.integers(0, 5, size=16)
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=0).history
    assert ("reconstruction_loss" in history) == reconstruction
    assert ("reconstruction" in model(x[:1])) == reconstruction
    assert np.all(np.isfinite(history["loss"]))
    expected = np.array(history["margin_loss"])
    if reconstruction:
        expected = expected + 0.0005 * np.array(history["reconstruction_loss"])
    np.testing.assert_allclose(history["loss"], expected, rtol=1e-4)


def test_em_shapes_and_tiny_fit(rng):
    model = _tiny_em()
    x = rng.uniform(size=(8, 20, 20, 1)).astype("float32")
    out = model(x[:2])
    assert out["scores"].shape == (2, 4) and out["coefficients"].shape == (2, 3, 4)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    history = model.fit(x, rng.integers(0, 4, size=8), batch_size=4, epochs=2, verbose=0).history
    assert np.all(np.isfinite(history["loss"]))
    # the margin rises from 0.2 towards 0.9 over margin_steps=7 steps
    assert 0.2 < history["margin"][0] < history["margin"][1] <= 0.9


@pytest.mark.parametrize("make", [_tiny_capsnet, _tiny_em])
@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_training_takes_the_same_steps_as_the_whole_batch(rng, make, shards):
    """An epoch of batches of 4, 4 and 2 images (with 4 shards the last has two empty shards),
    random shifts on: the same weights and metrics as one XLA computation per batch. Plain SGD,
    so that rounding differences in the gradients stay as small in the weights."""
    x = rng.uniform(size=(10, *make().image_shape)).astype("float32")
    y = rng.integers(0, make().num_classes, size=10)
    weights, histories = [], []
    for n in (1, shards):
        keras.utils.set_random_seed(0)     # the same initial weights
        model = make(max_shift=1, shards=n)
        model.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=True)
        histories.append(model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0).history)
        weights.append([ops.convert_to_numpy(w) for w in model.trainable_weights])
    keras.utils.set_random_seed(0)
    start = [ops.convert_to_numpy(w) for w in make().trainable_weights]
    assert not all(np.allclose(a, b) for a, b in zip(weights[0], start))
    for sharded, whole in zip(weights[1], weights[0]):
        np.testing.assert_allclose(sharded, whole, rtol=1e-5, atol=1e-5)
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-5, atol=1e-7)


def test_baseline_runs_shard_only_xla_steps_by_default():
    assert BaselineConfig(model="em").train_shards == default_shards()      # XLA by default
    assert BaselineConfig(model="em", jit_compile="false").train_shards == 1
    assert BaselineConfig(model="capsnet").train_shards == 1                # no XLA by default
    assert BaselineConfig(model="capsnet", jit_compile="true", shards=3).train_shards == 3


@pytest.mark.parametrize("make", [_tiny_capsnet, _tiny_em])
def test_config_round_trip_and_reload_identical_predictions(tmp_path, rng, make):
    model = make(shards=2)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    x = rng.uniform(size=(4, *model.image_shape)).astype("float32")
    model.fit(x, rng.integers(0, model.num_classes, size=4), epochs=1, verbose=0)
    config = model.get_config()
    assert config["shards"] == 2
    assert type(model).from_config(config).get_config() == config
    path = str(tmp_path / "model.keras")
    model.save(path)
    again = keras.saving.load_model(path)
    assert again.optimizer is not None and again.shards == 2     # compiled again on loading
    np.testing.assert_array_equal(ops.convert_to_numpy(again(x)["scores"]),
                                  ops.convert_to_numpy(model(x)["scores"]))


@pytest.mark.parametrize("make, kwargs, message", [
    (CapsNet, {"image_shape": (28, 28), "num_classes": 10}, "image_shape must be"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 1}, "num_classes must be"),
    (MatrixCapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "routing_iterations": 0},
     "at least one M-step"),
    (CapsNet, {"image_shape": (28, 28, 1), "num_classes": 10, "shards": 0}, "shards must be"),
])
def test_invalid_arguments(make, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_model_saved_with_the_guarded_schedule_loads_in_a_fresh_process(tmp_path, rng):
    import subprocess
    import sys

    from poecaps.guard import ScaledSchedule

    model = _tiny_capsnet()
    model.compile(optimizer=keras.optimizers.Adam(
        ScaledSchedule(keras.optimizers.schedules.ExponentialDecay(1e-3, 10, 0.9))))
    x = rng.uniform(size=(4, *model.image_shape)).astype("float32")
    model.fit(x, rng.integers(0, model.num_classes, size=4), epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "scores.npy", ops.convert_to_numpy(model(x)["scores"]))
    code = ("import sys, numpy as np, keras; sys.path.insert(0, '.'); import trainers.supervised; "
            f"m = keras.saving.load_model({path!r}); x = np.load({str(tmp_path / 'x.npy')!r}); "
            f"np.testing.assert_array_equal(np.asarray(m(x)['scores']), np.load({str(tmp_path / 'scores.npy')!r}))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("make, jit_compile", [(_tiny_capsnet, False), (_tiny_em, True)])
def test_compiled_batched_prediction_equals_the_eager_model(rng, make, jit_compile):
    from poecaps.baseline_evaluation import compiled_predictor, predict_in_batches

    model = make()
    x = rng.uniform(size=(7, *model.image_shape)).astype("float32")
    eager = model(x, training=False)
    # batches of 3: the last one holds 1 image and 2 zero images, dropped again
    scores, coefficients = predict_in_batches(compiled_predictor(model, jit_compile), x, 3)
    assert scores.shape == (7, model.num_classes)
    np.testing.assert_allclose(scores, ops.convert_to_numpy(eager["scores"]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(coefficients, ops.convert_to_numpy(eager["coefficients"]),
                               rtol=1e-4, atol=1e-6)
