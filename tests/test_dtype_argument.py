"""A layer or model made with `dtype=...` computes as one made under that global policy, as Keras layers do.

Keras hands a layer's `dtype` to nothing by itself: a layer that makes layers passes its `dtype_policy` on
(Keras' `MultiHeadAttention` does). Before, poecaps' layers and models passed it on to none of theirs, so
`CapsNet(dtype="float64")` kept float32 weights and computed in float32, the learned routers of a
`CapsuleDense(dtype="float64")` did too, and the models' configs dropped `dtype` and `trainable`, so a saved
model came back in the loading session's policy and trainable.
"""

import keras
import numpy as np
import pytest
from policies import global_policy
from small_trainers import TRAINER_NAMES, each_trainer

from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.layers import (
    AttentionPooling,
    CapsuleDense,
    InducedSetAttention,
    MultiheadAttentionBlock,
)
from poecaps.models import (
    CapsNet,
    GenerativeCapsules,
    MatrixCapsNet,
    ProbabilisticCapsuleAutoencoder,
    ProbabilisticCapsules,
    RoutingCapsNet,
    VariationalAutoencoder,
)
from poecaps.trainers.resumable import fit_resumable

_data = np.random.default_rng(0)
_IMAGES12 = _data.uniform(size=(2, 12, 12, 1)).astype("float32")
_IMAGES28 = _data.uniform(size=(2, 28, 28, 1)).astype("float32")
_CAPSULES = _data.uniform(-0.5, 0.5, size=(2, 5, 4)).astype("float32")
_SETS = _data.uniform(size=(2, 5, 8)).astype("float32")


def _pcae(**dtype):
    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=2, num_parts=2, template_size=5, **dtype)
    return ProbabilisticCapsuleAutoencoder(generative, channels=4, hidden=8, encoding=4, blocks=1, inducing=2,
                                           heads=2, **dtype)


# name: (make(**dtype), inputs); each makes layers of its own.
CASES = {
    "capsule_dense_similarity": (lambda **d: CapsuleDense(3, 4, routing="similarity", **d), (_CAPSULES,)),
    "capsule_dense_connectionist": (lambda **d: CapsuleDense(3, 4, routing="connectionist", **d), (_CAPSULES,)),
    "capsule_experts": (lambda **d: CapsuleExperts(3, 2, **d), (_CAPSULES,)),
    "attention_block": (lambda **d: MultiheadAttentionBlock(8, 2, **d), (_SETS, _SETS)),
    "induced_set_attention": (lambda **d: InducedSetAttention(8, 2, 3, **d), (_SETS,)),
    "attention_pooling": (lambda **d: AttentionPooling(8, 2, 2, **d), (_SETS,)),
    "capsnet": (lambda **d: CapsNet((12, 12, 1), 3, conv_filters=4, primary_types=2, primary_dim=4, class_dim=4,
                                    kernel_size=3, **d), (_IMAGES12,)),
    "routing_capsnet": (lambda **d: RoutingCapsNet((28, 28, 1), 3, routing="connectionist", filters=4,
                                                   primary_types=2, conv_types=2, **d), (_IMAGES28,)),
    "routing_capsnet_sparse": (lambda **d: RoutingCapsNet((28, 28, 1), 3, routing="sparse_inference", filters=4,
                                                          primary_types=2, conv_types=2, **d), (_IMAGES28,)),
    "matrix_capsnet": (lambda **d: MatrixCapsNet((28, 28, 1), 3, a=4, b=2, c=2, d=2, **d), (_IMAGES28,)),
    "vae": (lambda **d: VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5, **d), (_IMAGES12,)),
    "capsule_autoencoder": (_pcae, (_IMAGES12,)),
    "generative_capsules": (lambda **d: GenerativeCapsules(2, 3, 4, seed=0, **d), (_CAPSULES,)),
}


def _made(make, inputs, **dtype):
    """`(layer, outputs)`: `make(**dtype)` with Keras' global seed reset first (same initial weights), called."""
    keras.utils.set_random_seed(0)
    layer = make(**dtype)
    return layer, layer(*inputs)


def _policies(layer):
    """Each computing layer's class and dtype policy, in Keras' order. Keras' `Sequential` takes no `dtype` and
    hands tensors on as they come, so it and its input layer are left out."""
    containers = (keras.Sequential, keras.layers.InputLayer)
    return [(type(sub).__name__, sub.dtype_policy.name) for sub in layer._flatten_layers()
            if not isinstance(sub, containers)]


def _floating(outputs):
    return [np.asarray(keras.ops.convert_to_numpy(t)) for t in keras.tree.flatten(outputs)
            if keras.backend.is_float_dtype(t.dtype)]


@pytest.mark.parametrize("policy", ["float64", "mixed_bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_dtype_given_computes_as_the_global_policy(name, policy):
    """Made with `dtype=policy` under float32, each layer and model has the layers, weights and outputs (dtypes
    and values) of the same one made under the global `policy`. Both run the same operations on the same
    numbers, so they agree to a few roundings of the outputs' dtype."""
    make, inputs = CASES[name]
    with global_policy(policy):
        want, want_out = _made(make, inputs)
    got, got_out = _made(make, inputs, dtype=policy)
    assert _policies(got) == _policies(want)
    assert [v.dtype for v in got.weights] == [v.dtype for v in want.weights]
    for g, w in zip(got.get_weights(), want.get_weights()):
        np.testing.assert_array_equal(g, w)
    got_out, want_out = _floating(got_out), _floating(want_out)
    assert [t.dtype for t in got_out] == [t.dtype for t in want_out]
    for g, w in zip(got_out, want_out):
        eps = np.finfo(np.float64 if g.dtype == np.float64 else np.float32).eps
        np.testing.assert_allclose(g.astype("float64"), w.astype("float64"), rtol=100 * eps,
                                   atol=100 * eps * max(1.0, float(np.abs(w).max())))


MODELS = ["capsnet", "routing_capsnet", "matrix_capsnet", "vae", "capsule_autoencoder"]


@pytest.mark.parametrize("name", MODELS)
def test_a_saved_model_keeps_its_dtype_and_trainable(tmp_path, name):
    """A model saved with `dtype="float64"` and `trainable=False` loads (under float32) as it was saved: its
    config records both, as every Keras layer's does, and its weights come back unrounded."""
    make, inputs = CASES[name]
    model, _ = _made(make, inputs, dtype="float64", trainable=False)
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    assert loaded.dtype_policy.name == "float64" and not loaded.trainable
    assert _policies(loaded) == _policies(model)
    for g, w in zip(loaded.get_weights(), model.get_weights()):
        assert g.dtype == np.float64
        np.testing.assert_array_equal(g, w)


def test_a_capsule_autoencoder_refuses_a_generative_model_of_another_precision():
    """Its likelihoods are computed in the generative model's precision: one made in float32 inside a float64
    model failed deep in rendering (a float32 tensor met a float64 one); now it is named at once."""
    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=2, num_parts=2, template_size=5)
    with pytest.raises(InputError, match="make the ProbabilisticCapsules with dtype='float64'"):
        ProbabilisticCapsuleAutoencoder(generative, channels=4, hidden=8, encoding=4, blocks=1, inducing=2,
                                        heads=2, dtype="float64")
    with pytest.raises(InputError, match="must be a ProbabilisticCapsules"):
        ProbabilisticCapsuleAutoencoder(CapsuleExperts(3, 2))


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_every_trainer_takes_data_of_either_float_dtype(name, make, x, y):
    """`fit_resumable` hands a trainer its arrays as they are (Keras' `fit` casts them to `floatx` first). Each
    trainer's steps cast a batch to its model's precision, as a Keras layer casts its inputs: float64 data
    trains a float32 model exactly as the same data in float32 does (the cast is the data's rounding). Before,
    five of the seven trainers failed at their first step, adding a float64 term to a float32 one."""
    trained = {}
    for dtype in ("float32", "float64"):
        keras.utils.set_random_seed(0)
        trainer = make()
        trainer.compile(optimizer=keras.optimizers.SGD(1e-2))
        data = [np.asarray(x, dtype), None if y is None or y.dtype.kind == "i" else np.asarray(y, dtype)]
        history = fit_resumable(trainer, data[0], y if data[1] is None else data[1], epochs=1, batch_size=4,
                                seed=0, verbose=0)
        assert all(np.isfinite(values).all() for values in history.values())
        trained[dtype] = trainer.get_weights()
    for got, want in zip(trained["float64"], trained["float32"]):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_a_trainer_trains_a_float64_model_as_under_a_float64_policy(name, make, x, y):
    """A model made with `dtype="float64"` under float32 trains, on float32 data, in float64 (weights, steps and
    predictions) and to the weights the same trainer reaches under Keras' float64 set-up (policy and `floatx`).
    The two differ only where Keras keeps `floatx`: the optimizer's learning rate, rounded to float32 (a relative
    6e-8 of each step), so they agree to 1e-6 of how far the weights moved. Before, the trainer's float32
    policy rounded the model's input in `predict`, and most steps failed on the float32 data."""
    runs = {}
    for setup in ("global", "argument"):
        with global_policy("float64" if setup == "global" else "float32"):
            keras.utils.set_random_seed(0)
            trainer = make() if setup == "global" else make(dtype="float64")
            initial = trainer.get_weights()
            trainer.compile(optimizer=keras.optimizers.SGD(1e-2))
            fit_resumable(trainer, x, y, epochs=1, batch_size=4, seed=0, verbose=0)
            predicted = _floating(trainer.predict(x, batch_size=4, verbose=0))
            runs[setup] = initial, trainer.get_weights(), predicted
            assert trainer.dtype_policy.name == "float64"
    (initial, want, _), (_, got, predicted) = runs["global"], runs["argument"]
    assert {w.dtype for w in got if w.dtype.kind != "i"} == {np.dtype("float64")}    # beside counters of draws
    assert {p.dtype for p in predicted} == {np.dtype("float64")}
    for g, w, start in zip(got, want, initial):
        moved = float(np.abs(w - start).max()) if w.size else 0.0
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-6 * moved + 1e-15)


TRAINED = {"supervised": "network", "cd": "energy_model", "decoder": "energy_model", "rbm": "energy_model",
           "autoencoder": "autoencoder", "generative": "layer", "variational": "model"}


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_a_trainer_refuses_a_dtype_other_than_its_models(name, make, x, y):
    """A trainer computes in its model's precision, so a `dtype` given to it is the model's or an `InputError`
    naming both. Before, a float64 trainer of a float32 model failed at its first step (5 of 7) adding float64
    terms to float32 ones, and one of another precision otherwise trained its model in the model's own. A
    mixed policy given to the trainer of a model made with it is the model's: Keras' (CapsNet, the autoencoders)
    or float32 (the layers that compute in full precision under it)."""
    for model_dtype, refused in (("float32", "float64"), ("float64", "float32"), ("float64", "mixed_bfloat16")):
        model = getattr(make(dtype=model_dtype), TRAINED[name])
        with pytest.raises(InputError, match=rf"^\w+Trainer computes in the precision of the model it trains, "
                                             rf"\w+'s '{model_dtype}'; .* Received: dtype='{refused}'$"):
            type(make())(model, dtype=refused)
    for model_dtype in ("float64", "mixed_bfloat16"):
        model = getattr(make(dtype=model_dtype), TRAINED[name])
        for given in (model_dtype, keras.DTypePolicy(model_dtype)):
            assert type(make())(model, dtype=given).dtype_policy.name == model.dtype_policy.name
