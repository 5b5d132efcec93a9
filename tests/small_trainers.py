"""The seven trainers, each with a small model and a batch of the data its `fit` takes (shared by tests)."""

import numpy as np

from poecaps.experts import CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.models import CapsNet, GenerativeCapsules, VariationalAutoencoder
from poecaps.rbm import BernoulliRBM
from poecaps.trainers.autoencoder import AutoencoderTrainer
from poecaps.trainers.cd import CDTrainer, DecoderTrainer
from poecaps.trainers.generative import GenerativeCapsuleTrainer
from poecaps.trainers.supervised import SupervisedTrainer
from poecaps.trainers.variational import VariationalTrainer

TRAINER_NAMES = ["supervised", "cd", "decoder", "rbm", "autoencoder", "generative", "variational"]


def each_trainer(dtype="float32"):
    """`[(name, make, x, y)]`: each trainer's name, a function that makes it with a small model (under the
    dtype policy in force when it is called; `make(**kwargs)` hands the model keyword arguments, such as a
    `dtype`), and a batch of its data in `dtype` (`y` None if it takes none)."""
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(8, 12, 12, 1)).astype(dtype)
    upper = rng.uniform(-0.5, 0.5, size=(8, 5, 4)).astype(dtype)
    lower = rng.uniform(-0.5, 0.5, size=(8, 3, 2)).astype(dtype)

    def experts(**kwargs):
        layer = CapsuleExperts(3, 2, **kwargs)
        layer.build((None, 5, 4))
        return layer

    found = [
        ("supervised", lambda **k: SupervisedTrainer(CapsNet((12, 12, 1), 3, conv_filters=4, primary_types=2,
                                                             primary_dim=4, class_dim=4, kernel_size=3, **k)),
         images, np.arange(8) % 3),
        ("cd", lambda **k: CDTrainer(experts(**k)), upper, None),
        ("decoder", lambda **k: DecoderTrainer(experts(**k), "delta"), upper, lower),
        ("rbm", lambda **k: CDTrainer(BernoulliRBM(3, seed=0, **k)), images.reshape(8, -1), None),
        ("autoencoder", lambda **k: AutoencoderTrainer(ConvAutoencoder(filters=4, kernel_size=3, dropout=0.0, seed=0,
                                                                       **k)), images, None),
        ("generative", lambda **k: GenerativeCapsuleTrainer(GenerativeCapsules(2, 3, 4, seed=0, **k), iterations=2),
         upper, None),
        ("variational", lambda **k: VariationalTrainer(VariationalAutoencoder(image_size=(12, 12), latent=2, hidden=5,
                                                                              seed=0, **k), seed=0), images, None),
    ]
    assert [name for name, *_ in found] == TRAINER_NAMES
    return found
