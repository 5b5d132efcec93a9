"""Train the products of expert capsules layer by layer (and the RBM baseline).

Example:
    python scripts/train_layerwise.py --dataset fashion_mnist --run-dir runs/fmnist
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from poecaps import cli
from poecaps.configs import STAGES, LayerwiseConfig


def main(argv=None):
    p = cli.parser(__doc__.splitlines()[0], LayerwiseConfig)
    p.add_argument("--stage", choices=STAGES, action="append",
                   help="train only this stage (repeatable); default: all, in order")
    args = p.parse_args(argv)
    from trainers.layerwise import train_layerwise  # TensorFlow: after --help

    train_layerwise(cli.config_from_args(LayerwiseConfig, args), args.run_dir,
                    stages=args.stage or STAGES, resume=args.resume)


if __name__ == "__main__":
    cli.run_main(main)
