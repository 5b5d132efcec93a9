"""Faria's Table 1 network (`RoutingCapsNet`): sizes by hand, votes against NumPy, gradients to every router weight."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps.errors import InputError
from poecaps.initializers import NearIdentity
from poecaps.layers import CapsuleDense
from poecaps.models import RoutingCapsNet
from poecaps.models.routing_capsnet import layer_routers
from poecaps.models.saving import load_component, save_component
from poecaps.routing import ConnectionistRouting, DynamicRouting, EMRouting, SimilarityRouting


def table1_parameters(side, num_classes):
    """Weights of Table 1 without routing, counted by hand for a side x side grey image."""
    conv = 5 * 5 * 1 * 64 + 64
    batch_norm = 2 * 64                                   # gamma, beta (the moving statistics are not trained)
    primary = (64 * 8 * 16 + 8 * 16) + (64 * 8 + 8)       # 1x1 convolutions to 8 poses of 16 and 8 activations
    caps1 = 3 * 3 * 8 * 16 * 16                           # one 4x4 W per (kernel offset, type in, type out)
    caps2 = 3 * 3 * 16 * 16 * 16
    grid = (((side - 5) // 2 + 1 - 3) // 2 + 1) - 2        # 12 -> 5 -> 3 on MNIST; 14 -> 6 -> 4 on smallNORB
    unshared_class = grid * grid * 16 * num_classes * 16
    return conv + batch_norm + primary + caps1 + caps2 + unshared_class


def _routing_weights(model):
    return sum(int(np.prod(w.shape)) for r in model.routers for w in r.trainable_weights)


@pytest.mark.parametrize("side, num_classes", [(28, 10), (32, 5)])
def test_parameters_without_routing_match_table_1(side, num_classes):
    model = RoutingCapsNet((side, side, 1), num_classes, routing="uniform")
    count = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert _routing_weights(model) == 0
    assert count == table1_parameters(side, num_classes)
    if side == 32:
        assert count == 86408           # the paper's "86K parameters excluding routing" on smallNORB


def test_shapes_and_routers_per_layer():
    model = RoutingCapsNet((28, 28, 1), 10, routing="connectionist", routing_iterations=2)
    out = model(np.zeros((3, 28, 28, 1), "float32"))
    assert tuple(out["scores"].shape) == (3, 10)
    assert tuple(out["poses"].shape) == (3, 10, 16)
    assert tuple(out["coefficients"].shape) == (3, 3 * 3 * 16, 10)
    hidden = [(r.compatibility_hidden, r.activation_hidden) for r in model.routers]
    assert hidden == [((), ()), ((32, 32), (64, 64)), ((64, 64), (124, 124))]      # Table 2
    assert [r.iterations for r in model.routers] == [2, 2, 2]
    similarity = RoutingCapsNet((28, 28, 1), 10, routing="similarity").routers
    assert [r.num_kernels for r in similarity] == [4, 4, 10]
    assert all(isinstance(r, DynamicRouting) and r.iterations == 1 for r in layer_routers("uniform", 3))


def test_votes_are_poses_times_frobenius_normalised_matrices(rng):
    poses = rng.normal(size=(2, 3, 16)).astype("float32")
    layer = CapsuleDense(4, 16, routing="uniform", pose="matrix", frobenius_votes=True,
                         kernel_initializer=NearIdentity(0.5, seed=1))
    layer.build(poses.shape)
    w = ops.convert_to_numpy(layer.kernel)
    votes = ops.convert_to_numpy(layer.votes(poses))
    for b in range(2):
        for i in range(3):
            for j in range(4):
                want = poses[b, i].reshape(4, 4) @ w[i, j] / np.sqrt(np.sum(w[i, j] ** 2))
                np.testing.assert_allclose(votes[b, i, j], want.reshape(16), rtol=1e-5, atol=1e-6)


def test_near_identity_initializer():
    w = ops.convert_to_numpy(NearIdentity(0.1, seed=3)((50, 4, 4)))
    off = w - np.eye(4)
    assert np.abs(off).max() <= 0.1 and np.abs(off).max() > 0.09      # uniform on [-0.1, 0.1]
    assert abs(off.mean()) < 0.01


@pytest.mark.parametrize("routing", ["similarity", "connectionist", "em"])
def test_every_routing_weight_gets_a_gradient(rng, routing):
    model = RoutingCapsNet((28, 28, 1), 10, routing=routing)
    images = rng.uniform(size=(4, 28, 28, 1)).astype("float32")
    labels = np.array([0, 3, 5, 9])
    weights = [w for r in model.routers for w in r.trainable_weights]
    assert weights
    with tf.GradientTape() as tape:
        loss, _, _ = model.loss_terms(images, labels, training=True)
    grads = tape.gradient(loss, weights)
    for w, g in zip(weights, grads):
        assert g is not None, w.path
        assert float(tf.reduce_max(tf.abs(g))) > 0, w.path


def test_invalid_arguments():
    with pytest.raises(InputError, match="Received: loss='hinge'"):
        RoutingCapsNet((28, 28, 1), 10, loss="hinge")
    with pytest.raises(InputError, match="Received: logit_scale=0"):
        RoutingCapsNet((28, 28, 1), 10, loss="scaled_cross_entropy", logit_scale=0)
    with pytest.raises(InputError, match="one router per capsule layer"):
        RoutingCapsNet((28, 28, 1), 10, routing=["uniform", "uniform"])
    with pytest.raises(InputError, match="Unknown routing"):
        RoutingCapsNet((28, 28, 1), 10, routing="magic")


@pytest.mark.parametrize("loss", ["cross_entropy", "scaled_cross_entropy", "spread", "margin"])
def test_a_trained_network_saves_and_reloads_with_identical_predictions(tmp_path, rng, loss):
    from poecaps.trainers.supervised import SupervisedTrainer

    routers = [SimilarityRouting(2, num_kernels=3, entropy_weight=2.0, seed=5),
               ConnectionistRouting(2, units=4, compatibility_hidden=(3,), activation_hidden=(5,), seed=6),
               EMRouting(2, final_lambda=0.5, cost_normalization="standardize")]
    model = RoutingCapsNet((20, 20, 1), 3, routing=routers, loss=loss, logit_scale=3.0, margin_steps=7,
                           filters=8, primary_types=2, conv_types=3, seed=4)
    images = rng.uniform(size=(16, 20, 20, 1)).astype("float32")
    labels = rng.integers(0, 3, 16)
    trainer = SupervisedTrainer(model)
    # Four steps, eagerly: what is tested is saving, not the compiled step (compiling it was 3/4 of the test)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2), run_eagerly=True)
    before = [w.copy() for w in model.get_weights()]
    trainer.fit(images, labels, epochs=2, batch_size=8, verbose=0)
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights()))    # it trained
    path = os.path.join(tmp_path, "model.keras")
    save_component(model, path)
    again = load_component(path)
    as_json = lambda config: json.dumps(config, sort_keys=True)        # tuples and lists alike
    assert as_json(again.get_config()) == as_json(model.get_config())
    for key in ("scores", "poses", "coefficients"):
        np.testing.assert_array_equal(ops.convert_to_numpy(again(images)[key]),
                                      ops.convert_to_numpy(model(images)[key]))
    if loss == "scaled_cross_entropy":
        learned = float(model.log_logit_scale.numpy())
        assert float(again.log_logit_scale.numpy()) == learned != np.float32(np.log(3.0))     # learned


def test_scaled_cross_entropy_is_softmax_cross_entropy_of_the_scaled_activations(rng):
    """Against NumPy: -log softmax(s a)_y, s = exp(log_logit_scale) starting at logit_scale; its gradient
    reaches the scale."""
    model = RoutingCapsNet((20, 20, 1), 3, routing="uniform", loss="scaled_cross_entropy", logit_scale=7.0,
                           filters=8, primary_types=2, conv_types=3, seed=4)
    images = rng.uniform(size=(5, 20, 20, 1)).astype("float32")
    labels = np.array([0, 1, 2, 1, 0])
    with tf.GradientTape() as tape:
        loss, scores, terms = model.loss_terms(images, labels)
    a = 7.0 * ops.convert_to_numpy(scores).astype("float64")
    expected = np.mean(np.log(np.exp(a).sum(1)) - a[np.arange(5), labels])
    # float32 logits of size <= 7: the log-sum-exp is exact to about 7 * 1e-7
    np.testing.assert_allclose(float(loss), expected, atol=1e-5)
    np.testing.assert_allclose(float(terms["logit_scale"]), 7.0, rtol=1e-6)
    grad = tape.gradient(loss, model.log_logit_scale)
    assert grad is not None and float(grad) != 0.0


@pytest.mark.parametrize("routing", ["uniform", "dynamic", "sparse_inference"])
def test_squashing_routers_start_with_usable_class_lengths(rng, routing):
    """Poses are renormalised before every capsule layer: squashed lengths do not shrink layer by layer
    (without it the uniform network's class lengths start near 1e-20)."""
    model = RoutingCapsNet((28, 28, 1), 10, routing=routing)
    scores = ops.convert_to_numpy(model(rng.uniform(size=(8, 28, 28, 1)).astype("float32"))["scores"])
    assert scores.max() > 0.05 and scores.max() < 0.999


def test_seed_fixes_every_weight_but_the_primary_convolutions_which_follow_the_global_state():
    """The docstring's contract for `seed`: two networks with one seed built after different global seeds differ in
    the primary capsules' two convolutions alone; with the global state seeded alike they are equal everywhere."""
    def build(global_seed):
        keras.utils.set_random_seed(global_seed)
        net = RoutingCapsNet((28, 28, 1), 10, routing="similarity", filters=8, primary_types=2, conv_types=2, seed=3)
        return [(w.path, w.numpy()) for w in net.weights]

    first, other, again = build(1), build(2), build(1)
    differ = sorted(path.split("/", 1)[1] for (path, a), (_, b) in zip(first, other) if not np.array_equal(a, b))
    assert differ == ["primary_capsules/activation_conv/kernel", "primary_capsules/pose_conv/kernel"]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(first, again))
