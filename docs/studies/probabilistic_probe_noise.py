"""How small a change of the top capsules' features does the probe table's probe survive?

Usage: python docs/studies/probabilistic_probe_noise.py RUN [--seed 0] [--draws 5]

Reads `RUN/models/capsules.keras` and the run's digits, and writes
`RUN/probe_noise.json`. The table's probes (`poecaps.metrics.linear_probe`
on the encoder's `t0` and `(t0, A0)` of all upright training digits) are
tested on the encoder's features of the 1,000 upright test digits plus
independent Gaussian noise of standard deviation `s` in the features' own
units, for each `s` of `SCALES` and `draws` draws. For scale: the features'
standard deviation over the upright test digits, and the mean absolute
change of each feature between a test digit upright and rotated by 45, 90
and 180 degrees (both averaged over the features of each set).
"""

import argparse
import os

import numpy as np

from poecaps import metrics, transforms
from poecaps.experiments import probabilistic_capsules as study

SCALES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)


def probe_with_features(train, y_train, test, y_test):
    """Accuracy of `linear_probe` for each feature set, as a dict."""
    return {n: metrics.linear_probe(train[n], y_train, test[n], y_test) for n in ("t0", "t0_A0")}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draws", type=int, default=5)
    args = p.parse_args()
    run, capsules, vae, (_, y_train), (x_test, y_test), table_train = study.load_study(args.run_dir, args.seed)
    encode = study._features(capsules, vae)
    features = lambda found: study.probe_features(found["t0"], found["A0"])
    upright = features(study._batched(encode, x_test))
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "seed": args.seed, "draws": args.draws,
              "test_digits": len(x_test), "clean": probe_with_features(table_train, y_train, upright, y_test),
              "feature_std": {n: float(v.std(0).mean()) for n, v in upright.items()},
              "rotation_change": {}, "noise": {}}
    for angle in (45, 90, 180):
        rotated = features(study._batched(encode, np.asarray(transforms.rotate(x_test, float(angle)))))
        result["rotation_change"][str(angle)] = {n: float(np.abs(rotated[n] - upright[n]).mean()) for n in upright}
    rng = np.random.default_rng(args.seed)
    for s in SCALES:
        runs = [probe_with_features(table_train, y_train,
                                    {n: v + rng.normal(0.0, s, v.shape) for n, v in upright.items()}, y_test)
                for _ in range(args.draws)]
        result["noise"][str(s)] = {n: float(np.mean([r[n] for r in runs])) for n in ("t0", "t0_A0")}
        print(f"[noise {s:g}] t0 {result['noise'][str(s)]['t0']:.3f}, (t0, A0) {result['noise'][str(s)]['t0_A0']:.3f}",
              flush=True)
    print(f"clean: {result['clean']}; feature std {result['feature_std']}; "
          f"rotation change {result['rotation_change']}", flush=True)
    run.write_json("probe_noise.json", result)
    print(f"wrote {run.file('probe_noise.json')}")


if __name__ == "__main__":
    main()
