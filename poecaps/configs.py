"""The settings of the scripts, one frozen dataclass each; every field is a flag.

Each field's comment is its command-line help (`poecaps.cli.field_help`).
This module imports no TensorFlow, so that a script's `--help` answers at
once (0.2-0.4 s against 4-7 s when the flags came from the trainers'
modules); the trainers and evaluations that use the settings import them
from here.
"""

import dataclasses

from poecaps.data import DATASETS
from poecaps.errors import InputError
from poecaps.run_options import RunOptions


def _check_at_least_one(config, names):
    """Raise `InputError` naming the first of `names` whose value is below 1."""
    for name in names:
        if getattr(config, name) < 1:
            raise InputError(f"{name} must be >= 1. Received: {name}={getattr(config, name)}")


# Layer-wise stages, in training order (`scripts/train_layerwise.py --stage`).
STAGES = ("autoencoder", "encoder", "decoder", "rbm")
DECODER_RULES = ("clamped", "section41", "delta", "mirror")
# Supervised baselines (`scripts/baseline.py --model`).
MODELS = ("capsnet", "em")


@dataclasses.dataclass(frozen=True)
class LayerwiseConfig(RunOptions):
    """Every setting of a layer-wise run (the paper's sizes by default)."""

    dataset: str = "fashion_mnist"    # "mnist" or "fashion_mnist"
    data_dir: str | None = None       # IDX folder (default: Debian path, then TFDS)
    seed: int = 0                     # seeds weights, shuffling, dropout and sampling
    limit: int | None = None          # use only this many training images
    batch_size: int = 128             # images per step, every stage
    heldout_size: int = 256           # test images for the free-energy gap
    # front end (section 4.1)
    filters: int = 128                # channels of both conv layers
    kernel_size: int = 9              # square filter size
    strides: int = 2                  # stride of the second conv layer
    dropout: float = 0.1              # dropout rate after each conv layer
    ae_epochs: int = 1                # autoencoder epochs
    ae_learning_rate: float = 1e-3    # Adam learning rate of the autoencoder
    capsule_dim: int = 8              # pose size of the primary (lower) capsules
    # capsule encoder / decoder (Algorithm 1)
    num_capsules: int = 20            # upper capsules of the encoder
    upper_dim: int = 16               # pose size of the upper capsules
    routing_iterations: int = 3       # dynamic-routing agreement updates (0: uniform coefficients)
    agreement: str = "cosine"         # "cosine" (Hauser) or "dot" (Sabour)
    center_code: bool = True          # subtract the mean code before forming capsules
    normalize: str = "parents"        # encoder coefficients: sum over parents (Sabour) or children (eq. 3)
    init_stddev: float = 0.01         # standard deviation of the encoder's initial W (Algorithm 1's N(0, 0.01), read as a standard deviation)
    pose_constraint: str = "none"     # "isometric": each encoder capsule's map keeps equal singular values (poecaps.constraints.IsometricPoses; not in the paper)
    encoder_epochs: int = 3           # CD epochs of the capsule encoder (and of the RBM)
    decoder_epochs: int = 3           # CD epochs of the capsule decoder
    cd_learning_rate: float = 0.1     # SGD learning rate of the encoder
    decoder_learning_rate: float = 1.0    # SGD learning rate of the decoder
    decay_rate: float = 0.9           # learning rate multiplied by this every epoch
    momentum: float = 0.9             # SGD momentum of the CD stages
    l2: float = 1e-4                  # L2 weight decay of the CD stages
    decoder_l2: float | None = None   # L2 weight decay of the decoder stage alone (default: --l2)
    cd_steps: int = 1                 # k of CD-k
    persistent: bool = False          # persistent chains (PCD) instead of CD-k from the data
    decoder_init: str = "encoder_transpose"   # or "random"
    decoder_rule: str = "clamped"     # "clamped" (data lower capsules, Algorithm 1's mixing), "section41" (section 4.1's rule as printed), "delta" (wake-sleep's delta rule; not in the paper) or "mirror" (eq. 18 mirrored)
    decoder_input: str = "all"        # decoder trained on the whole upper code ("all", the paper) or on each image's longest capsule only ("longest")
    decoder_length: bool = False      # the decoder reads each upper capsule as (x_j, |x_j|)/sqrt(2) (poecaps.capsules.with_length), so a capsule's two sides can decode to different images (not in the paper)
    jit_cd: bool = True               # XLA for the CD stages (not the autoencoder)
    cd_shards: int | None = None      # capsule CD steps in this many concurrent XLA parts (default: 2 on a CPU, 1 with a GPU; needs --jit-cd)
    # sparsity of the capsule encoder's upper capsules (cost 0: off; see CDTrainer)
    sparsity_target: float = 0.1      # target mean P(on) of the encoder's upper capsules
    sparsity_cost: float = 0.0        # weight of the sparsity penalty (0: off)
    population_sparsity_cost: float = 0.0  # weight of the per-image penalty pulling each image's mean P(on) over the capsules to the target (0: off; not in the paper)
    # baseline
    rbm_hidden: int = 20              # hidden units of the baseline Bernoulli RBM
    rbm_learning_rate: float = 0.05   # SGD learning rate of the RBM

    def __post_init__(self):
        super().__post_init__()
        if self.filters % self.capsule_dim:
            raise InputError(f"capsule_dim must divide filters (the code's channels form capsules). "
                             f"Received: capsule_dim={self.capsule_dim}, filters={self.filters}")
        if self.dataset not in DATASETS:
            raise InputError(f"dataset must be one of {DATASETS}. Received: dataset={self.dataset!r}")
        _check_at_least_one(self, ("batch_size", "num_capsules", "upper_dim", "capsule_dim", "cd_steps"))
        for name in ("ae_learning_rate", "cd_learning_rate", "decoder_learning_rate",
                     "rbm_learning_rate", "init_stddev"):
            if getattr(self, name) <= 0:
                raise InputError(f"{name} must be positive. Received: {name}={getattr(self, name)}")
        if not 0.0 < self.sparsity_target < 1.0 or self.sparsity_cost < 0 or self.population_sparsity_cost < 0:
            raise InputError(f"sparsity_target must be in (0, 1) and sparsity_cost, population_sparsity_cost "
                             f">= 0. Received: sparsity_target={self.sparsity_target}, "
                             f"sparsity_cost={self.sparsity_cost}, "
                             f"population_sparsity_cost={self.population_sparsity_cost}")
        if self.cd_shards is not None and (self.cd_shards < 1 or (self.cd_shards > 1 and not self.jit_cd)):
            raise InputError(f"cd_shards must be >= 1, and 1 without jit_cd (each shard is an XLA "
                             f"computation). Received: cd_shards={self.cd_shards}, jit_cd={self.jit_cd}")
        if self.decoder_rule not in DECODER_RULES:
            raise InputError(f"decoder_rule must be one of {DECODER_RULES}. "
                             f"Received: decoder_rule={self.decoder_rule!r}")
        if self.decoder_input not in ("all", "longest"):
            raise InputError(f"decoder_input must be 'all' or 'longest'. "
                             f"Received: decoder_input={self.decoder_input!r}")
        for name in ("l2", "decoder_l2"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise InputError(f"{name} must be >= 0. Received: {name}={getattr(self, name)}")
        if self.pose_constraint not in ("none", "isometric"):
            raise InputError(f"pose_constraint must be 'none' or 'isometric'. "
                             f"Received: pose_constraint={self.pose_constraint!r}")
        if self.decoder_init not in ("encoder_transpose", "random"):
            raise InputError(f"decoder_init must be 'encoder_transpose' or 'random'. "
                             f"Received: decoder_init={self.decoder_init!r}")


@dataclasses.dataclass(frozen=True)
class BaselineConfig(RunOptions):
    """Every setting of a baseline run (the papers' choices by default)."""

    model: str = "capsnet"             # "capsnet" (dynamic routing) or "em" (matrix capsules)
    dataset: str = "fashion_mnist"     # "mnist" or "fashion_mnist"
    data_dir: str | None = None        # IDX folder (default: Debian path, then TFDS)
    seed: int = 0                      # seeds weights, shuffling and augmentation
    limit: int | None = None           # use only this many training images
    epochs: int = 1                    # training epochs
    batch_size: int = 128              # images per step
    routing_iterations: int = -1       # -1: the paper's (2 agreement updates for CapsNet, 3 EM rounds)
    reconstruction: bool = True        # CapsNet's reconstruction decoder and loss
    learning_rate: float = 1e-3        # Adam's initial learning rate
    decay_rate: float = 0.96           # Adam's learning rate times this every epoch
    max_shift: int = 2                 # random shifts (CapsNet)
    em_size: str = "small"             # "small" (A=64, B=8, C=D=16) or "paper" (all 32)
    em_cost_normalization: str = "standardize"   # or "none": the paper's eq. 27
    em_final_lambda: float = -1.0      # -1: 1 with standardised costs, 0.01 with the paper's
    jit_compile: str = "auto"          # "auto": XLA for EM (routing-bound), not for CapsNet (conv-bound)
    shards: int | None = None          # each train step in this many concurrent XLA parts (default: 2 on a CPU under XLA, else 1; needs XLA)

    def __post_init__(self):
        super().__post_init__()
        if self.model not in MODELS:
            raise InputError(f"model must be one of {MODELS}. Received: model={self.model!r}")
        if self.dataset not in DATASETS:
            raise InputError(f"dataset must be one of {DATASETS}. Received: dataset={self.dataset!r}")
        if self.em_size not in ("small", "paper"):
            raise InputError(f"em_size must be 'small' or 'paper'. Received: em_size={self.em_size!r}")
        _check_at_least_one(self, ("epochs", "batch_size"))
        if self.learning_rate <= 0:
            raise InputError(f"learning_rate must be positive. Received: learning_rate={self.learning_rate}")
        if self.jit_compile not in ("auto", "true", "false"):
            raise InputError("jit_compile must be 'auto', 'true' or 'false'. "
                             f"Received: jit_compile={self.jit_compile!r}")
        if self.shards is not None and (self.shards < 1 or (self.shards > 1 and not self.xla)):
            raise InputError(f"shards must be >= 1, and 1 without XLA (each shard is an XLA "
                             f"computation). Received: shards={self.shards}, jit_compile={self.jit_compile!r}")
        if self.routing_iterations < -1 or (self.model == "em" and self.routing_iterations == 0):
            raise InputError("routing_iterations must be >= 0 for capsnet, >= 1 for em, or -1 for "
                             f"the paper's. Received: routing_iterations={self.routing_iterations}")

    @property
    def xla(self):
        return self.model == "em" if self.jit_compile == "auto" else self.jit_compile == "true"

    @property
    def train_shards(self):
        """Concurrent XLA parts of each train step: `shards`, or 2 on a CPU under XLA, else 1."""
        from trainers.shards import default_shards  # imports TensorFlow: not at --help

        if self.shards is not None:
            return self.shards
        return default_shards() if self.xla else 1

    @property
    def iterations(self):
        if self.routing_iterations >= 0:
            return self.routing_iterations
        return 2 if self.model == "capsnet" else 3


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """Settings of `scripts/evaluate.py`."""

    seed: int = 0                  # seeds the reference classifier and the samples
    rows: int = 20                 # samples per capsule for specialisation
    classifier_epochs: int = 3     # reference classifier epochs (trained once per run)
    restricted: bool = True        # also report the restricted domain, both halves (mean direction, winning side)
    draws: int = 5                 # draws of the paper's N(0, I) grid per domain (sampler seeds seed, seed+1, ...)

    def __post_init__(self):
        _check_at_least_one(self, ("rows", "classifier_epochs", "draws"))


@dataclasses.dataclass(frozen=True)
class BaselineEvaluationConfig:
    """Settings of `scripts/baseline.py --evaluate-only` and of the evaluation after training."""

    seed: int = 0                  # seeds the random affine transforms
    batch_size: int = 256          # images per forward pass
    perturb_examples: int = 3      # test images for the Sabour Figure 4 perturbation plot
    test_limit: int | None = None  # evaluate on only this many test images
