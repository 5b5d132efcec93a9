"""A small CD run with step checkpoints, for the kill-and-resume test (run as a subprocess).

Usage: python tests/workers/resume_run.py RUN_DIR MODEL [--resume] [--sleep S]
Writes RUN_DIR/final.npz (the energy model's weights) when training ends.
"""

import argparse
import os
import time

import keras
import numpy as np

from poecaps.capsules import squash
from poecaps.experts import CapsuleExperts
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from poecaps.trainers.cd import CDTrainer, default_optimizer
from poecaps.trainers.resumable import fit_resumable


class Slow(keras.callbacks.Callback):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("model", choices=("rbm", "capsules"))
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sleep", type=float, default=0.0)
    args = p.parse_args()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if args.model == "rbm":
        x = (rng.uniform(size=(96, 20)) < 0.3).astype("float32")
        model = BernoulliRBM(6, seed=1)
        model.build((None, 20))
        trainer = CDTrainer(model, steps=2, seed=2)
    else:
        x = np.asarray(squash(rng.normal(size=(96, 10, 4)))).astype("float32")
        model = CapsuleExperts(3, 5, routing=DynamicRouting(2, "cosine"),
                               kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=0))
        model.build((None, 10, 4))
        trainer = CDTrainer(model, seed=2)
    trainer.compile(optimizer=default_optimizer(0.05, 12, 0.9, 0.9))
    fit_resumable(trainer, x, epochs=4, batch_size=8, seed=0,
                  checkpoint_dir=os.path.join(args.run_dir, "checkpoints"), resume=args.resume,
                  save_every=3, callbacks=[Slow(args.sleep)], verbose=0)
    np.savez(os.path.join(args.run_dir, "final.npz"), *model.get_weights())


if __name__ == "__main__":
    main()
