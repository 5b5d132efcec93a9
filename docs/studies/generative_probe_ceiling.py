"""How much a linear probe reads from the primary capsules themselves: the ceiling of issue 32's probe criterion.

Usage: python docs/studies/generative_probe_ceiling.py RUN [--probe-train 1000] [--seed 0]

RUN is a trained CapsNet run (`scripts/baseline.py --preset sabour2017 --set
routing_iterations=0 ...`), the one whose frozen primary capsules the
generative capsule layer is trained on (docs/generative_capsules.md). With
the probe of that page (`poecaps.metrics.linear_probe`, trained on
`probe-train` training digits spread over the split, tested on the whole
test split), writes `RUN/probe_ceiling.json` with the probe's accuracy on:

- `children`: the flattened primary capsules (1,152 x 8 numbers), everything
  the inferred parents are computed from;
- `child_lengths`: the primary capsules' lengths;
- `random_projection_160`: a random Gaussian projection of the flattened
  capsules to 160 numbers (as many as 10 parents x 16), for each of three
  seeds.

The inferred parents are a function of the children, so a linear probe on
them that beats `children` would need the inference to make the digits more
linearly separable than all of the children are.
"""

import argparse
import json
import os

import numpy as np

from poecaps import metrics
from poecaps.experiments.generative_capsules import primary_capsules
from poecaps.experiments.runs import load_images, spread_indices
from poecaps.experiments.trained import load_capsnet


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--probe-train", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    run, config, model = load_capsnet(args.run_dir)
    train, train_labels, _ = load_images(config, "train")
    test, test_labels, _ = load_images(config, "test")
    few = spread_indices(len(train), args.probe_train)
    x_train = primary_capsules(model, train[few]).reshape(len(few), -1)
    x_test = primary_capsules(model, test).reshape(len(test), -1)
    probe = lambda a, b: metrics.linear_probe(a, train_labels[few], b, test_labels)
    lengths = lambda x: np.linalg.norm(x.reshape(len(x), -1, 8), axis=-1)
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "probe_train_images": len(few),
              "test_images": len(test), "seed": args.seed,
              "children": probe(x_train, x_test), "child_lengths": probe(lengths(x_train), lengths(x_test))}
    projections = []
    for k in range(3):
        w = np.random.default_rng(args.seed + k).normal(size=(x_train.shape[1], 160)) / np.sqrt(x_train.shape[1])
        projections.append(probe(x_train @ w, x_test @ w))
    result["random_projection_160"] = projections
    with open(run.file("probe_ceiling.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
