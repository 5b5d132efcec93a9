"""Which loss lets the learned routers train in the Table 1 network: one (router, loss) per run (docs/routing_table.md).

The routing table's budget (batch 32, Adam 3e-3 decayed 0.96 per epoch,
shifts of up to 2 pixels, the given epochs, seed 0) on 3,000 of mnist-5k's
training digits; validated on the other 1,000 (every fourth digit, so every
class), never on the test split. Records the training and validation
accuracy and the loss of every epoch.

    python docs/studies/learned_routing_loss.py --routing similarity --loss scaled_cross_entropy \
        --epochs 5 --out runs/learned_routing_loss

writes `OUT/<routing>-<loss>.json`.
"""

import argparse
import json
import os
import time

import keras
import numpy as np

from poecaps import data
from poecaps.models import RoutingCapsNet
from poecaps.models.routing_capsnet import LOSSES
from poecaps.trainers.supervised import SupervisedTrainer


def split(count):
    """`(train, validation)` indices: every fourth digit validates (mnist-5k is ordered by class)."""
    validation = np.arange(0, count, 4)
    return np.setdiff1d(np.arange(count), validation), validation


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routing", choices=("similarity", "connectionist"), required=True)
    p.add_argument("--loss", choices=LOSSES, required=True)
    p.add_argument("--logit-scale", type=float, default=1.0, help="initial scale of scaled_cross_entropy")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data",
                                                      "mnist-5k"))
    p.add_argument("--out", default=os.path.join("runs", "learned_routing_loss"))
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    images, labels, _ = data.load_arrays("mnist", "train", args.data_dir)
    images = data.to_float(images)
    train, validation = split(len(images))
    batch, steps = 32, int(np.ceil(len(train) / 32))
    network = RoutingCapsNet((28, 28, 1), 10, routing=args.routing, loss=args.loss, logit_scale=args.logit_scale,
                             margin_steps=args.epochs * steps,
                             seed=args.seed)
    trainer = SupervisedTrainer(network, max_shift=2, seed=args.seed)
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-3, steps, 0.96)
    trainer.compile(optimizer=keras.optimizers.Adam(schedule), jit_compile=True)
    start = time.perf_counter()
    history = trainer.fit(images[train], labels[train], batch_size=batch, epochs=args.epochs,
                          validation_data=(images[validation], labels[validation]), verbose=2)
    result = {"routing": args.routing, "loss": args.loss, "logit_scale_start": args.logit_scale, "epochs": args.epochs, "seed": args.seed,
              "train_images": len(train), "validation_images": len(validation),
              "seconds": time.perf_counter() - start, **{k: [float(v) for v in vs] for k, vs in history.history.items()}}
    os.makedirs(args.out, exist_ok=True)
    suffix = "" if args.logit_scale == 1.0 else f"-start{args.logit_scale:g}"
    with open(os.path.join(args.out, f"{args.routing}-{args.loss}{suffix}.json"), "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
