"""Keras' global precision set for a block (shared by tests)."""

import contextlib

import keras


@contextlib.contextmanager
def global_policy(name):
    """The global dtype policy `name` (and, for float64, `floatx` too) inside the block, both restored after."""
    saved = keras.config.dtype_policy(), keras.config.floatx()
    keras.config.set_dtype_policy(name)
    if name == "float64":
        keras.config.set_floatx("float64")
    try:
        yield
    finally:
        keras.config.set_dtype_policy(saved[0])
        keras.config.set_floatx(saved[1])
