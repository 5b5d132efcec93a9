import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops
from small_trainers import TRAINER_NAMES, each_trainer

from poecaps.capsules import squash, unsquash
from poecaps.errors import InputError
from poecaps.experiments.configs import LayerwiseConfig
from poecaps.experiments.layerwise import stage_l2
from poecaps.experts import CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from poecaps.trainers.autoencoder import AutoencoderTrainer
from poecaps.trainers.cd import (
    CDTrainer,
    DecoderTrainer,
    FreeEnergyGap,
    OffCapsulesWarning,
    cd_step,
    default_optimizer,
    descent,
    sharded_cd_step,
)
from poecaps.trainers.checkpoints import trainer_state
from poecaps.trainers.shards import shard_bounds
from poecaps.trainers.supervised import SupervisedTrainer
from poecaps.trainers.variational import VariationalTrainer


def _np_squash(z):
    sq = np.sum(z * z, -1, keepdims=True)
    return z * np.sqrt(sq) / (1 + sq)


def _np_mix(x, w, c, steps):
    """Algorithm 1's mixing in NumPy: x~ = squash(sum_j c_ij W_ij^T squash(z_j)), z_j = sum_i c_ij W_ij x_i."""
    for _ in range(steps):
        z = np.einsum("bij,ijoe,bie->bjo", c, w, x)
        x = _np_squash(np.einsum("bij,ijoe,bjo->bie", c, w, _np_squash(z)))
    return x


def _capsules(rng, n, num, dim, scale=2.0):
    return ops.convert_to_numpy(squash(rng.normal(size=(n, num, dim)) * scale)).astype("float32")


def _experts(num_in, d_in, num_out, d_out, normalize="parents", seed=0, dtype="float32", stddev=0.3):
    layer = CapsuleExperts(num_out, d_out, routing=DynamicRouting(3, "cosine", normalize), dtype=dtype,
                           kernel_initializer=keras.initializers.RandomNormal(stddev=stddev, seed=seed))
    layer.build((None, num_in, d_in))
    return layer


def test_cd_step_is_minus_autodiff_of_the_free_energy_difference(rng):
    """cd_step's gradient is grad_W [F(x) - F(x~)] + l2 W, with F (eq. 10) written here in TensorFlow
    and c and the NumPy reconstruction x~ (Algorithm 1) held fixed."""
    x = _capsules(rng, 4, 6, 3).astype("float64")
    layer = _experts(6, 3, 2, 4, dtype="float64")
    grads, negatives, stats = cd_step(layer, x, l2=0.0)
    c = ops.convert_to_numpy(layer.coefficients(x))
    x_neg = _np_mix(x, ops.convert_to_numpy(layer.kernel), c, 1)
    np.testing.assert_allclose(ops.convert_to_numpy(negatives), x_neg, rtol=1e-9, atol=1e-12)
    kernel = tf.Variable(ops.convert_to_numpy(layer.kernel))
    free_energy = lambda v: -tf.reduce_sum(tf.math.log1p(tf.reduce_sum(
        tf.square(tf.einsum("bij,ijoe,bie->bjo", c, kernel, v)), -1)), -1)
    with tf.GradientTape() as tape:
        objective = tf.reduce_mean(free_energy(x) - free_energy(x_neg))
    expected = tape.gradient(objective, kernel).numpy()
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]), expected, rtol=1e-7, atol=1e-12)
    sq = np.sum(np.einsum("bij,ijoe,bie->bjo", c, ops.convert_to_numpy(layer.kernel), x) ** 2, -1)
    np.testing.assert_allclose(ops.convert_to_numpy(stats["p_on"]), sq / (1 + sq), rtol=1e-9)
    l2_grads, _, _ = cd_step(layer, x, l2=0.5)
    np.testing.assert_allclose(ops.convert_to_numpy(l2_grads[0] - grads[0]),
                               0.5 * ops.convert_to_numpy(layer.kernel), rtol=1e-9, atol=1e-12)


def test_cd_k_mixes_k_times(rng):
    x = _capsules(rng, 3, 5, 2).astype("float64")
    layer = _experts(5, 2, 2, 3, dtype="float64", stddev=1.5)
    _, negatives, _ = layer.cd_gradients(x, steps=3)
    c = ops.convert_to_numpy(layer.coefficients(x))
    expected = _np_mix(x, ops.convert_to_numpy(layer.kernel), c, 3)
    np.testing.assert_allclose(ops.convert_to_numpy(negatives), expected, rtol=1e-9, atol=1e-12)
    assert np.abs(expected - _np_mix(x, ops.convert_to_numpy(layer.kernel), c, 2)).max() > 1e-4


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_delta_rule_equals_minus_autodiff_of_code_error(rng, iterations):
    """dU = -grad_U mean_b sum_i |unsquash(lower_i) - sum_j e_ji U_ji x_j|^2 with e held fixed."""
    upper, lower = _capsules(rng, 3, 2, 4), _capsules(rng, 3, 5, 3)
    decoder = CapsuleExperts(5, 3, routing=DynamicRouting(iterations, "cosine", "children"),
                             kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=2))
    decoder.build((None, 2, 4))
    grads, negatives, stats = decoder.decoder_gradients(upper, lower, "delta")
    e = tf.constant(ops.convert_to_numpy(decoder.coefficients(upper)), tf.float64)
    u = tf.Variable(ops.convert_to_numpy(decoder.kernel).astype("float64"))
    target = tf.constant(ops.convert_to_numpy(unsquash(lower.astype("float64"))))
    with tf.GradientTape() as tape:
        predicted = tf.einsum("bji,jioe,bje->bio", e, u, upper.astype("float64"))
        errors = tf.reduce_sum(tf.square(target - predicted), axis=(1, 2))
        loss = tf.reduce_mean(errors)
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]), -tape.gradient(loss, u).numpy(),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(stats["code_error"]), errors.numpy() / (5 * 3), rtol=1e-4)
    np.testing.assert_array_equal(ops.convert_to_numpy(negatives), upper)


def test_section41_rule_matches_the_printed_equation(rng):
    """z~ = sum_j e U x (the data's x), x~ = squash(sum_i e U^T z~); dU = 2 e (f(z) x^T - f(z~) x~^T)."""
    upper, lower = _capsules(rng, 3, 2, 4), _capsules(rng, 3, 5, 3)
    decoder = _experts(2, 4, 5, 3, normalize="children")
    grads, _, stats = decoder.decoder_gradients(upper, lower, "section41")
    e = ops.convert_to_numpy(decoder.coefficients(upper)).astype("float64")
    u = ops.convert_to_numpy(decoder.kernel).astype("float64")
    x = upper.astype("float64")
    z_data = ops.convert_to_numpy(unsquash(lower.astype("float64")))
    z_model = np.einsum("bji,jioe,bje->bio", e, u, x)
    pre = np.einsum("bji,jioe,bio->bje", e, u, z_model)
    x_model = pre * (np.sum(pre * pre, -1, keepdims=True) / (1 + np.sum(pre * pre, -1, keepdims=True))
                     / np.sqrt(np.sum(pre * pre, -1, keepdims=True)))
    f = lambda z: z / (1 + np.sum(z * z, -1, keepdims=True))
    expected = 2 * (np.einsum("bji,bio,bje->jioe", e, f(z_data), x)
                    - np.einsum("bji,bio,bje->jioe", e, f(z_model), x_model)) / 3
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]), expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(stats["code_error"]),
                               np.mean((z_data - z_model) ** 2, axis=(1, 2)), rtol=1e-4)
    with pytest.raises(InputError, match="rule must be one of"):
        decoder.decoder_gradients(upper, lower, "clamped")


def test_delta_rule_trainer_fits_a_teacher_decoder(rng):
    """(upper, lower) pairs from a random decoder: the delta rule drives code_error down."""
    upper = _capsules(rng, 64, 3, 4)
    teacher = _experts(3, 4, 5, 2, normalize="children", seed=7)
    lower = ops.convert_to_numpy(teacher(upper))
    student = _experts(3, 4, 5, 2, normalize="children", seed=1)
    trainer = DecoderTrainer(student, "delta", l2=0.0, heldout=upper[:8])
    trainer.compile(optimizer=default_optimizer(0.5, 100))
    history = trainer.fit(upper, lower, epochs=20, batch_size=16, verbose=0)
    errors = history.history["code_error"]
    assert set(history.history) >= {"code_error", "p_on", "free_energy"}
    assert errors[-1] < 0.2 * errors[0]
    with pytest.raises(InputError, match=r"^DecoderTrainer learns from \(x, y\) pairs, y the lower capsules"):
        trainer.fit(upper, verbose=0)
    with pytest.raises(InputError, match="rule must be one of"):
        DecoderTrainer(student, "clamped")


def test_the_decoder_trainer_refuses_cd_sampling_settings_it_would_not_use():
    """The decoder rules draw no samples; CD's sampling settings, which `DecoderTrainer` handed on to
    `CDTrainer` and never used, are refused by name."""
    student = _experts(3, 4, 5, 2, normalize="children", seed=1)
    with pytest.raises(InputError, match=r"CD's steps, persistent would be unused. Received: steps=3, persistent=True$"):
        DecoderTrainer(student, "delta", steps=3, persistent=True)
    with pytest.raises(InputError, match=r"sparsity_cost would be unused. Received: sparsity_cost=0.1$"):
        DecoderTrainer(student, "delta", sparsity_cost=0.1)


def test_rbm_cd_gradient_equals_autodiff(rng):
    v = rng.uniform(size=(5, 7)).astype("float32")
    rbm = BernoulliRBM(4, seed=1)
    rbm.build((None, 7))
    rbm.kernel.assign(rng.normal(size=(7, 4)).astype("float32"))
    grads, negatives, _ = rbm.cd_gradients(v)
    with tf.GradientTape() as tape:
        objective = tf.reduce_mean(rbm.free_energy(v) - rbm.free_energy(tf.stop_gradient(negatives)))
    auto = tape.gradient(objective, rbm.trainable_weights)
    for closed, a in zip(grads, auto):
        np.testing.assert_allclose(ops.convert_to_numpy(closed), -a.numpy(), rtol=1e-4, atol=1e-6)


def test_cd_trainer_lowers_the_free_energy_of_data_against_noise_beyond_growing_w(rng):
    """Capsules from a 2-D latent model: CD makes the data's free energy lower than that of noise
    capsules of the same lengths, by more than the initial W scaled to the trained W's norm does
    (so the result is not W merely growing)."""
    mixing = rng.normal(size=(6, 3, 2))
    data = _np_squash(np.einsum("ide,ne->nid", mixing, rng.normal(size=(256, 2)))).astype("float32")
    noise = rng.normal(size=data.shape)
    noise = (noise / np.linalg.norm(noise, axis=-1, keepdims=True)
             * np.linalg.norm(data, axis=-1, keepdims=True)).astype("float32")
    layer = _experts(6, 3, 3, 4)
    start = ops.convert_to_numpy(layer.kernel).copy()

    def gap(kernel):
        layer.kernel.assign(kernel)
        return float(ops.mean(layer.free_energy(data)) - ops.mean(layer.free_energy(noise)))

    trainer = CDTrainer(layer, l2=0.0, heldout=data[:8])
    trainer.compile(optimizer=default_optimizer(0.05, 10))
    history = trainer.fit(data, epochs=5, batch_size=16, verbose=0,
                          callbacks=[FreeEnergyGap(data[8:16], trainer.heldout)])
    trained = ops.convert_to_numpy(layer.kernel).copy()
    scaled = start * np.linalg.norm(trained) / np.linalg.norm(start)
    assert gap(trained) < gap(scaled) - 0.1 and gap(trained) < gap(start) - 0.1, (
        gap(trained), gap(scaled), gap(start))
    assert set(history.history) >= {"reconstruction_error", "p_on", "free_energy", "free_energy_gap"}


def test_persistent_chains_are_kept_between_steps(rng):
    x = _capsules(rng, 32, 6, 3)
    layer = _experts(6, 3, 2, 4)
    trainer = CDTrainer(layer, persistent=True, chain_shape=(8, 6, 3), seed=3)
    trainer.compile(optimizer=default_optimizer(0.05, 10))
    start = ops.convert_to_numpy(trainer.chain).copy()
    trainer.fit(x, epochs=1, batch_size=8, verbose=0)
    assert not np.allclose(start, ops.convert_to_numpy(trainer.chain))


@pytest.mark.parametrize("chain_shape", [(8, 5, 3), (8, 6), (8, 6, 3, 1)])
def test_chains_of_another_shape_than_the_visible_units_are_refused_before_a_step(rng, chain_shape):
    """Chains whose visible units differ from the batch's in a size or in rank failed deep in CD's sampling
    (a reshape, an axis out of bounds, a transpose); now one InputError names both shapes, before any weight
    moves."""
    layer = _experts(6, 3, 2, 4)
    before = [w.copy() for w in layer.get_weights()]
    trainer = CDTrainer(layer, persistent=True, chain_shape=chain_shape, seed=3)
    trainer.compile(optimizer=default_optimizer(0.05, 10))
    with pytest.raises(InputError, match=rf"chains hold visible units of shape {re.escape(str(chain_shape[1:]))}"
                                         r".*the batch's are \(6, 3\)"):
        trainer.fit(_capsules(rng, 16, 6, 3), epochs=1, batch_size=8, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, layer.get_weights()))


def test_rbm_trainer_learns(rng):
    v = (rng.uniform(size=(256, 16)) < np.linspace(0.05, 0.95, 16)).astype("float32")
    rbm = BernoulliRBM(6, seed=0)
    trainer = CDTrainer(rbm, l2=0.0, seed=0)
    trainer.compile(optimizer=default_optimizer(0.1, 100))
    history = trainer.fit(v, epochs=5, batch_size=32, verbose=0)
    errors = history.history["reconstruction_error"]
    assert errors[-1] < errors[0]


def test_shard_bounds_cut_the_batch_into_near_equal_consecutive_parts():
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    dynamic = shard_bounds(tf.constant(7), 3)
    assert [(int(a), int(b)) for a, b in dynamic] == [(0, 3), (3, 5), (5, 7)]


@pytest.mark.parametrize("rule", [None, "delta", "section41"])
@pytest.mark.parametrize("shards, batch", [(2, 7), (3, 7), (4, 2)])
@pytest.mark.parametrize("static", [True, False])
def test_sharded_cd_step_equals_the_whole_batch_step(rng, rule, shards, batch, static):
    """Size-weighted shard means are the batch mean; empty shards (batch < shards) weigh 0.
    `rule` None is the encoder's CD step, else a decoder rule on (upper, lower) pairs. In float64,
    so that the shards' other summation order stays far below the tolerance."""
    x, lower = _capsules(rng, batch, 6, 3).astype("float64"), _capsules(rng, batch, 5, 2).astype("float64")
    layer = _experts(6, 3, 5, 2, normalize="children", dtype="float64")

    def step(x, chain, targets):
        if rule is None:
            return cd_step(layer, x, chain=chain, l2=0.1)
        ascent, negatives, stats = layer.decoder_gradients(x, targets, rule)
        return descent(ascent, layer.trainable_weights, 0.1), negatives, stats

    expected = step(x, None, lower)
    n = batch if static else None
    sharded = tf.function(lambda x, t: sharded_cd_step(step, x, shards, targets=t),
                          input_signature=[tf.TensorSpec((n, 6, 3), tf.float64),
                                           tf.TensorSpec((n, 5, 2), tf.float64)])
    grads, negatives, stats = sharded(x, lower)
    np.testing.assert_allclose(grads[0].numpy(), ops.convert_to_numpy(expected[0][0]), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(negatives.numpy(), ops.convert_to_numpy(expected[1]), rtol=1e-10, atol=1e-13)
    for key, value in expected[2].items():
        np.testing.assert_allclose(stats[key].numpy(), ops.convert_to_numpy(value), rtol=1e-10, atol=1e-13)


def test_descent_is_minus_the_ascent_plus_l2_weights_and_refuses_directions_that_do_not_match_the_weights():
    """Before, a model's `cd_gradients` with one direction too few trained the other weights and left the
    last untouched (zip), and a direction of shape [1] was broadcast over its weight."""
    weights = [keras.Variable(np.array([1.0, -2.0])), keras.Variable(np.array([[3.0]]))]
    ascent = [np.array([0.5, 0.25]), np.array([[1.0]])]
    got = descent(ascent, weights, 0.5)
    np.testing.assert_array_equal(ops.convert_to_numpy(got[0]), [-0.5 + 0.5, -0.25 - 1.0])
    np.testing.assert_array_equal(ops.convert_to_numpy(got[1]), [[-1.0 + 1.5]])
    with pytest.raises(InputError, match="descent needs one ascent direction per trainable weight. Received: 1 directions "
                                         "for 2 weights"):
        descent(ascent[:1], weights, 0.5)
    with pytest.raises(InputError, match=re.escape("Ascent direction 0 must have its weight's shape (2,). Received: "
                                                   "shape (1,)")):
        descent([np.array([0.5]), ascent[1]], weights, 0.5)


def test_sharded_trainer_takes_the_same_steps_as_the_whole_batch_one(rng):
    """Two epochs (batches of 16 and a last one of 8) with 1 and 3 shards end at the same weights."""
    x = _capsules(rng, 40, 6, 3)
    kernels, histories = [], []
    for shards in (1, 3):
        layer = _experts(6, 3, 3, 4)
        trainer = CDTrainer(layer, l2=1e-3, shards=shards)
        trainer.compile(optimizer=default_optimizer(0.5, 10), jit_compile=True)
        histories.append(trainer.fit(x, epochs=2, batch_size=16, shuffle=False, verbose=0).history)
        kernels.append(ops.convert_to_numpy(layer.kernel))
    assert not np.allclose(kernels[0], ops.convert_to_numpy(_experts(6, 3, 3, 4).kernel))
    np.testing.assert_allclose(kernels[1], kernels[0], rtol=1e-4, atol=1e-6)
    for key in histories[0]:
        np.testing.assert_allclose(histories[1][key], histories[0][key], rtol=1e-4)


def test_sharded_trainer_keeps_persistent_chains(rng):
    x = _capsules(rng, 32, 6, 3)
    chains = []
    for shards in (1, 2):
        trainer = CDTrainer(_experts(6, 3, 2, 4), persistent=True, chain_shape=(8, 6, 3), seed=3,
                            shards=shards)
        trainer.compile(optimizer=default_optimizer(0.05, 10))
        trainer.fit(x, epochs=1, batch_size=8, shuffle=False, verbose=0)
        chains.append(ops.convert_to_numpy(trainer.chain))
    np.testing.assert_allclose(chains[1], chains[0], rtol=1e-4, atol=1e-6)


def test_sharding_is_refused_for_a_model_that_draws_random_numbers():
    with pytest.raises(InputError, match="seed generator"):
        CDTrainer(BernoulliRBM(2), shards=2)


@pytest.mark.parametrize("kwargs, message", [
    ({"shards": 0}, "shards=0"), ({"shards": 1.5}, "shards=1.5"),
    ({"steps": 0}, "steps=0"), ({"l2": -1.0}, "l2=-1.0"), ({"persistent": True}, "chain_shape=None"),
    ({"chain_shape": (8, 2)}, r"pass persistent=True .* Received: chain_shape=\(8, 2\)"),
    ({"persistent": True, "chain_shape": (8,)}, r"\[chains, \*the visible units' shape\].*chain_shape=\(8,\)"),
    ({"persistent": True, "chain_shape": (8, 0)}, r"positive integers. Received: chain_shape=\(8, 0\)"),
    ({"persistent": True, "chain_shape": (8, 2.0)}, r"chain_shape=\(8, 2.0\)"),
    ({"persistent": True, "chain_shape": 8}, "chain_shape=8")])
def test_cd_trainer_invalid_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        CDTrainer(BernoulliRBM(2), **kwargs)


def test_default_optimizer_rejects_non_positive_learning_rate():
    with pytest.raises(InputError, match="learning_rate=-0.1"):
        default_optimizer(-0.1)


def test_autoencoder_trainer_reduces_reconstruction_error(rng):
    images = np.zeros((32, 14, 14, 1), "float32")
    images[:, 4:10, 4:10] = 1.0
    trainer = AutoencoderTrainer(ConvAutoencoder(filters=4, kernel_size=3, dropout=0.0, seed=0))
    trainer.compile(optimizer=keras.optimizers.Adam(0.01))
    history = trainer.fit(images, epochs=8, batch_size=16, verbose=0)
    assert history.history["mse"][-1] < history.history["mse"][0]


@pytest.mark.parametrize("iterations,cost,population_cost", [(0, 0.7, 0.0), (2, 0.7, 0.0), (0, 0.0, 1.3),
                                                             (2, 0.7, 1.3)])
def test_capsule_sparsity_term_is_minus_autodiff_of_penalty(rng, iterations, cost, population_cost):
    """The closed-form sparsity term equals -d/dW of cost sum_j (q_j - p)^2
    + population_cost J mean_b (r_b - p)^2, with c held fixed."""
    x = _capsules(rng, 5, 6, 3).astype("float64")
    layer = CapsuleExperts(3, 4, routing=DynamicRouting(iterations, "cosine"), dtype="float64",
                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=1))
    layer.build((None, 6, 3))
    target = 0.2
    plain, _, _ = layer.cd_gradients(x)
    sparse, _, _ = layer.cd_gradients(x, sparsity=(target, cost, population_cost))
    c = tf.constant(ops.convert_to_numpy(layer.coefficients(x)))
    kernel = tf.Variable(ops.convert_to_numpy(layer.kernel))
    with tf.GradientTape() as tape:
        z = tf.einsum("bij,ijoe,bie->bjo", c, kernel, x)    # eq. 3, independent of energy.py
        s = tf.reduce_sum(z * z, -1)
        p_on = s / (1 + s)                                   # [B, J]
        penalty = (cost * tf.reduce_sum((tf.reduce_mean(p_on, 0) - target) ** 2)
                   + population_cost * 3 * tf.reduce_mean((tf.reduce_mean(p_on, 1) - target) ** 2))
    expected = -tape.gradient(penalty, kernel).numpy()
    assert np.max(np.abs(expected)) > 1e-4
    np.testing.assert_allclose(ops.convert_to_numpy(sparse[0] - plain[0]), expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("cost,population_cost", [(0.5, 0.0), (0.0, 0.8), (0.5, 0.8)])
def test_rbm_sparsity_term_is_minus_autodiff_of_penalty(rng, cost, population_cost):
    v = rng.uniform(size=(6, 5))
    rbm = BernoulliRBM(3, seed=0, dtype="float64")
    rbm.build((None, 5))
    rbm.kernel.assign(rng.normal(size=(5, 3)))
    rbm.hidden_bias.assign(rng.normal(size=3))
    target = 0.1
    # The same Gibbs draws in both calls, so the negative phases cancel.
    start = rbm.seed_generator.state.numpy()
    plain, _, _ = rbm.cd_gradients(v)
    rbm.seed_generator.state.assign(start)
    sparse, _, _ = rbm.cd_gradients(v, sparsity=(target, cost, population_cost))
    kernel, bias = tf.Variable(rbm.kernel.numpy()), tf.Variable(rbm.hidden_bias.numpy())
    with tf.GradientTape() as tape:
        h = tf.sigmoid(v @ kernel + bias)                    # [B, J]
        penalty = (cost * tf.reduce_sum((tf.reduce_mean(h, 0) - target) ** 2)
                   + population_cost * 3 * tf.reduce_mean((tf.reduce_mean(h, 1) - target) ** 2))
    d_kernel, d_bias = tape.gradient(penalty, [kernel, bias])
    np.testing.assert_allclose(ops.convert_to_numpy(sparse[0] - plain[0]), -d_kernel.numpy(),
                               rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(ops.convert_to_numpy(sparse[2] - plain[2]), -d_bias.numpy(),
                               rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("stage, settings", [
    ("encoder", {"sparsity_target": 0.2, "sparsity_cost": 2.0, "population_sparsity_cost": 3.0,
                 "cd_learning_rate": 0.07, "l2": 1e-3}),
    ("encoder", {"sparsity_cost": 0.0, "population_sparsity_cost": 0.0}),
    ("decoder", {"decoder_rule": "delta", "decoder_learning_rate": 0.3, "decoder_l2": 2e-3}),
    ("decoder", {"decoder_rule": "section41", "decoder_learning_rate": 0.3}),
])
def test_each_setting_reaches_its_stages_trainer(tmp_path, rng, monkeypatch, stage, settings):
    """The config travels through `train_stage` to the trainer `fit` gets: sparsity target and both
    costs (distinct values, so swapping two would fail), the rule, learning rate and L2 of the stage."""
    from poecaps.experiments import layerwise
    from poecaps.experiments.runs import RunDir

    config = LayerwiseConfig(filters=4, kernel_size=3, capsule_dim=2, num_capsules=3, upper_dim=2,
                             batch_size=8, heldout_size=4, jit_cd=False, **settings)
    run = RunDir(str(tmp_path / "run"))
    images = rng.uniform(size=(16, 9, 9, 1)).astype("float32")
    autoencoder = ConvAutoencoder(4, 3, 2, 0.0, seed=0)
    autoencoder.build((None, 9, 9, 1))
    from poecaps.models.saving import save_component

    save_component(autoencoder, run.models + "/autoencoder.keras")
    seen = {}

    def fit(trainer, x, *args, y=None, **kwargs):
        seen.update(trainer=trainer, x=x, y=y)
        trainer(x[:1]) if y is None else trainer.energy_model(x[:1])
    monkeypatch.setattr(layerwise, "_fit", fit)
    layerwise.train_stage("encoder", config, run, images, images)
    if stage == "decoder":
        layerwise.train_stage("decoder", config, run, images, images)
    trainer = seen["trainer"]
    assert trainer.l2 == stage_l2(config, stage)
    if stage == "encoder":
        assert type(trainer) is CDTrainer
        costs = (config.sparsity_target, config.sparsity_cost, config.population_sparsity_cost)
        assert trainer.sparsity == (None if costs[1:] == (0.0, 0.0) else costs)
        assert float(trainer.optimizer.learning_rate) == pytest.approx(config.cd_learning_rate)
    else:
        assert type(trainer) is DecoderTrainer and trainer.rule == config.decoder_rule
        assert float(trainer.optimizer.learning_rate) == pytest.approx(config.decoder_learning_rate)
        assert seen["y"].shape == (16, 3 * 3 * 4 // 2, 2)     # the lower capsules are the targets


def test_sparsity_arguments_are_checked(rng):
    layer = _experts(4, 2, 2, 3)
    x = _capsules(rng, 2, 4, 2)
    with pytest.raises(InputError, match=r"^sparsity target must be a finite number > 0 and < 1\. Received: sparsity target=1\.5$"):
        layer.cd_gradients(x, sparsity=(1.5, 0.1))
    with pytest.raises(InputError, match=r"^sparsity cost must be a finite number >= 0\. Received: sparsity cost=-1\.0$"):
        CDTrainer(layer, sparsity_cost=-1.0)
    with pytest.raises(InputError, match=r"^population sparsity cost must be a finite number >= 0\."):
        CDTrainer(layer, population_sparsity_cost=-1.0)
    with pytest.raises(InputError, match=r"sparsity must be \(target, cost\)"):
        layer.cd_gradients(x, sparsity=(0.1,))
    with pytest.raises(InputError, match=r"sparsity must be \(target, cost\).*Received: sparsity=0\.1$"):
        layer.cd_gradients(x, sparsity=0.1)      # a bare number, not a pair


@pytest.mark.parametrize("reads_length", [False, True])
@pytest.mark.parametrize("normalize", ["parents", "children"])
def test_decoder_starts_as_the_encoders_down_pass(rng, normalize, reads_length):
    """At uniform coefficients the initial decoder maps upper capsules to what
    Algorithm 1's reconstruction `squash(sum_j c_ij W_ij^T x_j)` gives; a
    decoder that reads `(x, |x|)/sqrt(2)` (`--decoder-length`) starts the same."""
    from poecaps.models.capsule_pipeline import decoder_kernel_from_encoder

    num_in, d_in, num_out, d_out = 12, 3, 4, 5
    stddev = 0.3 * (1 if normalize == "parents" else num_in / num_out)  # the same model either way
    encoder = CapsuleExperts(num_out, d_out, routing=DynamicRouting(1, "cosine", normalize),
                             kernel_initializer=keras.initializers.RandomNormal(stddev=stddev, seed=1))
    encoder.build((None, num_in, d_in))
    x = _capsules(rng, 3, num_in, d_in)
    upper = ops.convert_to_numpy(encoder(x))
    c = ops.convert_to_numpy(encoder.coefficients(x))
    expected = _np_squash(np.einsum("bij,ijoe,bjo->bie", c, ops.convert_to_numpy(encoder.kernel), upper))
    decoder = CapsuleExperts(num_in, d_in, routing=DynamicRouting(1, "cosine", "children"))
    decoder.build((None, num_out, d_out + int(reads_length)))
    decoder.kernel.assign(decoder_kernel_from_encoder(encoder, reads_length))
    # (x, |x|)/sqrt(2), written out.
    inputs = np.concatenate([upper, np.linalg.norm(upper, axis=-1, keepdims=True)], -1) / np.sqrt(2.0)
    decoded = decoder(inputs if reads_length else upper)
    np.testing.assert_allclose(ops.convert_to_numpy(decoded), expected, rtol=1e-5, atol=1e-6)
    assert np.abs(expected).max() > 1e-2


def test_off_capsules_warning_fires_only_for_capsules_all_but_off(capsys):
    callback = OffCapsulesWarning(threshold=1e-3)
    callback.on_epoch_end(2, {"p_on": 3.3e-7})
    assert "warning: epoch 3: mean P(on) of the capsules is 3.3e-07" in capsys.readouterr().err
    for logs in ({"p_on": 0.27}, {"loss": 1.0}, None):
        callback.on_epoch_end(0, logs)
    assert capsys.readouterr().err == ""


def test_decoder_l2_applies_to_the_decoder_stage_alone():
    config = LayerwiseConfig(l2=1e-3, decoder_l2=0.0)
    assert [stage_l2(config, stage) for stage in ("encoder", "decoder", "rbm")] == [1e-3, 0.0, 1e-3]
    assert stage_l2(LayerwiseConfig(l2=1e-3), "decoder") == 1e-3


def test_a_stage_with_non_finite_outputs_is_refused_by_name(tmp_path, rng, monkeypatch):
    """An encoder whose weights are finite but whose capsules overflow never feeds the decoder stage."""
    from poecaps.errors import NonFiniteError
    from poecaps.experiments import layerwise
    from poecaps.experiments.runs import RunDir
    from poecaps.models.saving import load_component, save_component

    config = LayerwiseConfig(filters=4, kernel_size=3, capsule_dim=2, num_capsules=3, upper_dim=2,
                             batch_size=8, heldout_size=4, jit_cd=False)
    run = RunDir(str(tmp_path / "run"))
    images = rng.uniform(size=(16, 9, 9, 1)).astype("float32")
    autoencoder = ConvAutoencoder(4, 3, 2, 0.0, seed=0)
    autoencoder.build((None, 9, 9, 1))
    save_component(autoencoder, run.models + "/autoencoder.keras")
    monkeypatch.setattr(layerwise, "_fit", lambda trainer, x, *args, **kwargs: None)
    layerwise.train_stage("encoder", config, run, images, images)
    encoder = load_component(run.models + "/encoder.keras")
    encoder.kernel.assign(np.full(encoder.kernel.shape, 1e30, "float32"))     # finite, overflowing
    save_component(encoder, run.models + "/encoder.keras")
    with pytest.raises(NonFiniteError, match="The encoder stage's outputs .* lower cd_learning_rate"):
        layerwise.train_stage("decoder", config, run, images, images)
    assert not os.path.exists(run.models + "/decoder.keras")


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_every_trainer_descends_the_models_weight_regularizers(name, make, x, y):
    """A weight regularizer on the trained model joins every trainer's update, as Keras adds a model's `losses`
    to a compiled loss (CD's update, not a loss's gradient, gains the regularizer's gradient). Two trainers in
    one state take one plain SGD step (rate 0.1) on one batch, the second with an L2 of 0.5 on its first weight:
    that weight moves by a further -0.1 * (2 * 0.5 * w) = -0.1 w, and every other weight as in the first.
    Before, every trainer ignored the regularizer. Tolerances: float32 rounding of the steps' sums (a few 1e-8
    of weights and steps of order 1), far below the 0.1 w tested."""
    learning_rate, strength = 0.1, 0.5
    trainers = []
    for _ in range(2):
        trainer = make()
        trainer.compile(optimizer=keras.optimizers.SGD(learning_rate))
        trainer(x[:1])
        trainer.optimizer.build(trainer.trainable_variables)
        trainers.append(trainer)
    plain, regularized = trainers
    for source, target in zip(trainer_state(plain), trainer_state(regularized)):
        target.assign(source)
    weight = regularized.trainable_weights[0]
    weight.regularizer = keras.regularizers.L2(strength)
    start = ops.convert_to_numpy(weight).copy()
    for trainer in trainers:
        trainer.train_on_batch(x, y)
    moved = [ops.convert_to_numpy(b) - ops.convert_to_numpy(a)
             for a, b in zip(plain.trainable_weights, regularized.trainable_weights)]
    np.testing.assert_allclose(moved[0], -learning_rate * 2 * strength * start, rtol=1e-4, atol=1e-6)
    for difference in moved[1:]:
        np.testing.assert_allclose(difference, 0.0, atol=1e-6)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_saving_a_trainer_whole_names_the_model_to_save_and_that_advice_works(tmp_path, name, make, x, y):
    """`save` (and `ModelCheckpoint`'s default) needs a config, which a trainer holding a model and callables
    has not: the `InputError` names the attribute holding the trained model (before, Keras' NotImplementedError
    asked for a `get_config`). Saving that attribute as advised reloads the model's weights."""
    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-2))
    trainer(x[:2])
    with pytest.raises(InputError, match=r"^\w+Trainer is not saved whole: .*keras\.saving\.save_model\(trainer\."
                                         r"(\w+), path\)") as refused:
        trainer.save(str(tmp_path / "trainer.keras"))
    model = getattr(trainer, re.search(r"save_model\(trainer\.(\w+)", str(refused.value)).group(1))
    keras.saving.save_model(model, str(tmp_path / "model.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "model.keras"))
    assert len(model.weights) > 0
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make_trainer, model, message", [
    (CDTrainer, keras.layers.Dense(3), "CDTrainer trains a model of type EnergyModel. Received: Dense"),
    (DecoderTrainer, BernoulliRBM(3), "DecoderTrainer trains a model of type CapsuleExperts. Received: BernoulliRBM"),
    (AutoencoderTrainer, CapsuleExperts(2, 3), ("AutoencoderTrainer trains a model of type ConvAutoencoder. "
                                               "Received: CapsuleExperts")),
    (SupervisedTrainer, ConvAutoencoder(), ("SupervisedTrainer trains a Keras layer with loss_terms, loss_term_names, "
                                           "image_shape, num_classes. Received: ConvAutoencoder, which has no "
                                           "loss_terms, loss_term_names, image_shape, num_classes")),
    (VariationalTrainer, "vae", "VariationalTrainer trains a Keras layer with bound, TERMS. Received: str"),
])
def test_a_trainer_refuses_a_model_it_cannot_train_by_name(make_trainer, model, message):
    """Before, an AttributeError when made (`TERMS`, `loss_term_names`, `dtype_policy`) or at the first step (the
    CD trainer's `cd_gradients`, the autoencoder trainer's `kernel1`)."""
    with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
        make_trainer(model)
