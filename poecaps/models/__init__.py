"""Networks built from poecaps' layers."""

from poecaps.models.capsnet import CapsNet
from poecaps.models.capsule_pipeline import CapsulePipeline
from poecaps.models.generative_capsules import GenerativeCapsules
from poecaps.models.matrix_capsnet import MatrixCapsNet
from poecaps.models.probabilistic_capsules import ProbabilisticCapsules
from poecaps.models.routing_capsnet import RoutingCapsNet

__all__ = ["CapsNet", "CapsulePipeline", "GenerativeCapsules", "MatrixCapsNet", "ProbabilisticCapsules",
           "RoutingCapsNet"]
