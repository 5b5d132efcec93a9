"""Linear probes on each part of a generative layer's inferred parents: poses, activations, both.

Usage: python docs/studies/generative_parent_probes.py RUN [--seed S]

RUN is a CapsNet run holding a trained generative layer
(`scripts/generative_capsules.py --run-dir RUN`, docs/generative_capsules.md).
The layer's inference returns, per digit, the parents' poses `v [J, D]`, the
posterior `r [I, J]` over parents of each of the I children, and the parents'
activations, the share of children each explains. With the run's own settings
(`RUN/generative/config.json`), the run's own compiled inversion
(`poecaps.experiments.generative_capsules.Inversion`) and the run's probe
(`poecaps.metrics.linear_probe`, `probe_train` training digits spread over the
split, the whole test split), for the learned layer and for the same layer
with its initial random G, this writes `RUN/generative/parent_probes.json`
with the probe's test accuracy on:

- `poses`: the flattened poses (J x D numbers), the run's own probe; the
  script checks that it equals `generative.json`'s `probe_accuracy`;
- `activations`: the J shares `sum_i r_ij / I`, every child counted alike;
- `poses_and_activations`: both;
- `length_weighted_shares`: `sum_i |u_i| r_ij / sum_i |u_i|`, the same
  posterior with each child weighted by its length (its presence), computed
  after the inference (which weighs the children as the run's `child_weights`
  says; with "lengths" these are the layer's own activations).

`--seed` seeds the random G's layer (and Keras' global generator); by default
the run's own seed, which rebuilds the run's initial layer, the reference
`generative.json` reports.
"""

import argparse
import json
import os

import keras
import numpy as np

from poecaps import metrics
from poecaps.experiments.generative_capsules import SETTINGS, Inversion, primary_capsules
from poecaps.experiments.runs import load_images, spread_indices
from poecaps.experiments.trained import load_capsnet, load_saved
from poecaps.models import GenerativeCapsules


def feature_sets(poses, coefficients, children):
    """The probe's feature sets of one layer's inferred parents (see the module docstring)."""
    lengths = np.linalg.norm(children, axis=-1)                                  # [N, I]
    shares = coefficients.mean(axis=1)                                           # [N, J]
    flat = poses.reshape(len(poses), -1)
    return {"poses": flat, "activations": shares, "poses_and_activations": np.hstack([flat, shares]),
            "length_weighted_shares": np.einsum("ni,nij->nj", lengths, coefficients) / lengths.sum(1)[:, None]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, help="the random G's seed (default: the run's)")
    args = p.parse_args()
    run, config, model = load_capsnet(args.run_dir)
    settings = run.read_json(SETTINGS)["settings"]
    seed = settings["seed"] if args.seed is None else args.seed
    with open(run.file(os.path.join("generative", "generative.json"))) as handle:
        reported = json.load(handle)["probe_accuracy"]
    train, train_labels, _ = load_images(config, "train")
    test, test_labels, _ = load_images(config, "test")
    keras.utils.set_random_seed(seed)
    x_train, x_test = primary_capsules(model, train), primary_capsules(model, test)
    few = spread_indices(len(x_train), settings["probe_train"])
    lengths = np.linalg.norm(x_train, axis=-1)
    # the run's initial layer, as `train_generative` builds it: its G stays random
    initial = GenerativeCapsules(settings["parents"], settings["parent_dim"], x_train.shape[-1], kappa=5.0,
                                 sigma=float(lengths.std()), seed=seed, name="generative_capsules")
    initial.build(x_train.shape)
    learned = load_saved(args.run_dir, "generative").layers[-1]
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "seed": seed, "probe_train_images": len(few),
              "test_images": len(x_test), "reported_probe_accuracy": reported}
    for name, layer in (("learned", learned), ("random_g", initial)):
        # every child alike in runs from before the setting
        inversion = Inversion(layer, settings["batch_size"], settings["iterations"],
                               settings.get("child_weights", "uniform"))
        train_sets = feature_sets(*inversion.outputs(x_train[few])[:2], x_train[few])
        test_sets = feature_sets(*inversion.outputs(x_test)[:2], x_test)
        result[name] = {key: metrics.linear_probe(train_sets[key], train_labels[few], test_sets[key], test_labels)
                        for key in train_sets}
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" for k, v in result[name].items()), flush=True)
    # the random G's figure is the run's only when its seed is the run's
    result["poses_equal_reported"] = all(result[k]["poses"] == reported[k] for k in ("learned", "random_g"))
    with open(run.file(os.path.join("generative", "parent_probes.json")), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
