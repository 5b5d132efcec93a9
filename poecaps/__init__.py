"""poecaps: products of expert capsules and capsule routing on TensorFlow and Keras 3."""

__version__ = "0.1.0"
