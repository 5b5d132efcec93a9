"""What the top capsules of a trained probabilistic capsule run carry: per-image spread of every latent.

Usage: python docs/studies/probabilistic_diagnosis.py RUN [--every 4] [--untrained [--seed S]]

Reads `RUN/models/capsules.keras` and the run's test digits (every
`every`-th), and writes `RUN/diagnosis.json`: for the top and the part
capsules, the mean and the standard deviation over images of the encoder's
presence probabilities and poses; each part's size (the mean of
`sqrt|det P_j|`, the share of the canvas's side its template spans) and the
standard deviation of its six pose entries over images, averaged; the learned prior
presences `p_i`; the posterior share of the parts each parent explains
(index 0 the dummy); the mean pose spread `c_ij`; and the top presences
averaged over each class. A top layer that says nothing about the image
has standard deviations near 0 and the same row for every class.

`--untrained` measures instead a model built as the run's was, before
training (the code's current architecture, seeded by `--seed`, by default
the run's seed), and writes `RUN/diagnosis_untrained.json`. The trained
model's figures draw nothing at random.
"""

import argparse
import json
import os

import numpy as np
import tensorflow as tf

from poecaps.experiments import probabilistic_capsules as study


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--untrained", action="store_true")
    p.add_argument("--seed", type=int, help="the untrained model's seed (default: the run's)")
    args = p.parse_args()
    if args.seed is not None and not args.untrained:
        p.error("--seed seeds the untrained model: it needs --untrained")
    run, settings, capsules, _ = study.load_trained(args.run_dir)
    if args.untrained:
        capsules = study.build_capsules(settings["canvas"], settings["seed"] if args.seed is None else args.seed)
    x, y = study.load_digits(settings["data_dir"], "test", settings["canvas"])
    x, y = tf.constant(x[::args.every]), y[::args.every]
    found = capsules.variational_parameters(x)
    top, parts = tf.sigmoid(found["top_logits"]).numpy(), tf.sigmoid(found["part_logits"]).numpy()
    top_pose, part_pose = found["top_pose"].numpy(), found["part_pose"].numpy()
    g = capsules.generative
    routed = g.route(tf.constant(top), found["top_pose"], tf.constant(parts), found["part_pose"]).coefficients.numpy()
    r = lambda a: np.round(np.asarray(a, "float64"), 4).tolist()
    result = {
        "images": len(y),
        "top_presence_mean": r(top.mean(0)), "top_presence_std_over_images": r(top.std(0)),
        "top_pose_std_over_images_mean": float(top_pose.std(0).mean()),
        "part_presence_mean": r(parts.mean(0)), "part_presence_std_over_images": r(parts.std(0)),
        "part_pose_std_over_images_per_entry": r(part_pose.std(0).mean(0)),
        "part_size_per_part": r(np.sqrt(np.abs((1.0 + part_pose[..., 0]) * (1.0 + part_pose[..., 4])
                                               - part_pose[..., 1] * part_pose[..., 3])).mean(0)),
        "part_pose_std_over_images_per_part": r(part_pose.std(0).mean(-1)),
        "prior_top_presence": r(tf.sigmoid(g.top_logits).numpy()),
        "posterior_share_per_parent": r(routed.mean((0, 1))),
        "pose_spread_mean": float(g.spreads().numpy().mean()),
        "top_presence_by_class": {str(k): r(top[y == k].mean(0)) for k in range(10)},
    }
    name = "diagnosis_untrained.json" if args.untrained else "diagnosis.json"
    with open(os.path.join(run.path, name), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
