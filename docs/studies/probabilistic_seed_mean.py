"""The probe table of several seeds of the probabilistic capsule run: each seed's figures and their mean.

Usage: python docs/studies/probabilistic_seed_mean.py EVAL.json [EVAL.json ...] [--logits]

Reads each run's `eval.json` (`scripts/probabilistic_capsules.py`) and
prints, per feature set and test condition, every seed's probe accuracy
and their mean (and, for several seeds, their standard deviation,
`ddof=1`; the "up to" rows too), then the issue's probe criteria on the mean: `t0` at
least 0.80 at 0 degrees, `(t0, A0)` at least `t0` at 0, 45, 90 and 180
degrees and on the affine stand-in, and `(t0, A0)` beating the VAE there
by at least 0.10. Each seed's own outcome of the second criterion is
printed beside it. `--logits` reads `t0` as the presences' logits (the
table's `t0_logits` and `t0_logits_A0` rows) instead of their
probabilities.

Runs evaluated with the "up to" conditions (each digit turned by its own
angle uniform in +-45 ... 180 degrees; `docs/probabilistic_rotation_range.md`)
also print those rows and `(t0, A0) - t0` there, labelled as a reading
of the paper and not the issue's criterion.

It only reads and averages figures already computed, so it takes no `--seed`.
"""

import argparse
import json

import numpy as np

CONDITIONS = ("0", "45", "90", "135", "180", "affine")
CHECKED = ("0", "45", "90", "180", "affine")
UP_TO = ("up_to_45", "up_to_90", "up_to_135", "up_to_180")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("evals", nargs="+")
    p.add_argument("--logits", action="store_true", help="read t0 as the presences' logits")
    args = p.parse_args()
    rows = {"t0": "t0_logits", "t0_A0": "t0_logits_A0", "vae": "vae"} if args.logits else \
        {"t0": "t0", "t0_A0": "t0_A0", "vae": "vae"}
    runs = []
    for path in args.evals:
        with open(path) as handle:
            runs.append(json.load(handle))
    seeds = [r["seed"] for r in runs]
    print("seeds:", seeds)
    mean = {}
    for features, row in rows.items():
        values = np.array([[r["probe_accuracy"][row][c] for c in CONDITIONS] for r in runs])
        mean[features] = dict(zip(CONDITIONS, values.mean(0)))
        cells = [" / ".join(f"{v:.3f}" for v in column) + f" (mean {m:.3f})"
                 for column, m in zip(values.T, values.mean(0))]
        print(f"{row}: " + "; ".join(f"{c} {cell}" for c, cell in zip(CONDITIONS, cells)))
        if len(runs) > 1:
            spread = values.std(0, ddof=1)
            print(f"{row} standard deviation over seeds: " + "; ".join(f"{c} {s:.3f}" for c, s in
                                                                        zip(CONDITIONS, spread)))
    print(f"mean t0 at 0 degrees: {mean['t0']['0']:.3f} ->", "met" if mean["t0"]["0"] >= 0.80 else "not met")
    for r in runs:
        found = r["probe_accuracy"]
        short = [c for c in CHECKED if found[rows["t0_A0"]][c] < found[rows["t0"]][c]]
        print(f"seed {r['seed']}: (t0, A0) below t0 at {', '.join(short) if short else 'none'}")
    gaps = {c: mean["t0_A0"][c] - mean["t0"][c] for c in CHECKED}
    print("mean (t0, A0) - t0: " + ", ".join(f"{c} {g:+.3f}" for c, g in gaps.items()),
          "->", "met" if min(gaps.values()) >= 0 else "not met")
    lead = mean["t0_A0"]["affine"] - mean["vae"]["affine"]
    print(f"mean (t0, A0) - VAE on the affine stand-in: {lead:+.3f} ->", "met" if lead >= 0.10 else "not met")
    if all(c in r["probe_accuracy"]["t0"] for r in runs for c in UP_TO):
        up_to = {}
        for features, row in rows.items():
            values = np.array([[r["probe_accuracy"][row][c] for c in UP_TO] for r in runs])
            up_to[features] = values.mean(0)
            print(f"{row}, turned by up to: " + "; ".join(
                f"{c[6:]} " + " / ".join(f"{v:.3f}" for v in column) + f" (mean {m:.3f})"
                for c, column, m in zip(UP_TO, values.T, values.mean(0))))
            if len(runs) > 1:
                print(f"{row}, turned by up to, standard deviation over seeds: " + "; ".join(
                    f"{c[6:]} {s:.3f}" for c, s in zip(UP_TO, values.std(0, ddof=1))))
        print("mean (t0, A0) - t0, turned by up to (the paper's likely reading, not the issue's criterion): " +
              ", ".join(f"{c[6:]} {g:+.3f}" for c, g in zip(UP_TO, up_to["t0_A0"] - up_to["t0"])))


if __name__ == "__main__":
    main()
