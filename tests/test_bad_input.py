"""Every bad input gets one clear error naming the argument and what was expected."""

import gzip
import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
from small_trainers import TRAINER_NAMES, each_trainer

from poecaps import data as data_lib
from poecaps import routing
from poecaps.constraints import IsometricPoses
from poecaps.errors import InputError
from poecaps.experiments.configs import (
    BaselineConfig,
    EvaluationConfig,
    LayerwiseConfig,
    RunOptions,
)
from poecaps.experiments.settings import SettingError
from poecaps.experts import CapsuleExperts
from poecaps.initializers import NearIdentity
from poecaps.layers import (
    AttentionPooling,
    CapsuleDense,
    ClassCapsules,
    ConvAutoencoder,
    ConvCapsules,
    InducedSetAttention,
    MultiheadAttentionBlock,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
)
from poecaps.models import (
    CapsNet,
    CapsulePipeline,
    GenerativeCapsules,
    MatrixCapsNet,
    ProbabilisticCapsuleAutoencoder,
    ProbabilisticCapsules,
    RoutingCapsNet,
    VariationalAutoencoder,
)
from poecaps.rbm import BernoulliRBM
from poecaps.routing import (
    ConnectionistRouting,
    DynamicRouting,
    EMRouting,
    GenerativeRouting,
    SimilarityRouting,
    SparseInferenceRouting,
    TopDownAttention,
)
from poecaps.samplers import CapsuleSampler, RBMSampler
from poecaps.trainers.autoencoder import AutoencoderTrainer
from poecaps.trainers.cd import CDTrainer, OffCapsulesWarning, cd_step, default_optimizer
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.schedule import ScaledSchedule
from poecaps.trainers.supervised import SupervisedTrainer
from poecaps.trainers.variational import VariationalTrainer
from poecaps.validation import check_choice, check_flag, check_integer, check_number

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def capsnet():
    trainer = SupervisedTrainer(CapsNet((12, 12, 1), 3, conv_filters=4, primary_types=2, primary_dim=4,
                                        class_dim=4, kernel_size=3))
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3))
    return trainer


def _images(shape=(4, 12, 12, 1), fill=None):
    images = np.random.default_rng(0).uniform(size=shape).astype("float32")
    if fill is not None:
        images.flat[3] = fill
    return images


LABELS = np.array([0, 1, 2, 0])


@pytest.mark.parametrize("x, y, message", [
    (_images((4, 12, 12)), LABELS, r"x \(images\) must have shape \[N, 12, 12, 1\]. Received: shape \(4, 12, 12\)"),
    (_images((4, 12, 12, 3)), LABELS, r"must have shape \[N, 12, 12, 1\]. Received: shape \(4, 12, 12, 3\)"),
    (_images((4, 14, 14, 1)), LABELS, r"must have shape \[N, 12, 12, 1\]"),
    (_images() * 255, LABELS, r"x \(images\) must lie in \[0.0, 1.0\].*divide 8-bit images by 255"),
    (_images(fill=np.nan), LABELS, r"x \(images\) holds 1 NaN or infinite pixels"),
    (_images(fill=np.inf), LABELS, r"holds 1 NaN or infinite pixels"),
    (_images((0, 12, 12, 1)), LABELS[:0], r"x \(images\) is empty"),
    (_images(), np.array([0, 1, 2, 7]), r"y \(labels\) must lie in \[0, 3\). Received: 0 to 7"),
    (_images(), np.array([0, 1, 2]), r"x and y must have as many examples. Received: 4 and 3"),
    (_images(), np.array([0.0, 1.0, 2.0, 0.0]), r"y \(labels\) must be integers"),
    (np.array([["a"]] * 4), LABELS, r"x \(images\) must hold numbers"),
])
def test_bad_training_arrays(capsnet, x, y, message):
    with pytest.raises(InputError, match=message):
        fit_resumable(capsnet, x, y, epochs=1, batch_size=2, seed=0, verbose=0)


@pytest.mark.parametrize("counts, message", [
    ({"epochs": 0}, "epochs must be an integer >= 1. Received: epochs=0"),
    ({"epochs": 2.0}, "epochs must be an integer >= 1. Received: epochs=2.0"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1. Received: batch_size=0"),
    ({"batch_size": "2"}, "batch_size must be an integer >= 1. Received: batch_size='2'"),
    ({"save_every": -1}, "save_every must be an integer >= 0. Received: save_every=-1"),
    # before, Keras took these as they were ('x', 3) or read True as a progress bar
    ({"verbose": "x"}, "verbose must be 'auto', 0, 1 or 2. Received: verbose='x'"),
    ({"verbose": 3}, "verbose must be 'auto', 0, 1 or 2. Received: verbose=3"),
    ({"verbose": True}, "verbose must be 'auto', 0, 1 or 2. Received: verbose=True"),
])
def test_fit_resumable_refuses_bad_counts_by_name(capsnet, counts, message):
    settings = {"epochs": 1, "batch_size": 2, "verbose": 0, **counts}
    with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
        fit_resumable(capsnet, _images(), LABELS, seed=0, **settings)


def test_bad_visible_units_for_cd():
    layer = CapsuleExperts(2, 3)
    layer.build((None, 5, 4))
    trainer = CDTrainer(layer)
    trainer.compile(optimizer=default_optimizer())
    with pytest.raises(InputError, match=r"x \(visible units\) must have shape \[N, 5, 4\]. Received: shape \(3, 5, 8\)"):
        fit_resumable(trainer, np.zeros((3, 5, 8), "float32"), epochs=1, batch_size=2, seed=0, verbose=0)


def test_capsule_experts_take_coefficients_of_their_visible_capsules():
    """`free_energy(x, c)` and `p_on(x, c)` with coefficients given: before, c [1, I, J] was broadcast over the
    batch without a word and other shapes failed in Keras' words ('Dimensions 1 and 3 are not compatible')."""
    layer = CapsuleExperts(3, 4)
    x = np.random.default_rng(0).normal(size=(2, 5, 2)).astype("float32")
    layer(x)
    uniform = np.full((2, 5, 3), 1 / 3, "float32")
    assert layer.free_energy(x, uniform).shape == (2,) and layer.p_on(x, uniform).shape == (2, 3)
    for shape in [(1, 5, 3), (2, 5, 1), (2, 5, 4), (5, 3)]:
        for use in (layer.free_energy, layer.p_on):
            with pytest.raises(InputError, match=re.escape(f"c must be the coefficients [B, I, J] = [2, 5, 3] of the "
                                                           f"visible capsules. Received: c of shape {list(shape)}")):
                use(x, np.full(shape, 0.25, "float32"))


def _write_idx(directory, images, labels, image_bytes=None, magic=2051):
    os.makedirs(directory, exist_ok=True)
    n, h, w = images.shape
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in (n, h, w))
    with gzip.open(os.path.join(directory, "t10k-images-idx3-ubyte.gz"), "wb") as handle:
        handle.write(header + (image_bytes if image_bytes is not None else images.tobytes()))
    with gzip.open(os.path.join(directory, "t10k-labels-idx1-ubyte.gz"), "wb") as handle:
        handle.write((2049).to_bytes(4, "big") + n.to_bytes(4, "big") + labels.astype("uint8").tobytes())


@pytest.mark.parametrize("kind, message", [
    ("truncated", r"t10k-images-idx3-ubyte: IDX file holds 1016 bytes, its header promises 3152 \(truncated"),
    ("magic", r"bad magic number"),
    ("not_gzip", r"not a readable \(gzipped\) IDX file"),
])
def test_damaged_idx_files(tmp_path, kind, message):
    images = np.zeros((4, 28, 28), "uint8")
    labels = np.arange(4)
    directory = str(tmp_path / "idx")
    if kind == "truncated":
        _write_idx(directory, images, labels, image_bytes=bytes(1000))
    elif kind == "magic":
        _write_idx(directory, images, labels, magic=1234)
    else:
        _write_idx(directory, images, labels)
        with open(os.path.join(directory, "t10k-images-idx3-ubyte.gz"), "wb") as handle:
            handle.write(b"this is not gzip")
    with pytest.raises(InputError, match=message):
        data_lib.load_arrays("mnist", "test", directory, source="idx")


def _rbm_on(visible):
    rbm = BernoulliRBM(2, seed=0)
    rbm.build((None, visible))
    return rbm


@pytest.mark.parametrize("build, message", [
    (lambda: data_lib.load_arrays("cifar10", "train"), r"Unknown dataset.*Received: name='cifar10'"),
    (lambda: routing.get("attention"), r"Unknown routing 'attention'.*Received: routing='attention'"),
    (lambda: EMRouting(iterations=0), r"iterations"),
    (lambda: LayerwiseConfig(capsule_dim=7), r"capsule_dim must divide filters.*capsule_dim=7, filters=128"),
    (lambda: PrimaryCapsules(capsule_dim=0), r"capsule_dim"),
    (lambda: LayerwiseConfig(cd_learning_rate=-0.1), r"cd_learning_rate must be a finite number > 0. Received: cd_learning_rate=-0.1"),
    (lambda: LayerwiseConfig(cd_shards=2, jit_cd=False), r"cd_shards above 1 needs jit_cd.*cd_shards=2, jit_cd=False"),
    (lambda: LayerwiseConfig(cd_shards=0), r"cd_shards must be an integer >= 1, or none. Received: cd_shards=0"),
    (lambda: LayerwiseConfig(init_stddev=0.0), r"init_stddev must be a finite number > 0. Received: init_stddev=0.0"),
    (lambda: LayerwiseConfig(sparsity_target=1.5), r"sparsity_target must be a finite number > 0 and < 1. Received: sparsity_target=1.5"),
    (lambda: LayerwiseConfig(population_sparsity_cost=-1.0), r"population_sparsity_cost=-1.0"),
    (lambda: LayerwiseConfig(decoder_l2=-1.0), r"decoder_l2 must be a finite number >= 0, or none. Received: decoder_l2=-1.0"),
    (lambda: LayerwiseConfig(decoder_rule="mirror"), r"decoder_rule must be one of 'section41', 'delta'. Received: decoder_rule='mirror'"),
    (lambda: LayerwiseConfig(decoder_input="top2"), r"decoder_input must be one of 'all', 'longest'. Received: decoder_input='top2'"),
    (lambda: LayerwiseConfig(num_capsules=2.5), r"num_capsules must be an integer >= 1. Received: num_capsules=2.5"),
    (lambda: LayerwiseConfig(center_code="yes"), r"center_code must be true or false. Received: center_code='yes'"),
    (lambda: EvaluationConfig(draws=0), r"draws must be an integer >= 1. Received: draws=0"),
    (lambda: EvaluationConfig(rows=0), r"rows must be an integer >= 1. Received: rows=0"),
    (lambda: BaselineConfig(learning_rate=-1.0), r"learning_rate must be a finite number > 0. Received: learning_rate=-1.0"),
    (lambda: BaselineConfig(model="em", routing_iterations=0), r"EM routing needs routing_iterations >= 1"),
    (lambda: BaselineConfig(epochs=0), r"epochs must be an integer >= 1. Received: epochs=0"),
    (lambda: BaselineConfig(model="capsnet", shards=2), r"shards above 1 needs XLA.*shards=2"),
    (lambda: BaselineConfig(model="em", shards=0), r"shards must be an integer >= 1, or none. Received: shards=0"),
    (lambda: RunOptions(on_nan="ignore"), r"on_nan must be one of .*Received: on_nan='ignore'"),
    (lambda: RunOptions(strategy="tpu"), r"strategy must be one of .*Received: strategy='tpu'"),
    (lambda: RunOptions(precision="float8"), r"precision must be one of .*Received: precision='float8'"),
    (lambda: RunOptions(save_every=-5), r"save_every must be an integer >= 0. Received: save_every=-5"),
    (lambda: default_optimizer(learning_rate=0.0), r"learning_rate must be a finite number > 0\. Received: learning_rate=0\.0"),
    (lambda: default_optimizer(decay_steps=2.5), r"decay_steps must be an integer >= 1\. Received: decay_steps=2\.5"),
    (lambda: CDTrainer(CapsuleExperts(2, 3), steps=0), r"steps must be an integer >= 1. Received: steps=0"),
    # the RBM's chains ran no step for 0 or -1 and returned their start as a sample
    (lambda: _rbm_on(3).gibbs(np.zeros((2, 3), "float32"), steps=0), r"steps must be an integer >= 1. Received: steps=0"),
    (lambda: _rbm_on(3).gibbs(np.zeros((2, 3), "float32"), steps=-1), r"steps=-1"),
    (lambda: _rbm_on(3).reconstruct(np.zeros((2, 3), "float32"), steps=0), r"steps=0"),
    (lambda: _rbm_on(3).gibbs(np.zeros((2, 3), "float32"), steps=2.5), r"steps=2.5"),
])
def test_bad_names_sizes_and_hyperparameters(build, message):
    with pytest.raises(InputError, match=message):
        build()


@pytest.mark.parametrize("image_size", [(12.7, 12), (0, 12), (12,), 12, ("12", "12"), (True, 12)])
@pytest.mark.parametrize("model", ["vae", "probabilistic"])
def test_the_image_models_refuse_image_sizes_that_are_not_two_positive_integers(model, image_size):
    """Before, both cut a float size to an integer without a word (12.7 made 12 x 12 images), and the VAE
    took a zero or a one-number size into Keras' layers, which failed there."""
    make = {"vae": lambda: VariationalAutoencoder(image_size=image_size, latent=2, hidden=5),
            "probabilistic": lambda: ProbabilisticCapsules(image_size=image_size, num_top=2, num_parts=2,
                                                           template_size=5)}[model]
    with pytest.raises(InputError, match=r"^image_size must be \(height, width\), two integers >= 1\. Received: "):
        make()


@pytest.mark.parametrize("name", ["dynamic", "em", "similarity", "connectionist", "sparse_inference", "generative"])
def test_every_routing_refuses_votes_of_another_rank_by_name(name):
    layer = routing.get(name)
    with pytest.raises(ValueError, match=rf"layer '{layer.name}'.*expected ndim=4, found ndim=3"):
        layer(np.zeros((2, 6, 4), "float32"))


def test_bad_input_in_a_script_is_one_line_without_a_stack_trace(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/baseline.py", "--set", "learning_rate=-1", "--run-dir", str(tmp_path)],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error: learning_rate must be a finite number > 0. Received: learning_rate=-1\n" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_integer_accepts_python_and_numpy_integers_and_refuses_the_rest():
    assert check_integer(3, "n") == 3
    assert type(check_integer(np.int64(3), "n")) is int
    assert check_integer(0, "n", minimum=0) == 0
    assert check_integer(None, "n", allow_none=True) is None
    for value in (True, False, 2.0, "3", None, 0, np.float32(3.0)):
        with pytest.raises(InputError, match="^" + re.escape(f"n must be an integer >= 1. Received: n={value!r}") + "$"):
            check_integer(value, "n")
    with pytest.raises(InputError, match=r"^n must be an integer >= 2, or None\. Received: n=1$"):
        check_integer(1, "n", minimum=2, allow_none=True)


def test_check_choice_returns_a_known_name_and_refuses_the_rest_by_name():
    assert check_choice("matrix", "pose", ("vector", "matrix")) == "matrix"
    assert check_choice(np.str_("full"), "domain", {"full": None, "restricted": "x"}) == "full"     # a dict's keys
    expected = "pose must be one of 'vector', 'matrix'. Received: pose="
    for value in ("tensor", "Vector", "", None, 1, ["vector"], np.array(["vector"])):
        with pytest.raises(InputError, match="^" + re.escape(expected + repr(value)) + "$"):
            check_choice(value, "pose", ("vector", "matrix"))
    with pytest.raises(SettingError, match="^kind must be one of 'layerwise', 'baseline'"):
        check_choice("other", "kind", ("layerwise", "baseline"), SettingError)


# Every size that a layer, model or routing stores, with the name its config gives it.
SIZES = [
    (lambda v: CapsuleDense(v, 8), "num_capsules"),
    (lambda v: CapsuleDense(4, v), "capsule_dim"),
    (lambda v: ConvCapsules(v, 16), "num_capsules"),
    (lambda v: ConvCapsules(4, 16, kernel_size=v), "kernel_size"),
    (lambda v: ConvCapsules(4, 16, chunk_size=v), "chunk_size"),
    (lambda v: PrimaryMatrixCapsules(v), "num_capsules"),
    (lambda v: PrimaryCapsules(capsule_dim=v), "capsule_dim"),
    (lambda v: ConvAutoencoder(filters=v), "filters"),
    (lambda v: BernoulliRBM(v), "num_hidden"),
    (lambda v: DynamicRouting(iterations=v), "iterations"),
    (lambda v: ConnectionistRouting(units=v), "units"),
    (lambda v: SimilarityRouting(num_kernels=v), "num_kernels"),
    (lambda v: TopDownAttention(iterations=v), "iterations"),
    (lambda v: GenerativeCapsules(v, 4, 3), "num_parents"),
    (lambda v: ProbabilisticCapsules(num_top=v), "num_top"),
    # the autoencoder's own sizes: before, a bool or NaN failed inside Keras' Conv2D or Dense, or range()
    (lambda v: ProbabilisticCapsuleAutoencoder(channels=v), "channels"),
    (lambda v: ProbabilisticCapsuleAutoencoder(hidden=v, heads=1), "hidden"),
    (lambda v: ProbabilisticCapsuleAutoencoder(encoding=v), "encoding"),
    (lambda v: ProbabilisticCapsuleAutoencoder(blocks=v), "blocks"),
    (lambda v: VariationalAutoencoder(latent=v), "latent"),
    (lambda v: MultiheadAttentionBlock(units=6, heads=v), "heads"),
    (lambda v: InducedSetAttention(units=6, heads=2, inducing=v), "inducing"),
    (lambda v: AttentionPooling(units=6, heads=2, seeds=v), "seeds"),
]


@pytest.mark.parametrize("make, name", SIZES)
def test_sizes_refuse_bools_and_store_numpy_integers_as_int(make, name):
    with pytest.raises(InputError, match=rf"{name} must be an integer >= [01](, or None)?\. Received: {name}=True"):
        make(True)
    config = make(np.int64(3)).get_config()
    assert config[name] == 3 and type(config[name]) is int
    json.dumps(config, default=lambda value: pytest.fail(f"{name}: not JSON-serialisable: {value!r}"))


# Every seed a model, layer, router, initializer, trainer or sampling method takes: (make(seed), whether None, unseeded, is allowed).
# Those that derive their layers' seeds from it (seed + k) need a number.
_IMAGES = np.zeros((8, 12, 12, 1), "float32")
SEEDS = [
    (lambda s: CapsNet((28, 28, 1), 10, conv_filters=4, primary_types=2, seed=s), True),
    (lambda s: RoutingCapsNet((28, 28, 1), 3, routing="dynamic", filters=4, primary_types=2, conv_types=2, seed=s),
     False),
    (lambda s: VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5, seed=s), False),
    (lambda s: ProbabilisticCapsules(image_size=(12, 12), num_top=2, num_parts=2, template_size=5, seed=s), False),
    (lambda s: ProbabilisticCapsuleAutoencoder(
        ProbabilisticCapsules(image_size=(12, 12), num_top=2, num_parts=2, template_size=5), channels=4, hidden=8,
        encoding=4, blocks=1, inducing=2, heads=2, seed=s), False),
    (lambda s: GenerativeCapsules(2, 3, 4, seed=s), True),
    (lambda s: ConvAutoencoder(filters=4, seed=s), True),
    (lambda s: BernoulliRBM(3, seed=s), True),
    (lambda s: ConnectionistRouting(seed=s), True),
    (lambda s: SimilarityRouting(seed=s), True),
    (lambda s: NearIdentity(seed=s), True),
    (lambda s: CDTrainer(BernoulliRBM(3), seed=s), True),
    (lambda s: SupervisedTrainer(CapsNet((28, 28, 1), 10, conv_filters=4, primary_types=2), seed=s), True),
    (lambda s: VariationalTrainer(VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5), seed=s), False),
    (lambda s: fit_resumable(_compiled_autoencoder(), _IMAGES, epochs=1, batch_size=4, seed=s, verbose=0), False),
    (lambda s: _capsule_model().generative.generate(2, seed=s), False),
    (lambda s: RBMSampler(BernoulliRBM(3), (2, 2, 1), seed=s), False),
    (lambda s: CapsuleSampler(CapsulePipeline(ConvAutoencoder(filters=4)), seed=s), False),
    (lambda s: _capsule_model().refine(_IMAGES[:2], steps=1, seed=s), False),
    (lambda s: _capsule_model().mean_bound(_IMAGES[:2], _capsule_model().variational_parameters(_IMAGES[:2]),
                                           draws=1, seed=s), False),
]


def _capsule_model():
    return ProbabilisticCapsuleAutoencoder(
        ProbabilisticCapsules(image_size=(12, 12), num_top=2, num_parts=2, template_size=5), channels=4, hidden=8,
        encoding=4, blocks=1, inducing=2, heads=2)


def _compiled_autoencoder():
    trainer = AutoencoderTrainer(ConvAutoencoder(filters=4, kernel_size=3, seed=0))
    trainer.compile(optimizer="sgd")
    return trainer


@pytest.mark.parametrize("make, unseeded", SEEDS)
def test_seeds_are_integers_at_least_zero(make, unseeded):
    """A seed is an integer >= 0, as the programs' `--seed` is. Before, 1.5 was truncated to 1 or refused by
    Keras or NumPy in their own words, True read as 1, -1 failed in NumPy's batch order (`fit_resumable`) or
    passed, and None failed in arithmetic (`seed + k`) where it was not a choice."""
    for bad in (1.5, True, -1, "3"):
        with pytest.raises(InputError, match=rf"seed must be an integer >= 0(, or None)?\. Received: seed={bad!r}"):
            make(bad)
    make(np.int64(2))
    if unseeded:
        make(None)
    else:
        with pytest.raises(InputError, match=r"seed must be an integer >= 0\. Received: seed=None"):
            make(None)


def _generated_children(layer, seed):
    return layer.generate(np.full((2, 3, 4), 0.5, "float32"), seed)[0]


# Every method that takes a stateless seed, a pair of integers: (draw(seed), whether None, unseeded, is allowed).
_PAIR_IMAGES = np.random.default_rng(0).uniform(size=(2, 12, 12, 1)).astype("float32")
_GENERATIVE = GenerativeCapsules(3, 4, 4, seed=1)
_GENERATIVE.infer(np.ones((2, 6, 4), "float32"))
_PAIR_VAE = VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5, seed=0)
_PAIR_CAPSULES = _capsule_model()
SEED_PAIRS = [
    (lambda s: _generated_children(_GENERATIVE, s), False),
    (lambda s: _PAIR_VAE.bound(_PAIR_IMAGES, seed=s)["bound"], True),
    (lambda s: _PAIR_CAPSULES.bound(_PAIR_IMAGES, seed=s)["bound"], True),
]


@pytest.mark.parametrize("draw, unseeded", SEED_PAIRS)
def test_stateless_seeds_are_pairs_of_integers_and_their_values_alone_set_the_draws(draw, unseeded):
    """A stateless seed is a pair of integers, given as a list, a tuple, a NumPy array or an int32 or int64
    tensor; each form of the same values draws the same. Before, floats were truncated or failed in
    TensorFlow's own words, (True, 1) drew or failed, a single integer failed in the stateless kernels, a list
    and an int64 tensor of the same values drew differently in the capsule autoencoder (int32 and int64 split
    differently), and 2**32 + 1 was wrapped to 1 in the generative capsules' draws."""
    import tensorflow as tf

    reference = draw(tf.constant([1, 2], tf.int64)).numpy()
    for same in ([1, 2], (1, 2), np.array([1, 2]), np.array([1, 2], "int32"), [np.int64(1), np.int32(2)],
                 tf.constant([1, 2], tf.int32)):
        np.testing.assert_array_equal(draw(same).numpy(), reference, err_msg=repr(same))
    assert not np.array_equal(draw([1, 3]).numpy(), reference)                          # the seed matters
    assert not np.array_equal(draw([2 ** 32 + 1, 2]).numpy(), reference)                # no wrapping to int32
    or_none = ", or None" if unseeded else ""
    for bad in (3, (1.5, 2), np.array([1.0, 2.0]), (True, 1), [1, "2"], [1, 2, 3], [[1, 2]], "12", [2 ** 63, 0],
                [1, None]):
        message = re.escape(f"seed must be a pair of integers (a stateless seed){or_none}. Received: seed={bad!r}")
        with pytest.raises(InputError, match=message):
            draw(bad)
    for bad in (tf.constant([1.0, 2.0]), tf.constant([1, 2, 3])):
        with pytest.raises(InputError, match=re.escape(f"Received: a {bad.dtype.name} tensor of shape "
                                                       f"{tuple(bad.shape)}")):
            draw(bad)
    if unseeded:
        assert draw(None).shape == reference.shape
    else:
        with pytest.raises(InputError, match=r"Received: seed=None"):
            draw(None)


def test_check_number_returns_a_float_and_refuses_the_rest_by_name_and_range():
    assert check_number(2, "beta", above=0) == 2.0 and type(check_number(2, "beta", above=0)) is float
    assert type(check_number(np.float32(0.5), "p", above=0, below=1)) is float
    assert check_number(0, "l1", minimum=0) == 0.0 and check_number(1, "p", maximum=1) == 1.0     # inclusive bounds
    assert check_number(-3.5, "shift") == -3.5                                                    # no bounds
    for value in (0, 0.0, -1e-300, float("nan"), np.float64("nan"), float("inf"), -float("inf"), True, "1", None,
                  [1.0], np.array([1.0]), 1 + 0j, 10 ** 400):
        with pytest.raises(InputError, match="^" + re.escape(f"beta must be a finite number > 0. Received: beta={value!r}") + "$"):
            check_number(value, "beta", above=0)
    ranges = [({"minimum": 0, "below": 1}, 1.0, ">= 0 and < 1"), ({"above": 0, "maximum": 1}, 1.5, "> 0 and <= 1"),
              ({"above": 1e-6}, 1e-6, "> 1e-06"), ({"minimum": -2.5}, -3.0, ">= -2.5"), ({}, float("inf"), "")]
    for bounds, value, words in ranges:
        expected = f"p must be a finite number{' ' + words if words else ''}. Received: p={value!r}"
        with pytest.raises(InputError, match="^" + re.escape(expected) + "$"):
            check_number(value, "p", **bounds)


# Every number that a layer, model, routing or trainer takes, its name and its range as the message words them.
NUMBERS = [
    (lambda v: TopDownAttention(beta=v), "beta", "> 0"),
    (lambda v: EMRouting(final_lambda=v), "final_lambda", "> 0"),
    (lambda v: EMRouting(variance_floor=v), "variance_floor", "> 0"),
    (lambda v: SparseInferenceRouting(learning_rate=v), "learning_rate", "> 0"),
    (lambda v: SparseInferenceRouting(l1=v), "l1", ">= 0"),
    (lambda v: SimilarityRouting(entropy_weight=v), "entropy_weight", ">= 0"),
    (lambda v: SimilarityRouting(prior_weight=v), "prior_weight", ">= 0"),
    (lambda v: SimilarityRouting(num_kernels=2, length_scales=[1.0, v]), "length_scales[1]", "> 0"),
    (lambda v: GenerativeRouting(kappa=v), "kappa", "> 0"),
    (lambda v: GenerativeRouting(sigma=v), "sigma", "> 0"),
    (lambda v: GenerativeCapsules(2, 4, 3, kappa=v), "kappa", "> 0"),
    (lambda v: GenerativeCapsules(2, 4, 3, sigma=v), "sigma", "> 0"),
    (lambda v: ProbabilisticCapsules(part_scale=v), "part_scale", "> 0"),
    (lambda v: ProbabilisticCapsules(temperature=v), "temperature", "> 0"),
    (lambda v: ProbabilisticCapsules(c_min=v), "c_min", "> 0"),
    (lambda v: ProbabilisticCapsuleAutoencoder(specialisation=v), "specialisation", ">= 0"),
    (lambda v: ProbabilisticCapsuleAutoencoder(presence_free_bits=v), "presence_free_bits", ">= 0"),
    (lambda v: ProbabilisticCapsuleAutoencoder(sparsity_classes=v), "sparsity_classes", "> 0"),
    (lambda v: VariationalAutoencoder(pixel_sigma=v), "pixel_sigma", "> 0"),
    (lambda v: RoutingCapsNet((28, 28, 1), 10, routing="dynamic", logit_scale=v), "logit_scale", "> 0"),
    (lambda v: ConvAutoencoder(dropout=v), "dropout", ">= 0 and < 1"),
    (lambda v: NearIdentity(noise=v), "noise", ">= 0"),
    (lambda v: IsometricPoses(epsilon=v), "epsilon", "> 0"),
    (lambda v: ScaledSchedule(1e-3, scale=v), "scale", "> 0"),
    (lambda v: ScaledSchedule(v), "learning_rate", "> 0"),
    (lambda v: OffCapsulesWarning(threshold=v), "threshold", ">= 0 and <= 1"),
    (lambda v: ConvAutoencoder(negative_slope=v), "negative_slope", ">= 0"),
    (lambda v: CapsNet((28, 28, 1), 10, conv_filters=4, primary_types=2, reconstruction_weight=v),
     "reconstruction_weight", ">= 0"),
    (lambda v: default_optimizer(learning_rate=v), "learning_rate", "> 0"),
    (lambda v: default_optimizer(decay_rate=v), "decay_rate", "> 0"),
    (lambda v: default_optimizer(momentum=v), "momentum", ">= 0 and < 1"),
    (lambda v: CDTrainer(CapsuleExperts(2, 3), l2=v), "l2", ">= 0"),
    (lambda v: CDTrainer(CapsuleExperts(2, 3), sparsity_target=v, sparsity_cost=1.0), "sparsity target", "> 0 and < 1"),
    # without a cost too: before, a target of NaN, 'x' or 1.0 was taken and ignored, as if no penalty were asked
    (lambda v: CDTrainer(CapsuleExperts(2, 3), sparsity_target=v), "sparsity target", "> 0 and < 1"),
    # before, a NaN or negative l2 made NaN or ascending weight decay
    (lambda v: cd_step(CapsuleExperts(2, 3), np.ones((2, 4, 3), "float32"), l2=v), "l2", ">= 0"),
]


@pytest.mark.parametrize("make, name, words", NUMBERS)
def test_numbers_refuse_what_is_not_a_finite_number_in_range_by_name(make, name, words):
    outside = {"> 0": 0.0, ">= 0": -0.5, "> 0 and < 1": 1.0, ">= 0 and < 1": 1.0, ">= 0 and <= 1": 1.5}[words]
    for value in (float("nan"), float("inf"), "0.5", None, True, outside):
        expected = f"{name} must be a finite number {words}. Received: {name}={value!r}"
        with pytest.raises(InputError, match="^" + re.escape(expected) + "$"):
            make(value)
    make(np.float32(0.5))      # a NumPy number in range is taken


# Every on/off switch that a layer, model, routing or trainer takes, and the name it is stored under.
FLAGS = [
    (lambda v: CapsuleDense(4, 8, frobenius_votes=v), "frobenius_votes"),
    (lambda v: ConvCapsules(4, 16, frobenius_votes=v), "frobenius_votes"),
    (lambda v: ClassCapsules(4, coordinate_addition=v), "coordinate_addition"),
    (lambda v: PrimaryCapsules(squash=v), "squash"),
    (lambda v: CapsNet((28, 28, 1), 10, reconstruction=v), "reconstruction"),
    (lambda v: MatrixCapsNet((28, 28, 1), 10, batch_norm=v), "batch_norm"),
    (lambda v: TopDownAttention(accumulate=v), "accumulate"),
    (lambda v: TopDownAttention(trainable_beta=v), "trainable_beta"),
    (lambda v: ProbabilisticCapsuleAutoencoder(detach_parts=v), "detach_parts"),
    (lambda v: ProbabilisticCapsuleAutoencoder(equivariant_top=v), "equivariant_top"),
    (lambda v: ProbabilisticCapsuleAutoencoder(anchored_parts=v), "anchored_parts"),
    (lambda v: CDTrainer(CapsuleExperts(2, 3), persistent=v), "persistent"),
]


@pytest.mark.parametrize("make, name", FLAGS)
def test_flags_take_true_or_false_and_refuse_what_would_only_read_as_a_truth_value(make, name):
    """`"false"` would read as True, 0 and 1 as numbers, None as off: each is refused by name. A NumPy bool
    is taken and stored as a Python bool (a config that JSON writes)."""
    for value in ("false", "True", 0, 1, None, np.array([True])):
        expected = f"{name} must be True or False. Received: {name}={value!r}"
        with pytest.raises(InputError, match="^" + re.escape(expected) + "$"):
            make(value)
    made = make(np.bool_(False))
    assert getattr(made, name) is False


def test_check_flag_returns_a_python_bool():
    assert check_flag(True, "on") is True and check_flag(np.bool_(False), "on") is False
    value = np.float64(1.0)
    with pytest.raises(InputError, match="^" + re.escape(f"on must be True or False. Received: on={value!r}") + "$"):
        check_flag(value, "on")


@pytest.mark.parametrize("name", ["kernel_weight", "activation_bias", "divergence_weight"])
def test_similarity_initial_weights_take_any_finite_number_and_refuse_the_rest(name):
    for value in (float("nan"), float("-inf"), "0.5", True):
        expected = f"{name} must be a finite number. Received: {name}={value!r}"
        with pytest.raises(InputError, match="^" + re.escape(expected) + "$"):
            SimilarityRouting(**{name: value})
    assert getattr(SimilarityRouting(**{name: np.float32(-2.5)}), name) == -2.5    # any sign: a learned weight's start


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_trainers_refuse_sample_weights_that_they_would_ignore(name, make, x, y):
    """Every trainer's loss (or CD statistic) is a batch mean that weighs examples alike: a batch with sample
    weights is refused by the trainer's name, where they were ignored before, and no weight has moved; without
    them the same data trains. A dataset of `(x, y, w)` batches; and `sample_weight` or `class_weight` given
    to `fit` (or `evaluate`), by keyword or by position, refused at once. Before, Keras dropped a
    `sample_weight` given with no y, and read a `class_weight`'s y as class labels, failing with a TypeError on
    the decoder trainer's lower capsules and an IndexError with no y."""
    import tensorflow as tf

    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
    labelled = {} if y is None else {"y": y}
    trainer.fit(x, batch_size=4, epochs=1, verbose=0, **labelled)           # unweighted: trains
    before = [w.copy() for w in trainer.get_weights()]
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    message = f"^{type(trainer).__name__} weighs every example alike; it takes no sample_weight or class_weight.$"
    with pytest.raises(InputError, match=message):
        trainer.fit(tf.data.Dataset.from_tensor_slices((x, x if y is None else y, weights)).batch(4), epochs=1,
                    shuffle=False, verbose=0)
    classes = {0: 1.0, 1: 2.0, 2: 1.0}
    for weighing in ({"sample_weight": weights}, {"class_weight": classes}):
        with pytest.raises(InputError, match=message):
            trainer.fit(x, batch_size=4, epochs=1, verbose=0, **weighing, **labelled)
    with pytest.raises(InputError, match=message):
        trainer.fit(x, y, 4, 1, 0, None, 0.0, None, True, classes, weights)     # fit's 10th and 11th arguments
    with pytest.raises(InputError, match=message):
        trainer.evaluate(x, batch_size=4, verbose=0, sample_weight=weights, **labelled)
    for a, b in zip(trainer.get_weights(), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_trainers_refuse_a_compiled_loss_or_metrics_that_they_would_ignore(name, make, x, y):
    """Every trainer trains by its own objective and reports its own metrics, so a `loss`, `loss_weights`,
    `metrics` or `weighted_metrics` given to `compile` (by keyword, or the loss by position) is refused by name,
    where before it was ignored: not used by `train_step`, not in the history. The optimizer alone compiles and
    trains."""
    trainer = make()
    for given, expected in [
            ({"loss": "mse"}, "loss. Received: loss='mse'"),
            ({"metrics": ["mae"]}, "metrics. Received: metrics=['mae']"),
            ({"loss_weights": [2.0], "weighted_metrics": ["mae"]},
             "loss_weights, weighted_metrics. Received: loss_weights=[2.0], weighted_metrics=['mae']")]:
        message = (f"{type(trainer).__name__} trains by its own objective and reports its own metrics; "
                   f"compile takes no {expected}")
        with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
            trainer.compile(optimizer=keras.optimizers.SGD(1e-3), **given)
    with pytest.raises(InputError, match="compile takes no loss. Received: loss='mse'$"):
        trainer.compile(keras.optimizers.SGD(1e-3), "mse")
    trainer.compile(keras.optimizers.SGD(1e-3))
    labelled = {} if y is None else {"y": y}
    history = trainer.fit(x, batch_size=4, epochs=1, verbose=0, **labelled).history
    assert set(history) == {metric.name for metric in trainer.metrics}


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_trainers_refuse_a_y_they_would_ignore_and_need_the_y_they_learn_from(name, make, x, y):
    """A trainer that learns from x alone refuses a y (the clean images of a denoising pair were ignored, and
    the autoencoder went on reconstructing its input); one that learns from (x, y) pairs refuses x alone (it
    failed deep in its loss, on None). Both by the trainer's name, in `fit` and `evaluate`, before any weight
    moves."""
    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
    if y is None:
        message, given = f"{type(trainer).__name__} learns from x alone and would ignore a y; pass x only.", (x, x)
    else:
        message, given = (f"{type(trainer).__name__} learns from (x, y) pairs, y the {trainer.targets}; "
                          "pass both."), (x,)
    for run in (trainer.fit, trainer.evaluate):
        before = [w.copy() for w in trainer.get_weights()]
        with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
            run(*given, batch_size=4, verbose=0)
        for a, b in zip(trainer.get_weights(), before):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", routing.names())
def test_every_router_refuses_activations_that_do_not_fit_its_votes(name):
    """Activations must be `[B, I]` for votes `[B, I, J, D]`: one too many children, a trailing axis, or another
    batch size is refused by the router's name with both shapes (before: TensorFlow's error from deep in the
    routing). Sizes unknown while tracing match any."""
    import tensorflow as tf

    votes = np.random.default_rng(0).normal(size=(2, 6, 3, 4)).astype("float32")
    router = routing.get(name)
    for shape in [(2, 7), (2, 6, 1), (3, 6)]:
        expected = (f"{type(router).__name__}: activations must be [B, I] = [2, 6] for votes [B, I, J, D] of shape "
                    f"[2, 6, 3, 4]. Received: activations of shape {list(shape)}")
        with pytest.raises(InputError, match="^" + re.escape(expected) + "$"):
            router(votes, np.ones(shape, "float32"))
    traced = tf.function(router, input_signature=[tf.TensorSpec([None, 6, 3, 4]), tf.TensorSpec([None, None])])
    found = traced(votes, np.ones((2, 6), "float32"))
    assert tuple(found.poses.shape) == (2, 3, 4)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_fit_and_evaluate_check_arrays_as_fit_resumable_does(name, make, x, y):
    """Arrays given to Keras' own `fit` and `evaluate` (x, y and validation arrays) meet the trainer's
    `check_inputs`, as `fit_resumable` checks them, before any weight moves: a NaN among the inputs is refused
    by every trainer. Before, `fit` trained on them (or failed inside the graph), and the generative and
    variational trainers checked no input, in `fit_resumable` either. `predict` checks its x alike (before, it
    predicted from NaN inputs, and images of another size failed inside a layer once Keras had relaxed its
    traced shapes)."""
    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
    labelled = {} if y is None else {"y": y}
    trainer.fit(x, batch_size=4, epochs=1, verbose=0, **labelled)
    before = [w.copy() for w in trainer.get_weights()]
    bad = np.array(x, copy=True)
    bad.reshape(-1)[1] = np.nan
    calls = [lambda: trainer.fit(bad, batch_size=4, epochs=1, verbose=0, **labelled),
             lambda: trainer.fit(x, batch_size=4, epochs=1, verbose=0, validation_data=(bad, y), **labelled),
             lambda: trainer.fit(x, batch_size=4, epochs=1, verbose=0, validation_data=(bad,), **labelled)
             if y is None else trainer.evaluate(bad, y, verbose=0),
             lambda: trainer.predict(bad, batch_size=4, verbose=0)]
    for call in calls:
        with pytest.raises(InputError, match=r"holds 1 NaN or infinite"):
            call()
    for a, b in zip(before, trainer.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("labels, message", [
    (lambda y: np.eye(3)[y], r"^y \(labels\) must be one integer per example, shape \[8\]"),
    (lambda y: y.astype("float32"), r"^y \(labels\) must be integers"),
    (lambda y: np.full_like(y, 3), r"^y \(labels\) must lie in \[0, 3\)"),
])
def test_the_supervised_trainers_fit_refuses_labels_it_would_misread(labels, message):
    """Before, Keras' `fit` trained a 3-class network on the label 3 without a word (margin loss 0, accuracy 0),
    and one-hot or float labels failed inside the traced step."""
    network = CapsNet((14, 14, 1), 3, conv_filters=4, primary_types=2, kernel_size=3)
    trainer = SupervisedTrainer(network, seed=0)
    trainer.compile(optimizer=keras.optimizers.SGD(1e-3))
    x = np.random.default_rng(0).uniform(size=(8, 14, 14, 1)).astype("float32")
    y = np.arange(8) % 3
    with pytest.raises(InputError, match=message):
        trainer.fit(x, labels(y), epochs=1, verbose=0)
    with pytest.raises(InputError, match=message):
        trainer.evaluate(x, labels(y), verbose=0)
    with pytest.raises(InputError, match=r"must lie in \[0.0, 1.0\].*divide 8-bit images by 255"):
        trainer.fit((x * 255).astype("uint8"), y, epochs=1, verbose=0)
    assert trainer.predict(x, verbose=0)["scores"].shape == (8, 3)
    with pytest.raises(InputError, match=r"x \(images\) must have shape \[N, 14, 14, 1\]"):
        trainer.predict(np.zeros((8, 16, 16, 1), "float32"), verbose=0)


@pytest.mark.parametrize("make, built_for, other_inputs, activations, transposed", [
    (lambda: CapsuleDense(3, 4), (2, 5, 6), [(2, 7, 6), (2, 5, 8)], (2, 5), [(2, 4), (5, 2), (2, 5, 1)]),
    (lambda: CapsuleDense(3, 16, pose="matrix", routing="em"), (2, 5, 16), [(2, 7, 16), (2, 5, 9)], (2, 5),
     [(2, 4)]),
    (lambda: ConvCapsules(3, routing="em"), (2, 5, 7, 2, 16), [(2, 5, 7, 3, 16), (2, 5, 7, 2, 9)],
     (2, 5, 7, 2), [(2, 7, 5, 2), (2, 5, 7, 1)]),
    (lambda: ConvCapsules(3, 8, pose="vector", routing="dynamic"), (2, 5, 7, 2, 6), [(2, 5, 7, 2, 8)],
     (2, 5, 7, 2), [(2, 7, 5, 2)]),
    (lambda: ClassCapsules(4, routing="em"), (2, 5, 7, 2, 16), [(2, 5, 7, 3, 16), (2, 5, 7, 2, 9)],
     (2, 5, 7, 2), [(2, 7, 5, 2), (2, 70)]),
])
def test_capsule_layers_refuse_inputs_and_activations_that_do_not_fit_their_kernel(
        make, built_for, other_inputs, activations, transposed):
    """A built capsule layer refuses inputs whose capsule count, types or pose size differ from those its kernel
    was built for, by its name with both shapes (before: TensorFlow's einsum or reshape error), and activations
    that are not the inputs' shape without the pose axis. Before, the activations of a transposed map
    (`[B, W, H, T]` for a 5 x 7 map) were reshaped into place and routed without a word, and the dense layer's
    `route_linear` path (dynamic routing) skipped the router's activation check. A map's height and width stay
    free, and a batch size unknown while tracing matches any."""
    import tensorflow as tf

    rng = np.random.default_rng(0)
    layer = make()
    x = rng.uniform(size=built_for).astype("float32")
    a = rng.uniform(size=activations).astype("float32")
    expected = tuple(layer(x, a).shape)
    expected_for = [None] + list(built_for[1:])
    if len(built_for) == 5:
        expected_for[1:3] = [None, None]
    for shape in other_inputs:
        message = (f"{layer.name} was built for inputs of shape {expected_for} (None: any size). "
                   f"Received: inputs of shape {list(shape)}")
        with pytest.raises(InputError, match=re.escape(message)):
            layer(rng.uniform(size=shape).astype("float32"))
    for shape in transposed:
        message = (f"{layer.name}: activations must have the inputs' shape without the pose axis, "
                   f"{list(built_for[:-1])}. Received: activations of shape {list(shape)}")
        with pytest.raises(InputError, match=re.escape(message)):
            layer(x, rng.uniform(size=shape).astype("float32"))
    signature = [tf.TensorSpec([None, *built_for[1:]]), tf.TensorSpec([None, *activations[1:]])]
    traced = tf.function(layer, input_signature=signature)
    assert tuple(traced(x, a).shape) == expected
    if len(built_for) == 5:   # another height and width: the kernel is shared over positions
        wider = rng.uniform(size=(2, 6, 6, *built_for[3:])).astype("float32")
        assert layer(wider, rng.uniform(size=(2, 6, 6, built_for[3])).astype("float32")).shape[0] == 2


@pytest.mark.parametrize("make", [
    lambda: CapsNet((14, 14, 1), 3, conv_filters=4, primary_types=2, kernel_size=3),
    lambda: MatrixCapsNet((28, 28, 1), 3, a=8, b=2, c=2, d=2),
    lambda: RoutingCapsNet((28, 28, 1), 3, filters=8, primary_types=2, conv_types=2),
], ids=["CapsNet", "MatrixCapsNet", "RoutingCapsNet"])
def test_the_classifiers_refuse_images_of_another_shape_than_their_image_shape(make):
    """Before, a MatrixCapsNet built for 28 x 28 images classified 40 x 40 ones without a word, and the others
    failed with a Keras layer's or TensorFlow's message; the batch size stays free, also while tracing."""
    import tensorflow as tf

    network = make()
    h, w, c = network.image_shape
    rng = np.random.default_rng(0)
    for shape in [(2, h + 12, w + 12, c), (2, h, w, 3), (h, w, c)]:
        message = f"{type(network).__name__} takes images of shape [batch, {h}, {w}, {c}]. Received: shape={shape}"
        with pytest.raises(InputError, match=re.escape(message)):
            network(rng.uniform(size=shape).astype("float32"))
    traced = tf.function(network, input_signature=[tf.TensorSpec([None, h, w, c])])
    assert tuple(traced(rng.uniform(size=(3, h, w, c)).astype("float32"))["scores"].shape) == (3, 3)


def test_a_built_autoencoder_refuses_images_and_codes_of_another_size():
    """The decoder's output padding holds for the image size built for: before, a ConvAutoencoder built on
    28 x 28 images turned 29 x 29 ones into 30 x 30 reconstructions without a word, and a code with other
    channels or a single image failed inside TensorFlow."""
    autoencoder = ConvAutoencoder(filters=8, seed=0)
    with pytest.raises(InputError, match=r"is not built: it learns its code's shape from images"):
        autoencoder.decode(np.zeros((2, 6, 6, 8), "float32"))
    with pytest.raises(InputError, match=r"takes images of shape \[batch, height, width, channels\] with known sizes"):
        ConvAutoencoder(filters=8)(np.zeros((28, 28, 1), "float32"))
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(2, 28, 28, 1)).astype("float32")
    assert tuple(autoencoder(images).shape) == (2, 28, 28, 1)
    for shape in [(2, 29, 29, 1), (2, 32, 32, 1), (2, 28, 28, 3), (28, 28, 1)]:
        message = f"{autoencoder.name} takes images of shape [batch, 28, 28, 1]. Received: shape={shape}"
        with pytest.raises(InputError, match=re.escape(message)):
            autoencoder(rng.uniform(size=shape).astype("float32"))
    with pytest.raises(InputError, match=re.escape("decodes codes of shape [batch, 6, 6, 8]. Received: shape=(2, 6, 6, 4)")):
        autoencoder.decode(np.zeros((2, 6, 6, 4), "float32"))
    assert tuple(autoencoder.decode(autoencoder.encode(images)).shape) == (2, 28, 28, 1)


def test_the_rbm_refuses_units_of_another_width_by_name():
    """`p_on`, `free_energy`, `gibbs`, `reconstruct`, the call and `visible_probabilities` name the RBM's width
    and the shape given (before: TensorFlow's matmul error, or an AttributeError on an RBM not yet built, which
    now builds for the visible units it is first given). A width unknown while tracing fits any."""
    import tensorflow as tf

    rbm = BernoulliRBM(5, seed=0)
    assert tuple(rbm.free_energy(np.ones((2, 7), "float32")).shape) == (2,)      # builds for 7 visible units
    visible = [rbm.p_on, rbm.free_energy, rbm.gibbs, rbm.reconstruct, rbm]
    for use in visible:
        assert use(np.ones((2, 7), "float32")).shape[0] == 2
        for shape in [(2, 6), (2, 8), ()]:
            with pytest.raises(InputError, match=re.escape(f"has 7 visible units. Received: visible units of shape "
                                                           f"{shape}")):
                use(np.ones(shape, "float32"))
    with pytest.raises(InputError, match=re.escape("has 5 hidden units. Received: hidden units of shape (2, 7)")):
        rbm.visible_probabilities(np.ones((2, 7), "float32"))
    traced = tf.function(rbm.p_on, input_signature=[tf.TensorSpec([None, None])])
    assert tuple(traced(np.ones((3, 7), "float32")).shape) == (3, 5)


def test_the_energy_models_refuse_visible_units_that_do_not_fit_in_every_public_method():
    """The capsule experts' `free_energy`, `p_on` (also with given coefficients), `cd_gradients` (data and
    persistent chain) and `decoder_gradients` (upper and lower capsules), and the RBM's `cd_gradients`, name the
    shape they were built for (before: TensorFlow's einsum or matmul errors from the routing's inner loop)."""
    rng = np.random.default_rng(0)
    experts = CapsuleExperts(3, 4)
    x, bad = rng.uniform(size=(2, 6, 5)).astype("float32"), rng.uniform(size=(2, 7, 5)).astype("float32")
    assert tuple(experts.free_energy(x).shape) == (2,) and len(experts.cd_gradients(x)[0]) == 1
    message = re.escape("was built for inputs of shape [None, 6, 5] (None: any size). Received: inputs of shape "
                        "[2, 7, 5]")
    for use in [lambda: experts.free_energy(bad), lambda: experts.p_on(bad),
                lambda: experts.p_on(bad, c=np.full((2, 7, 3), 1 / 3, "float32")),
                lambda: experts.cd_gradients(bad), lambda: experts.cd_gradients(x, chain=bad)]:
        with pytest.raises(InputError, match=message):
            use()
    decoder = CapsuleExperts(6, 5)
    upper = rng.uniform(size=(2, 3, 4)).astype("float32")
    assert len(decoder.decoder_gradients(upper, x, "delta")[0]) == 1
    with pytest.raises(InputError, match=re.escape("built for lower capsules of shape [None, 6, 5] (None: any size). "
                                                   "Received: lower capsules of shape [2, 7, 5]")):
        decoder.decoder_gradients(upper, bad, "delta")
    with pytest.raises(InputError, match=re.escape("Received: inputs of shape [2, 3, 5]")):
        decoder.decoder_gradients(rng.uniform(size=(2, 3, 5)).astype("float32"), x, "section41")
    rbm = BernoulliRBM(3, seed=0)
    v = rng.uniform(size=(2, 5)).astype("float32")
    assert len(rbm.cd_gradients(v)[0]) == 3
    for use in [lambda: rbm.cd_gradients(v[:, :4]), lambda: rbm.cd_gradients(v, chain=v[:, :4])]:
        with pytest.raises(InputError, match=re.escape("has 5 visible units. Received: visible units of shape (2, 4)")):
            use()


def test_capsnet_reconstructs_only_class_capsules_of_its_shape_and_classes_it_has():
    """Before, poses of another capsule size changed the batch without a word (4 examples of [3, 8] poses
    decoded to 2 images), a class outside [0, K) decoded an all-zero mask, and float classes were truncated."""
    import tensorflow as tf

    network = CapsNet((14, 14, 1), 3, conv_filters=4, primary_types=2, kernel_size=3, class_dim=16)
    poses = np.ones((4, 3, 16), "float32")
    assert tuple(network.reconstruct(poses, [0, 1, 2, 0]).shape) == (4, 14, 14, 1)
    for bad, classes, message in [
            (np.ones((4, 3, 8), "float32"), [0, 1, 2, 0],
             r"poses must be the class capsules \[batch, 3, 16\]. Received: shape=\(4, 3, 8\)"),
            (poses, [0, 1], r"classes must be one class per example, shape \[4\]. Received: shape=\(2,\)"),
            (poses, np.eye(3, dtype="int64")[[0, 1, 2, 0]], r"classes must be one class per example"),
            (poses, [0, 1, 2, 5], r"classes must lie in \[0, 3\). Received: 0 to 5"),
            (poses, [0.0, 1.0, 2.0, 1.0], r"classes must be integers")]:
        with pytest.raises(InputError, match=message):
            network.reconstruct(bad, classes)
    traced = tf.function(network.reconstruct, input_signature=[tf.TensorSpec([None, 3, 16]),
                                                               tf.TensorSpec([None], tf.int64)])
    assert tuple(traced(poses, np.array([0, 1, 2, 0])).shape) == (4, 14, 14, 1)
