"""Keras layers: the conv autoencoder front end, capsule layers and set-transformer blocks."""

from poecaps.layers.autoencoder import ConvAutoencoder
from poecaps.layers.capsule_dense import CapsuleDense
from poecaps.layers.conv_capsules import ClassCapsules, ConvCapsules, PrimaryMatrixCapsules
from poecaps.layers.primary import PrimaryCapsules
from poecaps.layers.set_attention import (
    AttentionPooling,
    InducedSetAttention,
    MultiheadAttentionBlock,
)

__all__ = ["AttentionPooling", "CapsuleDense", "ClassCapsules", "ConvAutoencoder", "ConvCapsules",
           "InducedSetAttention", "MultiheadAttentionBlock", "PrimaryCapsules", "PrimaryMatrixCapsules"]
