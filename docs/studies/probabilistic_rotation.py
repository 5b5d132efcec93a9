"""What rotation does to the probe features of a trained probabilistic capsule run: shifted, blurred or relabelled.

Usage: python docs/studies/probabilistic_rotation.py RUN

Reads `RUN/models/capsules.keras` and the run's digits, and writes
`RUN/rotation_study.json`. For `t0` (the top presences) and `A0` (the top
poses), on the training digits and on the test digits rotated by 0, 45, 90
and 180 degrees:

- `class_separation`: the standard deviation over the ten classes of each
  feature's class mean, divided by the feature's standard deviation over
  all digits, averaged over features (0: the feature says nothing of the
  class);
- `shift`: the mean absolute z-score of the rotated test features under
  the training digits' mean and standard deviation (about 0.8 for features
  drawn like the training ones);
- `nearest_own_class_mean`: the share of test digits whose features, both
  standardised by the training statistics, lie nearer (Euclidean) to their
  own class's mean on the upright training digits than to any other
  class's mean;
- `nearest_class_mean_of_rotated`: the same, with the class means taken on
  the test digits rotated alike (labels used: a reading of how separable
  the rotated features are, not a classifier trained without them);
- `probe_A0`: `poecaps.metrics.linear_probe` on `A0` alone, trained on the
  upright training digits.

A representation that rotation only blurs keeps `nearest_own_class_mean`
near `nearest_class_mean_of_rotated`; one whose classes rotation relabels
keeps the second high while the first falls.

Nothing here is drawn at random (the encoders' features, fixed rotations,
a probe fitted from zero weights), so the script takes no `--seed`.
"""

import argparse
import json
import os

import numpy as np

from poecaps import metrics, transforms
from poecaps.experiments import probabilistic_capsules as study

ANGLES = (0, 45, 90, 180)


def class_means(features, labels):
    return np.stack([features[labels == k].mean(0) for k in range(10)])


def nearest_mean_share(features, labels, means):
    distances = np.linalg.norm(features[:, None] - means[None], axis=-1)
    return float(np.mean(np.argmin(distances, axis=1) == labels))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    args = p.parse_args()
    run, settings, capsules, vae = study.load_trained(args.run_dir)
    x_train, y_train = study.load_digits(settings["data_dir"], "train", settings["canvas"])
    x_test, y_test = study.load_digits(settings["data_dir"], "test", settings["canvas"])
    features = study._features(capsules, vae)
    train = study._batched(features, x_train)
    r = lambda v: round(float(v), 4)
    result = {"run": args.run_dir, "train_images": len(y_train), "test_images": len(y_test), "angles": {}}
    for name in ("t0", "A0"):
        f = train[name]
        result[f"{name}_train_class_separation"] = r((class_means(f, y_train).std(0) / f.std(0)).mean())
    for angle in ANGLES:
        test = study._batched(features, np.asarray(transforms.rotate(x_test, float(angle))))
        row = {}
        for name in ("t0", "A0"):
            mean, std = train[name].mean(0), train[name].std(0) + 1e-12
            z_train, z_test = (train[name] - mean) / std, (test[name] - mean) / std
            row[name] = {
                "class_separation": r((class_means(test[name], y_test).std(0) / test[name].std(0)).mean()),
                "shift": r(np.abs(z_test).mean()),
                "nearest_own_class_mean": r(nearest_mean_share(z_test, y_test, class_means(z_train, y_train))),
                "nearest_class_mean_of_rotated": r(nearest_mean_share(z_test, y_test, class_means(z_test, y_test))),
            }
        row["probe_A0"] = r(metrics.linear_probe(train["A0"], y_train, test["A0"], y_test))
        result["angles"][str(angle)] = row
        print(f"[rotation] {angle}: {json.dumps(row)}", flush=True)
    with open(os.path.join(run.path, "rotation_study.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
