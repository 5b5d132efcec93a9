"""The command-line programs: parse, then call one function. TensorFlow loads only after parsing.

Installed, each is a console script (`poecaps-train-layerwise`, ...); from a
checkout, `python scripts/<name>.py` runs the same function.
"""

import json
import os

from poecaps.experiments import cli, presets
from poecaps.experiments.configs import STAGES, EvaluationConfig, SampleConfig


def _train_layerwise(argv=None):
    p = cli.parser("Train the products of expert capsules layer by layer (and the RBM baseline), then "
                   "draw the result grid and evaluate the run.", "layerwise", "default")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    cli.add_shortcuts(p, "layerwise", ("seed", "dataset", "data_dir", "limit"))
    p.add_argument("--stage", choices=STAGES, action="append",
                   help="train only this stage (repeatable); default: all, in order")
    p.add_argument("--no-evaluate", action="store_true", help="train only: no result grid, no eval.json")
    args = p.parse_args(argv)
    config, record = cli.config_from_args("layerwise", args, ("seed", "dataset", "data_dir", "limit"))
    from poecaps.experiments.api import run_layerwise  # TensorFlow: after --help

    run_layerwise(config, args.run_dir, record, stages=args.stage or STAGES, resume=args.resume,
                  evaluate=not args.no_evaluate)


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

    print(json.dumps(evaluate_run(args.run_dir, config), indent=2))


def _baseline(argv=None):
    p = cli.parser("Train and evaluate a supervised capsule network: CapsNet (dynamic routing), matrix "
                   "capsules (EM routing) or Faria's routing network with any router (--preset faria2019-...).",
                   "baseline", "sabour2017",
                   run_dir_default=os.path.join("runs", "baseline"))
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    shortcuts = ("model", "seed", "dataset", "data_dir", "limit", "epochs")
    cli.add_shortcuts(p, "baseline", shortcuts)
    p.add_argument("--evaluate-only", action="store_true",
                   help="skip training; evaluate --run-dir (here --seed draws the affine test set; default 0)")
    p.add_argument("--test-limit", default=None, metavar="N", help="evaluate on only this many test images")
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
        given = ["--set"] * bool(args.set) + ["--resume"] * args.resume + [
            "--" + name.replace("_", "-") for name in shortcuts if name != "seed" and getattr(args, name)]
        if given:
            raise SettingError(f"--evaluate-only evaluates the run as it was trained; it takes no "
                               f"{', '.join(given)}.")
    else:
        config, record = cli.config_from_args("baseline", args, shortcuts)
        train_baseline(config, args.run_dir, record, resume=args.resume)
    result = evaluate_baseline(args.run_dir, evaluation)
    print(json.dumps(result, indent=2))


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
    p.add_argument("--test-limit", default=None, metavar="N", help="evaluate on only this many test images")
    args = p.parse_args(argv)
    from poecaps.experiments.configs import BaselineEvaluationConfig
    from poecaps.experiments.routing_comparison import compare_routing  # TensorFlow: after --help
    from poecaps.experiments.settings import parse_assignment, with_values

    settings = {name: getattr(args, name) for name in shortcuts if getattr(args, name) is not None}
    settings.update(parse_assignment(text) for text in args.set)
    evaluation = with_values(BaselineEvaluationConfig(), {} if args.test_limit is None else
                             {"test_limit": args.test_limit})
    _, table = compare_routing(args.run_dir, settings, args.row, evaluation)
    print(table)


def _toy_routing(argv=None):
    p = cli.parser("Kiefer et al.'s toy (appendix B, Figure 3): the hidden states of a 3-3-1 predictive-coding "
                   "network over 500 steps, with no penalty, L1 and L2, under both readings of the energy; "
                   "writes RUN/toy_routing.png.", run_dir_default=os.path.join("runs", "toy_routing"))
    p.add_argument("--json", action="store_true", help="print the six final states as one JSON line, last")
    p.add_argument("--seed", default=None, metavar="VALUE",
                   help="accepted for uniformity; the toy is deterministic (it starts at x = u)")
    args = p.parse_args(argv)
    from poecaps.experiments.toy_routing import toy_routing  # TensorFlow: after --help

    finals = toy_routing(args.run_dir)
    print(f"wrote {os.path.join(args.run_dir, 'toy_routing.png')}")
    for reading, states in finals.items():
        for penalty, x in states.items():
            print(f"{reading:12s} {penalty:5s} x = ({', '.join(f'{v:+.4f}' for v in x)})")
    if args.json:
        print(json.dumps(finals))


def _sparse_inference(argv=None):
    p = cli.parser("Sparse iterative inference on a trained CapsNet run without routing (Kiefer et al., appendix "
                   "C): primary and class capsules free, L1 on or off, label clamped or not; writes "
                   "RUN/inference/inference.json, lengths.png and energy.png.", run_dir_default=None)
    p.add_argument("--examples", type=int, default=1000, help="test digits (an even spread of the test split)")
    p.add_argument("--steps", type=int, default=500, help="inference steps")
    p.add_argument("--l1", default="auto", help="L1 weight on the class-capsule lengths, or 'auto': the largest "
                   "of 1, 0.7, 0.5, 0.3, 0.2, 0.1 that costs no accuracy on training digits")
    p.add_argument("--seed", default=None, metavar="VALUE",
                   help="accepted for uniformity; inference is deterministic")
    args = p.parse_args(argv)
    if not args.run_dir:
        p.error("--run-dir (a CapsNet baseline run) is required")
    for name in ("examples", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1. Received: {getattr(args, name)}")
    if args.l1 != "auto":
        try:
            args.l1 = float(args.l1)
        except ValueError:
            p.error(f"--l1 must be 'auto' or a number >= 0. Received: {args.l1}")
        if not args.l1 >= 0:
            p.error(f"--l1 must be 'auto' or a number >= 0. Received: {args.l1}")
    from poecaps.experiments.capsnet_inference import infer_run  # TensorFlow: after --help

    print(json.dumps(infer_run(args.run_dir, args.examples, args.steps, l1=args.l1), indent=2))


def _generative_capsules(argv=None):
    p = cli.parser("Learn a generative capsule layer (Kiefer et al., section 4) on the frozen primary capsules of a "
                   "trained CapsNet run; writes RUN/generative/generative.json and samples.png.", run_dir_default=None)
    p.add_argument("--parents", type=int, default=10, help="parent capsules J")
    p.add_argument("--parent-dim", type=int, default=16, help="pose size of a parent")
    p.add_argument("--epochs", type=int, default=2, help="epochs of generalised EM")
    p.add_argument("--seed", type=int, default=0, help="seeds the initial G, the batch order and the samples")
    args = p.parse_args(argv)
    if not args.run_dir:
        p.error("--run-dir (a CapsNet baseline run) is required")
    for name in ("parents", "parent_dim", "epochs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.seed < 0:
        p.error(f"--seed must be >= 0. Received: {args.seed}")
    from poecaps.experiments.generative_capsules import train_generative  # TensorFlow: after --help

    print(json.dumps(train_generative(args.run_dir, args.parents, args.parent_dim, args.epochs, seed=args.seed),
                     indent=2))


def _probabilistic_capsules(argv=None):
    p = cli.parser("Train the probabilistic capsule model (Smith et al.) and its VAE baseline on MNIST digits, then "
                   "refine at test time, probe and draw: RUN/train.json, RUN/eval.json and four figures.",
                   run_dir_default=os.path.join("runs", "probabilistic"))
    p.add_argument("--data-dir", default=None, help="folder of MNIST IDX files (e.g. ../shared/data/mnist-5k)")
    p.add_argument("--epochs", type=int, default=150, help="epochs of each model (default: 150)")
    p.add_argument("--batch-size", type=int, default=64, help="batch size (default: 64)")
    p.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's learning rate (default: 0.001)")
    p.add_argument("--canvas", type=int, default=40, help="digits are padded to this size (default: 40)")
    p.add_argument("--tto-steps", type=int, default=200, help="test-time optimisation steps (default: 200)")
    p.add_argument("--specialisation", type=float, default=0.0,
                   help="weight of the top presences' information in training, nats per image (default: 0, the "
                        "paper's bound alone)")
    p.add_argument("--sparsity", type=float, nargs=2, default=(0.0, 0.0), metavar=("WITHIN", "BETWEEN"),
                   help="weights of the top presences' prior sparsity within and between images in training "
                        "(default: 0 0, the paper's bound alone)")
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the batch order and the draws")
    p.add_argument("--resume", action="store_true", help="continue the training in --run-dir")
    p.add_argument("--evaluate-only", action="store_true", help="skip training; evaluate --run-dir")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "canvas"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1. Received: {getattr(args, name)}")
    if args.tto_steps < 0 or args.seed < 0:
        p.error(f"--tto-steps and --seed must be >= 0. Received: {args.tto_steps} and {args.seed}")
    if not args.learning_rate > 0:
        p.error(f"--learning-rate must be > 0. Received: {args.learning_rate}")
    for name, value in (("--specialisation", args.specialisation), *(("--sparsity", v) for v in args.sparsity)):
        if not 0.0 <= value < float("inf"):
            p.error(f"{name} must be finite numbers >= 0. Received: {value}")
    if not args.evaluate_only and not args.data_dir:
        p.error("--data-dir (a folder of MNIST IDX files) is required to train")
    from poecaps.experiments import probabilistic_capsules as study  # TensorFlow: after --help

    if not args.evaluate_only:
        study.train_run(args.run_dir, args.epochs, args.batch_size, args.learning_rate, args.canvas, args.data_dir,
                        args.seed, args.resume, specialisation=args.specialisation,
                        within_sparsity=args.sparsity[0], between_sparsity=args.sparsity[1])
    print(json.dumps(study.evaluate_run(args.run_dir, tto_steps=args.tto_steps, seed=args.seed), indent=2))


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
