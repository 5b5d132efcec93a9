"""What holds EM routing back on mnist-5k: one variant per run, the learned routers' budget (docs/em_study.md).

Each variant trains a network with EM routing on the 4,000 training digits of
mnist-5k (batch 32, Adam 3e-3 decayed 0.96 per epoch, the given epochs,
seed 0) and records the training and test accuracy of every epoch.

    python docs/studies/em_study.py --variant matrix --epochs 5 --out runs/em_study

writes `OUT/<variant>.json`. `--list` prints the variants.
"""

import argparse
import json
import os
import time

import keras
import numpy as np

from poecaps import data
from poecaps.initializers import NearIdentity
from poecaps.models import MatrixCapsNet, RoutingCapsNet
from poecaps.models.routing_capsnet import layer_routers
from poecaps.trainers.supervised import SupervisedTrainer


def matrix(**changes):
    # The study's baseline is MatrixCapsNet as it was before the study: W ~ N(0, 0.5).
    changes = {"kernel_initializer": keras.initializers.RandomNormal(stddev=0.5), **changes}
    return lambda steps: MatrixCapsNet((28, 28, 1), 10, margin_steps=steps, chunk_capsules=None,
                                       **{"final_lambda": 1.0, "cost_normalization": "standardize", **changes})


def routing_net(**em):
    return lambda steps: RoutingCapsNet((28, 28, 1), 10, routing=layer_routers("em", 3, 0, **{
        "final_lambda": 1.0, "cost_normalization": "standardize", **em}), margin_steps=steps)


# name: (network builder of the total steps, shift in pixels, one line)
VARIANTS = {
    "matrix": (matrix(), 0, "hinton2018-small as it is (no BN, W ~ N(0, 0.5), standardised costs, lambda 1)"),
    "routingnet": (routing_net(), 2, "faria2019-em as it is (the Table 1 network)"),
    "matrix_bn": (matrix(batch_norm=True), 0, "matrix with batch norm after the ReLU convolution"),
    "matrix_w1": (matrix(kernel_initializer=keras.initializers.RandomNormal(stddev=1.0)), 0,
                  "matrix with W ~ N(0, 1) (the public code's randn)"),
    "matrix_identity": (matrix(kernel_initializer=NearIdentity(0.1)), 0,
                        "matrix with W = I + U(-0.1, 0.1) (the learned-routing network's start)"),
    "matrix_raw_costs": (matrix(cost_normalization="none", final_lambda=0.01), 0,
                         "matrix with the paper's raw costs (eq. 27) and inverse-temperature scale 0.01"),
}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", choices=sorted(VARIANTS))
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                                                      "mnist-5k"))
    p.add_argument("--out", default=os.path.join("runs", "em_study"))
    p.add_argument("--list", action="store_true")
    args = p.parse_args()
    if args.list or not args.variant:
        for name, (_, shift, line) in VARIANTS.items():
            print(f"{name}: {line} (shifts {shift})")
        return
    keras.utils.set_random_seed(args.seed)
    x, y, _ = data.load_arrays("mnist", "train", args.data_dir)
    xt, yt, _ = data.load_arrays("mnist", "test", args.data_dir)
    x, xt = data.to_float(x), data.to_float(xt)
    build, shift, line = VARIANTS[args.variant]
    batch, steps = 32, int(np.ceil(len(x) / 32))
    network = build(args.epochs * steps)
    trainer = SupervisedTrainer(network, max_shift=shift, seed=args.seed)
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, steps, 0.96)
    trainer.compile(optimizer=keras.optimizers.Adam(schedule), jit_compile=True)
    start = time.perf_counter()
    history = trainer.fit(x, y, batch_size=batch, epochs=args.epochs, validation_data=(xt, yt), verbose=2)
    result = {"variant": args.variant, "what": line, "epochs": args.epochs, "seed": args.seed,
              "seconds": time.perf_counter() - start,
              "train_accuracy": [float(a) for a in history.history["accuracy"]],
              "test_accuracy": [float(a) for a in history.history["val_accuracy"]]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.variant}.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
