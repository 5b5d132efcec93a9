"""Train and evaluate a supervised capsule baseline: CapsNet (dynamic routing) or matrix capsules (EM).

Example:
    python scripts/baseline.py --model capsnet --dataset mnist --data-dir ../shared/data/mnist-5k \
        --routing-iterations 2 --epochs 5 --run-dir runs/capsnet
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from poecaps import cli
from poecaps.configs import BaselineConfig, BaselineEvaluationConfig


def main(argv=None):
    p = cli.parser(__doc__.splitlines()[0], BaselineConfig)
    p.add_argument("--evaluate-only", action="store_true", help="skip training; evaluate --run-dir")
    p.add_argument("--test-limit", type=int, default=None, help="evaluate on this many test images")
    args = p.parse_args(argv)
    from poecaps.baseline_evaluation import evaluate_baseline  # TensorFlow: after --help
    from trainers.baselines import train_baseline

    if not args.evaluate_only:
        train_baseline(cli.config_from_args(BaselineConfig, args), args.run_dir, resume=args.resume)
    result = evaluate_baseline(args.run_dir, BaselineEvaluationConfig(seed=args.seed, test_limit=args.test_limit))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli.run_main(main)
