"""Image transforms for training and generalisation tests (batched, per-example draws).

Every function takes images `[B, H, W, C]` in [0, 1] and returns the same
shape; out-of-image pixels are filled with 0. They are built on
`keras.ops.image.affine_transform`, whose transform `[a0, a1, a2, b0, b1, b2,
c0, c1]` maps an output point (x, y) to the input point
`(a0 x + a1 y + a2, b0 x + b1 y + b2)`.

The random transforms take a `seed`: a `keras.random.SeedGenerator`, which
advances (each call draws anew), or an integer (each call draws the same;
None is 0), which needs no variable and so also serves inside a
`tf.function`.
"""

import math
import numbers

import keras
import numpy as np
from keras import ops

from poecaps import distribute
from poecaps.errors import InputError
from poecaps.validation import check_integer, check_number, check_seed


def _check_images(images, owner):
    """Refuse, with an `InputError` naming `owner`, images whose static rank is not 4 (`[B, H, W, C]`)."""
    shape = images.shape if hasattr(images, "shape") else np.shape(images)
    if getattr(shape, "rank", len(shape)) not in (4, None):      # a graph's tensor of unknown rank passes
        raise InputError(f"{owner} takes a batch of images [B, H, W, C]. Received: shape {tuple(shape)}")


def _check_per_image(values, images, name, width=None):
    """Refuse `values` whose static leading size (and `width`, if given) does not fit one row per image."""
    if getattr(values.shape, "rank", 0) is None or getattr(images.shape, "rank", 4) is None:
        return
    shape, batch = tuple(values.shape), images.shape[0]
    wanted = (batch,) if width is None else (batch, width)
    if len(shape) != len(wanted) or any(s is not None and w is not None and s != w for s, w in zip(shape, wanted)):
        described = "[B]" if width is None else f"[B, {width}]"
        raise InputError(f"{name} must be one value per image, {described} with B = {batch}. Received: shape {shape}")


def _check_values(values, name, whole=False):
    """`values` as a tensor; refuse, naming `name`, values that are not numbers, and known values (NumPy's, an
    eager tensor's) that are not finite (or, with `whole`, not whole numbers). A traced tensor's values are not
    known until it runs, so only its dtype is checked."""
    tensor = ops.convert_to_tensor(values)
    kind = "whole numbers" if whole else "finite numbers"
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    if dtype == "bool" or not ("float" in dtype or "int" in dtype):
        raise InputError(f"{name} must be {kind}. Received: {name} of dtype {dtype}")
    if hasattr(tensor, "numpy"):                        # eager: the values are known
        known = np.asarray(tensor.numpy(), "float64")
        if not np.all(np.isfinite(known)) or (whole and not np.all(known == np.round(known))):
            raise InputError(f"{name} must be {kind}. Received: {name}={np.asarray(values)!r}")
    return tensor


def _apply(images, matrices, interpolation="bilinear"):
    """Apply output->input affine maps `[B, 2, 3]` (about the image centre)."""
    h, w = images.shape[1], images.shape[2]
    cx, cy = (w - 1) / 2.0, (h - 1) / 2.0
    a, b = matrices[:, 0], matrices[:, 1]
    # Conjugate by the translation to the centre: p_in = A (p_out - c) + c + t.
    a2 = a[:, 2] + cx - a[:, 0] * cx - a[:, 1] * cy
    b2 = b[:, 2] + cy - b[:, 0] * cx - b[:, 1] * cy
    zeros = ops.zeros_like(a2)
    transform = ops.stack([a[:, 0], a[:, 1], a2, b[:, 0], b[:, 1], b2, zeros, zeros], axis=1)
    out = ops.image.affine_transform(images, transform, interpolation=interpolation,
                                     fill_mode="constant", fill_value=0.0)
    return ops.clip(out, 0.0, 1.0)


def _matrices(rotation, shear, scale_x, scale_y, tx, ty):
    """Forward maps (rotate, shear, scale, translate) inverted into output->input maps."""
    cos, sin = ops.cos(rotation), ops.sin(rotation)
    # forward F = R @ Sh @ S: [[cos, -sin], [sin, cos]] [[1, s], [0, 1]] [[sx, 0], [0, sy]]
    f00, f01 = cos * scale_x, (cos * shear - sin) * scale_y
    f10, f11 = sin * scale_x, (sin * shear + cos) * scale_y
    det = f00 * f11 - f01 * f10
    i00, i01, i10, i11 = f11 / det, -f01 / det, -f10 / det, f00 / det
    # p_in = F^-1 (p_out - t)
    row0 = ops.stack([i00, i01, -(i00 * tx + i01 * ty)], axis=1)
    row1 = ops.stack([i10, i11, -(i10 * tx + i11 * ty)], axis=1)
    return ops.stack([row0, row1], axis=1)


def shift(images, shifts):
    """Shift each image by whole pixels: `shifts [B, 2]` integers (x right, y down); zeros fill in.

    `out[b, r, c] = images[b, r - y_b, c - x_b]`, written as two one-hot
    selections (exact, and compiled by XLA, which has no kernel for the
    projective-transform op).
    """
    _check_images(images, "shift")
    shifts = _check_values(shifts, "shifts", whole=True)
    _check_per_image(shifts, images, "shifts", width=2)
    h, w = images.shape[1], images.shape[2]
    shifts = ops.cast(shifts, "int32")
    rows = ops.arange(h)[None, :] - shifts[:, 1:2]                                   # [B, H]
    cols = ops.arange(w)[None, :] - shifts[:, 0:1]                                   # [B, W]
    row_pick = ops.cast(rows[:, :, None] == ops.arange(h)[None, None, :], images.dtype)  # [B, H, H_in]
    col_pick = ops.cast(cols[:, :, None] == ops.arange(w)[None, None, :], images.dtype)  # [B, W, W_in]
    # [B, H, H_in] x [B, H_in, W_in, C] -> [B, H, W_in, C]
    out = ops.einsum("bih,bhwc->biwc", row_pick, images)
    # [B, W, W_in] x [B, H, W_in, C] -> [B, H, W, C]
    return ops.einsum("bjw,biwc->bijc", col_pick, out)


def _seed(seed):
    """A `SeedGenerator` as given, or an integer seed >= 0 (`check_seed`); None is 0."""
    if isinstance(seed, keras.random.SeedGenerator):
        return seed
    return check_seed(seed, allow_none=True) or 0


def random_shift(images, max_shift=2, seed=None):
    """Shift each image by a whole number of pixels in [-max_shift, max_shift] (Sabour)."""
    _check_images(images, "random_shift")
    max_shift = check_integer(max_shift, "max_shift", minimum=0)
    seed = _seed(seed)
    if max_shift == 0:
        return images
    batch = ops.shape(images)[0]
    draw = lambda shape, seed: keras.random.randint(shape, -max_shift, max_shift + 1, seed=seed)
    return shift(images, distribute.per_example_draw(draw, (batch, 2), seed))


def rotate(images, degrees):
    """Rotate the images about their centre by `degrees`: one angle for all, or one per image (`[B]`)."""
    _check_images(images, "rotate")
    batch = ops.shape(images)[0]
    ones, zeros = ops.ones((batch,)), ops.zeros((batch,))
    if isinstance(degrees, numbers.Real):                       # NumPy scalars too
        angle = ones * (check_number(degrees, "degrees") * math.pi / 180.0)
    else:
        degrees = _check_values(degrees, "degrees")
        if len(degrees.shape) != 0:
            _check_per_image(degrees, images, "degrees")
        angle = ones * (ops.cast(degrees, ones.dtype) * math.pi / 180.0)
    return _apply(images, _matrices(angle, zeros, ones, ones, zeros, zeros))


def random_rotation(images, max_degrees, seed=None):
    """Rotate each image about its centre by its own angle, uniform in +-`max_degrees`."""
    _check_images(images, "random_rotation")
    max_degrees = check_number(max_degrees, "max_degrees", minimum=0)
    return rotate(images, keras.random.uniform((ops.shape(images)[0],), -max_degrees, max_degrees,
                                               seed=_seed(seed)))


def random_affine(images, max_rotation=20.0, max_shear=0.2, scale_range=(0.8, 1.2),
                  max_translation=0.1, seed=None):
    """affNIST-like random affine transforms, one per image.

    Rotation uniform in +-max_rotation degrees, shear in +-max_shear,
    independent x/y scales in `scale_range`, translation up to
    `max_translation` of the image size.
    """
    _check_images(images, "random_affine")
    for value, name in ((max_rotation, "max_rotation"), (max_shear, "max_shear"),
                        (max_translation, "max_translation")):
        check_number(value, name, minimum=0)
    if (not isinstance(scale_range, (tuple, list)) or len(scale_range) != 2
            or not 0 < check_number(scale_range[0], "scale_range[0]") <= check_number(scale_range[1], "scale_range[1]")):
        raise InputError(f"scale_range must be (low, high) with 0 < low <= high. Received: scale_range={scale_range!r}")
    batch = ops.shape(images)[0]
    h, w = images.shape[1], images.shape[2]
    seed = _seed(seed)
    ranges = [(-max_rotation, max_rotation), (-max_shear, max_shear), scale_range, scale_range,
              (-max_translation, max_translation), (-max_translation, max_translation)]
    if isinstance(seed, keras.random.SeedGenerator):        # one draw per parameter, the generator advancing
        drawn = [keras.random.uniform((batch,), low, high, seed=seed) for low, high in ranges]
    else:     # one draw of all six: an integer seed repeats a draw, which would tie the parameters together
        unit = keras.random.uniform((6, batch), seed=seed)
        drawn = [low + (high - low) * unit[k] for k, (low, high) in enumerate(ranges)]
    degrees, shear, scale_x, scale_y, tx, ty = drawn
    matrices = _matrices(degrees * (math.pi / 180.0), shear, scale_x, scale_y, tx * w, ty * h)
    return _apply(images, matrices)
