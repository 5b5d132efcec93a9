"""tf.distribute (2 logical CPU devices) against one device, mixed precision and float64."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from keras import ops
from policies import global_policy
from small_trainers import TRAINER_NAMES, each_trainer

from poecaps import distribute, routing
from poecaps.capsules import squash
from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.models import CapsNet, MatrixCapsNet
from poecaps.rbm import BernoulliRBM
from poecaps.routing import TopDownAttention
from poecaps.trainers.cd import CDTrainer, DecoderTrainer, default_optimizer
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.supervised import SupervisedTrainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "distribute_run.py")


def _run_worker(*kinds):
    # A fresh process: logical devices must be set before TensorFlow starts.
    result = subprocess.run([sys.executable, WORKER, *kinds], cwd=ROOT, capture_output=True, text=True,
                            timeout=900, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


# What is checked is how replicas combine: a gradient summed instead of averaged over replicas
# doubles each step, and replicas that share (or misslice) random draws train on other shifts,
# dropout masks or Gibbs samples; each moves the weights by a difference of the order of their
# whole movement. Summation order is all that differs otherwise: float32 rounding (1e-7), which
# the runs' few SGD steps amplify by their sensitivity (largest here, CapsNet's: a few 1e-4 of
# the movement on this machine). A tolerance of 1e-2 of each weight's movement is far above the
# rounding on any machine and far below any error of the kind tested.
TOLERANCE = 1e-2
TRAINERS = {"cd", "rbm", "autoencoder", "capsnet", "em", "routingnet", "generative", "vae", "capsules"}
# MultiWorkerMirroredStrategy's single worker has one replica: it checks the strategy's collectives under each
# trainer class, so one network per class (CapsNet for the supervised networks, the VAE for the variational
# models), not the three costliest to compile again.
MULTIWORKER = TRAINERS - {"em", "routingnet", "capsules"}


def _check(result, replicas, trainers=TRAINERS):
    assert set(result) == trainers
    for name, figures in result.items():
        assert figures["replicas"] == replicas, name
        assert figures["weights_moved"] == figures["weights"], (name, figures)   # training moved every weight
        assert figures["difference_over_movement"] < TOLERANCE, (name, figures)


@pytest.mark.slow
def test_mirrored_strategy_on_two_devices_and_a_single_multiworker_worker_match_one_device():
    # One process trains each trainer once on one device, the reference of both strategies.
    result = _run_worker("mirrored", "multiworker=" + ",".join(sorted(MULTIWORKER)))
    assert set(result) == {"mirrored", "multiworker"}
    _check(result["mirrored"], replicas=2)
    _check(result["multiworker"], replicas=1, trainers=MULTIWORKER)


def test_per_example_draw_is_the_plain_draw_on_one_device():
    seed_a, seed_b = keras.random.SeedGenerator(3), keras.random.SeedGenerator(3)
    a = distribute.per_example_draw(keras.random.uniform, (4, 2), seed_a)
    b = keras.random.uniform((4, 2), seed=seed_b)
    np.testing.assert_array_equal(ops.convert_to_numpy(a), ops.convert_to_numpy(b))


def _tiny_capsnet():
    trainer = SupervisedTrainer(CapsNet((12, 12, 1), 3, conv_filters=8, primary_types=2, primary_dim=4,
                                        class_dim=4, kernel_size=3), max_shift=1)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3))
    return trainer


def _tiny_em():
    trainer = SupervisedTrainer(MatrixCapsNet((28, 28, 1), 3, routing_iterations=2, a=4, b=2, c=2, d=2))
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3))
    return trainer


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("make, size", [(_tiny_capsnet, 12), (_tiny_em, 28)])
def test_mixed_precision_trains_with_float32_routing(rng, policy, make, size):
    images = rng.uniform(size=(8, size, size, 1)).astype("float32")
    labels = rng.integers(0, 3, size=8)
    with distribute.precision_policy(policy):
        trainer = make()
        history = fit_resumable(trainer, images, labels, epochs=2, batch_size=4, seed=0, verbose=0)
        assert keras.config.dtype_policy().name == policy
    assert keras.config.dtype_policy().name == "float32"   # restored
    assert np.isfinite(history["loss"]).all()
    assert trainer.network.conv1.compute_dtype == policy.split("_")[1]
    result = trainer.network.encode(images)
    assert keras.backend.standardize_dtype(result.activations.dtype) == "float32"
    assert keras.backend.standardize_dtype(result.coefficients.dtype) == "float32"
    if policy == "mixed_float16":
        assert isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", routing.names())
def test_every_routing_routes_in_float32_under_a_mixed_policy(rng, policy, name):
    """A router made under a mixed policy, handed votes in the low precision (as a capsule layer computes
    them), routes them in float32: its weights are neither stored nor read in the low precision.

    Reference: the same router and weights made under float32, given the same votes and activations in float32.
    Both then run the same float32 operations on the same numbers, so they agree to float32 rounding (a few
    1e-7, grown a little by the rounds). Weights read in the low precision (Keras' autocast) move the result
    by their rounding, about 1e-3 of it (float16) or 1e-2 (bfloat16), and sublayers computing in it fail on
    mixed dtypes, as the connectionist router's networks did.
    """
    votes = rng.normal(size=(2, 6, 3, 4)).astype("float32")
    activations = rng.uniform(0.1, 1.0, size=(2, 6)).astype("float32")
    low = policy.split("_")[1]
    rounded, rounded_activations = (ops.convert_to_numpy(ops.cast(ops.cast(x, low), "float32"))
                                    for x in (votes, activations))
    with distribute.precision_policy(policy):
        mixed = routing.get(name)
        found = mixed(ops.cast(votes, low), ops.cast(activations, low))
    plain = routing.get(name)
    plain(rounded, rounded_activations)
    plain.set_weights(mixed.get_weights())
    expected = plain(rounded, rounded_activations)
    for field, got, want in zip(expected._fields, found, expected):
        assert keras.backend.standardize_dtype(got.dtype) == "float32", field
        np.testing.assert_allclose(ops.convert_to_numpy(got), ops.convert_to_numpy(want), rtol=1e-5, atol=1e-6,
                                   err_msg=field)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_top_down_attention_attends_in_float32_under_a_mixed_policy(rng, policy):
    """`TopDownAttention` (a layer beside the routers, eq. 6) keeps float32 as they do. Reference: the layer
    made under float32 on the same low-precision-rounded inputs, which runs the same float32 operations, so the
    two agree to float32 rounding; attending in the low precision moves the softmax by its rounding (about 1e-3
    in float16, 1e-2 in bfloat16) and returns low-precision tensors."""
    children = rng.normal(size=(2, 5, 4)).astype("float32")
    predictions = rng.normal(size=(2, 5, 3, 4)).astype("float32")
    low = policy.split("_")[1]
    rounded = [ops.convert_to_numpy(ops.cast(ops.cast(x, low), "float32")) for x in (children, predictions)]
    with distribute.precision_policy(policy):
        mixed = TopDownAttention(iterations=3, beta=0.7, accumulate=True)
        found = mixed(ops.cast(children, low), ops.cast(predictions, low))
    expected = TopDownAttention(iterations=3, beta=0.7, accumulate=True)(*rounded)
    for name, got, want in zip(("attention", "children"), found, expected):
        assert keras.backend.standardize_dtype(got.dtype) == "float32", name
        np.testing.assert_allclose(ops.convert_to_numpy(got), ops.convert_to_numpy(want), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def _cd_trainer(kind):
    """A small trainer of each CD kind, its data, and the energy model whose weights it moves."""
    data = np.random.default_rng(1)
    if kind == "rbm":
        model = BernoulliRBM(4, seed=0)
        model.build((None, 12))
        return CDTrainer(model, seed=0), (data.uniform(size=(16, 12)).astype("float32"),), model
    model = CapsuleExperts(2, 4, kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=0))
    model.build((None, 6, 3))
    upper = np.asarray(squash(data.normal(size=(16, 6, 3)))).astype("float32")
    if kind == "capsules":
        return CDTrainer(model), (upper,), model
    lower = np.asarray(squash(data.normal(size=(16, 2, 4)))).astype("float32")
    return DecoderTrainer(model, "delta"), (upper, lower), model


@pytest.mark.parametrize("kind", ["capsules", "rbm", "decoder"])
def test_cd_under_mixed_float16_moves_the_weights_as_under_float32(kind):
    """CD hands the optimizer closed-form float32 statistics, not a scaled loss's gradients. Under
    mixed_float16 Keras would wrap the optimizer in a LossScaleOptimizer, which divides what it is given by
    its scale (2^15 at first), so CD barely moved (by 3e-5 of its float32 movement). The CD trainers compile
    without it: the same float32 operations on the same numbers, so the weights after two epochs agree with
    float32's to float32 rounding. A LossScaleOptimizer given on purpose is refused."""
    found = {}
    for policy in ("float32", "mixed_float16"):
        with distribute.precision_policy(policy):
            keras.utils.set_random_seed(0)          # the RBM's initial weights and its Gibbs draws
            trainer, data, model = _cd_trainer(kind)
            trainer.compile(optimizer=default_optimizer(0.05))
            start = [w.copy() for w in model.get_weights()]
            fit_resumable(trainer, *data, epochs=2, batch_size=8, seed=0, verbose=0)
            found[policy] = model.get_weights()
            assert not isinstance(trainer.optimizer, keras.optimizers.LossScaleOptimizer)
    moved = max(np.abs(a - b).max() for a, b in zip(found["float32"], start))
    assert moved > 1e-3
    for a, b in zip(found["mixed_float16"], found["float32"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * moved)
    with distribute.precision_policy("mixed_float16"):
        trainer, _, _ = _cd_trainer(kind)
        with pytest.raises(InputError, match="a LossScaleOptimizer would divide them by its scale"):
            trainer.compile(optimizer=keras.optimizers.LossScaleOptimizer(default_optimizer(0.05)))


def test_mixed_precision_keeps_energies_and_cd_in_float32(rng):
    x = np.asarray(squash(rng.normal(size=(16, 6, 3)))).astype("float32")
    with distribute.precision_policy("mixed_bfloat16"):
        layer = CapsuleExperts(2, 4)
        layer.build((None, 6, 3))
        trainer = CDTrainer(layer)
        trainer.compile(optimizer=default_optimizer(0.05), auto_scale_loss=False)
        history = fit_resumable(trainer, x, epochs=1, batch_size=8, seed=0, verbose=0)
    assert layer.compute_dtype == "float32"
    assert keras.backend.standardize_dtype(layer.free_energy(x).dtype) == "float32"
    assert np.isfinite(history["reconstruction_error"]).all()


def _dtypes(values):
    return {keras.backend.standardize_dtype(t.dtype) for t in keras.tree.flatten(values)}


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_every_trainer_trains_evaluates_and_predicts_under_a_mixed_policy(policy, name, make, x, y):
    """Under either mixed policy each trainer is built by a call (as `fit_resumable` builds it; Keras casts the
    call's input to the low precision), trains, evaluates and predicts, with finite figures. Before, the
    generative capsule trainer's call ran EM in the low precision (TensorFlow has no bfloat16 matrix solve, nor
    a float16 one on CPU) and the VAE's bound subtracted its decoder's low-precision mean from float32 images:
    both failed under both policies."""
    with distribute.precision_policy(policy):
        trainer = make()
        trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
        history = fit_resumable(trainer, x, y, epochs=2, batch_size=4, seed=0, verbose=0)
        scores = trainer.evaluate(x, y, batch_size=4, verbose=0, return_dict=True)
        predicted = trainer.predict(x, batch_size=4, verbose=0)
    assert history and all(np.isfinite(values).all() for values in history.values())
    assert scores and all(np.isfinite(value) for value in scores.values())
    assert all(np.isfinite(np.asarray(value, "float32")).all() for value in keras.tree.flatten(predicted))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_likelihoods_and_bounds_are_float32_under_a_mixed_policy(policy):
    """Under a mixed policy the generative capsules' EM, the VAE's and the probabilistic capsule model's bound
    terms, and the capsule model's reconstructions, samples and test-time refinement are float32, computed from
    their networks' low-precision outputs, and the capsule model trains. Before, the capsule model could not be
    built (its encoders' low-precision poses met its float32 templates) and the VAE's terms failed as above.

    Their float32 weights are read unrounded inside the low-precision calls around them: the trainer's EM (the
    trainer takes its layer's float32 policy, so Keras hands it the children unrounded), and the capsule
    model's reconstructions, equal EM and rendering run outside any call, to float32 rounding (1e-5 here; the
    same operations on the same values). Weights rounded to the low precision (2e-3 of their size in bfloat16,
    5e-4 in float16) move them by 1e-4 or more."""
    from poecaps.models import (
        GenerativeCapsules,
        ProbabilisticCapsuleAutoencoder,
        ProbabilisticCapsules,
        VariationalAutoencoder,
    )
    from poecaps.trainers.generative import GenerativeCapsuleTrainer
    from poecaps.trainers.variational import VariationalTrainer

    data = np.random.default_rng(0)
    images = data.uniform(size=(8, 12, 12, 1)).astype("float32")
    children = data.uniform(-0.5, 0.5, size=(8, 5, 4)).astype("float32")
    with distribute.precision_policy(policy):
        low = keras.config.dtype_policy().compute_dtype
        em = GenerativeCapsules(2, 3, 4, seed=0)
        inferred = GenerativeCapsuleTrainer(em, iterations=3)(children)
        vae = VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5, seed=0)
        model = ProbabilisticCapsuleAutoencoder(
            ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1),
            channels=8, hidden=16, encoding=8, blocks=2, inducing=4, heads=2, equivariant_top=True,
            localisation=0.1, seed=2)
        trainer = VariationalTrainer(model, seed=0)
        trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
        history = trainer.fit(images, batch_size=4, epochs=1, verbose=0).history
        called = model(images)
        found = {"vae bound": vae.bound(images, seed=[0, 1]), "vae call": vae(images),
                 "capsule bound": model.bound(images, seed=[0, 1]), "capsule call": called,
                 "samples": {k: t for k, t in model.generative.generate(3, seed=0).items() if t.dtype.is_floating},
                 "refined": model.refine(images[:2], 2), "attention": model.part_attention(images)}
        rendered = model.generative.render(called["part_presence"], called["part_pose"])
    assert model.convs[0].compute_dtype == low                  # the networks do compute in the low precision
    assert _dtypes(inferred) == {"float32"}
    for what, values in found.items():
        assert _dtypes(values) == {"float32"}, what
    assert all(np.isfinite(values).all() for values in history.values())
    direct = em.infer(ops.convert_to_tensor(children), iterations=3)
    for got, want in zip(inferred, direct):
        np.testing.assert_allclose(ops.convert_to_numpy(got), ops.convert_to_numpy(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ops.convert_to_numpy(called["reconstructions"]), ops.convert_to_numpy(rendered),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", routing.names())
def test_every_routing_routes_in_float64_under_a_float64_policy(rng, name):
    """A router made under float64 and handed float64 votes routes in float64, as `Routing` promises.

    Votes moved by 1e-9 of their size (far below float32's resolution, 6e-8, far above float64's, 1e-16) move
    every output, so the arithmetic carried float64 throughout: a router that rounds the votes (or its
    weights) to float32 anywhere gives the unmoved result bit for bit, as EM, connectionist and sparse
    inference routing did. Against the same router and weights under float32 the outputs agree to float32
    rounding (a few 1e-7, grown a little by the rounds; the tolerance of the mixed-policy test)."""
    votes = rng.normal(size=(2, 6, 3, 4))
    activations = rng.uniform(0.1, 1.0, size=(2, 6))
    moved = votes * (1.0 + 1e-9 * rng.choice([-1.0, 1.0], size=votes.shape))
    with global_policy("float64"):
        router = routing.get(name)
        found = router(votes, activations)
        found_moved = router(moved, activations)
    plain = routing.get(name)
    plain(votes.astype("float32"), activations.astype("float32"))
    plain.set_weights(router.get_weights())
    expected = plain(votes.astype("float32"), activations.astype("float32"))
    for field, got, got_moved, want in zip(expected._fields, found, found_moved, expected):
        got, got_moved = ops.convert_to_numpy(got), ops.convert_to_numpy(got_moved)
        assert got.dtype == np.float64 and got_moved.dtype == np.float64, field
        assert {w.dtype for w in router.weights} <= {"float64"}, field
        np.testing.assert_allclose(got, ops.convert_to_numpy(want), rtol=1e-5, atol=1e-6, err_msg=field)
        if field != "coefficients" or name not in ("uniform", "sparse_inference"):   # theirs are constants
            assert not np.array_equal(got, got_moved), field


@pytest.mark.parametrize("name, make, x, y", each_trainer("float64"), ids=TRAINER_NAMES)
def test_every_trainer_trains_in_float64_under_a_float64_policy(name, make, x, y):
    """Under Keras' float64 set-up each trainer trains on float64 data with float64 weights and finite
    metrics. Before, the energy models were pinned to float32, and constants and casts of float32 in the
    CD descent, the reconstruction losses and the VAE's draws met float64 tensors: six of the seven failed
    with a dtype mismatch."""
    with global_policy("float64"):
        trainer = make()
        trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
        history = trainer.fit(x, y, batch_size=4, epochs=2, verbose=0).history
    assert {w.dtype for w in trainer.weights if "float" in w.dtype} == {"float64"}
    assert history and all(np.isfinite(values).all() for values in history.values())


def test_capsule_networks_and_the_probabilistic_capsule_model_train_in_float64():
    """The networks whose float32 constants or casts met float64 tensors: matrix capsules (the spread loss's
    margin), the Table 1 routing network (its scores were cast to float32) and the probabilistic capsule model
    (the pose offsets, the dummy parent's binding and spread, and every draw of `generate`). Under Keras'
    float64 set-up each trains with float64 weights and finite metrics; the networks' scores, the model's
    samples and its test-time refinement are float64 too."""
    from poecaps.models import (
        ProbabilisticCapsuleAutoencoder,
        ProbabilisticCapsules,
        RoutingCapsNet,
    )
    from poecaps.trainers.variational import VariationalTrainer

    data = np.random.default_rng(0)
    with global_policy("float64"):
        matrix = SupervisedTrainer(MatrixCapsNet((28, 28, 1), 3, routing_iterations=2, a=4, b=2, c=2, d=2))
        table = SupervisedTrainer(RoutingCapsNet((28, 28, 1), 3, routing="dynamic", routing_iterations=2, filters=8,
                                                 primary_types=2, conv_types=2))
        capsules = VariationalTrainer(ProbabilisticCapsuleAutoencoder(
            ProbabilisticCapsules(image_size=(12, 12), num_top=3, num_parts=4, template_size=5, seed=1),
            channels=8, hidden=16, encoding=8, blocks=2, inducing=4, heads=2, seed=2), seed=0)
        digits, labels = data.uniform(size=(8, 28, 28, 1)), np.arange(8) % 3
        for trainer, x, y in [(matrix, digits, labels), (table, digits, labels),
                              (capsules, data.uniform(size=(8, 12, 12, 1)), None)]:
            trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
            history = trainer.fit(x, y, batch_size=4, epochs=1, verbose=0).history
            assert {w.dtype for w in trainer.weights if "float" in w.dtype} == {"float64"}
            assert all(np.isfinite(values).all() for values in history.values())
        scores = [trainer.network.loss_terms(digits, labels)[1] for trainer in (matrix, table)]
        drawn = capsules.model.generative.generate(3, seed=0)
        refined = capsules.model.refine(x[:2], 2)
    assert {str(ops.convert_to_numpy(t).dtype) for t in scores} == {"float64"}
    assert {str(ops.convert_to_numpy(t).dtype) for t in drawn.values() if t.dtype.is_floating} == {"float64"}
    assert {str(ops.convert_to_numpy(t).dtype) for t in refined.values()} == {"float64"}


def test_a_checkpoint_resumes_only_under_the_dtypes_it_was_written_in(tmp_path):
    """A float64 run's checkpoints refuse a float32 trainer and the other way round, naming both dtypes (before,
    `assign` cast the weights and the run went on in the other precision). A mixed_bfloat16 run keeps float32
    weights and goes on under float32, as the layer-wise program lets the two take each other's place."""
    from poecaps.errors import CheckpointError

    def fit(policy, folder, resume, epochs):
        with global_policy(policy):
            _, make, x, y = each_trainer(keras.config.floatx())[0]
            trainer = make()
            trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
            fit_resumable(trainer, x, y, epochs=epochs, batch_size=4, seed=0, checkpoint_dir=str(tmp_path / folder),
                          resume=resume, verbose=0)
        return trainer

    for trained, resumed in [("float64", "float32"), ("float32", "float64")]:
        fit(trained, trained, False, 1)
        with pytest.raises(CheckpointError, match=rf"other dtypes \({trained} where this trainer's are {resumed}\)"):
            fit(resumed, trained, True, 2)
    fit("mixed_bfloat16", "mixed", False, 1)
    assert int(fit("float32", "mixed", True, 2).optimizer.iterations.numpy()) == 4   # 2 steps an epoch


@pytest.mark.parametrize("chunk_size", [None, 5])
def test_capsule_maps_route_in_float64_under_a_float64_policy(rng, chunk_size):
    """Convolutional capsules routed in chunks inside a compiled function (as MatrixCapsNet routes them; 9
    receptive fields, the last chunk padded) and class capsules with coordinate addition, made under float64,
    return float64, and poses moved by 1e-9 of their size move the class poses: the chunks no longer round
    the routing to float32 (they did, so matrix capsules trained in float64 routed in float32)."""
    import tensorflow as tf

    from poecaps.layers import ClassCapsules, ConvCapsules
    from poecaps.routing import EMRouting

    poses = rng.normal(size=(2, 7, 7, 2, 16))
    activations = rng.uniform(0.1, 1.0, size=(2, 7, 7, 2))
    moved = poses * (1.0 + 1e-9 * rng.choice([-1.0, 1.0], size=poses.shape))
    with global_policy("float64"):
        conv = ConvCapsules(3, 16, 3, 2, routing=EMRouting(2), chunk_size=chunk_size)
        classes = ClassCapsules(4, 16, routing=EMRouting(2))

        @tf.function
        def route(x):
            found = conv.route(x, activations)
            return (found.poses, *classes.route(found.poses, found.activations))

        outputs, outputs_moved = route(tf.constant(poses)), route(tf.constant(moved))
    for got, got_moved in zip(outputs, outputs_moved):
        assert got.dtype == tf.float64 and got_moved.dtype == tf.float64
    assert not np.array_equal(outputs[1].numpy(), outputs_moved[1].numpy())
