"""Routing procedures, one per module, all behind one interface.

`get(name_or_instance, **kwargs)` resolves `"dynamic"` (alias `"sabour"`),
`"cosine"` (dynamic routing with cosine agreement, Hauser), a config dict,
`"em"` (EM routing of matrix capsules), or a `Routing` instance.
"""

import keras

from poecaps.routing.base import Routing, RoutingResult
from poecaps.routing.dynamic import DynamicRouting
from poecaps.routing.em import EMRouting

_REGISTRY = {
    "dynamic": lambda **kw: DynamicRouting(**kw),
    "sabour": lambda **kw: DynamicRouting(**{"agreement": "dot", **kw}),
    "cosine": lambda **kw: DynamicRouting(**{"agreement": "cosine", **kw}),
    "em": lambda **kw: EMRouting(**kw),
}


def get(identifier, **kwargs):
    """Return a routing layer from a name, a serialized config or an instance."""
    if isinstance(identifier, Routing):
        return identifier
    if isinstance(identifier, dict):
        return keras.saving.deserialize_keras_object(identifier)
    if isinstance(identifier, str) and identifier.lower() in _REGISTRY:
        return _REGISTRY[identifier.lower()](**kwargs)
    raise ValueError(
        f"Unknown routing {identifier!r}; expected one of {sorted(_REGISTRY)} or a Routing "
        f"instance. Received: routing={identifier!r}"
    )


__all__ = ["DynamicRouting", "EMRouting", "Routing", "RoutingResult", "get"]
