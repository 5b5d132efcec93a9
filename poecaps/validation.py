"""Checks of user-supplied arrays and sizes, each failing with one `InputError` that names the argument."""

import math
import numbers
from collections.abc import Hashable

import numpy as np

from poecaps.errors import InputError


def check_integer(value, name, minimum=1, allow_none=False):
    """Return `value` as a Python `int` if it is an integer of at least `minimum`; else raise `InputError`.

    Python and NumPy integers pass (a NumPy one comes back as `int`, so configs stay JSON-serialisable);
    bools, floats (even 2.0) and strings do not. With `allow_none`, None passes through unchanged.
    `InputError` is a `ValueError`.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        alternative = ", or None" if allow_none else ""
        raise InputError(f"{name} must be an integer >= {minimum}{alternative}. Received: {name}={value!r}")
    return int(value)


def check_seed(value, name="seed", allow_none=False):
    """Return `value` as a Python `int` if it is a seed, an integer >= 0 (as the programs' `--seed`); else raise
    `InputError`. With `allow_none`, None (unseeded: Keras' global random state) passes through. Floats, bools
    and strings are refused, where `int(seed)` would truncate 1.5 to 1 or read True as 1."""
    return check_integer(value, name, minimum=0, allow_none=allow_none)


def check_seed_pair(value, name="seed", allow_none=False):
    """Return `value` as a stateless seed, an int64 tensor `[2]`, if it is a pair of integers; else raise
    `InputError`.

    A pair of Python or NumPy integers within int64's range passes, as does an integer tensor of shape `[2]` (a
    traced one too: only its dtype and shape are known). Floats (1.5 or 1.0 alike), bools, strings, a single
    integer and integers beyond int64 are refused, where TensorFlow would truncate floats, wrap large integers or
    fail in the stateless kernels. With `allow_none`, None (unseeded draws) passes through.
    """
    import tensorflow as tf

    if value is None and allow_none:
        return None
    if tf.is_tensor(value):
        if value.dtype in (tf.int32, tf.int64) and value.shape.is_compatible_with([2]):
            return tf.cast(value, tf.int64)
        received = f"a {value.dtype.name} tensor of shape {tuple(value.shape)}"
    else:
        pair = list(value) if isinstance(value, (tuple, list, np.ndarray)) and np.ndim(value) == 1 else None
        if pair is not None and len(pair) == 2 and all(
                not isinstance(v, (bool, np.bool_)) and isinstance(v, numbers.Integral) and -2 ** 63 <= v < 2 ** 63
                for v in pair):
            return tf.constant([int(v) for v in pair], tf.int64)
        received = f"{name}={value!r}"
    alternative = ", or None" if allow_none else ""
    raise InputError(f"{name} must be a pair of integers (a stateless seed){alternative}. Received: {received}")


def check_flag(value, name):
    """Return `value` as a Python `bool` if it is True or False (NumPy's bools too); else raise `InputError`.

    Strings (`"false"`), numbers (0, 1) and None are refused: each would otherwise be read by its truth value
    (`"false"` as True), and a NumPy bool would leave a config that JSON cannot write.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False. Received: {name}={value!r}")
    return bool(value)


def check_verbose(verbose, allow_auto=False):
    """`verbose` if it is 0, 1 or 2 (Keras' settings of a progress bar: none, a bar, one line at the end), or
    with `allow_auto` "auto"; else an `InputError` naming it. Bools are refused, where Keras would read True as 1."""
    choices = ("auto", 0, 1, 2) if allow_auto else (0, 1, 2)
    if isinstance(verbose, bool) or not isinstance(verbose, Hashable) or verbose not in choices:
        raise InputError(f"verbose must be {', '.join(map(repr, choices[:-1]))} or {choices[-1]}. Received: "
                         f"verbose={verbose!r}")
    return verbose


def check_choice(value, name, choices, error=InputError):
    """Return `value` if it equals one of `choices` (any iterable of names, a dict's keys); else raise `error`.

    The message lists the choices and names the argument: "pose must be one of 'vector', 'matrix'. Received:
    pose='tensor'". `error` is `InputError` or a subclass of it (`DataError`, `SettingError`), so every refusal is
    a `ValueError` that the command lines print as one line. Unhashable values (lists, arrays) are refused too.
    """
    choices = tuple(choices)
    if not isinstance(value, Hashable) or value not in choices:
        raise error(f"{name} must be one of {choice_list(choices)}. Received: {name}={value!r}")
    return value


def choice_list(choices):
    """The choices as messages and help list them: `'vector', 'matrix'`."""
    return ", ".join(map(repr, choices))


def check_number(value, name, minimum=None, maximum=None, above=None, below=None):
    """Return `value` as a Python `float` if it is a finite real number in range; else raise `InputError`.

    `minimum` and `maximum` are inclusive bounds, `above` and `below` exclusive (None: unbounded). Python and
    NumPy numbers pass, integers too (each comes back as `float`, so configs stay JSON-serialisable); bools,
    strings, None, NaN and infinities do not. The message names the argument and its range: "beta must be a
    finite number > 0. Received: beta=inf".
    """
    number = None
    if not isinstance(value, bool) and isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:       # an int beyond the largest float
            pass
    if (number is None or not math.isfinite(number)
            or (minimum is not None and number < minimum) or (maximum is not None and number > maximum)
            or (above is not None and number <= above) or (below is not None and number >= below)):
        bounds = number_bounds(minimum, maximum, above, below)
        raise InputError(f"{name} must be a finite number{' ' + bounds if bounds else ''}. "
                         f"Received: {name}={value!r}")
    return number


def check_setting(value, name, **bounds):
    """`value` unchanged if it is a math function's scalar setting in range (`check_number`'s bounds) or a tensor;
    else an `InputError`. A tensor is a traced schedule's or a trainer's counter and passes unread; anything else
    (Python and NumPy numbers, 0-d arrays, strings, None) is checked as `check_number` checks it."""
    import tensorflow as tf

    if not tf.is_tensor(value):
        check_number(value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value, name, **bounds)
    return value


def number_bounds(minimum=None, maximum=None, above=None, below=None):
    """A number's range as messages and help write it: `>= 0 and < 1` (empty when unbounded)."""
    bounds = ((">=", minimum), (">", above), ("<=", maximum), ("<", below))
    return " and ".join(f"{sign} {_number(bound)}" for sign, bound in bounds if bound is not None)


def _number(x):
    """A bound as text: floats in their shortest form (`1e-06`, `0.5`), anything else as `str`."""
    return f"{x:g}" if isinstance(x, float) else str(x)


def _check_sizes(value, name, axes):
    """`value` as a tuple of ints if it is a tuple or list of one integer >= 1 per name in `axes`; else an
    `InputError` naming `name` and the axes."""
    count = {2: "two", 3: "three"}[len(axes)]
    if (not isinstance(value, (tuple, list)) or len(value) != len(axes)
            or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in value)):
        raise InputError(f"{name} must be ({', '.join(axes)}), {count} integers >= 1. Received: {name}={value!r}")
    return tuple(int(s) for s in value)


def check_image_size(image_size):
    """`(height, width)`, two integers >= 1, as a tuple of ints; else an `InputError` naming `image_size`."""
    return _check_sizes(image_size, "image_size", ("height", "width"))


def check_image_shape(image_shape, name="image_shape"):
    """`(height, width, channels)`, three integers >= 1, as a tuple of ints; else an `InputError` naming it."""
    return _check_sizes(image_shape, name, ("height", "width", "channels"))


def check_integers(minimum=1, **values):
    """`check_integer` of each keyword argument, named by its keyword; returns the ints in the same order."""
    return tuple(check_integer(value, name, minimum) for name, value in values.items())


def sizes_fit(a, b):
    """Whether two sizes of an axis agree; an unknown size (None, while tracing) fits any."""
    return a is None or b is None or a == b


def shape_fits(shape, expected):
    """Whether `shape` has `expected`'s rank and every size fits (`sizes_fit`: None, unknown or any, fits)."""
    return len(shape) == len(expected) and all(map(sizes_fit, shape, expected))


def check_array(array, name, shape=None, low=None, high=None, what="values", dtype="float32"):
    """Check that `array` is a non-empty finite float array of `[N, *shape]` within [low, high].

    `shape` entries of None match any size. Returns the array as NumPy of `dtype`.
    """
    try:
        array = np.asarray(array)
    except Exception as error:  # noqa: BLE001  (anything not array-like)
        raise InputError(f"{name} must be an array. Received: {type(array).__name__} ({error})") from None
    if array.dtype == object or not (np.issubdtype(array.dtype, np.number) or array.dtype == bool):
        raise InputError(f"{name} must hold numbers. Received: dtype {array.dtype}")
    if array.ndim == 0 or len(array) == 0:
        raise InputError(f"{name} is empty; it must hold at least one example. Received: shape {array.shape}")
    if shape is not None:
        expected = (None, *shape)
        if array.ndim != len(expected) or any(e is not None and e != a for e, a in zip(expected, array.shape)):
            wanted = "[N, " + ", ".join("?" if e is None else str(e) for e in shape) + "]"
            raise InputError(f"{name} must have shape {wanted}. Received: shape {array.shape}")
    array = check_finite(array.astype(dtype, copy=False), name, what)
    if low is not None and high is not None and (array.min() < low or array.max() > high):
        raise InputError(f"{name} must lie in [{low}, {high}]. Received: {what} from {array.min():g} "
                         f"to {array.max():g} (divide 8-bit images by 255)")
    return array


def check_finite(array, name, what="values"):
    """`array` (NumPy numbers) unchanged if every entry is finite; else an `InputError` naming it and counting the
    NaN and infinite entries."""
    finite = np.isfinite(array)
    if not finite.all():
        raise InputError(f"{name} holds {int(finite.size - finite.sum())} NaN or infinite {what}; they must all be "
                         f"finite.")
    return array


def check_images(images, name="images", image_shape=None, channels=None):
    """Images `[N, H, W, C]` in [0, 1]: `image_shape` (H, W, C) or just `channels` must match if given."""
    if image_shape is None:
        image_shape = (None, None, channels)
    return check_array(images, name, tuple(image_shape), 0.0, 1.0, "pixels")


def static_shape(x):
    """The shape of an array, tensor or nested list as a tuple; None for a size unknown while tracing."""
    shape = getattr(x, "shape", None)
    return tuple(shape) if shape is not None else np.shape(x)


def check_image_batch(images, image_size, owner, channels=1):
    """Refuse, with an `InputError` naming `owner`, images (array or tensor) not `[B, H, W, C]` of `image_size`
    (H, W) and `channels` (C).

    A check of the static shape: it also runs while a graph is traced, and dimensions unknown then pass.
    """
    shape = static_shape(images)
    expected = (*image_size, channels)
    if not shape_fits(shape, (None, *expected)):
        raise InputError(f"{owner} takes images of shape [batch, {image_size[0]}, {image_size[1]}, {channels}]. "
                         f"Received: shape={shape}")


def check_labels(labels, num_classes, count, name="labels"):
    """Integer class labels in [0, num_classes), one per example."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != count:
        raise InputError(f"{name} must be one integer per example, shape [{count}]. Received: shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise InputError(f"{name} must be integers. Received: dtype {labels.dtype}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise InputError(f"{name} must lie in [0, {num_classes}). Received: {labels.min()} to {labels.max()}")
    return labels
