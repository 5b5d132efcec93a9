"""The trained models of a run directory, loaded with errors that say what is missing."""

import os

from poecaps.errors import InputError
from poecaps.models.capsule_pipeline import CapsulePipeline
from poecaps.models.saving import load_component


def load_pipeline(run, config):
    """The run's trained `CapsulePipeline`; an `InputError` if its encoder or decoder is missing."""
    pipeline = CapsulePipeline.load(run.models, config.capsule_dim)
    missing = [name for name in ("encoder", "decoder") if getattr(pipeline, name) is None]
    if missing:
        raise InputError(f"{run.path} has no trained {' or '.join(missing)}; train the "
                         f"{', '.join(repr(m) for m in missing)} stage{'s' if len(missing) > 1 else ''} first.")
    return pipeline


def load_rbm(run):
    """The run's trained RBM, or None."""
    path = os.path.join(run.models, "rbm.keras")
    return load_component(path) if os.path.exists(path) else None
