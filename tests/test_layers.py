import keras
import numpy as np
import pytest
from keras import ops

from poecaps.capsules import primary_capsules, squash
from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.layers import CapsuleDense, ConvAutoencoder, PrimaryCapsules
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting


def _roundtrip(layer):
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config
    return clone


def _save_and_reload(tmp_path, model, inputs):
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(ops.convert_to_numpy(model(inputs)),
                                  ops.convert_to_numpy(reloaded(inputs)))


def test_capsule_dense_shapes_and_hand_computed_case():
    layer = CapsuleDense(1, 2, routing=DynamicRouting(0))
    x = np.array([[[1.0, 0.0], [0.0, 1.0]]], dtype="float32")  # two 2-D inputs, one parent
    layer.build(x.shape)
    layer.kernel.assign(np.array([[[[1.0, 0.0], [0.0, 1.0]]], [[[2.0, 0.0], [0.0, 2.0]]]]))
    # c = 1 (one parent); z = I x_1 + 2 I x_2 = (1, 2); squash -> 5/6 * (1, 2)/sqrt(5)
    expected = 5 / 6 * np.array([1.0, 2.0]) / np.sqrt(5)
    np.testing.assert_allclose(ops.convert_to_numpy(layer(x))[0, 0], expected, rtol=1e-5)


def test_capsule_dense_votes_path_equals_linear_path(rng):
    x = rng.normal(size=(2, 6, 4)).astype("float32")
    layer = CapsuleDense(3, 5, routing="cosine")
    fast = ops.convert_to_numpy(layer(x))
    slow = ops.convert_to_numpy(layer.routing(layer.votes(x)).poses)
    np.testing.assert_allclose(fast, slow, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_capsules": 0, "capsule_dim": 4}, "num_capsules=0"),
    ({"num_capsules": 3, "capsule_dim": -2}, "capsule_dim=-2"),
])
def test_capsule_dense_invalid_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        CapsuleDense(**kwargs)


def test_capsule_dense_votes_build_and_check_the_inputs(rng):
    """`votes` builds the layer for the first inputs, as `route` does (before, AttributeError 'kernel'), and
    refuses inputs of another shape after (before, an einsum error)."""
    x = rng.normal(size=(2, 6, 4)).astype("float32")
    layer = CapsuleDense(3, 5, name="caps")
    votes = ops.convert_to_numpy(layer.votes(x))
    np.testing.assert_allclose(votes, np.einsum("bie,ijoe->bijo", x, ops.convert_to_numpy(layer.kernel)),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match=r"caps was built for inputs of shape \[None, 6, 4\]"):
        layer.votes(x[:, :, :3])


def test_capsule_dense_rejects_wrong_rank():
    with pytest.raises(InputError, match="input_shape"):
        CapsuleDense(2, 3).build((4, 8))


def test_capsule_dense_config_round_trip_and_save(tmp_path, rng):
    layer = CapsuleDense(3, 5, routing=DynamicRouting(2, "cosine", "children"),
                         kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1),
                         kernel_regularizer=keras.regularizers.L2(0.1), name="caps")
    clone = _roundtrip(layer)
    assert clone.routing.get_config() == layer.routing.get_config()
    inputs = keras.Input((6, 4))
    model = keras.Model(inputs, layer(inputs))
    _save_and_reload(tmp_path, model, rng.normal(size=(2, 6, 4)).astype("float32"))


def test_capsule_dense_tiny_fit(rng):
    x = rng.normal(size=(16, 6, 4)).astype("float32")
    y = rng.uniform(0.1, 0.9, size=(16, 2)).astype("float32")
    inputs = keras.Input((6, 4))
    lengths = keras.layers.Lambda(lambda p: ops.sqrt(ops.sum(p * p, -1) + 1e-7))(
        CapsuleDense(2, 3, routing="dynamic")(inputs))
    model = keras.Model(inputs, lengths)
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss="mse")
    history = model.fit(x, y, epochs=15, verbose=0)
    assert history.history["loss"][-1] < history.history["loss"][0]


def test_primary_capsules(tmp_path, rng):
    layer = PrimaryCapsules(capsule_dim=4, squash=False, name="prim")
    _roundtrip(layer)
    code = rng.normal(size=(2, 3, 3, 8)).astype("float32")
    out = ops.convert_to_numpy(layer(code))
    assert out.shape == (2, 18, 4)
    np.testing.assert_array_equal(out[1, 3], code[1, 0, 1, 4:8])
    squashed = ops.convert_to_numpy(PrimaryCapsules(4)(code))
    np.testing.assert_allclose(squashed, ops.convert_to_numpy(squash(out)), rtol=1e-6)
    with pytest.raises(InputError, match="capsule_dim=3"):
        PrimaryCapsules(3)(code)
    with pytest.raises(InputError, match="capsule_dim=0"):
        PrimaryCapsules(0)
    # a code without its channel axis: before, its width was read as channels ("must divide the channels (3)")
    for layer in (PrimaryCapsules(4), lambda c: primary_capsules(c, 4)):
        with pytest.raises(InputError, match=r"A conv code must be \[batch, height, width, channels\]\. "
                                             r"Received: shape=\(2, 3, 3\)"):
            layer(code[..., 0])


def test_primary_capsules_in_a_functional_model_on_images_of_any_size(rng):
    """A code of unknown height and width gives an unknown capsule count (before: None * None failed), and the
    model then reshapes each code as NumPy does."""
    import keras

    code_in = keras.Input((None, None, 8))
    capsules = PrimaryCapsules(4, squash=False)(code_in)
    assert tuple(capsules.shape) == (None, None, 4)
    model = keras.Model(code_in, capsules)
    for h, w in ((3, 3), (2, 5)):
        code = rng.normal(size=(2, h, w, 8)).astype("float32")
        np.testing.assert_array_equal(ops.convert_to_numpy(model(code)), code.reshape(2, h * w * 2, 4))


def test_conv_autoencoder_sizes_rgb_and_tied_weights(rng):
    ae = ConvAutoencoder(filters=16, kernel_size=5, strides=2, dropout=0.2, seed=3)
    images = rng.uniform(size=(2, 32, 32, 3)).astype("float32")
    out = ae(images)
    assert out.shape == images.shape
    assert ae.code_shape == (12, 12, 16)
    assert tuple(ae.encode(images).shape) == (2, 12, 12, 16)
    # Only two filter banks: the decoder reuses them transposed.
    assert sorted(w.path.split("/")[-1] for w in ae.weights if len(w.shape) == 4) == ["kernel1", "kernel2"]


def test_conv_autoencoder_paper_sizes(rng):
    ae = ConvAutoencoder()
    images = rng.uniform(size=(1, 28, 28, 1)).astype("float32")
    assert tuple(ae.encode(images).shape) == (1, 6, 6, 128)
    assert ae(images).shape == (1, 28, 28, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"filters": 0}, "filters=0"), ({"dropout": 1.5}, "dropout=1.5"), ({"strides": 0}, "strides=0"),
    # before, taken as given: NaN made every output NaN, a string failed in the first call
    ({"negative_slope": float("nan")}, r"negative_slope must be a finite number >= 0\. Received: negative_slope=nan"),
    ({"negative_slope": "a"}, r"Received: negative_slope='a'")])
def test_conv_autoencoder_invalid_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        ConvAutoencoder(**kwargs)


def test_conv_autoencoder_rejects_too_small_images():
    with pytest.raises(InputError, match="too small"):
        ConvAutoencoder(kernel_size=9)(np.zeros((1, 12, 12, 1), "float32"))


def test_conv_autoencoder_config_round_trip_and_save(tmp_path, rng):
    _roundtrip(ConvAutoencoder(filters=8, kernel_size=3, strides=1, dropout=0.3,
                               negative_slope=0.1, seed=7, name="ae"))
    inputs = keras.Input((10, 10, 1))
    model = keras.Model(inputs, ConvAutoencoder(filters=8, kernel_size=3)(inputs))
    _save_and_reload(tmp_path, model, rng.uniform(size=(2, 10, 10, 1)).astype("float32"))


def test_capsule_experts_and_rbm_config_round_trip_and_save(tmp_path, rng):
    experts = CapsuleExperts(4, 3, routing=DynamicRouting(1, "dot", "children"), name="poe")
    clone = _roundtrip(experts)
    assert clone.routing.normalize == "children"
    inputs = keras.Input((5, 2))
    _save_and_reload(tmp_path, keras.Model(inputs, experts(inputs)),
                     rng.normal(size=(2, 5, 2)).astype("float32"))
    rbm = BernoulliRBM(7, seed=3, name="rbm")
    _roundtrip(rbm)
    inputs = keras.Input((6,))
    _save_and_reload(tmp_path, keras.Model(inputs, rbm(inputs)), rng.uniform(size=(3, 6)).astype("float32"))
    with pytest.raises(InputError, match="num_hidden=0"):
        BernoulliRBM(0)


@pytest.mark.parametrize("make", [lambda: CapsuleExperts(2, 3, name="poe"), lambda: BernoulliRBM(4, name="poe")])
def test_energy_models_without_weights_say_so(make):
    """Before, `visible_shape` (both) and the RBM's `visible_probabilities` raised AttributeError 'kernel'."""
    with pytest.raises(InputError, match=r"^poe has no weights yet; build it \(call it on a batch of visible units\)"):
        _ = make().visible_shape
    if isinstance(make(), BernoulliRBM):
        with pytest.raises(InputError, match=r"^poe has no weights yet"):
            make().visible_probabilities(np.eye(4, dtype="float32"))


def test_capsule_experts_reconstruct_builds_and_checks_its_visible_capsules(rng):
    """`reconstruct` builds the layer for the capsules it is first given, as `free_energy` and `p_on` do (before,
    AttributeError 'kernel'), and refuses capsules of another shape after."""
    x = squash(rng.normal(size=(3, 5, 4)).astype("float32"))
    experts = CapsuleExperts(2, 3, name="poe")
    assert tuple(experts.reconstruct(x).shape) == (3, 5, 4) and experts.visible_shape == (5, 4)
    with pytest.raises(InputError, match=r"poe was built for inputs of shape \[None, 5, 4\]"):
        experts.reconstruct(x[:, :4])
