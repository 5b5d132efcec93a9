"""Train each trainer a few steps on one device and under each strategy; print weight differences as JSON.

Run as a subprocess: it splits the CPU into 2 logical devices before TensorFlow starts. Each trainer
is trained once on one device, the reference of every strategy named; a strategy named as
`kind=name,name` trains only the trainers named (the caller, tests/test_distribute.py, says which).
Usage: python tests/workers/distribute_run.py [mirrored[=cd,rbm,...]] [multiworker[=...]]   (default: both, all)
"""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras
import numpy as np

from poecaps.capsules import squash
from poecaps.experts import CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.models import (
    CapsNet,
    GenerativeCapsules,
    MatrixCapsNet,
    ProbabilisticCapsuleAutoencoder,
    ProbabilisticCapsules,
    RoutingCapsNet,
    VariationalAutoencoder,
)
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from poecaps.trainers.autoencoder import AutoencoderTrainer
from poecaps.trainers.cd import CDTrainer, default_optimizer
from poecaps.trainers.generative import GenerativeCapsuleTrainer
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.supervised import SupervisedTrainer
from poecaps.trainers.variational import VariationalTrainer

rng = np.random.default_rng(0)
# (epochs, global batch): 8 steps of 8, except EM: one step of 32, and the capsule model: 4 steps
# of 16. EM's steep sigmoids (final_lambda = 20 times standardised costs, the steepest setting)
# amplify rounding differences of the replica sum over steps; one step shows the sum is right.
# The capsule model's 8 steps of 8 amplify them to 2e-3 of its movement; 4 of 16, to 1e-4. Every trainer uses plain SGD
# with momentum: Adam divides each gradient by its own magnitude, which turns rounding
# differences of near-zero gradients into differences of a whole step.
SCHEDULE = {"em": (1, 32), "capsules": (2, 16)}
CAPSULES = np.asarray(squash(rng.normal(size=(32, 10, 4)))).astype("float32")
IMAGES = rng.uniform(size=(32, 16, 16, 1)).astype("float32")
LABELS = rng.integers(0, 3, size=32)
IMAGES28 = rng.uniform(size=(32, 28, 28, 1)).astype("float32")


def cd():
    model = CapsuleExperts(3, 5, routing=DynamicRouting(2, "cosine"),
                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=0))
    trainer = CDTrainer(model, seed=1)
    trainer.compile(optimizer=default_optimizer(0.1, 4, 0.9, 0.9))
    return trainer, CAPSULES, None, lambda t: t.energy_model.get_weights()


def autoencoder():
    trainer = AutoencoderTrainer(ConvAutoencoder(4, 5, 2, dropout=0.2, seed=0))
    trainer.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
    return trainer, IMAGES, None, lambda t: t.autoencoder.get_weights()


def rbm():
    model = BernoulliRBM(6, seed=0)
    trainer = CDTrainer(model, seed=1)
    trainer.compile(optimizer=default_optimizer(0.1, 4, 0.9, 0.9))
    return trainer, (IMAGES.reshape(32, -1)[:, :20] > 0.5).astype("float32"), None, \
        lambda t: t.energy_model.get_weights()


def capsnet():
    network = CapsNet((16, 16, 1), 3, routing_iterations=3, conv_filters=8, primary_types=2,
                      primary_dim=4, class_dim=4, kernel_size=5, seed=0)
    trainer = SupervisedTrainer(network, max_shift=2, seed=0)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
    return trainer, IMAGES, LABELS, lambda t: t.network.get_weights()


def em():
    network = MatrixCapsNet((28, 28, 1), 3, routing_iterations=2, a=4, b=2, c=2, d=2, final_lambda=20.0)
    trainer = SupervisedTrainer(network, seed=0)
    trainer.compile(optimizer=keras.optimizers.SGD(0.5, momentum=0.9))
    return trainer, IMAGES28, LABELS, lambda t: t.network.get_weights()


def routingnet():
    # Faria's network: batch normalisation after its first convolution, which must see the global batch
    network = RoutingCapsNet((28, 28, 1), 3, routing="dynamic", filters=8, primary_types=2, conv_types=2, seed=0)
    trainer = SupervisedTrainer(network, seed=0)
    trainer.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return trainer, IMAGES28, LABELS, lambda t: t.network.get_weights()


def generative():
    # Generalised EM: each replica infers its children's parents, the M-step's gradient is the global batch's
    teacher = GenerativeCapsules(3, 4, 5, seed=1, kappa=20.0, sigma=0.2)
    teacher.build((None, 12, 5))
    parents = np.random.default_rng(1).normal(size=(32, 3, 4)).astype("float32")     # the same at every call
    children = teacher.generate(parents, seed=[3, 4])[0].numpy()
    layer = GenerativeCapsules(3, 4, 5, seed=2, kappa=20.0, sigma=0.2)
    layer.build((None, 12, 5))
    trainer = GenerativeCapsuleTrainer(layer, iterations=3)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return trainer, children, None, lambda t: t.layer.get_weights()


def vae():
    # Reparameterised draws: each replica's latents must be one device's for its rows of the global batch
    trainer = VariationalTrainer(VariationalAutoencoder(image_size=(16, 16), latent=3, hidden=16, seed=0), seed=1)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return trainer, IMAGES, None, lambda t: t.model.get_weights()


def capsules():
    # Relaxed presence draws, and the top encoder's batch normalisation over the global batch. Not compared: the
    # attention key biases, which move by rounding alone (a bias every key shares leaves the softmax over the
    # keys as it was, so their gradient is zero: they move by 1e-10 where every other weight moves by 1e-3).
    model = ProbabilisticCapsuleAutoencoder(
        ProbabilisticCapsules(image_size=(16, 16), num_top=3, num_parts=4, template_size=5, seed=1),
        channels=8, hidden=16, encoding=8, blocks=1, inducing=4, heads=2, seed=2)
    trainer = VariationalTrainer(model, seed=1)
    trainer.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    return trainer, IMAGES, None, lambda t: [v for v in t.model.weights if not v.path.endswith("key/bias")]


def train(make, strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        trainer, x, y, weights = make()
        epochs, batch = SCHEDULE.get(make.__name__, (2, 8))
        fit_resumable(trainer, x, y, epochs=epochs, batch_size=batch, seed=0, verbose=0)
    return [np.asarray(w) for w in weights(trainer)], trainer.distribute_strategy.num_replicas_in_sync


STRATEGIES = {"mirrored": lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
              "multiworker": tf.distribute.MultiWorkerMirroredStrategy}
TRAINERS = ("cd", "rbm", "autoencoder", "capsnet", "em", "routingnet", "generative", "vae", "capsules")


def parse(arguments):
    """{kind: the trainers it trains} from `kind` or `kind=name,name` arguments."""
    trained = {}
    for argument in arguments or list(STRATEGIES):
        kind, _, names = argument.partition("=")
        trained[kind] = tuple(names.split(",")) if names else TRAINERS
        unknown = set(trained[kind]) - set(TRAINERS)
        if kind not in STRATEGIES or unknown:
            sys.exit(f"unknown strategy or trainers: {argument}")
    return trained


def main():
    trained = parse(sys.argv[1:])
    strategies = {kind: STRATEGIES[kind]() for kind in trained}
    result = {kind: {} for kind in trained}
    for make in (globals()[name] for name in TRAINERS):
        one, _ = train(make, tf.distribute.get_strategy())
        moved = [float(np.abs(w - w0).max()) for w, w0 in zip(one, train_initial(make))]
        for kind, strategy in strategies.items():
            if make.__name__ not in trained[kind]:
                continue
            many, replicas = train(make, strategy)
            # Each weight's difference between the two runs, relative to how far training moved it.
            diff = max(float(np.abs(a - b).max()) / max(m, 1e-12) for a, b, m in zip(one, many, moved))
            result[kind][make.__name__] = {"replicas": replicas, "difference_over_movement": diff,
                                           "moved": max(moved), "weights_moved": sum(m > 0 for m in moved),
                                           "weights": len(moved)}
    print("RESULT " + json.dumps(result))


def train_initial(make):
    keras.utils.set_random_seed(0)
    trainer, x, _, weights = make()
    trainer(x[:1])
    return [np.asarray(w) for w in weights(trainer)]


if __name__ == "__main__":
    main()
