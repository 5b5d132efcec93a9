"""Evaluate a layer-wise run and write RUN/eval.json.

Example:
    python scripts/evaluate.py --run-dir runs/fmnist
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from poecaps import cli
from poecaps.configs import EvaluationConfig


def main(argv=None):
    p = cli.parser(__doc__.splitlines()[0], EvaluationConfig)
    p.add_argument("--dataset", help="ignored: the run's own dataset is used")
    p.add_argument("--data-dir", help="ignored: the run's own data directory is used")
    args = p.parse_args(argv)
    from poecaps.evaluation import evaluate_run  # TensorFlow: after --help

    result = evaluate_run(args.run_dir, cli.config_from_args(EvaluationConfig, args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli.run_main(main)
