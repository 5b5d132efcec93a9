"""The settings of every run, one frozen dataclass per kind; each field declared once (`settings.setting`).

A config's field defaults are its default preset (`poecaps.experiments.presets`);
named presets change some of them. This module imports no TensorFlow, so
that a script's `--help` answers at once.
"""

import dataclasses

from poecaps.data import DATASETS
from poecaps.distribute import PRECISIONS, STRATEGIES
from poecaps.experiments.settings import (
    SettingError,
    check_fields,
    setting,
    specs,
    unknown_field_error,
    with_values,
)
from poecaps.trainers import CHILD_WEIGHTS, NAN_POLICIES

# Layer-wise stages, in training order (`scripts/train_layerwise.py --stage`).
STAGES = ("autoencoder", "encoder", "decoder", "rbm")
# How the capsule decoder's U is trained (`poecaps.experts.CapsuleExperts.decoder_gradients`).
DECODER_RULES = ("section41", "delta")
# The half of capsule space the result grid draws from (`poecaps.samplers.CapsuleSampler`).
DOMAINS = ("full", "restricted", "winning")
# Supervised baselines (`scripts/baseline.py`): CapsNet, matrix capsules, Faria's Table 1 network.
MODELS = ("capsnet", "em", "routingnet")
# Routers a baseline can use (`poecaps.routing.get`); CapsNet routes dynamically, matrix capsules by EM,
# the routing network (`poecaps.models.RoutingCapsNet`) by any of them.
ROUTINGS = ("dynamic", "uniform", "em", "similarity", "connectionist", "sparse_inference", "generative")
MODEL_ROUTINGS = {"capsnet": ("dynamic",), "em": ("em",), "routingnet": ROUTINGS}


@dataclasses.dataclass(frozen=True)
class Checked:
    """A config whose fields are checked against their declarations when it is made, then by `check`."""

    def __post_init__(self):
        check_fields(self)
        self.check()

    def check(self):
        """Checks that involve more than one field (subclasses extend it)."""


@dataclasses.dataclass(frozen=True)
class RunOptions(Checked):
    """How a run is kept safe and where it runs; none of these changes the model."""

    save_every: int = setting(200, "also checkpoint every this many steps (0: at epoch ends only)", minimum=0)
    on_nan: str = setting("stop", "on a NaN: stop, reduce-lr (halve the learning rate and go on) or off",
                          choices=NAN_POLICIES)
    strategy: str = setting("default", "tf.distribute strategy", choices=STRATEGIES)
    precision: str = setting("float32", "Keras dtype policy", choices=PRECISIONS)


@dataclasses.dataclass(frozen=True)
class DataOptions(RunOptions):
    """Which data a run trains on."""

    dataset: str = setting("fashion_mnist", "dataset", choices=DATASETS)
    data_dir: str | None = setting(None, "folder of the IDX files (default: Debian's path, then TFDS)", kind=str)
    seed: int = setting(0, "seeds weights, data order, dropout and sampling", minimum=0)
    limit: int | None = setting(None, "train on only this many training images (default: all)", kind=int,
                                minimum=1)


@dataclasses.dataclass(frozen=True)
class LayerwiseConfig(DataOptions):
    """Every setting of a products-of-expert-capsules run; the defaults are the `default` preset."""

    batch_size: int = setting(128, "images per step, every stage", minimum=1)
    heldout_size: int = setting(256, "test images for the free-energy gap", minimum=1)
    # front end (section 4.1)
    filters: int = setting(128, "channels of both conv layers", minimum=1)
    kernel_size: int = setting(9, "square filter size of both conv layers", minimum=1)
    strides: int = setting(2, "stride of the second conv layer", minimum=1)
    dropout: float = setting(0.1, "dropout rate after each conv layer", minimum=0.0, below=1.0)
    ae_epochs: int = setting(1, "autoencoder epochs", minimum=1)
    ae_learning_rate: float = setting(1e-3, "Adam learning rate of the autoencoder", above=0.0)
    capsule_dim: int = setting(8, "pose size of the primary (lower) capsules; divides filters", minimum=1)
    # capsule encoder (Algorithm 1)
    num_capsules: int = setting(20, "upper capsules of the encoder", minimum=1)
    upper_dim: int = setting(16, "pose size of the upper capsules", minimum=1)
    routing_iterations: int = setting(4, "routing rounds, Sabour's r (0 and 1: uniform coefficients)",
                                      minimum=0)
    agreement: str = setting("cosine", "routing agreement: cosine (Hauser) or dot (Sabour)",
                             choices=("cosine", "dot"))
    normalize: str = setting("parents", "the axis the coefficients sum to 1 over", choices=("parents", "children"))
    center_code: bool = setting(True, "subtract the mean code before forming capsules (not in the paper)")
    init_stddev: float = setting(0.01, "standard deviation of the encoder's initial W", above=0.0)
    encoder_epochs: int = setting(3, "CD epochs of the capsule encoder (and of the RBM)", minimum=1)
    cd_learning_rate: float = setting(0.1, "SGD learning rate of the encoder", above=0.0)
    cd_steps: int = setting(1, "k of CD-k", minimum=1)
    persistent: bool = setting(False, "persistent chains (PCD) instead of CD-k from the data")
    sparsity_target: float = setting(0.1, "target mean P(on) of the sparsity penalties", above=0.0, below=1.0)
    sparsity_cost: float = setting(5.0, "weight of the lifetime sparsity penalty (0: off)", minimum=0.0)
    population_sparsity_cost: float = setting(
        15.0, "weight of the per-image (population) sparsity penalty (0: off; not in the paper)", minimum=0.0)
    # capsule decoder (section 4.1)
    decoder_epochs: int = setting(3, "epochs of the capsule decoder", minimum=1)
    decoder_learning_rate: float = setting(1.0, "SGD learning rate of the decoder", above=0.0)
    decoder_rule: str = setting("delta", "decoder update: section41 (as printed) or delta (wake-sleep's)",
                                choices=DECODER_RULES)
    decoder_input: str = setting("longest", "decoder trained on the whole code (all) or each image's "
                                 "longest capsule (longest)", choices=("all", "longest"))
    decoder_length: bool = setting(True, "the decoder reads each capsule as (x, |x|)/sqrt(2) (not in the paper)")
    decoder_l2: float | None = setting(None, "L2 weight decay of the decoder (default: l2)", kind=float,
                                       minimum=0.0)
    # both CD stages
    decay_rate: float = setting(0.9, "learning rate multiplied by this every epoch", above=0.0, maximum=1.0)
    momentum: float = setting(0.9, "SGD momentum", minimum=0.0, below=1.0)
    l2: float = setting(1e-4, "L2 weight decay", minimum=0.0)
    jit_cd: bool = setting(True, "XLA for the CD stages (not the autoencoder)")
    cd_shards: int | None = setting(None, "CD steps in this many concurrent XLA parts (default: 2 on a CPU)",
                                    kind=int, minimum=1)
    # Bernoulli RBM baseline
    rbm_hidden: int = setting(20, "hidden units of the baseline Bernoulli RBM", minimum=1)
    rbm_learning_rate: float = setting(0.05, "SGD learning rate of the RBM", above=0.0)
    # the result grid (Figure 2)
    sample_domain: str = setting("winning", "the grid's half of capsule space: full, restricted (mean "
                                 "direction) or winning (side of the winning poses)", choices=DOMAINS)
    sample_rows: int = setting(20, "draws per capsule in the grid", minimum=1)

    def check(self):
        if self.filters % self.capsule_dim:
            raise SettingError(f"capsule_dim must divide filters (the code's channels form capsules). "
                               f"Received: capsule_dim={self.capsule_dim}, filters={self.filters}")
        if self.cd_shards is not None and self.cd_shards > 1 and not self.jit_cd:
            raise SettingError(f"cd_shards above 1 needs jit_cd (each shard is an XLA computation). "
                               f"Received: cd_shards={self.cd_shards}, jit_cd={self.jit_cd}")


@dataclasses.dataclass(frozen=True)
class BaselineConfig(DataOptions):
    """Every setting of a supervised baseline run; the defaults are the `sabour2017` preset."""

    model: str = setting("capsnet", "capsnet (dynamic routing), em (matrix capsules) or routingnet (Faria's "
                         "Table 1 network, any routing)", choices=MODELS)
    routing: str | None = setting(None, "the router (default: the model's own, dynamic for capsnet and em for "
                                  "em; routingnet takes any and needs one)", kind=str, choices=ROUTINGS)
    loss: str = setting("cross_entropy", "routingnet's loss: cross_entropy (activations as logits), "
                        "scaled_cross_entropy (times a learned scale), spread or margin (capsnet and em keep their "
                        "papers' losses)", choices=("cross_entropy", "scaled_cross_entropy", "spread", "margin"))
    logit_scale: float = setting(1.0, "routingnet's scaled_cross_entropy: where its learned scale starts",
                                 above=0.0)
    epochs: int = setting(1, "training epochs", minimum=1)
    batch_size: int = setting(128, "images per step", minimum=1)
    routing_iterations: int = setting(3, "routing rounds (Sabour's r; EM's rounds, >= 1)", minimum=0)
    reconstruction: bool = setting(True, "CapsNet's reconstruction decoder and loss")
    learning_rate: float = setting(1e-3, "Adam's initial learning rate", above=0.0)
    decay_rate: float = setting(0.96, "Adam's learning rate times this every epoch", above=0.0, maximum=1.0)
    max_shift: int = setting(2, "random shifts in pixels while training", minimum=0)
    em_size: str = setting("small", "EM sizes: small (A=64, B=8, C=D=16) or paper (all 32)",
                           choices=("small", "paper"))
    em_cost_normalization: str = setting("standardize", "EM costs: standardize or none (the paper's eq. 27)",
                                         choices=("standardize", "none"))
    em_final_lambda: float = setting(1.0, "EM inverse-temperature scale (EMRouting.final_lambda)", above=0.0)
    jit_compile: str = setting("auto", "XLA: auto (for em and routingnet, not capsnet), true or false",
                               choices=("auto", "true", "false"))
    shards: int | None = setting(None, "each train step in this many concurrent XLA parts "
                                 "(default: 2 on a CPU under XLA)", kind=int, minimum=1)

    def check(self):
        if self.router is None:
            raise SettingError(f"model {self.model} needs a routing, one of {', '.join(ROUTINGS)}. "
                               f"Received: routing=None")
        if self.router not in MODEL_ROUTINGS[self.model]:
            raise SettingError(f"model {self.model} routes with {' or '.join(MODEL_ROUTINGS[self.model])}. "
                               f"Received: routing={self.routing!r}")
        if self.router == "em" and self.routing_iterations < 1:
            raise SettingError(f"EM routing needs routing_iterations >= 1. "
                               f"Received: routing_iterations={self.routing_iterations}")
        if self.shards is not None and self.shards > 1 and not self.xla:
            raise SettingError(f"shards above 1 needs XLA (each shard is an XLA computation). "
                               f"Received: shards={self.shards}, jit_compile={self.jit_compile!r}")

    @property
    def router(self):
        """The routing name in effect: `routing`, or the model's own (None for routingnet, which needs one)."""
        return self.routing or {"capsnet": "dynamic", "em": "em"}.get(self.model)

    @property
    def xla(self):
        return self.model != "capsnet" if self.jit_compile == "auto" else self.jit_compile == "true"


@dataclasses.dataclass(frozen=True)
class EvaluationConfig(Checked):
    """Settings of `scripts/evaluate.py`."""

    seed: int = setting(0, "seeds the reference classifier and the samples", minimum=0)
    rows: int = setting(20, "samples per capsule and draw", minimum=1)
    draws: int = setting(5, "draws of the N(0, I) grid per domain (sampler seeds seed, seed+1, ...)", minimum=1)
    classifier_epochs: int = setting(3, "reference classifier epochs (trained once per run)", minimum=1)
    diagnostics: bool = setting(False, "also the study's slow diagnostics: one-capsule decodings, the "
                                "autoencoder alone, the pixel k-means reference")


@dataclasses.dataclass(frozen=True)
class SampleConfig(Checked):
    """Settings of `scripts/sample.py`."""

    seed: int = setting(0, "seed of the draws", minimum=0)
    rows: int | None = setting(None, "draws per capsule (default: the run's sample_rows)", kind=int, minimum=1)
    domain: str | None = setting(None, "full, restricted (side of each capsule's mean training direction) or "
                                 "winning (side its winning poses visit); default: the run's sample_domain",
                                 kind=str, choices=DOMAINS)


@dataclasses.dataclass(frozen=True)
class BaselineEvaluationConfig(Checked):
    """Settings of a baseline's evaluation."""

    seed: int = setting(0, "seeds the random affine transforms", minimum=0)
    batch_size: int = setting(256, "images per forward pass", minimum=1)
    perturb_examples: int = setting(3, "test images for the Sabour Figure 4 perturbation plot", minimum=0)
    test_limit: int | None = setting(None, "use only this many test images, spread over the split", kind=int, minimum=1)


@dataclasses.dataclass(frozen=True)
class ProbabilisticTrainConfig(Checked):
    """Settings of Smith et al.'s model and its VAE baseline, trained alike (`probabilistic_capsules.train_run`)."""

    data_dir: str | None = setting(None, "folder of MNIST IDX files (e.g. ../shared/data/mnist-5k); required to "
                                   "train", kind=str)
    epochs: int = setting(100, "epochs of each model (100: the README's runs)", minimum=1)
    batch_size: int = setting(64, "batch size", minimum=1)
    learning_rate: float = setting(1e-3, "Adam's learning rate", above=0.0)
    canvas: int = setting(40, "digits are padded to this size", minimum=1)
    seed: int = setting(0, "seeds the weights, the batch order and the draws", minimum=0)
    specialisation: float = setting(0.0, "weight of the top presences' information in training, nats per image; "
                                    "0 is the paper's bound alone", minimum=0.0)
    within_sparsity: float = setting(0.0, "weight of the top presences' prior sparsity within images (0: off)",
                                     minimum=0.0)
    between_sparsity: float = setting(0.0, "weight of the top presences' prior sparsity between images (0: off)",
                                      minimum=0.0)


@dataclasses.dataclass(frozen=True)
class ProbabilisticEvaluationConfig(Checked):
    """Settings of a probabilistic capsule run's evaluation (`probabilistic_capsules.evaluate_run`)."""

    seed: int = setting(0, "seeds the affine stand-in, the draws of test-time optimisation and the samples",
                        minimum=0)
    tto_images: int = setting(200, "test digits refined at test time (an even spread of the split)", minimum=1)
    tto_steps: int = setting(200, "test-time optimisation steps", minimum=0)
    tto_learning_rate: float = setting(0.01, "Adam's learning rate of test-time optimisation", above=0.0)


@dataclasses.dataclass(frozen=True)
class GenerativeConfig(Checked):
    """Settings of a generative capsule layer learned on a CapsNet run (`generative_capsules.train_generative`)."""

    parents: int = setting(10, "parent capsules J", minimum=1)
    parent_dim: int = setting(16, "pose size of a parent", minimum=1)
    epochs: int = setting(5, "epochs of generalised EM (5: the README's run)", minimum=1)
    batch_size: int = setting(32, "children's images per EM step", minimum=1)
    learning_rate: float = setting(3e-3, "Adam's learning rate", above=0.0)
    iterations: int = setting(10, "EM iterations of every inference", minimum=1)
    child_weights: str = setting("uniform", "each child's weight a_i in inference and learning: uniform, or "
                                 "lengths (its length, a capsule's activation)", choices=CHILD_WEIGHTS)
    heldout: int = setting(200, "test images whose bound is followed over training", minimum=1)
    probe_train: int = setting(1000, "training images of the linear probes and of the figure's decoder", minimum=1)
    seed: int = setting(0, "seeds the initial G, the batch order and the samples", minimum=0)


@dataclasses.dataclass(frozen=True)
class SparseInferenceConfig(Checked):
    """Settings of sparse iterative inference on a CapsNet run (`capsnet_inference.infer_run`)."""

    examples: int = setting(1000, "test digits (an even spread of the test split)", minimum=1)
    steps: int = setting(500, "inference steps", minimum=1)
    learning_rate: float = setting(0.01, "step size of the descent", above=0.0)
    l1: float | None = setting(None, "L1 weight on the class-capsule lengths, or auto: the largest of 1, 0.7, 0.5, "
                               "0.3, 0.2, 0.1 that costs training digits no accuracy", kind=float, minimum=0.0,
                               none_word="auto")
    batch_size: int = setting(250, "digits per inference", minimum=1)
    shown: int = setting(4, "digits drawn in lengths.png", minimum=1)


@dataclasses.dataclass(frozen=True)
class ToyRoutingConfig(Checked):
    """Settings of Kiefer et al.'s appendix B toy (`toy_routing.toy_routing`)."""

    steps: int = setting(500, "gradient steps on the energy from x = u", minimum=1)
    learning_rate: float = setting(0.01, "SGD step size", above=0.0)


def probabilistic_configs(values, evaluate_only=False):
    """`(train, evaluation)`: a probabilistic capsule run's two configs with `values` set, each checked.

    `values` is `{field: value or command-line text}` over the fields of
    `ProbabilisticTrainConfig` and `ProbabilisticEvaluationConfig`; `seed`
    sets both. With `evaluate_only` the run is evaluated as it was trained,
    so a training setting is refused.
    """
    train_fields, evaluation_fields = specs(ProbabilisticTrainConfig), specs(ProbabilisticEvaluationConfig)
    for name in values:
        if name not in train_fields and name not in evaluation_fields:
            raise unknown_field_error(ProbabilisticTrainConfig, name, ProbabilisticEvaluationConfig)
    training_only = [name for name in values if name not in evaluation_fields]
    if evaluate_only and training_only:
        raise SettingError(f"evaluate_only evaluates the run as it was trained; it takes no "
                           f"{', '.join(training_only)}.")
    pick = lambda fields: {name: value for name, value in values.items() if name in fields}
    return (with_values(ProbabilisticTrainConfig(), pick(train_fields)),
            with_values(ProbabilisticEvaluationConfig(), pick(evaluation_fields)))


# Run kinds and their configs, as `config.json` names them.
KINDS = {"layerwise": LayerwiseConfig, "baseline": BaselineConfig}
