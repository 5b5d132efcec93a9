"""Drawing from trained models; samplers are objects resolvable by name."""

from poecaps.errors import InputError
from poecaps.samplers.capsule import CapsuleSampler
from poecaps.samplers.rbm import RBMSampler

_REGISTRY = {"capsule": CapsuleSampler, "rbm": RBMSampler}


def get(name, **kwargs):
    """`poecaps.samplers.get("capsule", pipeline=...)` -> a sampler object."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InputError(f"Unknown sampler; expected one of {sorted(_REGISTRY)}. Received: name={name!r}")
    return _REGISTRY[name](**kwargs)


__all__ = ["CapsuleSampler", "RBMSampler", "get"]
