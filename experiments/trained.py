"""The trained models of a run directory, loaded with errors that say what is missing."""

import hashlib
import os
import sys

import numpy as np

from poecaps.errors import InputError
from poecaps.experiments.configs import BaselineConfig
from poecaps.experiments.runs import RunDir, read_settings
from poecaps.graphs import batched
from poecaps.models import CapsNet
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


def load_capsnet(run_dir):
    """`(RunDir, settings, CapsNet)` of a CapsNet baseline run; an `InputError` if it holds none."""
    run = RunDir(run_dir, create=False)
    config = read_settings(run, BaselineConfig)
    path = os.path.join(run.models, "model.keras")
    if config.model != "capsnet" or not os.path.exists(path):
        raise InputError(f"{run_dir} holds no trained CapsNet (model {config.model}); train one with "
                         "scripts/baseline.py --preset sabour2017 --set routing_iterations=0.")
    model = load_component(path)
    if not isinstance(model, CapsNet):
        raise InputError(f"{path} is not a CapsNet.")
    return run, config, model


def saved_components(run):
    """Names of the trained components saved in `run.models` (`<name>.keras`), sorted."""
    if not os.path.isdir(run.models):
        return []
    return sorted(name[:-len(".keras")] for name in os.listdir(run.models)
                  if name.endswith(".keras") and not name.endswith(".tmp.keras"))


def load_saved(run_dir, name):
    """The component `name` saved in `run_dir/models/<name>.keras`; an `InputError` naming what the run holds."""
    run = RunDir(run_dir, create=False)
    saved = saved_components(run)
    if name not in saved:
        holds = ", ".join(repr(s) for s in saved) if saved else "no trained component yet"
        raise InputError(f"{run_dir} has no trained component {name!r}; it holds {holds}.")
    return load_component(os.path.join(run.models, f"{name}.keras"))


def load_rbm(run):
    """The run's trained RBM, or None."""
    path = os.path.join(run.models, "rbm.keras")
    return load_component(path) if os.path.exists(path) else None


def _fingerprint(pipeline, images):
    """SHA-256 of what a pipeline's upper capsules of `images` depend on: images, weights, mean code."""
    sha = hashlib.sha256()
    arrays = [images, *pipeline.autoencoder.get_weights(), *pipeline.encoder.get_weights()]
    if pipeline.code_mean is not None:
        arrays.append(pipeline.code_mean)
    for array in arrays:
        array = np.ascontiguousarray(array)
        sha.update(f"{array.dtype}{array.shape}".encode())
        sha.update(array.tobytes())
    sha.update(str(pipeline.capsule_dim).encode())
    return sha.hexdigest()


def store_training_capsules(run, pipeline, images, capsules):
    """Keep the upper capsules of the training images (`models/train_capsules.npz`) for the evaluation."""
    path = os.path.join(run.models, "train_capsules.npz")
    tmp = path[:-len(".npz")] + ".tmp.npz"
    np.savez(tmp, capsules=np.asarray(capsules, "float32"), fingerprint=np.array(_fingerprint(pipeline, images)))
    os.replace(tmp, path)


def training_capsules(run, pipeline, images):
    """Upper capsules of the training images `[N, J, D]`: the stored ones when they were computed
    from these images with these weights (the decoder stage stores them), else computed and stored."""
    path = os.path.join(run.models, "train_capsules.npz")
    if os.path.exists(path):
        try:
            with np.load(path) as stored:
                if str(stored["fingerprint"]) == _fingerprint(pipeline, images):
                    return stored["capsules"]
        except (OSError, ValueError, KeyError) as error:   # damaged: computed again below
            print(f"[evaluate] {path} is unreadable ({error}); computing the capsules again",
                  file=sys.stderr, flush=True)
    capsules = batched(pipeline.encode, images)
    store_training_capsules(run, pipeline, images, capsules)
    return capsules
