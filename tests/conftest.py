import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest

# A copy of ../shared/data/mnist-5k kept in the repository, so a clone runs its tests anywhere.
MNIST_5K = os.path.join(os.path.dirname(__file__), "data", "mnist-5k")


@pytest.fixture
def rng():
    keras.utils.set_random_seed(0)
    return np.random.default_rng(0)


@pytest.fixture
def mnist_dir():
    path = os.path.abspath(MNIST_5K)
    if not os.path.isdir(path):
        pytest.fail(f"the MNIST-5k test data is missing at {path}")
    return path
