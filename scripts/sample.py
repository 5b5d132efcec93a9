"""Sample images from capsule space: RUN/samples.png and RUN/samples.npz (Hauser Figure 2).

Example:
    python scripts/sample.py --run-dir runs/fmnist --rows 4 --restricted
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from poecaps import cli


def main(argv=None):
    p = cli.parser(__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rows", type=int, default=4, help="draws per capsule")
    p.add_argument("--restricted", nargs="?", const="mean", choices=["mean", "winning"],
                   help="draw from the half-sphere that training data visited: the side of each "
                        "capsule's mean training direction ('mean', the default), or the side of its "
                        "principal axis that most of its winning training poses lie on ('winning')")
    p.add_argument("--fitted", nargs="?", const="all", choices=["all", "longest"],
                   help="draw each capsule from N(0, M_j), the second moment of its own training poses "
                        "('all', the default), or of its poses on the training images where it is the "
                        "longest ('longest'), instead of the paper's N(0, I)")
    p.add_argument("--dataset", help="ignored: the run's own dataset is used")
    p.add_argument("--data-dir", help="ignored: the run's own data directory is used")
    args = p.parse_args(argv)
    # TensorFlow only once the flags are parsed: --help answers at once.
    import numpy as np

    from poecaps import figures
    from poecaps.runs import CapsulePipeline, RunDir
    from samplers import CapsuleSampler

    run = RunDir(args.run_dir)
    pipeline = CapsulePipeline.load(run.models, run.read_json("config.json", {}).get("capsule_dim", 8))
    if pipeline.decoder is None:
        sys.exit(f"{args.run_dir} has no trained decoder; run scripts/train_layerwise.py first.")
    moments = None
    if args.fitted:
        name = {"all": "pose_moments", "longest": "longest_pose_moments"}[args.fitted]
        moments = getattr(pipeline, name)
        if moments is None:
            sys.exit(f"{args.run_dir} has no pose moments (models/{name}.npy); train the decoder "
                     "stage again or run scripts/evaluate.py, which stores them.")
    result = CapsuleSampler(pipeline, seed=args.seed).sample(
        args.rows, restricted=bool(args.restricted), moments=moments, half=args.restricted or "mean")
    np.savez(run.file("samples.npz"), images=result["images"], draws=result["draws"])
    fitted = {None: "", "all": "fitted_", "longest": "fitted_longest_"}[args.fitted]
    domain = fitted + {None: "full", "mean": "restricted", "winning": "winning_side"}[args.restricted]
    for name in ("samples.png", f"samples_{domain}.png"):
        figures.image_grid(result["images"], run.file(name),
                           title=f"Samples from capsule space ({domain.replace('_', ' ')} domain): one column per capsule",
                           column_labels=range(result["images"].shape[1]))
    print(f"wrote {run.file('samples.png')} and {run.file('samples.npz')} "
          f"(images {result['images'].shape})")


if __name__ == "__main__":
    cli.run_main(main)
