"""Which block of `(t0, A0)` costs its probe on turned digits: the presences' change or the poses'?

Usage: python docs/studies/probabilistic_probe_blocks.py RUN --seed S

Reads `RUN/models/capsules.keras` and the run's digits, and writes
`RUN/probe_blocks.json`. The probe table's `(t0, A0)` probe
(`poecaps.metrics.linear_probe` on the encoder's `t0` and `A0` of every
upright training digit) is tested on the 1,000 test digits under each
condition (45, 90, 180 degrees, the affine stand-in) with four inputs:

- `both`: the turned digit's `t0` and `A0` (the table's figure);
- `poses_held`: the turned digit's `t0`, the upright digit's `A0`;
- `presences_held`: the upright digit's `t0`, the turned digit's `A0`;
- and, beside them, the `t0` probe on the turned digit's `t0` (the
  table's figure).

The probe is linear, so each held input removes exactly one block's
change from its logits. `--seed` must be the run's evaluation seed: it
draws the affine stand-in's transforms, and the recomputed table figures
are checked against the run's `eval.json`.
"""

import argparse
import os

import keras
import numpy as np

from poecaps import metrics, transforms
from poecaps.experiments import probabilistic_capsules as study


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, required=True, help="the run's evaluation seed (the affine transforms)")
    args = p.parse_args()
    run, capsules, vae, (_, y_train), (x_test, y_test), table_train = study.load_study(args.run_dir, args.seed)
    encode = study._features(capsules, vae)
    upright = study._batched(encode, x_test)
    conditions = {str(a): np.asarray(transforms.rotate(x_test, float(a))) for a in (45, 90, 180)}
    conditions["affine"] = np.asarray(transforms.random_affine(x_test, seed=keras.random.SeedGenerator(args.seed),
                                                               **study.AFFINE))
    table = run.read_json("eval.json")["probe_accuracy"]
    probe = lambda name, t0, a0: metrics.linear_probe(table_train[name], y_train,
                                                      study.probe_features(t0, a0)[name], y_test)
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "seed": args.seed,
              "test_digits": len(x_test), "conditions": {}}
    for name, images in conditions.items():
        turned = study._batched(encode, images)
        found = {"t0": probe("t0", turned["t0"], turned["A0"]),
                 "both": probe("t0_A0", turned["t0"], turned["A0"]),
                 "poses_held": probe("t0_A0", turned["t0"], upright["A0"]),
                 "presences_held": probe("t0_A0", upright["t0"], turned["A0"])}
        found["matches_eval_json"] = (found["t0"] == table["t0"][name] and found["both"] == table["t0_A0"][name])
        result["conditions"][name] = found
        print(f"[{name}] t0 {found['t0']:.3f}; (t0, A0): both turned {found['both']:.3f}, poses held "
              f"{found['poses_held']:.3f}, presences held {found['presences_held']:.3f}; table figures reproduced: "
              f"{found['matches_eval_json']}", flush=True)
    run.write_json("probe_blocks.json", result)
    print(f"wrote {run.file('probe_blocks.json')}")


if __name__ == "__main__":
    main()
