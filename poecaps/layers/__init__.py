"""Keras layers: the conv autoencoder front end and capsule layers."""

from poecaps.layers.autoencoder import ConvAutoencoder
from poecaps.layers.capsule_dense import CapsuleDense
from poecaps.layers.conv_capsules import ClassCapsules, ConvCapsules, PrimaryMatrixCapsules
from poecaps.layers.primary import PrimaryCapsules

__all__ = ["CapsuleDense", "ClassCapsules", "ConvAutoencoder", "ConvCapsules", "PrimaryCapsules",
           "PrimaryMatrixCapsules"]
