"""Does test-time optimisation keep the class in the top capsules? Probes on refined features of a trained run.

Usage: python docs/studies/probabilistic_refined_probe.py RUN [--every-train 4] [--every-test 4] [--steps 200]

Reads `RUN/models/capsules.keras` and the run's digits, and writes
`RUN/refined_probe.json`. Every `every-train`-th training digit and every
`every-test`-th test digit (upright, rotated by 45, 90 and 180 degrees, and
under the affine stand-in drawn on all test digits as the probe table
draws it) are refined by `ProbabilisticCapsuleAutoencoder.refine` (`steps`
Adam steps, learning rate 0.01, the run's evaluation settings) from the
encoder's output. For `t0` (top presence probabilities) and `(t0, A0)`
(with the top poses), three linear probes (`poecaps.metrics.linear_probe`):

- `table_probe_on_refined`: trained on the encoder's features of all
  upright training digits (the probe table's probe), tested on the refined
  test features: what classifying after refining does to the table;
- `amortised`: the same probe tested on the encoder's features of the same
  test digits (the table's reading on this subset);
- `refined_probe_on_refined`: trained on the refined features of the
  chosen upright training digits, tested on the refined test features:
  whether refined features carry the class on their own;
- `amortised_probe_same_digits`: trained on the encoder's features of the
  same chosen training digits, tested on the encoder's test features (the
  control for the smaller training set).

Also per condition: the mean bound (8 draws) before and after refining, and
the top presences' standard deviation over images, averaged over capsules,
before and after.
"""

import argparse
import os

import keras
import numpy as np
import tensorflow as tf

from poecaps import metrics, transforms
from poecaps.experiments import probabilistic_capsules as study

CONDITIONS = ("0", "45", "90", "180", "affine")
CHUNK = 250


def encode_and_refine(capsules, images, steps, seed):
    """Encoder's and refined parameters of `images` (in chunks), and the mean bound of each."""
    before, after, bounds = [], [], []
    for s in range(0, len(images), CHUNK):
        x = tf.constant(images[s:s + CHUNK])
        start = capsules.variational_parameters(x)
        found = capsules.refine(x, steps, 0.01, start, seed=seed)
        bounds.append(np.stack([capsules.mean_bound(x, p, draws=8, seed=seed + 1).numpy() for p in (start, found)], -1))
        before.append({k: v.numpy() for k, v in start.items()})
        after.append({k: v.numpy() for k, v in found.items()})
        print(f"  refined {min(s + CHUNK, len(images))} / {len(images)}", flush=True)
    join = lambda parts: {k: tf.constant(np.concatenate([p[k] for p in parts])) for k in parts[0]}
    return join(before), join(after), np.concatenate(bounds)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--every-train", type=int, default=4)
    p.add_argument("--every-test", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    run, capsules, _, (x_train, y_train), (x_test, y_test), table_train = study.load_study(args.run_dir, args.seed)

    chosen = np.arange(0, len(x_train), args.every_train)
    print(f"training digits: {len(chosen)}", flush=True)
    train_before, train_after, train_bounds = encode_and_refine(capsules, x_train[chosen], args.steps, args.seed)
    small_amortised, small_refined = study.parameter_features(train_before), study.parameter_features(train_after)

    tests = {f"{a}": np.asarray(transforms.rotate(x_test, float(a))) for a in (0, 45, 90, 180)}
    tests["affine"] = np.asarray(transforms.random_affine(x_test, seed=keras.random.SeedGenerator(args.seed),
                                                          **study.AFFINE))
    pick = np.arange(0, len(x_test), args.every_test)
    labels = y_test[pick]
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "steps": args.steps, "seed": args.seed,
              "train_digits_refined": len(chosen), "test_digits": len(pick),
              "train_bound_before": float(train_bounds[:, 0].mean()),
              "train_bound_after": float(train_bounds[:, 1].mean()), "conditions": {}}
    for condition in CONDITIONS:
        print(f"condition {condition}", flush=True)
        before, after, bounds = encode_and_refine(capsules, tests[condition][pick], args.steps, args.seed)
        amortised, refined = study.parameter_features(before), study.parameter_features(after)
        probe = lambda tr, ty, te: {n: metrics.linear_probe(tr[n], ty, te[n], labels) for n in ("t0", "t0_A0")}
        row = {
            "amortised": probe(table_train, y_train, amortised),
            "table_probe_on_refined": probe(table_train, y_train, refined),
            "amortised_probe_same_digits": probe(small_amortised, y_train[chosen], amortised),
            "refined_probe_on_refined": probe(small_refined, y_train[chosen], refined),
            "bound_before": float(bounds[:, 0].mean()), "bound_after": float(bounds[:, 1].mean()),
            "top_presence_std_before": float(amortised["t0"].std(0).mean()),
            "top_presence_std_after": float(refined["t0"].std(0).mean()),
        }
        result["conditions"][condition] = row
        print(f"[{condition}] " + "; ".join(f"{k}: t0 {v['t0']:.3f}, t0_A0 {v['t0_A0']:.3f}"
                                            for k, v in row.items() if isinstance(v, dict))
              + f"; bound {row['bound_before']:.1f} -> {row['bound_after']:.1f}; presence spread "
              f"{row['top_presence_std_before']:.4f} -> {row['top_presence_std_after']:.4f}", flush=True)
    run.write_json("refined_probe.json", result)
    print(f"wrote {run.file('refined_probe.json')}")


if __name__ == "__main__":
    main()
