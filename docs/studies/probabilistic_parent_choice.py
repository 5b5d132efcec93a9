"""How a trained probabilistic capsule model's parts choose their parents (docs/probabilistic_parent_choice.md).

Usage: python docs/studies/probabilistic_parent_choice.py RUN --seed S

Reads `RUN/models/capsules.keras` and the run's digits, and writes
`RUN/parent_choice.json`:

- `parent_choice`: `probabilistic_trials._parent_choice` on the 1,000
  upright test digits (its docstring: the bindings' peakedness, distinct
  parents per image, the parents' constancy over images and within
  classes, and the parts' term with the encoded presences, all on and the
  best single top capsule alone);
- `terms`: the mean over the test digits of each term of the bound at the
  encoders' output, one draw of the presences at seed `[S, 0]`;
- `top_presence_mean`, `prior_top_presence`: the encoder's top presence
  probabilities averaged over the test digits, and the learned `p_i`.
"""

import argparse
import os

import numpy as np
import tensorflow as tf
from probabilistic_trials import _parent_choice

from poecaps.experiments import probabilistic_capsules as study


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--seed", type=int, required=True, help="the seed of the bound's draw")
    args = p.parse_args()
    run, capsules, _, _, (x_test, y_test), _ = study.load_study(args.run_dir, args.seed)
    found = _parent_choice(capsules, x_test, y_test)
    terms = capsules.bound(tf.constant(x_test), seed=tf.constant([args.seed, 0]))
    logits = capsules.variational_parameters(tf.constant(x_test))["top_logits"]
    r = lambda a: np.round(np.asarray(a, "float64"), 4).tolist()
    result = {"run": os.path.basename(os.path.normpath(args.run_dir)), "seed": args.seed,
              "test_digits": len(x_test), "parent_choice": found,
              "terms": {k: float(tf.reduce_mean(v)) for k, v in terms.items()},
              "top_presence_mean": r(tf.reduce_mean(tf.sigmoid(logits), 0)),
              "prior_top_presence": r(tf.sigmoid(capsules.generative.top_logits))}
    print(f"parent choice: {found}", flush=True)
    print("terms: " + ", ".join(f"{k} {v:.2f}" for k, v in result["terms"].items()), flush=True)
    run.write_json("parent_choice.json", result)


if __name__ == "__main__":
    main()
