"""Networks built from poecaps' layers."""

from poecaps.models.capsnet import CapsNet
from poecaps.models.capsule_pipeline import CapsulePipeline
from poecaps.models.matrix_capsnet import MatrixCapsNet
from poecaps.models.routing_capsnet import RoutingCapsNet

__all__ = ["CapsNet", "CapsulePipeline", "MatrixCapsNet", "RoutingCapsNet"]
