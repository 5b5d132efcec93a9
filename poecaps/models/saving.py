"""Saving one model or layer in Keras' own format (`.keras`), atomically, and loading it with a clear error."""

import os

import keras

from poecaps.errors import InputError


def save_component(layer, path):
    """Save a built layer (config, build shape and weights) as one `.keras` file, atomically."""
    tmp = path[:-len(".keras")] + ".tmp.keras"
    keras.saving.save_model(layer, tmp)
    os.replace(tmp, path)


def load_component(path):
    """A layer saved by `save_component`, built and with its weights."""
    try:
        return keras.saving.load_model(path, compile=False)
    except Exception as error:  # noqa: BLE001  (zip, JSON and HDF5 errors all mean damaged)
        raise InputError(f"{path} is not a readable Keras file ({type(error).__name__}: {error})") from None
