"""Routing procedures, one per module, all behind one interface.

`get(name_or_instance, **kwargs)` resolves `"dynamic"` (alias `"sabour"`),
`"cosine"` (dynamic routing with cosine agreement, Hauser), `"uniform"`
(one round of dynamic routing: uniform coefficients, the no-routing
ablation), `"em"` (EM routing of matrix capsules), `"similarity"` and
`"connectionist"` (Faria's learned routings), `"sparse_inference"` (parents
inferred by descent on an energy, Kiefer et al.), `"generative"` (MAP-EM
inversion of a generative capsule model, Kiefer et al. section 4), a config
dict, or a `Routing` instance; `names()` lists the names.
"""

import keras

from poecaps.errors import InputError
from poecaps.routing.base import Routing, RoutingResult
from poecaps.routing.connectionist import ConnectionistRouting
from poecaps.routing.dynamic import DynamicRouting
from poecaps.routing.em import EMRouting
from poecaps.routing.generative import GenerativeRouting
from poecaps.routing.similarity import SimilarityRouting
from poecaps.routing.sparse_inference import SparseInferenceRouting
from poecaps.routing.top_down import TopDownAttention

_REGISTRY = {
    "dynamic": lambda **kw: DynamicRouting(**kw),
    "sabour": lambda **kw: DynamicRouting(**{"agreement": "dot", **kw}),
    "cosine": lambda **kw: DynamicRouting(**{"agreement": "cosine", **kw}),
    "uniform": lambda **kw: DynamicRouting(**{"iterations": 1, **kw}),
    "em": lambda **kw: EMRouting(**kw),
    "similarity": lambda **kw: SimilarityRouting(**kw),
    "connectionist": lambda **kw: ConnectionistRouting(**kw),
    "sparse_inference": lambda **kw: SparseInferenceRouting(**kw),
    "generative": lambda **kw: GenerativeRouting(**kw),
}


def names():
    """The names `get` resolves, sorted."""
    return sorted(_REGISTRY)


def get(identifier, dtype=None, **kwargs):
    """Return a routing layer from a name, a serialized config or an instance.

    `dtype` (a layer's `dtype_policy`, as Keras layers hand theirs to the
    layers they make) is the policy of a router made from a name, or from a
    config that records none; an instance keeps its own. `kwargs` (the
    router's arguments) go to a router made from a name; with an instance
    or a config, which hold their own, they are an `InputError`, as is
    `"uniform"` (one round) with `iterations` other than 1.
    """
    if kwargs and isinstance(identifier, (Routing, dict)):
        given = ", ".join(f"{name}={value!r}" for name, value in kwargs.items())
        raise InputError(f"A routing instance or config holds its own settings; set them there, or give a routing "
                         f"name. Received: {given} with a {'config' if isinstance(identifier, dict) else 'Routing'}")
    if isinstance(identifier, str) and identifier.lower() == "uniform" and kwargs.get("iterations", 1) != 1:
        raise InputError(f"'uniform' routing is one round of dynamic routing; for more rounds use 'dynamic'. "
                         f"Received: iterations={kwargs['iterations']!r}")
    if isinstance(identifier, Routing):
        return identifier
    if isinstance(identifier, dict):
        if dtype is not None and "dtype" not in identifier.get("config", {}):
            identifier = {**identifier, "config": {**identifier.get("config", {}), "dtype": dtype}}
        try:
            found = keras.saving.deserialize_keras_object(identifier)
        except (TypeError, ValueError) as error:        # Keras' words for a class it cannot find or build
            raise InputError(f"The routing config could not be read: {error}") from None
        if not isinstance(found, Routing):
            raise InputError(f"A routing config must describe a poecaps Routing. Received: a config of "
                             f"{identifier.get('class_name', 'no class_name')!r}, which gave a {type(found).__name__}")
        return found
    if isinstance(identifier, str) and identifier.lower() in _REGISTRY:
        return _REGISTRY[identifier.lower()](**kwargs, **({} if dtype is None else {"dtype": dtype}))
    raise InputError(
        f"Unknown routing {identifier!r}; expected one of {names()} or a Routing "
        f"instance. Received: routing={identifier!r}"
    )


__all__ = ["ConnectionistRouting", "DynamicRouting", "EMRouting", "GenerativeRouting", "Routing", "RoutingResult",
           "SimilarityRouting", "SparseInferenceRouting", "TopDownAttention", "get", "names"]
