"""The probabilistic capsule model (Smith et al.): binary Concrete, compositing, the exact parent marginal."""

import math
import re

import keras
import numpy as np
import pytest
import scipy.integrate
import scipy.special
import scipy.stats
import tensorflow as tf

from poecaps import compositing, concrete
from poecaps.errors import InputError
from poecaps.models.probabilistic_capsules import ProbabilisticCapsules


@pytest.mark.parametrize("logit", [-2.0, 0.0, 1.5])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_binary_concrete_density_integrates_to_one(logit, temperature):
    density = lambda y: float(np.exp(concrete.log_prob(tf.constant(y, tf.float64), logit, temperature)))
    total, error = scipy.integrate.quad(density, 0.0, 1.0, points=[0.5], limit=200, epsabs=1e-10, epsrel=1e-10)
    assert error < 1e-8
    assert abs(total - 1.0) < 1e-6


@pytest.mark.parametrize("temperature", [0.0, -0.5, float("nan"), "1"])
def test_binary_concrete_refuses_a_temperature_that_is_not_positive(temperature):
    """lambda <= 0 is no Concrete: 0 divided the logits by zero (draws of exactly 0 or 1, a log density of -inf or
    NaN) and a negative one flipped the draws; both are InputErrors now. A tensor temperature (a traced
    schedule's) still passes unread."""
    logit = tf.constant([0.3, -1.0], tf.float64)
    with pytest.raises(InputError, match="temperature must be a finite number > 0"):
        concrete.sample(logit, temperature, seed=tf.constant([1, 2]))
    with pytest.raises(InputError, match="temperature must be a finite number > 0"):
        concrete.log_prob(tf.constant([0.2, 0.6], tf.float64), logit, temperature)
    assert np.isfinite(concrete.log_prob(tf.constant([0.2, 0.6], tf.float64), logit, tf.constant(0.5))).all()


def test_binary_concrete_matches_maddisons_density_and_its_draws():
    """The log density against the paper's formula in NumPy; draws: P(y > 1/2) = sigmoid(logit)."""
    y = np.linspace(0.01, 0.99, 41)
    for logit, lam in ((0.7, 1.0), (-1.2, 0.5)):
        alpha = math.exp(logit)
        reference = (lam * alpha * y ** (-lam - 1) * (1 - y) ** (-lam - 1)
                     / (alpha * y ** (-lam) + (1 - y) ** (-lam)) ** 2)
        np.testing.assert_allclose(np.exp(concrete.log_prob(tf.constant(y), logit, lam)), reference, rtol=1e-12)
        draws = concrete.sample(tf.fill([200_000], tf.constant(logit, tf.float64)), lam, seed=tf.constant([1, 2]))
        share = float(tf.reduce_mean(tf.cast(draws > 0.5, tf.float64)))
        # binomial standard error at n = 200,000 is at most 0.0011: 5 of them
        assert abs(share - scipy.special.expit(logit)) < 0.0056


@pytest.mark.parametrize("call, message", [
    # one pose for two templates, or three: failed inside TensorFlow's gather
    (lambda t, p: compositing.warp(t, p[:, :1], (5, 5)), "one pose per template"),
    (lambda t, p: compositing.warp(t, tf.concat([p, p[:, :1]], 1), (5, 5)), "one pose per template"),
    (lambda t, p: compositing.warp(t, p, (0, 5)), "image_size"),          # drew an empty image
    (lambda t, p: compositing.warp(t, p, (5.5, 5)), "image_size"),
    (lambda t, p: compositing.warp(t[..., 0], p, (5, 5)), r"\[N, h, w, C\]"),
    # one alpha layer for three colour layers was broadcast: nothing in front hid what was behind
    (lambda t, p: compositing.composite(tf.ones([2, 3, 4, 4, 1]), tf.fill([2, 1, 4, 4, 1], 0.5)), "one alpha per"),
])
def test_warp_and_composite_refuse_shapes_that_do_not_fit(call, message):
    templates = tf.random.stateless_uniform([2, 4, 4, 1], [0, 1])
    poses = tf.tile(tf.constant([[compositing.IDENTITY]]), [3, 2, 1])
    with pytest.raises(InputError, match=message):
        call(templates, poses)
    # three layers of alpha 1/2 over black pass: 1/2 + 1/4 + 1/8 of a white colour
    found = compositing.composite(tf.ones([1, 3, 1, 1, 1]), tf.fill([1, 3, 1, 1, 1], 0.5))
    np.testing.assert_allclose(found.numpy().ravel(), [0.875], rtol=1e-6)


def test_over_and_composite_of_two_layers_by_hand():
    # front: C 0.8, alpha 0.5; back: C 0.4, alpha 0.6
    # a_o = 0.5 + 0.6 * 0.5 = 0.8; C_o = (0.8 * 0.5 + 0.4 * 0.6 * 0.5) / 0.8 = 0.52 / 0.8 = 0.65
    color, alpha = compositing.over(tf.constant([0.8]), tf.constant([0.5]), tf.constant([0.4]), tf.constant([0.6]))
    np.testing.assert_allclose([float(color[0]), float(alpha[0])], [0.65, 0.8], rtol=1e-6)
    colors = tf.constant([0.8, 0.4], shape=[1, 2, 1, 1, 1])
    alphas = tf.constant([0.5, 0.6], shape=[1, 2, 1, 1, 1])
    np.testing.assert_allclose(compositing.composite(colors, alphas).numpy().ravel(), [0.52], rtol=1e-6)
    # the back layer in front: a_o the same, image 0.4 * 0.6 + 0.8 * 0.5 * 0.4 = 0.4
    swapped = compositing.composite(tf.reverse(colors, [1]), tf.reverse(alphas, [1]))
    np.testing.assert_allclose(swapped.numpy().ravel(), [0.4], rtol=1e-6)


def _numpy_warp(template, pose, size):
    """Bilinear inverse warp in NumPy: image point x reads the template at P^-1 x, zero outside."""
    h, w = template.shape
    matrix = np.vstack([np.reshape(pose, (2, 3)), [0.0, 0.0, 1.0]])
    inverse = np.linalg.inv(matrix)
    out = np.zeros(size)
    for r in range(size[0]):
        for c in range(size[1]):
            x, y = 2 * (c + 0.5) / size[1] - 1, 2 * (r + 0.5) / size[0] - 1
            u, v, _ = inverse @ [x, y, 1.0]
            col, row = (u + 1) * w / 2 - 0.5, (v + 1) * h / 2 - 0.5
            total = 0.0
            for rr in (math.floor(row), math.floor(row) + 1):
                for cc in (math.floor(col), math.floor(col) + 1):
                    if 0 <= rr < h and 0 <= cc < w:
                        total += (1 - abs(row - rr)) * (1 - abs(col - cc)) * template[rr, cc]
            out[r, c] = total
    return out


def test_warp_matches_a_numpy_bilinear_warp_and_the_identity_copies(rng):
    templates = rng.uniform(size=(2, 6, 6, 1))
    identity = np.array([1.0, 0, 0, 0, 1.0, 0])
    same = compositing.warp(tf.constant(templates), tf.constant([[identity, identity]]), (6, 6))
    np.testing.assert_allclose(same.numpy()[0], templates, atol=1e-12)
    shift = np.array([1.0, 0, 2 * 2 / 6, 0, 1.0, 0])           # two pixels to the right
    moved = compositing.warp(tf.constant(templates), tf.constant([[shift, shift]]), (6, 6)).numpy()[0, 0, ..., 0]
    np.testing.assert_allclose(moved[:, 2:], templates[0, :, :4, 0], atol=1e-12)
    np.testing.assert_allclose(moved[:, :2], 0.0, atol=1e-12)
    poses = np.stack([identity + rng.normal(0, 0.3, 6), identity * 0.5 + rng.normal(0, 0.2, 6)])
    warped = compositing.warp(tf.constant(templates), tf.constant(poses[None]), (9, 11)).numpy()[0]
    for k in range(2):
        np.testing.assert_allclose(warped[k, ..., 0], _numpy_warp(templates[k, ..., 0], poses[k], (9, 11)),
                                   atol=1e-10)


def _model_and_state(seed=0, batch=2):
    model = ProbabilisticCapsules(image_size=(16, 16), num_top=3, num_parts=4, template_size=6, seed=seed)
    rng = np.random.default_rng(seed + 1)
    # every weight away from its symmetric start, so that a wrong index cannot hide
    for weight in model.trainable_weights:
        weight.assign(weight.numpy() + rng.normal(0, 0.3, weight.shape).astype("float32"))
    top_presence = rng.uniform(0.2, 0.9, (batch, 3)).astype("float32")
    top_pose = rng.normal(0, 0.3, (batch, 3, 6)).astype("float32")
    part_presence = rng.uniform(0.1, 0.9, (batch, 4)).astype("float32")
    part_pose = rng.normal(0, 0.3, (batch, 4, 6)).astype("float32")
    return model, [tf.constant(x) for x in (top_presence, top_pose, part_presence, part_pose)]


def _numpy_part_terms(model, top_presence, top_pose, part_presence, part_pose):
    """pi [B, N, K + 1] and f [B, N, K + 1] from the model's weights, in NumPy and SciPy."""
    softplus = lambda x: np.log1p(np.exp(x))
    rho = np.vstack([np.full((1, model.num_parts), model.rho_dummy), softplus(model.binding_raw.numpy())])
    on = np.concatenate([np.ones((top_presence.shape[0], 1)), top_presence], axis=1)
    weights = rho[None] * on[:, :, None]                                           # [B, K + 1, N]
    pi = np.transpose(weights / weights.sum(1, keepdims=True), (0, 2, 1))
    gamma_logit = model.presence_logits.numpy().T                                  # [N, K + 1]
    spreads = np.hstack([np.full((model.num_parts, 1), model.c_dummy),
                         model.c_min + softplus(model.spread_raw.numpy()).T])
    homog = lambda p: np.vstack([np.reshape(p, (2, 3)), [0, 0, 1]])
    eye = np.array([1.0, 0, 0, 0, 1.0, 0])
    b_count, n_count, k_count = part_presence.shape[0], model.num_parts, model.num_top
    f = np.zeros((b_count, n_count, k_count + 1))
    for b in range(b_count):
        for j in range(n_count):
            t = part_presence[b, j]
            for i in range(k_count + 1):
                alpha, lam = math.exp(gamma_logit[j, i]), model.temperature
                presence = (lam * alpha * t ** (-lam - 1) * (1 - t) ** (-lam - 1)
                            / (alpha * t ** (-lam) + (1 - t) ** (-lam)) ** 2)
                mean = eye if i == 0 else (homog(top_pose[b, i - 1] + eye) @ homog(model.offsets.numpy()[i - 1, j]))[:2].ravel()
                on_pose = scipy.stats.multivariate_normal.pdf(part_pose[b, j] + eye, mean, spreads[j, i] ** 2)
                off_pose = scipy.stats.multivariate_normal.pdf(part_pose[b, j], np.zeros(6), model.lambda_off ** 2)
                f[b, j, i] = presence * (t * on_pose + (1 - t) * off_pose)
    return pi, f


def test_the_enumerated_parent_marginal_equals_monte_carlo_over_the_parent_choices():
    model, state = _model_and_state()
    pi, f = _numpy_part_terms(model, *[s.numpy().astype("float64") for s in state])
    exact = np.exp(model.part_marginal_log_likelihood(*state).numpy())             # [B, N]
    rng = np.random.default_rng(7)
    draws = 1_500_000
    for b in range(pi.shape[0]):
        for j in range(pi.shape[1]):
            choices = rng.choice(pi.shape[2], size=draws, p=pi[b, j])
            values = f[b, j, choices]
            estimate, standard_error = values.mean(), values.std() / math.sqrt(draws)
            assert standard_error < 0.0025 * estimate       # 1 % is at least four standard errors
            assert abs(exact[b, j] / estimate - 1.0) < 0.01, (b, j, exact[b, j], estimate)


def test_the_routing_coefficients_are_the_posterior_over_parents():
    model, state = _model_and_state(seed=3)
    pi, f = _numpy_part_terms(model, *[s.numpy().astype("float64") for s in state])
    result = model.route(*state)
    posterior = pi * f / (pi * f).sum(-1, keepdims=True)
    np.testing.assert_allclose(result.coefficients.numpy(), posterior, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(result.coefficients.numpy().sum(-1), 1.0, rtol=1e-5)
    assert result.poses.shape == (2, 4, 6) and result.activations.shape == (2, 4)
    np.testing.assert_allclose(result.activations.numpy()[:, 0], 1.0)          # the dummy is always on


def test_the_joint_adds_the_prior_the_parts_and_the_pixels():
    model, state = _model_and_state(seed=4)
    top_presence, top_pose, part_presence, part_pose = [s.numpy().astype("float64") for s in state]
    pi, f = _numpy_part_terms(model, top_presence, top_pose, part_presence, part_pose)
    images = np.random.default_rng(5).uniform(size=(2, 16, 16, 1)).astype("float32")
    mean = model.render(state[2], state[3]).numpy()
    lam, logit = model.temperature, model.top_logits.numpy()
    t = top_presence
    prior = (np.log(lam) + logit - (lam + 1) * (np.log(t) + np.log1p(-t))
             - 2 * np.log(np.exp(logit) * t ** -lam + (1 - t) ** -lam)).sum(-1)
    prior += scipy.stats.norm.logpdf(top_pose).sum((1, 2))
    pixels = scipy.stats.norm.logpdf(images, mean, model.sigma).sum((1, 2, 3))
    expected = prior + np.log((pi * f).sum(-1)).sum(-1) + pixels
    found = model.log_prob(tf.constant(images), *state).numpy()
    # float32 sums of ~300 terms of size ~5: a few 1e-4 in ~1,000
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-3)


def test_a_part_that_is_off_draws_nothing():
    model, state = _model_and_state()
    off = model.render(tf.zeros_like(state[2]), state[3])
    np.testing.assert_array_equal(off.numpy(), 0.0)
    one = model.render(tf.constant([[1.0, 0, 0, 0]] * 2), state[3]).numpy()
    drawn = compositing.warp(model.templates(), state[3] + tf.constant([1.0, 0, 0, 0, 1.0, 0]), (16, 16)).numpy()
    np.testing.assert_allclose(one, drawn[:, 0, ..., :1] * drawn[:, 0, ..., 1:], rtol=1e-6, atol=1e-7)


def test_the_gradient_of_the_joint_reaches_every_generative_weight():
    model, state = _model_and_state()
    images = tf.constant(np.random.default_rng(2).uniform(size=(2, 16, 16, 1)).astype("float32"))
    with tf.GradientTape() as tape:
        value = tf.reduce_sum(model.log_prob(images, *state))
    grads = tape.gradient(value, model.trainable_weights)
    for weight, grad in zip(model.trainable_weights, grads):
        assert grad is not None, weight.name
        grad = grad.numpy()
        per_row = np.abs(grad).reshape(grad.shape[0], -1).sum(-1) if grad.ndim > 1 else np.abs(grad)
        # every template, every top capsule's prior, every (parent, part) row reached
        assert np.all(per_row > 0), weight.name


def test_generated_latents_follow_the_model():
    model = ProbabilisticCapsules(image_size=(16, 16), num_top=3, num_parts=4, template_size=6)
    sample = model.generate(4000, seed=1)
    assert sample["images"].shape == (4000, 16, 16, 1)
    # top presences are Bern(sigmoid(0)) = 1/2: standard error 0.0046 over 12,000 draws
    assert abs(float(tf.reduce_mean(sample["top_presence"])) - 0.5) < 0.02
    parents = sample["parents"].numpy()
    top = sample["top_presence"].numpy()
    chosen_on = np.take_along_axis(np.hstack([np.ones((4000, 1)), top]), parents, axis=1)
    assert np.all(chosen_on == 1)                              # no part picks a parent that is off
    off = sample["part_presence"].numpy() == 0
    assert 0 < off.mean() < 1


def test_config_round_trip_rebuilds_the_same_model():
    model = ProbabilisticCapsules(image_size=(12, 14), num_top=2, num_parts=3, template_size=5, part_scale=0.4,
                                  sigma=0.3, lambda_off=2.0, rho_dummy=0.1, c_dummy=0.5, c_min=0.2,
                                  temperature=0.7, seed=9)
    clone = ProbabilisticCapsules.from_config(model.get_config())
    assert clone.get_config() == model.get_config()
    for a, b in zip(model.weights, clone.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    restored = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(model))
    assert isinstance(restored, ProbabilisticCapsules) and restored.image_size == (12, 14)


def test_bad_sizes_are_refused():
    with pytest.raises(InputError, match="num_top"):
        ProbabilisticCapsules(num_top=0)
    with pytest.raises(InputError, match="sigma"):
        ProbabilisticCapsules(sigma=0.0)
    with pytest.raises(InputError, match="image_size"):
        ProbabilisticCapsules(image_size=(28,))


def _tiny_autoencoder():
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1)
    return ProbabilisticCapsuleAutoencoder(generative, channels=8, hidden=16, encoding=8, blocks=2, inducing=4,
                                           heads=2, seed=2)


def test_initial_weights_repeat_after_keras_global_seed_as_the_scripts_set_it():
    """`seed` fixes the convolutional and embedding weights; the set transformer's and the heads' come from
    Keras' global random state. Built after the same `set_random_seed`, two models agree in every weight."""
    keras.utils.set_random_seed(5)
    first = _tiny_autoencoder()
    keras.utils.set_random_seed(5)
    again = _tiny_autoencoder()
    assert [w.shape for w in first.weights] == [w.shape for w in again.weights]
    for a, b in zip(first.weights, again.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    keras.utils.set_random_seed(6)
    other = _tiny_autoencoder()
    moved = {a.path for a, b in zip(first.weights, other.weights) if not np.array_equal(a.numpy(), b.numpy())}
    assert any("/isab0/" in path for path in moved) and not any("part_conv" in path for path in moved)


@pytest.mark.parametrize("training", [False, True])
def test_the_bound_is_the_sum_of_its_terms_and_its_gradient_reaches_every_weight(training):
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(0).uniform(size=(3, 12, 12, 1)).astype("float32"))
    with tf.GradientTape() as tape:
        terms = model.bound(images, seed=tf.constant([3, 4], tf.int64), training=training)
        value = tf.reduce_mean(terms["bound"])
    parts = sum(terms[k] for k in ("image", "parts", "top", "part_entropy", "top_entropy"))
    np.testing.assert_allclose(terms["bound"].numpy(), parts.numpy(), rtol=1e-6)
    names = [w.path for w in model.trainable_weights]
    assert any("template_logits" in n for n in names) and any("isab" in n for n in names)
    for weight, grad in zip(model.trainable_weights, tape.gradient(value, model.trainable_weights)):
        assert grad is not None and np.any(grad.numpy() != 0), weight.path
    # the same seed draws the same presences: the bound is a deterministic function of it
    again = model.bound(images, seed=tf.constant([3, 4], tf.int64), training=training)["bound"]
    np.testing.assert_array_equal(again.numpy(), terms["bound"].numpy())


def test_the_top_encoder_standardises_the_parts_over_the_batch_in_training():
    """Batch statistics in training: shifting every image's part poses and presences by one constant per part
    and entry changes nothing; outside training (moving statistics) the same shift moves the output."""
    model = _tiny_autoencoder()
    rng = np.random.default_rng(5)
    presence = tf.constant(rng.uniform(0.2, 0.8, (6, 4)).astype("float32"))
    pose = tf.constant(rng.normal(0.0, 0.05, (6, 4, 6)).astype("float32"))
    shift_presence = tf.constant(rng.uniform(-0.1, 0.1, (1, 4)).astype("float32"))
    shift_pose = tf.constant(rng.normal(0.0, 0.5, (1, 4, 6)).astype("float32"))
    for training, same in ((True, True), (False, False)):
        before = model.encode_top(presence, pose, training=training)
        after = model.encode_top(presence + shift_presence, pose + shift_pose, training=training)
        for b, a in zip(before, after):
            # float32 rounding of the shifted inputs (|x| < 2, eps 1.2e-7) through two attention blocks
            assert np.allclose(b.numpy(), a.numpy(), atol=1e-4) == same, (training, np.abs(b - a).numpy().max())


def test_a_training_step_updates_the_moving_statistics():
    from poecaps.trainers.variational import VariationalTrainer

    model = _tiny_autoencoder()
    images = np.random.default_rng(6).uniform(size=(8, 12, 12, 1)).astype("float32")
    norm = model.part_normalisation
    assert np.all(norm.moving_mean.numpy() == 0.0)
    poses = model.encode_parts(tf.constant(images))[1].numpy()                                 # before the step
    trainer = VariationalTrainer(model, seed=0)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3))
    trainer.fit(images, epochs=1, batch_size=8, verbose=0)
    # one step on the whole set: the moving mean moved the share (1 - momentum) of the way from 0 to the
    # batch mean of the poses the encoder gave before the step (float32 sums in another order: rtol 1e-4);
    # the presence entries (index 0 of each part's 7) average the step's random draws, not checked here
    expected = (1.0 - norm.momentum) * poses.mean(0)
    got = norm.moving_mean.numpy().reshape(4, 7)
    np.testing.assert_allclose(got[:, 1:], expected, rtol=1e-4, atol=1e-9)
    assert np.all(got[:, 0] > 0.0)


def test_the_trainer_raises_the_bound_and_the_model_saves_and_reloads(tmp_path):
    from poecaps.trainers.variational import VariationalTrainer

    model = _tiny_autoencoder()
    rng = np.random.default_rng(1)
    images = np.zeros((32, 12, 12, 1), "float32")
    images[:, 3:9, 5:7] = 1.0                                          # one bar, shifted a little
    images = np.stack([np.roll(im, rng.integers(-2, 3), axis=1) for im in images])
    trainer = VariationalTrainer(model, seed=0)
    trainer.compile(optimizer=keras.optimizers.Adam(3e-3))
    before = trainer.evaluate(images, batch_size=32, verbose=0, return_dict=True)["bound"]
    trainer.fit(images, batch_size=8, epochs=4, verbose=0)
    after = trainer.evaluate(images, batch_size=32, verbose=0, return_dict=True)["bound"]
    assert after > before
    path = str(tmp_path / "model.keras")
    model.save(path)
    restored = keras.saving.load_model(path)
    for key, value in model(images[:4]).items():
        np.testing.assert_allclose(restored(images[:4])[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
    assert restored.get_config()["generative"]["config"] == model.get_config()["generative"]["config"]


def test_the_part_encoder_sees_where_each_pixel_is():
    from poecaps.models.capsule_autoencoder import _coordinates

    grid = _coordinates(tf.zeros((2, 2, 4, 1))).numpy()
    assert grid.shape == (2, 2, 4, 2)
    np.testing.assert_allclose(grid[1, 0, :, 0], [-0.75, -0.25, 0.25, 0.75])       # x: 2 (k + 1/2) / 4 - 1
    np.testing.assert_allclose(grid[1, :, 2, 1], [-0.5, 0.5])                      # y: 2 (k + 1/2) / 2 - 1
    model = _tiny_autoencoder()
    bar = np.zeros((2, 12, 12, 1), "float32")
    bar[0, 2:5, 2:5] = bar[1, 7:10, 7:10] = 1.0                      # the same square in two places
    poses = model.encode_parts(tf.constant(bar))[1].numpy()
    assert np.abs(poses[0] - poses[1]).max() > 1e-3


def test_refine_ascends_each_images_own_bound():
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(2).uniform(size=(4, 12, 12, 1)).astype("float32"))
    start = model.variational_parameters(images)
    same = model.refine(images, 0, parameters=start)
    for key, value in start.items():
        np.testing.assert_array_equal(same[key].numpy(), value.numpy())
    refined = model.refine(images, 30, learning_rate=0.02, parameters=start, seed=5)
    before = model.mean_bound(images, start, draws=16, seed=9).numpy()
    after = model.mean_bound(images, refined, draws=16, seed=9).numpy()
    assert np.all(after > before), (before, after)
    # Adam is coordinate-wise and the bound a sum over images: changing image 0 leaves the others' paths alone
    # (the same draws reach the same positions of the batch).
    other = tf.concat([1.0 - images[:1], images[1:]], axis=0)
    moved = model.refine(other, 30, learning_rate=0.02, parameters=start, seed=5)
    for key in start:
        np.testing.assert_allclose(moved[key][1:].numpy(), refined[key][1:].numpy(), rtol=1e-4, atol=1e-5)
        assert np.abs(moved[key][0].numpy() - refined[key][0].numpy()).max() > 1e-4
    with pytest.raises(InputError, match="steps"):
        model.refine(images, -1)
    with pytest.raises(InputError, match="learning_rate"):
        model.refine(images, 3, learning_rate=0.0)
    with pytest.raises(InputError, match="optimizer"):
        model.refine(images, 3, optimizer="rmsprop")


def test_refine_and_mean_bound_check_the_parameters_and_draws_they_are_given():
    # Before, parameters of another batch size, pose width or keys failed inside the compiled ascent (a
    # StagingError or TypeError), a missing key read as a pose of shape (), and draws=0 divided by zero.
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(2).uniform(size=(2, 12, 12, 1)).astype("float32"))
    start = model.variational_parameters(images)
    bad = [({key: value[:1] for key, value in start.items()}, r"parameters\['part_logits'\] must be \[2, 4\] for 2 images"),
           ({**start, "part_pose": start["part_pose"][..., :5]}, r"parameters\['part_pose'\] must be \[2, 4, 6\]"),
           ({**start, "extra": start["top_pose"]}, r"'top_logits', 'top_pose'\], or the parts' two alone"),
           ({k: v for k, v in start.items() if k != "top_pose"}, r"Received: \['part_logits', 'part_pose', 'top_logits'\]")]
    for parameters, message in bad:
        with pytest.raises(InputError, match=message):
            model.refine(images, 1, parameters=parameters)
        with pytest.raises(InputError, match=message):
            model.mean_bound(images, parameters)
    for draws in (0, -1, 2.5):
        with pytest.raises(InputError, match=rf"^draws must be an integer >= 1\. Received: draws={draws}$"):
            model.mean_bound(images, start, draws=draws)
    # bound_terms takes the top's two parameters together (one alone read the other as a pose of shape ()), and
    # encode_top the parts' presences [B, N] and poses [B, N, 6] (before, a reshape failed inside it, or took
    # 4 examples of 5 parts for 5 examples of 4 until a later concatenation failed).
    with pytest.raises(InputError, match=r"top_logits and top_pose together, or neither .*Received: only top_logits$"):
        model.bound_terms(images, start["part_logits"], start["part_pose"], top_logits=start["top_logits"])
    with pytest.raises(InputError, match=r"^part_presence must be \[batch, 4\]"):
        model.encode_top(tf.ones((4, 5)), tf.ones((4, 5, 6)))
    with pytest.raises(InputError, match=r"^part_pose must be \[batch, 4, 6\]"):
        model.encode_top(tf.ones((2, 4)), tf.ones((2, 4, 5)))
    with pytest.raises(InputError, match=r"share one batch size"):
        model.encode_top(tf.ones((2, 4)), tf.ones((3, 4, 6)))


def test_refine_and_mean_bound_refuse_values_that_are_not_finite():
    """A NaN pixel, or a NaN parameter, made every refined parameter and bound NaN without a word; both are
    InputErrors naming the array now. Finite values still refine to finite ones."""
    model = _tiny_autoencoder()
    images = np.random.default_rng(2).uniform(size=(2, 12, 12, 1)).astype("float32")
    start = model.variational_parameters(images)
    refined = model.refine(images, 2, parameters=start)
    assert all(np.isfinite(v.numpy()).all() for v in refined.values())
    broken = images.copy()
    broken[1, 3, 4, 0] = np.nan
    with pytest.raises(InputError, match=r"images holds 1 NaN or infinite pixels"):
        model.refine(broken, 2)
    with pytest.raises(InputError, match=r"images holds 1 NaN or infinite pixels"):
        model.mean_bound(broken, start)
    pose = start["top_pose"].numpy()
    pose[0, 0, 0] = np.inf
    for call in (lambda p: model.refine(images, 2, parameters=p), lambda p: model.mean_bound(images, p)):
        with pytest.raises(InputError, match=r"parameters\['top_pose'\] holds 1 NaN or infinite values"):
            call({**start, "top_pose": tf.constant(pose)})


def test_refine_by_plain_gradient_ascent_takes_the_bounds_gradient_step():
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(3).uniform(size=(3, 12, 12, 1)).astype("float32"))
    start = model.variational_parameters(images)
    names = sorted(start)
    values = [tf.identity(start[n]) for n in names]

    @tf.function(jit_compile=True)        # as refine runs: XLA's stateless draws differ from the eager kernels'
    def gradient(values):
        with tf.GradientTape() as tape:   # step 0 draws the presences with the stateless seed [seed, 0]
            tape.watch(values)
            bound = model.bound_terms(images, **dict(zip(names, values)), seed=tf.constant([7, 0], tf.int64))["bound"]
            total = tf.reduce_sum(bound)
        return tape.gradient(total, values)

    grads = dict(zip(names, gradient(values)))
    one = model.refine(images, 1, learning_rate=1e-3, parameters=start, seed=7, optimizer="sgd")
    for n in names:
        expected = start[n].numpy() + 1e-3 * grads[n].numpy()
        step = np.abs(1e-3 * grads[n].numpy()).max()
        assert step > 1e-4                                # the step stands well above the tolerance
        np.testing.assert_allclose(one[n].numpy(), expected, rtol=0, atol=1e-3 * step + 1e-6)
    refined = model.refine(images, 30, learning_rate=1e-3, parameters=start, seed=7, optimizer="sgd")
    before = model.mean_bound(images, start, draws=16, seed=9).numpy()
    after = model.mean_bound(images, refined, draws=16, seed=9).numpy()
    assert np.all(after > before), (before, after)


def test_refine_of_the_parts_alone_steps_on_the_parts_and_reads_the_top_from_the_encoder():
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(4).uniform(size=(3, 12, 12, 1)).astype("float32"))
    start = model.variational_parameters(images)
    names = ["part_logits", "part_pose"]
    values = [tf.identity(start[n]) for n in names]

    @tf.function(jit_compile=True)        # as refine runs: XLA's stateless draws differ from the eager kernels'
    def gradient(values):
        with tf.GradientTape() as tape:   # no top parameters: the top encoder reads the drawn parts
            tape.watch(values)
            bound = model.bound_terms(images, **dict(zip(names, values)), seed=tf.constant([7, 0], tf.int64))["bound"]
            total = tf.reduce_sum(bound)
        return tape.gradient(total, values)

    grads = dict(zip(names, gradient(values)))
    one = model.refine(images, 1, learning_rate=1e-3, parameters=start, seed=7, optimizer="sgd", parts_only=True)
    for n in names:
        expected = start[n].numpy() + 1e-3 * grads[n].numpy()
        step = np.abs(1e-3 * grads[n].numpy()).max()
        assert step > 1e-4                                # the step stands well above the tolerance
        np.testing.assert_allclose(one[n].numpy(), expected, rtol=0, atol=1e-3 * step + 1e-6)
    # the top is the encoder's reading of the refined parts' presence means, not a step of its own
    top_logits, top_pose = model.encode_top(tf.sigmoid(one["part_logits"]), one["part_pose"])
    np.testing.assert_allclose(one["top_logits"].numpy(), top_logits.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(one["top_pose"].numpy(), top_pose.numpy(), rtol=0, atol=1e-6)
    assert np.abs(one["top_logits"].numpy() - start["top_logits"].numpy()).max() > 1e-6   # it moved with the parts
    refined = model.refine(images, 30, learning_rate=1e-3, parameters=start, seed=7, optimizer="sgd",
                           parts_only=True)
    parts = lambda found: {n: found[n] for n in names}
    before = model.mean_bound(images, parts(start), draws=16, seed=9).numpy()
    after = model.mean_bound(images, parts(refined), draws=16, seed=9).numpy()
    assert np.all(after > before), (before, after)
    with pytest.raises(InputError, match="parts_only must be True or False"):
        model.refine(images, 1, parts_only="yes")


def test_refine_compiles_once_for_calls_that_differ_in_steps_rate_seed_or_values(monkeypatch):
    from poecaps.models import capsule_autoencoder

    traces = []
    loop = capsule_autoencoder._ascent_loop
    monkeypatch.setattr(capsule_autoencoder, "_ascent_loop", lambda *args: traces.append(1) or loop(*args))
    model = _tiny_autoencoder()
    images = tf.constant(np.random.default_rng(5).uniform(size=(3, 12, 12, 1)).astype("float32"))
    start = model.variational_parameters(images)
    model.refine(images, 2, learning_rate=0.05, parameters=start, seed=1)
    assert len(traces) == 1
    kept = model.refine(images, 4, learning_rate=0.02, seed=3)               # a new count, rate, seed and start
    assert len(traces) == 1
    # the kept loop took this call's numbers, not the first call's: a new, identical model compiles afresh
    twin = _tiny_autoencoder()
    twin.set_weights(model.get_weights())
    fresh = twin.refine(images, 4, learning_rate=0.02, seed=3)
    assert len(traces) == 2
    for key in fresh:
        np.testing.assert_array_equal(kept[key].numpy(), fresh[key].numpy())
    model.refine(images, 1, optimizer="sgd")                                  # another update rule: its own loop
    assert len(traces) == 3


def _tiny_vae():
    from poecaps.models import VariationalAutoencoder

    return VariationalAutoencoder(image_size=(6, 5), latent=3, hidden=7, pixel_sigma=0.3, seed=4)


def test_the_vae_bound_is_its_gaussian_likelihood_minus_the_kl_divergence():
    from scipy import stats

    vae = _tiny_vae()
    images = np.random.default_rng(3).uniform(size=(2, 6, 5, 1)).astype("float32")
    seed = tf.constant([1, 2], tf.int64)
    terms = {k: v.numpy() for k, v in vae.bound(tf.constant(images), seed=seed).items()}
    mu, sigma = (t.numpy() for t in vae.encode(tf.constant(images)))
    # KL(N(mu, sigma^2) || N(0, 1)) by quadrature, per latent
    for b in range(2):
        kl = 0.0
        for m, s in zip(mu[b], sigma[b]):
            q = stats.norm(m, s)
            z = np.linspace(m - 12 * s, m + 12 * s, 20001)
            kl += np.trapezoid(q.pdf(z) * (q.logpdf(z) - stats.norm.logpdf(z)), z)
        np.testing.assert_allclose(terms["kl"][b], kl, rtol=1e-4)
    z = mu + sigma * tf.random.stateless_normal(mu.shape, seed).numpy()
    mean = vae.decoder(tf.constant(z)).numpy()
    likelihood = stats.norm.logpdf(images, mean, 0.3).reshape(2, -1).sum(-1)
    np.testing.assert_allclose(terms["image"], likelihood, rtol=1e-5)
    np.testing.assert_allclose(terms["bound"], terms["image"] - terms["kl"], rtol=1e-6)


def test_the_vae_trains_saves_and_reloads(tmp_path):
    from poecaps.models import VariationalAutoencoder
    from poecaps.trainers.variational import VariationalTrainer

    vae = _tiny_vae()
    images = np.zeros((32, 6, 5, 1), "float32")
    images[::2, 1:4, 1:3] = 1.0
    trainer = VariationalTrainer(vae, seed=0)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-2))
    before = trainer.evaluate(images, batch_size=32, verbose=0, return_dict=True)["bound"]
    trainer.fit(images, batch_size=8, epochs=5, verbose=0)
    assert trainer.evaluate(images, batch_size=32, verbose=0, return_dict=True)["bound"] > before
    clone = VariationalAutoencoder.from_config(vae.get_config())
    assert clone.get_config() == vae.get_config() and clone.image_size == (6, 5) and clone.latent == 3
    # Built when made, as Keras counts it: two dense layers each side, 30 pixels, `hidden` units, 2 L outputs.
    pixels, hidden, latent = 30, vae.hidden, 3
    dense = lambda n_in, n_out: n_in * n_out + n_out
    assert clone.built and clone.count_params() == (dense(pixels, hidden) + dense(hidden, 2 * latent)
                                                    + dense(latent, hidden) + dense(hidden, pixels))
    path = str(tmp_path / "vae.keras")
    vae.save(path)
    restored = keras.saving.load_model(path)
    for key, value in vae(images[:3]).items():
        np.testing.assert_allclose(restored(images[:3])[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InputError, match="latent"):
        VariationalAutoencoder(latent=0)


def test_the_vae_decoder_refuses_latents_of_another_width():
    """Before, Keras' Sequential raised a ValueError about layer 'dense_2' for z [2, 4] of a 3-latent VAE."""
    vae = _tiny_vae()
    assert vae.decode(np.zeros((2, 3), "float32")).shape == (2, 6, 5, 1)
    for z in (np.zeros((2, 4), "float32"), np.zeros((3,), "float32")):
        with pytest.raises(InputError, match=re.escape(f"z must be latents [batch, 3]. Received: shape={z.shape}")):
            vae.decode(z)


def _numpy_information(logits):
    """I(image; capsule) for q_b(i) = t_bi / sum_k t_bk, t = sigmoid(logits), in float64."""
    t = 1.0 / (1.0 + np.exp(-np.asarray(logits, "float64")))
    q = t / t.sum(-1, keepdims=True)
    entropy = lambda p: -np.sum(p * np.log(p), -1)
    return entropy(q.mean(0)) - entropy(q).mean()


def test_the_presence_information_equals_a_numpy_computation_and_its_limits():
    from poecaps.models.capsule_autoencoder import presence_information

    logits = np.random.default_rng(7).normal(0.0, 2.0, (5, 4))
    got = presence_information(tf.constant(logits, tf.float32)).numpy()
    # float32 logs and sums of 4-20 terms of order 1: a few ulps of log(4) = 1.39
    np.testing.assert_allclose(got, _numpy_information(logits), atol=1e-5)
    same = np.tile(logits[:1], (6, 1))
    assert abs(presence_information(tf.constant(same, tf.float32)).numpy()) < 1e-5     # every image alike: 0
    # each of 4 images turns on its own capsule, the others far off: I -> log 4 (the off capsules' share
    # of each q is 3 e^-30 / 1, far below float32's resolution of log 4)
    one_hot = np.where(np.eye(4) > 0, 30.0, -30.0)
    np.testing.assert_allclose(presence_information(tf.constant(one_hot, tf.float32)).numpy(), np.log(4.0),
                               atol=1e-5)
    assert np.isfinite(presence_information(tf.constant(np.full((3, 4), -200.0), tf.float32)).numpy())


def test_the_specialisation_adds_the_weighted_information_to_the_training_objective_only():
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    plain = _tiny_autoencoder()
    weighted = ProbabilisticCapsuleAutoencoder.from_config({**plain.get_config(), "specialisation": 7.0})
    weighted.set_weights(plain.get_weights())
    rng = np.random.default_rng(8)
    images = tf.constant(rng.uniform(size=(4, 12, 12, 1)).astype("float32"))
    part_logits, part_pose = plain.encode_parts(images)
    top_logits = rng.normal(0.0, 2.0, (4, 3))
    top_pose = tf.constant(rng.normal(0.0, 0.1, (4, 3, 6)).astype("float32"))
    seed = tf.constant([1, 2], tf.int64)
    a, b = (m.bound_terms(images, part_logits, part_pose, tf.constant(top_logits, tf.float32), top_pose, seed=seed)
            for m in (plain, weighted))
    np.testing.assert_array_equal(a["bound"].numpy(), b["bound"].numpy())      # the bound is unchanged
    np.testing.assert_array_equal(a["objective"].numpy(), a["bound"].numpy())  # weight 0: the paper's training
    np.testing.assert_allclose(b["top_information"].numpy(), np.full(4, _numpy_information(top_logits)), atol=1e-5)
    # bound ~ 1e2-1e3 nats in float32: the sum's rounding is ~1e-4 relative at most
    np.testing.assert_allclose(b["objective"].numpy(), b["bound"].numpy() + 7.0 * b["top_information"].numpy(),
                               rtol=1e-5)
    with pytest.raises(InputError, match="specialisation"):
        ProbabilisticCapsuleAutoencoder(plain.generative, specialisation=-1.0)
    with pytest.raises(InputError, match="specialisation"):
        ProbabilisticCapsuleAutoencoder(plain.generative, specialisation=float("nan"))
    with pytest.raises(InputError, match="specialisation"):
        ProbabilisticCapsuleAutoencoder(plain.generative, specialisation=True)
    assert ProbabilisticCapsuleAutoencoder(plain.generative, specialisation=np.float32(2.5)).specialisation == 2.5
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(weighted)).specialisation == 7.0


def _numpy_binary_concrete_log_density(y, logit, temperature):
    """Maddison et al.'s binary Concrete density, as written there:
    `p(y) = tau a y^(-tau-1) (1-y)^(-tau-1) / (a y^(-tau) + (1-y)^(-tau))^2`, `a = e^logit`."""
    y, a, tau = np.float64(y), np.exp(np.float64(logit)), float(temperature)
    return np.log(tau * a * y ** (-tau - 1) * (1 - y) ** (-tau - 1) / (a * y ** -tau + (1 - y) ** -tau) ** 2)


def test_presence_free_bits_add_their_term_to_the_objective_and_cancel_the_kls_gradient_below_lambda():
    """`presence_free_bits = lambda`: the objective gains `sum_i (K_i - max(K_i, lambda))`, `K_i` the batch mean of
    `log q(t_bi) - log p(t_bi)` at the drawn presences (NumPy, Maddison et al.'s density written above); the
    bound is unchanged; the prior logit of a capsule with `K_i < lambda` gets no gradient from the objective,
    one with `K_i > lambda` gets the bound's."""
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    plain = _tiny_autoencoder()
    rng = np.random.default_rng(11)
    plain.generative.top_logits.assign(rng.normal(0.0, 2.0, 3).astype("float32"))
    images = tf.constant(rng.uniform(size=(4, 12, 12, 1)).astype("float32"))
    part_logits, part_pose = plain.encode_parts(images)
    top_logits = tf.constant(rng.normal(0.0, 2.0, (4, 3)).astype("float32"))
    top_pose = tf.constant(rng.normal(0.0, 0.1, (4, 3, 6)).astype("float32"))
    seed = tf.constant([3, 5], tf.int64)
    drawn = concrete.sample(top_logits, 1.0, tf.unstack(tf.random.experimental.stateless_split(seed, 2))[1]).numpy()
    prior = plain.generative.top_logits.numpy()
    kl = np.mean(_numpy_binary_concrete_log_density(drawn, top_logits.numpy(), 1.0)
                 - _numpy_binary_concrete_log_density(drawn, prior[None], 1.0), axis=0)         # K_i, [3]
    assert kl.max() - kl.min() > 0.1
    lam = float(np.median(kl))                     # one capsule above lambda, one below, one at it
    freed = ProbabilisticCapsuleAutoencoder.from_config({**plain.get_config(), "presence_free_bits": lam})
    freed.set_weights(plain.get_weights())

    terms, gradients = {}, {}
    for name, model in (("plain", plain), ("freed", freed)):
        with tf.GradientTape() as tape:
            terms[name] = model.bound_terms(images, part_logits, part_pose, top_logits, top_pose, seed=seed)
            objective = tf.reduce_mean(terms[name]["objective"])
        gradients[name] = tape.gradient(objective, model.generative.top_logits).numpy()
    a, b = terms["plain"], terms["freed"]
    np.testing.assert_array_equal(a["bound"].numpy(), b["bound"].numpy())
    # objectives ~1e2-1e3 nats in float32; K_i from log-densities of a few nats: float32 rounding of both
    np.testing.assert_allclose(b["objective"].numpy() - a["objective"].numpy(),
                               np.sum(kl - np.maximum(kl, lam)), rtol=0, atol=1e-4 * np.abs(a["bound"].numpy()).max())
    below, above = kl < lam - 1e-3, kl > lam + 1e-3
    assert below.any() and above.any()
    scale = np.abs(gradients["plain"]).max()
    assert scale > 1e-2                                                  # the prior's gradient is not small
    np.testing.assert_allclose(gradients["freed"][below], 0.0, atol=1e-5 * scale)
    np.testing.assert_allclose(gradients["freed"][above], gradients["plain"][above], rtol=1e-5, atol=1e-6 * scale)
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(freed)).presence_free_bits == lam
    with pytest.raises(InputError, match="presence_free_bits"):
        ProbabilisticCapsuleAutoencoder(plain.generative, presence_free_bits=-0.5)


def test_the_prior_sparsity_equals_a_hand_computation_and_pushes_where_the_information_does_not():
    from poecaps.models.capsule_autoencoder import presence_information, prior_sparsity

    # presences 0.5 / 0.5 / 0.5 (logits 0) and 0.5 / 0.5 / 0.5; 3 capsules, 2 images, 3 classes: every image's
    # sum is 1.5 against 3 / 3 = 1, so S_within = 0.25; every capsule's sum is 1 against 2 / 3, so
    # S_between = (1 / 3)^2
    within, between = prior_sparsity(tf.zeros((2, 3)), classes=3.0)
    np.testing.assert_allclose([within.numpy(), between.numpy()], [0.25, 1.0 / 9.0], rtol=1e-6)
    logits = np.random.default_rng(10).normal(0.0, 2.0, (5, 4))
    t = 1.0 / (1.0 + np.exp(-logits))
    within, between = prior_sparsity(tf.constant(logits, tf.float32), classes=10.0)
    np.testing.assert_allclose(within.numpy(), np.mean((t.sum(1) - 0.4) ** 2), rtol=1e-5)
    np.testing.assert_allclose(between.numpy(), np.mean((t.sum(0) - 0.5) ** 2), rtol=1e-5)
    # every image alike, capsule 0 on for all: I's gradient vanishes, S_between's pulls capsule 0 down
    same = tf.Variable(np.tile([[4.0, -4.0, -4.0, -4.0]], (6, 1)).astype("float32"))
    with tf.GradientTape(persistent=True) as tape:
        information = presence_information(same)
        between = prior_sparsity(same, classes=10.0)[1]
    assert np.abs(tape.gradient(information, same).numpy()).max() < 1e-6
    push = tape.gradient(between, same).numpy()
    assert (push[:, 0] > 1e-3).all()        # ascending -S_between lowers capsule 0's logit in every image


def test_the_prior_sparsity_weights_enter_the_training_objective_only():
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder, prior_sparsity

    plain = _tiny_autoencoder()
    config = {**plain.get_config(), "within_sparsity": 2.0, "between_sparsity": 0.35, "sparsity_classes": 4}
    weighted = ProbabilisticCapsuleAutoencoder.from_config(config)
    weighted.set_weights(plain.get_weights())
    rng = np.random.default_rng(11)
    images = tf.constant(rng.uniform(size=(4, 12, 12, 1)).astype("float32"))
    part_logits, part_pose = plain.encode_parts(images)
    top_logits = tf.constant(rng.normal(0.0, 2.0, (4, 3)).astype("float32"))
    top_pose = tf.constant(rng.normal(0.0, 0.1, (4, 3, 6)).astype("float32"))
    seed = tf.constant([3, 4], tf.int64)
    a, b = (m.bound_terms(images, part_logits, part_pose, top_logits, top_pose, seed=seed) for m in (plain, weighted))
    np.testing.assert_array_equal(a["bound"].numpy(), b["bound"].numpy())
    np.testing.assert_array_equal(a["objective"].numpy(), a["bound"].numpy())
    within, between = (v.numpy() for v in prior_sparsity(top_logits, 4.0))
    np.testing.assert_allclose(b["top_sparsity_within"].numpy(), np.full(4, within), rtol=1e-6)
    np.testing.assert_allclose(b["top_sparsity_between"].numpy(), np.full(4, between), rtol=1e-6)
    # bound ~ 1e2-1e3 nats in float32: the sum's rounding is ~1e-4 relative at most
    np.testing.assert_allclose(b["objective"].numpy(), b["bound"].numpy() - 2.0 * within - 0.35 * between,
                               rtol=1e-5)
    for name, bad in (("within_sparsity", -1.0), ("between_sparsity", float("inf")), ("sparsity_classes", 0.0),
                      ("within_sparsity", True)):
        with pytest.raises(InputError, match=name):
            ProbabilisticCapsuleAutoencoder(plain.generative, **{name: bad})
    found = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(weighted))
    assert (found.within_sparsity, found.between_sparsity, found.sparsity_classes) == (2.0, 0.35, 4.0)
    older = {k: v for k, v in plain.get_config().items() if "sparsity" not in k}     # a config from before them
    assert ProbabilisticCapsuleAutoencoder.from_config(older).between_sparsity == 0.0


def test_detached_parts_keep_the_bound_and_cut_only_the_top_layers_gradient_into_the_part_encoder():
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    plain = _tiny_autoencoder()
    detached = ProbabilisticCapsuleAutoencoder.from_config({**plain.get_config(), "detach_parts": True})
    detached.set_weights(plain.get_weights())
    images = tf.constant(np.random.default_rng(12).uniform(size=(4, 12, 12, 1)).astype("float32"))

    def gradients(model, key, training):
        """The terms, and the largest |gradient| of sum(terms[key]) in each part-encoder and top-encoder weight."""
        groups = [[w for layer in (*model.convs, model.part_head) for w in layer.trainable_weights],
                  model.top_presence_mlp.trainable_weights]
        with tf.GradientTape() as tape:
            terms = model.bound(images, seed=tf.constant([5, 6], tf.int64), training=training)
            total = tf.reduce_sum(terms[key])
        found = tape.gradient(total, groups)
        size = lambda g: 0.0 if g is None else float(np.abs(g.numpy()).max())      # None: no path
        return terms, [size(g) for g in found[0]], [size(g) for g in found[1]]

    a, plain_parts, _ = gradients(plain, "parts", True)
    b, detached_parts, detached_top = gradients(detached, "parts", True)
    np.testing.assert_array_equal(a["bound"].numpy(), b["bound"].numpy())       # the same values
    assert max(detached_parts) == 0.0 and min(plain_parts) > 0.0                # cut from the part encoder
    assert min(detached_top) > 0.0                                              # the top encoder learns
    assert gradients(plain, "image", True)[1:] == gradients(detached, "image", True)[1:]   # image term untouched
    assert min(gradients(detached, "parts", False)[1]) > 0.0                    # refine, evaluation: full gradient
    with pytest.raises(InputError, match="detach_parts"):
        ProbabilisticCapsuleAutoencoder(plain.generative, detach_parts=1)
    assert keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(detached)).detach_parts is True


def test_the_trainer_steps_on_the_objective():
    """One SGD step of learning rate 1: every trainable weight moves by minus the gradient of
    -mean(objective) / pixels at the trainer's first draw, not by that of the bound."""
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder
    from poecaps.trainers.variational import VariationalTrainer

    keras.utils.set_random_seed(9)          # the top encoder's MLPs draw from Keras's global generator
    model = ProbabilisticCapsuleAutoencoder.from_config({**_tiny_autoencoder().get_config(), "specialisation": 50.0})
    images = np.random.default_rng(9).uniform(size=(4, 12, 12, 1)).astype("float32")
    weights = model.trainable_weights
    grads = {}
    for key in ("objective", "bound"):
        with tf.GradientTape() as tape:
            terms = model.bound(tf.constant(images), seed=tf.constant([0, 0], tf.int64), training=True)
            loss = -tf.reduce_mean(terms[key]) / 144.0
        grads[key] = [g.numpy() for g in tape.gradient(loss, weights)]
    before = [w.numpy() for w in weights]
    trainer = VariationalTrainer(model, seed=0)
    trainer.compile(optimizer=keras.optimizers.SGD(1.0), jit_compile=False)
    trainer.fit(images, batch_size=4, epochs=1, verbose=0, shuffle=False)
    moved = [b - w.numpy() for b, w in zip(before, weights)]
    flat = lambda arrays: np.concatenate([a.ravel() for a in arrays])
    # the same float32 graph in another order of summation: agreement to 1e-4 of the largest step
    scale = np.abs(flat(grads["objective"])).max()
    np.testing.assert_allclose(flat(moved), flat(grads["objective"]), atol=1e-4 * scale)
    # and the bound's step is told apart from it: they differ by ten times that tolerance at least
    assert np.abs(flat(grads["objective"]) - flat(grads["bound"])).max() > 1e-3 * scale


def test_the_equivariant_top_encoder_keeps_the_presences_and_moves_the_poses_when_the_parts_turn():
    """Every part pose moved by one rotation and translation `R`: the top presence logits stay, the top poses
    `P_i = I + A_i` become `R P_i` (NumPy products); the plain encoder's presences move."""
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1)
    sizes = {"channels": 8, "hidden": 16, "encoding": 8, "blocks": 2, "inducing": 4, "heads": 2, "seed": 2}
    equivariant = ProbabilisticCapsuleAutoencoder(generative, equivariant_top=True, **sizes)
    plain = ProbabilisticCapsuleAutoencoder(ProbabilisticCapsules.from_config(generative.get_config()), **sizes)
    rng = np.random.default_rng(3)
    presence = tf.constant(rng.uniform(0.2, 0.9, (5, 4)).astype("float32"))
    pose = rng.normal(0.0, 0.3, (5, 4, 6)).astype("float32")
    identity = np.array(compositing.IDENTITY)
    square = lambda p: np.vstack([np.reshape(p, (2, 3)), [0.0, 0.0, 1.0]])
    for angle in (0.7, math.pi):
        c, s = math.cos(angle), math.sin(angle)
        motion = np.array([[c, -s, 0.2], [s, c, -0.1], [0.0, 0.0, 1.0]])
        moved = np.array([[(motion @ square(p + identity))[:2].ravel() for p in image] for image in pose]) - identity
        moved = tf.constant(moved.astype("float32"))
        logits, top = (x.numpy() for x in equivariant.encode_top(presence, tf.constant(pose)))
        moved_logits, moved_top = (x.numpy() for x in equivariant.encode_top(presence, moved))
        # float32 rounding of the moved poses (|P| < 3, eps 1.2e-7: ~1e-6 in the frame's angle over the parts'
        # spread, > 0.05 here), then a few-fold through the encoder's layers; a missing frame moves them by > 1e-2
        np.testing.assert_allclose(moved_logits, logits, atol=1e-4)
        expected = np.array([[(motion @ square(p + identity))[:2].ravel() for p in image] for image in top])
        np.testing.assert_allclose(moved_top + identity, expected, atol=1e-4)
        changed = plain.encode_top(presence, moved)[0].numpy() - plain.encode_top(presence, tf.constant(pose))[0]
        assert np.abs(changed).max() > 1e-2
    assert ProbabilisticCapsuleAutoencoder.from_config(equivariant.get_config()).equivariant_top
    with pytest.raises(InputError, match="equivariant_top"):
        ProbabilisticCapsuleAutoencoder(generative, equivariant_top=1, **sizes)


def test_images_of_another_size_are_refused_by_name():
    """The encoder would read them and the renderer draw the model's size: a silent mismatch, refused instead."""
    model, vae = _tiny_autoencoder(), _tiny_vae()
    wrong = np.zeros((2, 28, 28, 1), "float32")
    message = r"ProbabilisticCapsuleAutoencoder takes images of shape \[batch, 12, 12, 1\]. Received: shape=\(2, 28"
    for use in (model, model.variational_parameters, lambda x: model.refine(x, 1), model.bound):
        with pytest.raises(InputError, match=message):
            use(wrong)
    with pytest.raises(InputError, match=r"shape=\(2, 12, 12\)"):
        model(np.zeros((2, 12, 12), "float32"))
    with pytest.raises(InputError, match=r"VariationalAutoencoder takes images of shape \[batch, 6, 5, 1\]"):
        vae.bound(wrong)


def test_anchored_parts_sit_at_their_attentions_mean_cell_centre_plus_its_offsets():
    """With `anchored_parts` the part encoder reads the bare image, and a part's translation is
    `sum_l w_l (x_l + o_l)` over the last feature map's cells (centres written here by hand); its other
    entries are the attention-pooled head, as in the plain encoder."""
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1)
    sizes = {"channels": 8, "hidden": 16, "encoding": 8, "blocks": 2, "inducing": 4, "heads": 2, "seed": 2}
    model = ProbabilisticCapsuleAutoencoder(generative, anchored_parts=True, **sizes)
    assert model.convs[0].kernel.shape[2] == 1                       # no coordinate channels
    images = tf.constant(np.random.default_rng(6).uniform(size=(2, 12, 12, 1)).astype("float32"))
    h = images
    for conv in model.convs:
        h = conv(h)
    head = model.part_head(h).numpy().reshape(2, 3, 3, 4, 8)         # 12 -> 6 -> 3 cells a side
    centres = np.array([-2 / 3, 0.0, 2 / 3])                          # 2 (k + 1/2) / 3 - 1
    logits = head[..., 7].reshape(2, 9, 4)
    weights = np.exp(logits - logits.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    x = np.broadcast_to(centres[None, :, None], (3, 3, 4)).reshape(9, 4)      # x runs along the width
    y = np.broadcast_to(centres[:, None, None], (3, 3, 4)).reshape(9, 4)
    pooled = np.einsum("bln,blne->bne", weights, head[..., :7].reshape(2, 9, 4, 7))
    expected = pooled[..., 1:] + model.part_pose_offset.numpy()
    expected[..., 2] += np.einsum("bln,ln->bn", weights, x)
    expected[..., 5] += np.einsum("bln,ln->bn", weights, y)
    logits_out, pose = (v.numpy() for v in model.encode_parts(images))
    attention = model.part_attention(images).numpy()                          # [B, h, w, N], rows of cells
    np.testing.assert_allclose(attention.reshape(2, 9, 4), weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(logits_out, pooled[..., 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pose, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(np.einsum("bln,ln->bn", weights, x)).max() > 1e-2    # the anchors weigh in the test
    assert ProbabilisticCapsuleAutoencoder.from_config(model.get_config()).anchored_parts
    with pytest.raises(InputError, match="anchored_parts"):
        ProbabilisticCapsuleAutoencoder(generative, anchored_parts="yes", **sizes)


def test_localisation_takes_the_attention_entropies_from_the_training_objective_only():
    """`localisation = u`: `bound`'s objective is the plain model's less `u sum_j H_j`, `H_j` the entropy of
    part j's attention (NumPy, from `part_attention`); the bound is unchanged; the penalty's gradient reaches
    the attention head."""
    from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder

    generative = ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1)
    sizes = {"channels": 8, "hidden": 16, "encoding": 8, "blocks": 2, "inducing": 4, "heads": 2, "seed": 2}
    plain = ProbabilisticCapsuleAutoencoder(generative, anchored_parts=True, **sizes)
    local = ProbabilisticCapsuleAutoencoder(ProbabilisticCapsules.from_config(generative.get_config()),
                                            anchored_parts=True, localisation=0.5, **sizes)
    local.set_weights(plain.get_weights())
    images = tf.constant(np.random.default_rng(7).uniform(size=(3, 12, 12, 1)).astype("float32"))
    seed = tf.constant([4, 1], tf.int64)
    a, b = plain.bound(images, seed=seed), local.bound(images, seed=seed)
    attention = plain.part_attention(images).numpy().reshape(3, -1, 4)
    entropy = -np.sum(attention * np.log(attention), axis=1).sum(-1)              # [B], nats
    assert np.all(entropy > 1.0)                                                   # the penalty is not small
    np.testing.assert_allclose(b["bound"].numpy(), a["bound"].numpy(), rtol=1e-6)
    # float32 objectives of ~1e2-1e3 nats: a few ulps of them
    np.testing.assert_allclose(b["objective"].numpy(), a["objective"].numpy() - 0.5 * entropy, rtol=0,
                               atol=1e-4 * np.abs(a["objective"].numpy()).max())
    with tf.GradientTape() as tape:
        penalty = tf.reduce_sum(local.bound(images, seed=seed)["objective"] - local.bound(images, seed=seed)["bound"])
    grad = tape.gradient(penalty, local.part_head.kernel)
    assert grad is not None and np.abs(grad.numpy()).max() > 1e-4
    assert ProbabilisticCapsuleAutoencoder.from_config(local.get_config()).localisation == 0.5
    with pytest.raises(InputError, match="localisation"):
        ProbabilisticCapsuleAutoencoder(generative, localisation=-1.0, **sizes)


def test_latents_that_do_not_fit_the_model_are_refused_by_name():
    """`log_prob`, `route`, `render` and their terms name the latent whose shape does not fit (before: TensorFlow's
    broadcasting or reshape error from deep inside), and latents of different batch sizes; `generate` refuses a
    batch size that is not an integer >= 1 (before: TensorFlow's errors, and 0 drew an empty batch). A batch size
    unknown while tracing fits any."""
    model, latents = _model_and_state()
    images = tf.constant(np.random.default_rng(0).uniform(size=(2, 16, 16, 1)).astype("float32"))
    names = ["top_presence", "top_pose", "part_presence", "part_pose"]
    wrong = {"images": (2, 14, 14, 1), "top_presence": (2, 4), "top_pose": (2, 3, 5), "part_presence": (2, 3),
             "part_pose": (2, 5, 6)}
    expected = {"images": "[batch, 16, 16, 1]", "top_presence": "[batch, 3]", "top_pose": "[batch, 3, 6]",
                "part_presence": "[batch, 4]", "part_pose": "[batch, 4, 6]"}
    uses = {"log_prob": (lambda x, *z: model.log_prob(x, *z), ["images", *names]),
            "route": (lambda x, *z: model.route(*z), names),
            "part_marginal_log_likelihood": (lambda x, *z: model.part_marginal_log_likelihood(*z), names),
            "render": (lambda x, *z: model.render(*z[2:]), names[2:]),
            "call": (lambda x, *z: model(*z[2:]), names[2:]),
            "top_log_prior": (lambda x, *z: model.top_log_prior(*z[:2]), names[:2]),
            "image_log_likelihood": (lambda x, *z: model.image_log_likelihood(x, *z[2:]), ["images", *names[2:]]),
            "parent_log_weights": (lambda x, *z: model.parent_log_weights(z[0]), names[:1]),
            "predicted_part_poses": (lambda x, *z: model.predicted_part_poses(z[1]), names[1:2]),
            "part_log_likelihoods": (lambda x, *z: model.part_log_likelihoods(*z[1:]), names[1:])}
    for use, checked in uses.values():
        use(images, *latents)
        for name in checked:
            given = dict(zip(["images", *names], [images, *latents]))
            given[name] = tf.zeros(wrong[name])
            message = f"{name} must be {expected[name]} (K = 3 top capsules, N = 4 parts). Received: shape={wrong[name]}"
            with pytest.raises(InputError, match=re.escape(message)):
                use(*given.values())
        given = [images, *latents]
        first = ["images", *names].index(checked[0])
        given[first] = tf.concat([given[first], given[first][:1]], axis=0)
        if len(checked) > 1:
            with pytest.raises(InputError, match="must share one batch size"):
                use(*given)
    # one presence for every part was broadcast by part_log_likelihoods, without a word
    with pytest.raises(InputError, match=re.escape("part_presence must be [batch, 4]")):
        model.part_log_likelihoods(latents[1], latents[2][:, :1], latents[3])
    signature = [tf.TensorSpec([None, *t.shape[1:]]) for t in [images, *latents]]
    assert tuple(tf.function(model.log_prob, input_signature=signature)(images, *latents).shape) == (2,)
    for batch_size in (0, -1, 2.5, True):
        with pytest.raises(InputError, match=re.escape(f"batch_size must be an integer >= 1. Received: "
                                                       f"batch_size={batch_size}")):
            model.generate(batch_size)
    assert model.generate(np.int64(2))["images"].shape == (2, 16, 16, 1)
