"""The command-line programs: parse, then call one function. TensorFlow loads only after parsing.

Installed, each is a console script (`poecaps-train-layerwise`, ...); from a
checkout, `python scripts/<name>.py` runs the same function.
"""

import contextlib
import dataclasses
import json
import os
import sys

from poecaps.experiments import cli, presets
from poecaps.experiments.configs import (
    STAGES,
    EvaluationConfig,
    GenerativeConfig,
    ProbabilisticEvaluationConfig,
    ProbabilisticTrainConfig,
    SampleConfig,
    SparseInferenceConfig,
    ToyRoutingConfig,
    probabilistic_configs,
)
from poecaps.experiments.settings import specs

RESUME_HELP = "go on with the run in --run-dir, with its own settings; flags given change them (not the model)"


def _quietly(work):
    """`work()`, with what it prints (progress lines, Keras' bars) sent to stderr instead of stdout."""
    with contextlib.redirect_stdout(sys.stderr):
        return work()


def _print_json(work):
    """Print `work()`'s result on stdout as JSON, alone (`_quietly`): `command > result.json` writes the JSON,
    and the terminal still shows the progress."""
    print(json.dumps(_quietly(work), indent=2))


def _train_layerwise(argv=None):
    p = cli.parser("Train the products of expert capsules layer by layer (and the RBM baseline), then "
                   "draw the result grid and evaluate the run.", "layerwise", "default")
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    cli.add_shortcuts(p, "layerwise", ("seed", "dataset", "data_dir", "limit"))
    p.add_argument("--stage", choices=STAGES, action="append",
                   help="train only this stage (repeatable); default: all, in order")
    p.add_argument("--no-evaluate", action="store_true", help="train only: no result grid, no eval.json")
    args = p.parse_args(argv)
    config, record = cli.config_from_args("layerwise", args, ("seed", "dataset", "data_dir", "limit"))
    from poecaps.experiments.api import run_layerwise  # TensorFlow: after --help

    _print_json(lambda: run_layerwise(config, args.run_dir, record, stages=args.stage or STAGES,
                                      resume=args.resume, evaluate=not args.no_evaluate))


def _sample(argv=None):
    p = cli.parser("Draw the Figure 2 grid from capsule space: RUN/samples.png and RUN/samples.npz.")
    cli.add_config_flags(p, SampleConfig)
    args = p.parse_args(argv)
    config = cli.config_from_flags(SampleConfig, args)
    from poecaps.experiments.sampling import sample_run  # TensorFlow: after --help

    found = sample_run(args.run_dir, rows=config.rows, domain=config.domain, seed=config.seed)
    print(f"wrote {found['png']} and {found['npz']} (images {found['shape']})")


def _evaluate(argv=None):
    p = cli.parser("Evaluate a layer-wise run: write RUN/eval.json and print it.")
    cli.add_config_flags(p, EvaluationConfig)
    args = p.parse_args(argv)
    config = cli.config_from_flags(EvaluationConfig, args)
    from poecaps.experiments.evaluation import evaluate_run  # TensorFlow: after --help

    _print_json(lambda: evaluate_run(args.run_dir, config))


def _baseline(argv=None):
    p = cli.parser("Train and evaluate a supervised capsule network: CapsNet (dynamic routing), matrix "
                   "capsules (EM routing) or Faria's routing network with any router (--preset faria2019-...).",
                   "baseline", "sabour2017",
                   run_dir_default=os.path.join("runs", "baseline"))
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    shortcuts = ("model", "seed", "dataset", "data_dir", "limit", "epochs")
    cli.add_shortcuts(p, "baseline", shortcuts)
    p.add_argument("--evaluate-only", action="store_true",
                   help="skip training; evaluate --run-dir (here --seed draws the affine test set; default 0)")
    p.add_argument("--test-limit", default=None, metavar="N",
                   help="use only this many test images, spread over the split: each epoch's test figures and "
                        "the evaluation")
    args = p.parse_args(argv)
    from poecaps.experiments.baseline_evaluation import (
        evaluate_baseline,  # TensorFlow: after --help
    )
    from poecaps.experiments.baselines import train_baseline
    from poecaps.experiments.configs import BaselineEvaluationConfig
    from poecaps.experiments.settings import SettingError, with_values

    # The affine test set is drawn from the evaluation's seed, 0 unless `--evaluate-only --seed S` chooses
    # another: every run is measured on the same transforms, whatever seed trained it.
    values = {} if args.test_limit is None else {"test_limit": args.test_limit}
    if args.evaluate_only and args.seed is not None:
        values["seed"] = args.seed
    evaluation = with_values(BaselineEvaluationConfig(), values)
    if args.evaluate_only:
        given = ["--preset"] * (args.preset is not None) + ["--set"] * bool(args.set) + ["--resume"] * args.resume + [
            "--" + name.replace("_", "-") for name in shortcuts if name != "seed" and getattr(args, name)]
        if given:
            raise SettingError(f"--evaluate-only evaluates the run as it was trained; it takes no "
                               f"{', '.join(given)}.")
    else:
        config, record = cli.config_from_args("baseline", args, shortcuts)

    def train_and_evaluate():
        if not args.evaluate_only:
            train_baseline(config, args.run_dir, record, resume=args.resume, test_limit=evaluation.test_limit)
        return evaluate_baseline(args.run_dir, evaluation)

    _print_json(train_and_evaluate)


def _compare_routing(argv=None):
    p = cli.parser("Train and evaluate the routing network once per router (the presets below), alike, and "
                   "print one table: ROOT/routing_table.md, ROOT/routing_table.json, one run per row.",
                   run_dir_default=os.path.join("runs", "routing"))
    p.add_argument("--row", action="append", choices=presets.routing_table(),
                   help="only this row's preset (repeatable); default: every preset of the routing network")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="change one setting of every row's preset (repeatable; scripts/baseline.py --help lists them)")
    shortcuts = ("seed", "dataset", "data_dir", "limit", "epochs")
    cli.add_shortcuts(p, "baseline", shortcuts)
    p.add_argument("--test-limit", default=None, metavar="N",
                   help="use only this many test images, spread over the split: each epoch's test figures and "
                        "the evaluation")
    args = p.parse_args(argv)
    from poecaps.experiments.configs import BaselineEvaluationConfig
    from poecaps.experiments.routing_comparison import compare_routing  # TensorFlow: after --help
    from poecaps.experiments.settings import with_values

    settings = cli.flag_values(args, cli.shortcut_specs("baseline", shortcuts))
    evaluation = with_values(BaselineEvaluationConfig(), {} if args.test_limit is None else
                             {"test_limit": args.test_limit})
    _, table = _quietly(lambda: compare_routing(args.run_dir, settings, args.row, evaluation))
    print(table)                                                # alone on stdout, as the JSON of the others


def _toy_routing(argv=None):
    p = cli.parser("Kiefer et al.'s toy (appendix B, Figure 3): the hidden states of a 3-3-1 predictive-coding "
                   "network over its steps, with no penalty, L1 and L2, under both readings of the energy; "
                   "writes RUN/toy_routing.png.", run_dir_default=os.path.join("runs", "toy_routing"))
    cli.add_config_flags(p, ToyRoutingConfig)
    p.add_argument("--json", action="store_true",
                   help="print the six final states as one JSON line, alone on stdout (the rest on stderr)")
    p.add_argument("--seed", default=None, metavar="VALUE",
                   help="accepted for uniformity; the toy is deterministic (it starts at x = u)")
    args = p.parse_args(argv)
    config = cli.config_from_flags(ToyRoutingConfig, args)
    from poecaps.experiments.api import toy_routing  # TensorFlow: after --help

    def work():
        finals = toy_routing(args.run_dir, **dataclasses.asdict(config))
        print(f"wrote {os.path.join(args.run_dir, 'toy_routing.png')}")
        for reading, states in finals.items():
            for penalty, x in states.items():
                print(f"{reading:12s} {penalty:5s} x = ({', '.join(f'{v:+.4f}' for v in x)})")
        return finals

    if args.json:
        print(json.dumps(_quietly(work)))
    else:
        work()


def _sparse_inference(argv=None):
    p = cli.parser("Sparse iterative inference on a trained CapsNet run without routing (Kiefer et al., appendix "
                   "C): primary and class capsules free, L1 on or off, label clamped or not; writes "
                   "RUN/inference/inference.json, lengths.png and energy.png.", run_dir_default=None)
    cli.add_config_flags(p, SparseInferenceConfig, ("examples", "steps", "l1"))
    cli.add_set_flag(p, SparseInferenceConfig)
    p.add_argument("--seed", default=None, metavar="VALUE",
                   help="accepted for uniformity; inference is deterministic")
    args = p.parse_args(argv)
    if not args.run_dir:
        p.error("--run-dir (a CapsNet baseline run) is required")
    config = cli.config_from_flags(SparseInferenceConfig, args)
    from poecaps.experiments.api import sparse_inference  # TensorFlow: after --help

    _print_json(lambda: sparse_inference(args.run_dir, **dataclasses.asdict(config)))


def _generative_capsules(argv=None):
    p = cli.parser("Learn a generative capsule layer (Kiefer et al., section 4) on the frozen primary capsules of a "
                   "trained CapsNet run; writes RUN/generative/generative.json and samples.png.", run_dir_default=None)
    cli.add_config_flags(p, GenerativeConfig, ("parents", "parent_dim", "epochs", "seed"))
    cli.add_set_flag(p, GenerativeConfig)
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    args = p.parse_args(argv)
    if not args.run_dir:
        p.error("--run-dir (a CapsNet baseline run) is required")
    cli.config_from_flags(GenerativeConfig, args)                   # checked before TensorFlow
    from poecaps.experiments.api import generative_capsules  # TensorFlow: after --help

    given = cli.flag_values(args, specs(GenerativeConfig))          # resumed: the others are the layer's own
    _print_json(lambda: generative_capsules(args.run_dir, resume=args.resume, **given))


# The settings of `scripts/probabilistic_capsules.py` that are flags of their own (the help's dozen flags).
PROBABILISTIC_FLAGS = ("data_dir", "epochs", "batch_size", "learning_rate", "canvas", "seed", "tto_steps")


def _probabilistic_capsules(argv=None):
    p = cli.parser("Train the probabilistic capsule model (Smith et al.) and its VAE baseline on MNIST digits, then "
                   "refine at test time, probe and draw: RUN/train.json, RUN/eval.json and four figures.",
                   run_dir_default=os.path.join("runs", "probabilistic"))
    cli.add_config_flags(p, ProbabilisticTrainConfig, PROBABILISTIC_FLAGS)
    cli.add_config_flags(p, ProbabilisticEvaluationConfig, ("tto_steps",))
    cli.add_set_flag(p, ProbabilisticTrainConfig, ProbabilisticEvaluationConfig)
    p.add_argument("--resume", action="store_true", help=RESUME_HELP)
    p.add_argument("--evaluate-only", action="store_true", help="skip training; evaluate --run-dir")
    args = p.parse_args(argv)
    declared = {**specs(ProbabilisticEvaluationConfig), **specs(ProbabilisticTrainConfig)}
    settings = cli.flag_values(args, {name: declared[name] for name in PROBABILISTIC_FLAGS})
    train, _ = probabilistic_configs(settings, args.evaluate_only)       # checked before TensorFlow (text parsed)
    if not args.evaluate_only and not args.resume and not train.data_dir:      # resumed: the run's own
        p.error("--data-dir (a folder of MNIST IDX files) is required to train")
    from poecaps.experiments.api import probabilistic_capsules  # TensorFlow: after --help

    _print_json(lambda: probabilistic_capsules(args.run_dir, resume=args.resume, evaluate_only=args.evaluate_only,
                                               **settings))


def train_layerwise(argv=None):
    return cli.run_main(_train_layerwise, argv)


def sample(argv=None):
    return cli.run_main(_sample, argv)


def evaluate(argv=None):
    return cli.run_main(_evaluate, argv)


def baseline(argv=None):
    return cli.run_main(_baseline, argv)


def compare_routing(argv=None):
    return cli.run_main(_compare_routing, argv)


def toy_routing(argv=None):
    return cli.run_main(_toy_routing, argv)


def sparse_inference(argv=None):
    return cli.run_main(_sparse_inference, argv)


def generative_capsules(argv=None):
    return cli.run_main(_generative_capsules, argv)


def probabilistic_capsules(argv=None):
    return cli.run_main(_probabilistic_capsules, argv)
