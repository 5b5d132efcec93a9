import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import energy
from poecaps.capsules import squash, unsquash
from poecaps.configs import LayerwiseConfig
from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from trainers.autoencoder import AutoencoderTrainer
from trainers.cd import (
    CDTrainer,
    ClampedDecoderTrainer,
    FreeEnergyGap,
    OffCapsulesWarning,
    cd_step,
    default_optimizer,
    sharded_cd_step,
)
from trainers.layerwise import _cd_trainer, stage_l2
from trainers.shards import shard_bounds


def _capsules(rng, n, num, dim, scale=2.0):
    return ops.convert_to_numpy(squash(rng.normal(size=(n, num, dim)) * scale)).astype("float32")


def _experts(num_in, d_in, num_out, d_out, normalize="parents", seed=0):
    layer = CapsuleExperts(num_out, d_out, routing=DynamicRouting(2, "cosine", normalize),
                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=seed))
    layer.build((None, num_in, d_in))
    return layer


def test_cd_step_is_descent_direction_of_free_energy_difference(rng):
    x = _capsules(rng, 4, 6, 3)
    layer = _experts(6, 3, 2, 4)
    grads, _, stats = cd_step(layer, x, l2=0.0)
    c = layer.coefficients(x)
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]),
                               -ops.convert_to_numpy(energy.encoder_cd_gradient(x, layer.kernel, c)),
                               rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(ops.convert_to_numpy(stats["p_on"]),
                               ops.convert_to_numpy(layer.p_on(x)), rtol=1e-5)
    l2_grads, _, _ = cd_step(layer, x, l2=0.5)
    np.testing.assert_allclose(ops.convert_to_numpy(l2_grads[0] - grads[0]),
                               0.5 * ops.convert_to_numpy(layer.kernel), rtol=1e-5, atol=1e-7)


def test_cd_k_mixes_k_times(rng):
    x = _capsules(rng, 3, 5, 2)
    layer = _experts(5, 2, 2, 3)
    _, negatives, _ = layer.cd_gradients(x, steps=3)
    expected, _ = energy.mix(x, layer.kernel, layer.coefficients(x), steps=3)
    np.testing.assert_allclose(ops.convert_to_numpy(negatives), ops.convert_to_numpy(expected), rtol=1e-5)


def test_clamped_decoder_rule_matches_section_4_1(rng):
    """dU = 2 e (f(z_data) x^T - f(z~) x~^T) with z_data = unsquash(lower data)."""
    upper, lower = _capsules(rng, 3, 2, 4), _capsules(rng, 3, 5, 3)
    decoder = _experts(2, 4, 5, 3, normalize="children")
    grads, _, _ = decoder.cd_gradients(upper, hidden=lower)
    e = ops.convert_to_numpy(decoder.coefficients(upper)).astype("float64")
    u = ops.convert_to_numpy(decoder.kernel).astype("float64")
    z_data = ops.convert_to_numpy(unsquash(lower.astype("float64")))
    x_neg, z_neg = (ops.convert_to_numpy(t) for t in energy.mix(upper.astype("float64"), u, e))
    f = lambda z: z / (1 + np.sum(z * z, -1, keepdims=True))
    expected = 2 * (np.einsum("bji,bio,bje->jioe", e, f(z_data), upper)
                    - np.einsum("bji,bio,bje->jioe", e, f(z_neg), x_neg)) / 3
    np.testing.assert_allclose(ops.convert_to_numpy(grads[0]), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("iterations", [0, 1, 3])
def test_delta_rule_equals_minus_autodiff_of_code_error(rng, iterations):
    """dU = -grad_U mean_b sum_i |unsquash(lower_i) - sum_j e_ji U_ji x_j|^2 with e held fixed."""
    upper, lower = _capsules(rng, 3, 2, 4), _capsules(rng, 3, 5, 3)
    decoder = CapsuleExperts(5, 3, routing=DynamicRouting(iterations, "cosine", "children"),
                             kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=2))
    decoder.build((None, 2, 4))
    grads, negatives, stats = decoder.clamped_gradients(upper, lower, "delta")
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
    grads, _, stats = decoder.clamped_gradients(upper, lower, "section41")
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
    with pytest.raises(ValueError, match="rule must be one of"):
        decoder.clamped_gradients(upper, lower, "clamped")


def test_delta_rule_trainer_fits_a_teacher_decoder(rng):
    """(upper, lower) pairs from a random decoder: the delta rule drives code_error down."""
    upper = _capsules(rng, 64, 3, 4)
    teacher = _experts(3, 4, 5, 2, normalize="children", seed=7)
    lower = ops.convert_to_numpy(teacher(upper))
    student = _experts(3, 4, 5, 2, normalize="children", seed=1)
    trainer = ClampedDecoderTrainer(student, "delta", l2=0.0, heldout=upper[:8])
    trainer.compile(optimizer=default_optimizer(0.5, 100))
    history = trainer.fit(upper, lower, epochs=20, batch_size=16, verbose=0)
    errors = history.history["code_error"]
    assert set(history.history) >= {"code_error", "p_on", "free_energy"}
    assert errors[-1] < 0.2 * errors[0]
    with pytest.raises(InputError, match="fit on \\(upper, lower\\) pairs"):
        trainer.fit(upper, epochs=1, batch_size=16, verbose=0)
    with pytest.raises(ValueError, match="rule must be one of"):
        ClampedDecoderTrainer(student, "clamped")


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


def test_cd_trainer_fit_lowers_free_energy_of_data(rng):
    x = _capsules(rng, 64, 6, 3)
    layer = _experts(6, 3, 3, 4)
    before = float(ops.mean(layer.free_energy(x)))
    trainer = CDTrainer(layer, l2=0.0, heldout=x[:8])
    trainer.compile(optimizer=default_optimizer(0.05, 10))
    history = trainer.fit(x, epochs=3, batch_size=16, verbose=0,
                          callbacks=[FreeEnergyGap(x[8:16], trainer.heldout)])
    assert float(ops.mean(layer.free_energy(x))) < before
    assert set(history.history) >= {"reconstruction_error", "p_on", "free_energy", "free_energy_gap"}


def test_persistent_chains_are_kept_between_steps(rng):
    x = _capsules(rng, 32, 6, 3)
    layer = _experts(6, 3, 2, 4)
    trainer = CDTrainer(layer, persistent=True, chain_shape=(8, 6, 3), seed=3)
    trainer.compile(optimizer=default_optimizer(0.05, 10))
    start = ops.convert_to_numpy(trainer.chain).copy()
    trainer.fit(x, epochs=1, batch_size=8, verbose=0)
    assert not np.allclose(start, ops.convert_to_numpy(trainer.chain))


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


@pytest.mark.parametrize("shards, batch", [(2, 7), (3, 7), (4, 2)])
@pytest.mark.parametrize("static", [True, False])
def test_sharded_cd_step_equals_the_whole_batch_step(rng, shards, batch, static):
    """Size-weighted shard means are the batch mean; empty shards (batch < shards) weigh 0."""
    x, lower = _capsules(rng, batch, 6, 3), _capsules(rng, batch, 5, 2)
    layer = _experts(6, 3, 5, 2, normalize="children")
    expected = cd_step(layer, x, l2=0.1, hidden=lower)
    step = lambda x, chain, hidden: cd_step(layer, x, chain=chain, l2=0.1, hidden=hidden)
    n = batch if static else None
    sharded = tf.function(lambda x, h: sharded_cd_step(step, x, shards, hidden=h),
                          input_signature=[tf.TensorSpec((n, 6, 3)), tf.TensorSpec((n, 5, 2))])
    grads, negatives, stats = sharded(x, lower)
    np.testing.assert_allclose(grads[0].numpy(), ops.convert_to_numpy(expected[0][0]), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(negatives.numpy(), ops.convert_to_numpy(expected[1]), rtol=1e-5, atol=1e-7)
    for key, value in expected[2].items():
        np.testing.assert_allclose(stats[key].numpy(), ops.convert_to_numpy(value), rtol=1e-5, atol=1e-7)


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
    ({"steps": 0}, "steps=0"), ({"l2": -1.0}, "l2=-1.0"), ({"persistent": True}, "chain_shape=None")])
def test_cd_trainer_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CDTrainer(BernoulliRBM(2), **kwargs)


def test_default_optimizer_rejects_non_positive_learning_rate():
    with pytest.raises(ValueError, match="learning_rate=-0.1"):
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


@pytest.mark.parametrize("cost,population_cost,expected", [(0.0, 0.0, None), (2.0, 0.0, (0.2, 2.0, 0.0)),
                                                           (0.0, 3.0, (0.2, 0.0, 3.0))])
def test_layerwise_config_sets_both_sparsity_costs(rng, cost, population_cost, expected):
    """`--sparsity-cost` and `--population-sparsity-cost` reach the encoder's CD trainer."""
    config = LayerwiseConfig(sparsity_target=0.2, sparsity_cost=cost, population_sparsity_cost=population_cost,
                             jit_cd=False)
    trainer = _cd_trainer(_experts(4, 2, 2, 3), config, 10, _capsules(rng, 2, 4, 2), 0.1, 0.0,
                          config.sparsity_cost, config.population_sparsity_cost)
    assert trainer.sparsity == expected


def test_decoder_rule_delta_gets_the_delta_rule_trainer(rng):
    config = LayerwiseConfig(decoder_rule="delta", jit_cd=False)
    trainer = _cd_trainer(_experts(4, 2, 2, 3, normalize="children"), config, 10, _capsules(rng, 2, 4, 2),
                          0.1, 0.0, clamped_rule="delta")
    assert isinstance(trainer, ClampedDecoderTrainer) and trainer.rule == "delta" and trainer.sparsity is None


def test_sparsity_arguments_are_checked(rng):
    layer = _experts(4, 2, 2, 3)
    x = _capsules(rng, 2, 4, 2)
    with pytest.raises(ValueError, match="sparsity target must be in"):
        layer.cd_gradients(x, sparsity=(1.5, 0.1))
    with pytest.raises(ValueError, match="sparsity cost must be >= 0"):
        CDTrainer(layer, sparsity_cost=-1.0)
    with pytest.raises(ValueError, match="population sparsity cost must be >= 0"):
        CDTrainer(layer, population_sparsity_cost=-1.0)
    with pytest.raises(ValueError, match=r"sparsity must be \(target, cost\)"):
        layer.cd_gradients(x, sparsity=(0.1,))
    with pytest.raises(ValueError, match="clamped"):
        layer.cd_gradients(x, hidden=_capsules(rng, 2, 2, 3), sparsity=(0.1, 1.0))


@pytest.mark.parametrize("reads_length", [False, True])
@pytest.mark.parametrize("normalize", ["parents", "children"])
def test_decoder_starts_as_the_encoders_down_pass(rng, normalize, reads_length):
    """At uniform coefficients the initial decoder maps upper capsules to what
    Algorithm 1's reconstruction `squash(sum_j c_ij W_ij^T x_j)` gives; a
    decoder that reads `(x, |x|)/sqrt(2)` (`--decoder-length`) starts the same."""
    from trainers.layerwise import decoder_kernel_from_encoder

    num_in, d_in, num_out, d_out = 12, 3, 4, 5
    stddev = 0.3 * (1 if normalize == "parents" else num_in / num_out)  # the same model either way
    encoder = CapsuleExperts(num_out, d_out, routing=DynamicRouting(0, "cosine", normalize),
                             kernel_initializer=keras.initializers.RandomNormal(stddev=stddev, seed=1))
    encoder.build((None, num_in, d_in))
    x = _capsules(rng, 3, num_in, d_in)
    upper = ops.convert_to_numpy(encoder(x))
    c = ops.convert_to_numpy(encoder.coefficients(x))
    expected = ops.convert_to_numpy(squash(energy.reconstruct(upper, encoder.kernel, c)))
    decoder = CapsuleExperts(num_in, d_in, routing=DynamicRouting(0, "cosine", "children"))
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
