"""Networks built from poecaps' layers."""

from poecaps.models.capsnet import CapsNet
from poecaps.models.capsule_autoencoder import ProbabilisticCapsuleAutoencoder
from poecaps.models.capsule_pipeline import CapsulePipeline
from poecaps.models.generative_capsules import GenerativeCapsules
from poecaps.models.matrix_capsnet import MatrixCapsNet
from poecaps.models.probabilistic_capsules import ProbabilisticCapsules
from poecaps.models.routing_capsnet import RoutingCapsNet
from poecaps.models.vae import VariationalAutoencoder

__all__ = ["CapsNet", "CapsulePipeline", "GenerativeCapsules", "MatrixCapsNet", "ProbabilisticCapsuleAutoencoder",
           "ProbabilisticCapsules", "RoutingCapsNet",
           "VariationalAutoencoder"]
