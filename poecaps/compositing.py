"""Templates placed by 2-D affine poses and alpha-composited front to back (Smith et al., section 2.1).

Coordinates: an image of H x W pixels spans [-1, 1] x [-1, 1] (x along the
width, y along the height, pixel centres at `2 (k + 1/2) / n - 1`); so does
every template, whatever its size. A pose is the top two rows
`[[a, b, tx], [c, d, ty]]` of a homogeneous 3x3 map `P` that takes template
coordinates to image coordinates; the identity stretches a template over
the whole image. `warp` renders by inverse mapping: the image point `x`
reads the template at `P^-1 x`, bilinearly, zero outside the template.

`composite` draws a stack front to back with the *over* operation,

    a_o = a_a + a_b (1 - a_a),   C_o = (C_a a_a + C_b a_b (1 - a_a)) / a_o,

and returns the result over a black background, `C_o a_o`, the mean image
of the pixel likelihood (where nothing is drawn the image is 0, not the
undefined 0 / 0).
"""

import tensorflow as tf

from poecaps.errors import InputError
from poecaps.validation import check_image_size, shape_fits

# |det P| is kept at least this large when a pose is inverted.
_MIN_DET = 1e-4

# The identity pose's six entries.
IDENTITY = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)


def check_shape(x, expected, name, layout):
    """`x` unchanged if its static shape fits `expected` (`validation.shape_fits`: None fits any size); else an
    `InputError` naming it and its layout. Checked shapes keep a mismatched count of poses, templates or layers
    from being broadcast (a batch or stack of one drawn as many) or failing deep inside TensorFlow."""
    if not shape_fits(tuple(x.shape), tuple(expected)):
        raise InputError(f"{name} must have shape {layout}. Received: shape={tuple(x.shape)}")
    return x


def homogeneous(pose):
    """Poses `[..., 6]` (the top two rows, row-major) as homogeneous matrices `[..., 3, 3]`."""
    pose = tf.convert_to_tensor(pose)
    rows = tf.reshape(pose, tf.concat([tf.shape(pose)[:-1], [2, 3]], 0))
    last = tf.broadcast_to(tf.constant([0.0, 0.0, 1.0], pose.dtype), tf.concat([tf.shape(pose)[:-1], [1, 3]], 0))
    return tf.concat([rows, last], axis=-2)


def flat(matrix):
    """Homogeneous matrices `[..., 3, 3]` back to poses `[..., 6]`."""
    return tf.reshape(matrix[..., :2, :], tf.concat([tf.shape(matrix)[:-2], [6]], 0))


def invert(pose):
    """`P^-1` of poses `[..., 6]` in closed form, `|det|` floored at `_MIN_DET` (sign kept)."""
    a, b, tx, c, d, ty = tf.unstack(pose, axis=-1)
    det = a * d - b * c
    det = tf.where(det < 0, tf.minimum(det, -_MIN_DET), tf.maximum(det, _MIN_DET))
    ia, ib, ic, id_ = d / det, -b / det, -c / det, a / det
    return tf.stack([ia, ib, -(ia * tx + ib * ty), ic, id_, -(ic * tx + id_ * ty)], axis=-1)


def pixel_centres(n, dtype):
    """The `n` pixel centres along one axis in [-1, 1]: `2 (k + 1/2) / n - 1`, in `dtype` (counted in float32
    below it: TensorFlow has no float16 range on CPU)."""
    exact = tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32
    return tf.cast((2.0 * (tf.range(n, dtype=exact) + 0.5)) / n - 1.0, dtype)


def warp(templates, poses, image_size):
    """Each template drawn at each pose: `[N, h, w, C]` and poses `[B, N, 6]` -> `[B, N, H, W, C]`.

    Bilinear interpolation with zeros outside the template, differentiable
    in the templates and the poses. `image_size` is `(H, W)`, two integers
    >= 1; the poses must be one per template (an `InputError` otherwise).
    """
    templates = tf.convert_to_tensor(templates)
    check_shape(templates, (None, None, None, None), "templates", "[N, h, w, C]")
    poses = check_shape(tf.cast(poses, templates.dtype), (None, templates.shape[0], 6), "poses",
                        f"[B, {templates.shape[0]}, 6] (one pose per template)")
    n, h, w, channels = templates.shape
    height, width = check_image_size(image_size)
    ys, xs = tf.meshgrid(pixel_centres(height, templates.dtype), pixel_centres(width, templates.dtype), indexing="ij")
    grid = tf.stack([tf.reshape(xs, [-1]), tf.reshape(ys, [-1]), tf.ones([height * width], templates.dtype)])
    inverse = homogeneous(invert(poses))[..., :2, :]                     # [B, N, 2, 3]
    source = tf.einsum("bnij,jp->bnip", inverse, grid)                 # template coordinates [B, N, 2, HW]
    col = (source[:, :, 0] + 1.0) * (w / 2.0) - 0.5                     # continuous pixel indices
    row = (source[:, :, 1] + 1.0) * (h / 2.0) - 0.5
    col0, row0 = tf.floor(col), tf.floor(row)
    flat_templates = tf.reshape(templates, [n, h * w, channels])
    out = 0.0
    for dr in (0.0, 1.0):
        for dc in (0.0, 1.0):
            r, c = row0 + dr, col0 + dc
            weight = (1.0 - tf.abs(row - r)) * (1.0 - tf.abs(col - c))
            inside = (r >= 0) & (r <= h - 1) & (c >= 0) & (c <= w - 1)
            index = tf.cast(tf.clip_by_value(r, 0, h - 1) * w + tf.clip_by_value(c, 0, w - 1), tf.int32)
            # [B, N, HW] indices into each template's pixels: gather per template, batch along N.
            index_by_template = tf.transpose(index, (1, 0, 2))                # [N, B, HW]
            values = tf.gather(flat_templates, index_by_template, axis=1, batch_dims=1)   # [N, B, HW, C]
            values = tf.transpose(values, (1, 0, 2, 3))
            out = out + tf.where(inside, weight, 0.0)[..., None] * values
    return tf.reshape(out, tf.concat([tf.shape(poses)[:2], [height, width, channels]], 0))


def over(color_front, alpha_front, color_back, alpha_back):
    """The over operation: `(C_o, a_o)` of drawing the front layer on the back one (alphas `[..., 1]`)."""
    alpha = alpha_front + alpha_back * (1.0 - alpha_front)
    color = (color_front * alpha_front + color_back * alpha_back * (1.0 - alpha_front)) / tf.maximum(alpha, 1e-12)
    return color, alpha


def composite(colors, alphas):
    """Layers `[B, N, H, W, C]` with alphas `[B, N, H, W, 1]`, the first in front: the image over black.

    Returns `sum_k C_k a_k prod_(m<k) (1 - a_m)` (`[B, H, W, C]`), which is
    `C_o a_o` of folding `over` from the back layer to the front one. One
    alpha per layer and pixel: an `InputError` otherwise, where a single
    alpha layer would be broadcast over all and nothing would be hidden.
    """
    colors = tf.convert_to_tensor(colors)
    check_shape(colors, (None,) * 5, "colors", "[B, N, H, W, C]")
    alphas = check_shape(tf.cast(alphas, colors.dtype), (*colors.shape[:-1], 1), "alphas",
                         "[B, N, H, W, 1] (one alpha per layer and pixel of the colors)")
    transmitted = tf.math.cumprod(1.0 - alphas, axis=1, exclusive=True)   # light reaching layer k
    return tf.reduce_sum(colors * alphas * transmitted, axis=1)
