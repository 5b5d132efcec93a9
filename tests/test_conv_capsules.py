"""Matrix votes, convolutional and class capsules, primary matrix capsules, transforms."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import transforms
from poecaps.errors import InputError
from poecaps.layers import CapsuleDense, ClassCapsules, ConvCapsules, PrimaryMatrixCapsules
from poecaps.layers.capsule_dense import capsule_votes
from poecaps.layers.conv_capsules import capsule_patches
from poecaps.routing import DynamicRouting, EMRouting


def test_matrix_votes_are_pose_times_w(rng):
    poses = rng.normal(size=(2, 3, 16)).astype("float32")
    kernel = rng.normal(size=(3, 4, 4, 4)).astype("float32")
    votes = ops.convert_to_numpy(capsule_votes(poses, kernel, "matrix"))
    for b in range(2):
        for i in range(3):
            for j in range(4):
                expected = poses[b, i].reshape(4, 4) @ kernel[i, j]
                np.testing.assert_allclose(votes[b, i, j], expected.reshape(16), rtol=1e-5, atol=1e-6)


def test_votes_refuse_an_unknown_pose_and_inputs_that_do_not_fit_the_kernel(rng):
    """'vectors' was read as matrix poses (votes of the wrong product); inputs of another I or D_in failed inside
    TensorFlow's einsum."""
    poses, kernel = rng.normal(size=(2, 3, 16)).astype("float32"), rng.normal(size=(3, 4, 4, 4)).astype("float32")
    with pytest.raises(InputError, match="pose must be one of 'vector', 'matrix'"):
        capsule_votes(poses, kernel, "vectors")
    for inputs, pose in ((poses[:, :1], "matrix"), (poses[..., :4], "matrix"), (poses, "vector")):
        with pytest.raises(InputError, match=r"inputs \[B, I, D_in\] that fit the kernel \[3, 4, 4, 4\]"):
            capsule_votes(inputs, kernel, pose)
    # vector poses by hand: W_ij x_i with a 4 x 4 kernel on 4-D inputs; float32 sums of 4 products of standard
    # normals (|products| summing to below ~20) differ by at most 4 * 2^-24 * 20 = 5e-6 in any order, either side
    np.testing.assert_allclose(ops.convert_to_numpy(capsule_votes(poses[..., :4], kernel, "vector")),
                               np.einsum("ijoe,bie->bijo", kernel.astype("float64"), poses[..., :4].astype("float64")),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel_size, strides, message", [
    (0, 1, "kernel_size must be an integer >= 1"),
    (3, 0, "strides must be an integer >= 1"),     # ZeroDivisionError before
    (2.5, 1, "kernel_size must be an integer >= 1"),
])
def test_capsule_patches_refuse_sizes_that_are_not_positive_integers(rng, kernel_size, strides, message):
    with pytest.raises(InputError, match=message):
        capsule_patches(rng.normal(size=(1, 5, 5, 2, 3)).astype("float32"), kernel_size, strides)


def test_capsule_patches_match_loops(rng):
    x = rng.normal(size=(2, 7, 6, 3, 5)).astype("float32")
    patches = ops.convert_to_numpy(capsule_patches(x, 3, 2))
    assert patches.shape == (2, 3, 2, 27, 5)
    for r in range(3):
        for c in range(2):
            window = x[:, 2 * r:2 * r + 3, 2 * c:2 * c + 3]          # [B, 3, 3, T, D]
            np.testing.assert_array_equal(patches[:, r, c], window.reshape(2, 27, 5))


def test_conv_capsules_equal_routing_each_receptive_field(rng):
    poses = rng.normal(size=(2, 5, 5, 2, 16)).astype("float32")
    act = rng.uniform(size=(2, 5, 5, 2)).astype("float32")
    layer = ConvCapsules(3, 16, kernel_size=3, strides=2, routing=EMRouting(2))
    result = layer.route(poses, act)
    assert result.poses.shape == (2, 2, 2, 3, 16)
    assert result.activations.shape == (2, 2, 2, 3)
    kernel = ops.convert_to_numpy(layer.kernel)
    for r in range(2):
        for c in range(2):
            window = poses[:, 2 * r:2 * r + 3, 2 * c:2 * c + 3].reshape(2, 18, 16)
            window_act = act[:, 2 * r:2 * r + 3, 2 * c:2 * c + 3].reshape(2, 18)
            votes = np.einsum("bipq,ijqr->bijpr", window.reshape(2, 18, 4, 4), kernel).reshape(2, 18, 3, 16)
            expected = layer.routing(votes, window_act)
            np.testing.assert_allclose(ops.convert_to_numpy(result.poses[:, r, c]),
                                       ops.convert_to_numpy(expected.poses), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(ops.convert_to_numpy(result.activations[:, r, c]),
                                       ops.convert_to_numpy(expected.activations), rtol=1e-4, atol=1e-5)


def test_class_capsules_share_weights_and_add_coordinates(rng):
    poses = rng.normal(size=(1, 2, 3, 2, 16)).astype("float32")
    recorded = {}

    class Recorder(DynamicRouting):
        def call(self, votes, activations=None, training=None):
            recorded["votes"] = ops.convert_to_numpy(votes)
            return super().call(votes, activations, training)

    layer = ClassCapsules(4, 16, routing=Recorder(0), coordinate_addition=True)
    layer(poses)
    kernel = ops.convert_to_numpy(layer.kernel)                           # [T, J, 4, 4]
    votes = recorded["votes"].reshape(1, 2, 3, 2, 4, 16)
    for r in range(2):
        for c in range(3):
            for t in range(2):
                expected = np.einsum("pq,jqr->jpr", poses[0, r, c, t].reshape(4, 4), kernel[t])
                expected = expected.reshape(4, 16)
                expected[:, 3] += (r + 0.5) / 2
                expected[:, 7] += (c + 0.5) / 3
                np.testing.assert_allclose(votes[0, r, c, t], expected, rtol=1e-5, atol=1e-5)


def test_primary_matrix_capsules_shapes(rng):
    poses, act = PrimaryMatrixCapsules(5)(rng.normal(size=(2, 6, 6, 7)).astype("float32"))
    assert poses.shape == (2, 6, 6, 5, 16) and act.shape == (2, 6, 6, 5)
    assert np.all((ops.convert_to_numpy(act) > 0) & (ops.convert_to_numpy(act) < 1))


def test_primary_matrix_capsules_refuse_other_maps_by_name(rng):
    """Before, Keras' Conv2D refused a map without channels ("Kernel shape must have the same length as input")
    and, once built, another channel count by its own name ('pose_conv')."""
    layer = PrimaryMatrixCapsules(5, name="prim")
    with pytest.raises(InputError, match=r"prim takes feature maps \[batch, height, width, channels\]\. "
                                         r"Received: shape=\(2, 6, 6\)"):
        layer(np.zeros((2, 6, 6), "float32"))
    layer(np.zeros((2, 6, 6, 7), "float32"))
    with pytest.raises(InputError, match=r"prim takes feature maps \[batch, height, width, channels = 7\]\. "
                                         r"Received: shape=\(2, 6, 6, 8\)"):
        layer(np.zeros((2, 6, 6, 8), "float32"))


@pytest.mark.parametrize("make, message", [
    (lambda: ConvCapsules(0), "num_capsules must be an integer >= 1"),
    (lambda: ConvCapsules(4, 15), "square capsule_dim"),
    (lambda: ConvCapsules(4, 16, kernel_size=0), "kernel_size must be an integer >= 1"),
    (lambda: CapsuleDense(4, 16, pose="tensor"), "pose must be one of"),
    (lambda: PrimaryMatrixCapsules(0), "num_capsules must be an integer >= 1"),
])
def test_invalid_arguments(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_kernel_larger_than_map_is_a_clear_error(rng):
    with pytest.raises(InputError, match="does not fit"):
        ConvCapsules(2, 16, kernel_size=5)(rng.normal(size=(1, 3, 3, 2, 16)).astype("float32"))


def test_configs_round_trip_with_non_default_arguments(tmp_path, rng):
    layers = [
        ConvCapsules(3, 9, kernel_size=2, strides=1, routing=DynamicRouting(1, "cosine"),
                     pose="vector", name="conv"),
        ClassCapsules(5, 16, routing=EMRouting(2, 0.2, 1e-3), coordinate_addition=False, name="cls"),
        PrimaryMatrixCapsules(3, pose_side=3, kernel_size=2, name="prim"),
        CapsuleDense(4, 16, routing=EMRouting(1), pose="matrix", name="dense"),
    ]
    for layer in layers:
        config = layer.get_config()
        again = layer.__class__.from_config(config)
        assert again.get_config() == config


@pytest.mark.slow
def test_matrix_capsule_stack_saves_and_reloads(tmp_path, rng):
    inputs = keras.Input((6, 6, 4))
    poses, act = PrimaryMatrixCapsules(2)(inputs)
    r = ConvCapsules(3, 16, kernel_size=3, strides=1, routing=EMRouting(2))
    p2 = r(poses, act)
    out = ClassCapsules(4, 16, routing=EMRouting(2))(p2)
    model = keras.Model(inputs, out)
    x = rng.normal(size=(2, 6, 6, 4)).astype("float32")
    path = str(tmp_path / "m.keras")
    model.save(path)
    again = keras.saving.load_model(path)
    np.testing.assert_allclose(ops.convert_to_numpy(again(x)), ops.convert_to_numpy(model(x)),
                               rtol=1e-6, atol=1e-6)


def test_shift_moves_pixels_by_whole_steps():
    image = np.zeros((1, 5, 5, 1), "float32")
    image[0, 2, 2, 0] = 1.0
    shifted = ops.convert_to_numpy(transforms._apply(
        image, transforms._matrices(*(np.array([v], "float32") for v in (0, 0, 1, 1, 1, -2))),
        interpolation="nearest"))
    assert shifted[0, 0, 3, 0] == 1.0 and shifted.sum() == 1.0
    seed = keras.random.SeedGenerator(1)
    random = ops.convert_to_numpy(transforms.random_shift(np.repeat(image, 16, 0), 2, seed=seed))
    assert np.all(random.sum(axis=(1, 2, 3)) == 1.0)


_BATCH = np.zeros((3, 6, 6, 1), "float32")


@pytest.mark.parametrize("call, message", [
    (lambda: transforms.rotate(_BATCH[0], 30), r"^rotate takes a batch of images \[B, H, W, C\]\. Received: shape \(6, 6, 1\)$"),
    (lambda: transforms.rotate(_BATCH, [30.0, 40.0]), r"^degrees must be one value per image, \[B\] with B = 3\. Received: shape \(2,\)$"),
    (lambda: transforms.shift(_BATCH, np.zeros((2, 2))), r"^shifts must be one value per image, \[B, 2\] with B = 3"),
    (lambda: transforms.shift(_BATCH, np.zeros((3,))), r"^shifts must be one value per image, \[B, 2\]"),
    (lambda: transforms.random_shift(_BATCH, -1, seed=1), r"^max_shift must be an integer >= 0. Received: max_shift=-1$"),
    (lambda: transforms.random_shift(_BATCH, 1.5, seed=1), r"max_shift=1.5$"),
    (lambda: transforms.random_rotation(_BATCH[None], 10.0, seed=1), r"^random_rotation takes a batch of images"),
    (lambda: transforms.random_rotation(_BATCH, -10.0, seed=1), r"^max_degrees must be a finite number >= 0"),
    (lambda: transforms.random_affine(_BATCH, max_shear=float("nan"), seed=1), r"^max_shear must be a finite number"),
    (lambda: transforms.random_affine(_BATCH, scale_range=(1.2, 0.8), seed=1), r"^scale_range must be \(low, high\)"),
    (lambda: transforms.random_affine(_BATCH, scale_range=0.8, seed=1), r"scale_range=0.8$"),
    (lambda: transforms.rotate(_BATCH, float("nan")), r"^degrees must be a finite number. Received: degrees=nan$"),
    (lambda: transforms.rotate(_BATCH, True), r"^degrees must be a finite number. Received: degrees=True$"),
    (lambda: transforms.rotate(_BATCH, np.array([1.0, np.inf, 0.0])), r"^degrees must be finite numbers. Received: degrees=array"),
    (lambda: transforms.rotate(_BATCH, np.array([1, 0, 1], bool)), r"^degrees must be finite numbers. Received: degrees of dtype bool$"),
    (lambda: transforms.rotate(_BATCH, "30"), r"^degrees must be finite numbers. Received: degrees of dtype string$"),
    (lambda: transforms.shift(_BATCH, np.full((3, 2), 0.5)), r"^shifts must be whole numbers. Received: shifts="),
    (lambda: transforms.shift(_BATCH, np.array([[0, 1], [np.nan, 0], [1, 1]])), r"^shifts must be whole numbers"),
    (lambda: transforms.random_shift(_BATCH, 1, seed=1.5), r"^seed must be an integer >= 0, or None. Received: seed=1.5$"),
    (lambda: transforms.random_shift(_BATCH, 0, seed=-1), r"^seed must be an integer >= 0, or None. Received: seed=-1$"),
    (lambda: transforms.random_rotation(_BATCH, 10.0, seed="1"), r"^seed must be an integer >= 0, or None"),
    (lambda: transforms.random_affine(_BATCH, seed=True), r"^seed must be an integer >= 0, or None. Received: seed=True$"),
])
def test_transforms_refuse_images_and_ranges_they_would_misread(call, message):
    """Before, a single image, one angle or shift too few, and a negative or fractional max_shift failed inside
    TensorFlow's ops (an image of rank 3 as 'Input transform should be num_images x 8'), and a negative
    max_degrees, a NaN max_shear or a reversed scale_range were taken without a word. So were a NaN or infinite
    angle (an image of NaN), True (one degree) and shifts of NaN or half a pixel (cast to an integer: NaN to
    some whole number, 0.5 to 0); a seed of -1 or True passed, 1.5 failed in Keras' words."""
    with pytest.raises(InputError, match=message):
        call()


def test_transforms_in_a_graph_of_unknown_batch_size(rng):
    images = rng.uniform(size=(2, 6, 6, 1)).astype("float32")
    spec = tf.TensorSpec((None, 6, 6, 1), tf.float32)
    rotated = tf.function(lambda x: transforms.rotate(x, tf.constant([90.0, 0.0])), input_signature=[spec])(images)
    np.testing.assert_allclose(rotated.numpy()[1], images[1], atol=1e-5)
    shifted = tf.function(lambda x: transforms.random_shift(x, 1, seed=3), input_signature=[spec])(images)
    assert shifted.shape == images.shape


def test_rotation_by_90_is_rot90_and_0_is_identity(rng):
    image = rng.uniform(size=(2, 7, 7, 1)).astype("float32")
    np.testing.assert_allclose(ops.convert_to_numpy(transforms.rotate(image, 0)), image, atol=1e-5)
    rotated = ops.convert_to_numpy(transforms.rotate(image, 90))
    candidates = [np.rot90(image, k, axes=(1, 2)) for k in (1, 3)]
    assert min(np.abs(rotated - c).max() for c in candidates) < 1e-4


def test_rotation_takes_one_angle_per_image(rng):
    image = np.repeat(rng.uniform(size=(1, 7, 7, 1)).astype("float32"), 3, axis=0)
    rotated = ops.convert_to_numpy(transforms.rotate(image, np.array([90.0, 0.0, -90.0], "float32")))
    np.testing.assert_allclose(rotated[1], image[1], atol=1e-5)
    # +90 and -90 degrees are the two quarter turns, in opposite directions
    k = 1 if np.abs(rotated[0] - np.rot90(image[0], 1)).max() < 1e-4 else 3
    np.testing.assert_allclose(rotated[0], np.rot90(image[0], k), atol=1e-4)
    np.testing.assert_allclose(rotated[2], np.rot90(image[2], 4 - k), atol=1e-4)
    for scalar in (np.int64(90), np.float32(90.0), 90):          # one angle for all, in any scalar type
        np.testing.assert_allclose(ops.convert_to_numpy(transforms.rotate(image, scalar))[0], rotated[0], atol=1e-6)


def _bar_orientation(images):
    """The orientation in degrees, in (-90, 90], of each image's principal axis (second central moments)."""
    h, w = images.shape[1:3]
    ys, xs = np.mgrid[:h, :w]
    mass = images[..., 0].sum(axis=(1, 2))
    mx = (images[..., 0] * xs).sum(axis=(1, 2)) / mass
    my = (images[..., 0] * ys).sum(axis=(1, 2)) / mass
    dx, dy = xs[None] - mx[:, None, None], ys[None] - my[:, None, None]
    mu20, mu02, mu11 = ((images[..., 0] * m).sum(axis=(1, 2)) / mass for m in (dx * dx, dy * dy, dx * dy))
    return np.degrees(0.5 * np.arctan2(2 * mu11, mu20 - mu02))


def test_random_rotation_turns_each_image_by_its_own_angle_within_the_limit():
    bar = np.zeros((64, 21, 21, 1), "float32")
    bar[:, 10, 3:18] = 1.0                                   # a horizontal bar through the centre
    assert np.all(np.abs(_bar_orientation(bar)) < 1e-6)
    turned = ops.convert_to_numpy(transforms.random_rotation(bar, 40.0, seed=keras.random.SeedGenerator(3)))
    angles = _bar_orientation(turned)
    # bilinear sampling blurs the bar but keeps its axis: within a degree of the limit
    assert np.all(np.abs(angles) <= 41.0), angles
    assert angles.min() < -25.0 and angles.max() > 25.0        # spread over the range, not one angle for all
    assert len(np.unique(np.round(angles, 1))) > 50
    unturned = ops.convert_to_numpy(transforms.random_rotation(bar, 0.0, seed=keras.random.SeedGenerator(3)))
    np.testing.assert_allclose(unturned, bar, atol=1e-5)


def test_affine_map_is_rotation_shear_scale_about_the_centre_then_translation(rng):
    """Against scipy.ndimage's bilinear `affine_transform` with the inverse of the documented forward map
    F = R(angle) [[1, shear], [0, 1]] diag(sx, sy) about the image centre, then translated by (tx, ty): an
    output pixel p samples the input at F^-1 (p - centre - t) + centre. Compared where that point lies a
    pixel inside the image, so that both sample the same four pixels; a non-square image catches a swap of
    rows and columns."""
    from scipy import ndimage

    h, w = 13, 17
    image = rng.uniform(size=(1, h, w, 1)).astype("float32")
    angle, shear, sx, sy, tx, ty = 0.5, 0.2, 1.15, 0.85, 1.5, -2.0
    got = ops.convert_to_numpy(transforms._apply(image, transforms._matrices(
        *(np.array([v], "float32") for v in (angle, shear, sx, sy, tx, ty)))))[0, ..., 0]
    forward = (np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
               @ np.array([[1.0, shear], [0.0, 1.0]]) @ np.diag([sx, sy]))              # (x, y) coordinates
    inverse, centre = np.linalg.inv(forward), np.array([(w - 1) / 2, (h - 1) / 2])
    swap = np.array([[0.0, 1.0], [1.0, 0.0]])                                            # (x, y) <-> (row, col)
    matrix = swap @ inverse @ swap
    offset = swap @ (centre - inverse @ (centre + np.array([tx, ty])))
    expected = ndimage.affine_transform(image[0, ..., 0].astype("float64"), matrix, offset, order=1)
    rows, cols = np.mgrid[:h, :w]
    source = np.einsum("ij,jrc->irc", matrix, np.stack([rows, cols])) + offset[:, None, None]
    inside = (source[0] >= 1) & (source[0] <= h - 2) & (source[1] >= 1) & (source[1] <= w - 2)
    assert inside.sum() > 0.4 * h * w
    np.testing.assert_allclose(got[inside], expected[inside], rtol=0, atol=1e-5)    # float32 coordinates


def test_random_affine_keeps_range_and_shape(rng):
    image = rng.uniform(size=(4, 12, 12, 3)).astype("float32")
    out = ops.convert_to_numpy(transforms.random_affine(image, seed=keras.random.SeedGenerator(0)))
    assert out.shape == image.shape and out.min() >= 0.0 and out.max() <= 1.0
    assert np.abs(out - image).max() > 0.01


def test_random_affine_draws_its_six_parameters_apart_for_an_integer_seed_and_in_turn_from_a_generator(
        rng, monkeypatch):
    """The parameters `_matrices` receives, mapped back to [0, 1]: for an integer seed (or None) they are
    drawn apart (across 256 images no two of the six correlate beyond 0.3; independent draws give about
    1/16 = 0.06) and repeat from call to call, also inside a `tf.function`. Before, an integer seed drew one
    uniform vector six times over, so that rotation, shear, scales and translations were one number.
    From a `SeedGenerator` they are six draws of `keras.random.uniform` in turn, as the committed affine
    stand-ins were drawn (the reference is such a generator, drawn here)."""
    import tensorflow as tf

    seen = []
    original = transforms._matrices
    monkeypatch.setattr(transforms, "_matrices", lambda *args: seen.append(args) or original(*args))
    # rotation (radians, at most 20 degrees), shear, scales, translations (0.1 of the width 9 and height 8)
    ranges = [(-np.radians(20.0), np.radians(20.0)), (-0.2, 0.2), (0.8, 1.2), (0.8, 1.2), (-0.9, 0.9), (-0.8, 0.8)]
    images = rng.uniform(size=(256, 8, 9, 1)).astype("float32")

    def unit_draws(seed):
        seen.clear()
        transforms.random_affine(images, max_rotation=20.0, seed=seed)
        return np.stack([(ops.convert_to_numpy(p) - low) / (high - low) for p, (low, high) in zip(seen[0], ranges)])

    for seed in (5, None):
        draws = unit_draws(seed)
        assert draws.min() >= 0 and draws.max() <= 1
        assert np.abs(np.corrcoef(draws) - np.eye(6)).max() < 0.3
        np.testing.assert_array_equal(unit_draws(seed), draws)
    compiled = tf.function(lambda x: transforms.random_affine(x, seed=5))
    np.testing.assert_array_equal(compiled(images).numpy(), compiled(images).numpy())
    np.testing.assert_allclose(compiled(images).numpy(), transforms.random_affine(images, seed=5), atol=1e-6)
    reference = keras.random.SeedGenerator(3)
    expected = np.stack([ops.convert_to_numpy(keras.random.uniform((256,), seed=reference)) for _ in range(6)])
    np.testing.assert_allclose(unit_draws(keras.random.SeedGenerator(3)), expected, atol=1e-5)


def test_shift_equals_a_numpy_reference_and_compiles_with_xla(rng):
    import tensorflow as tf

    images = rng.uniform(size=(5, 6, 7, 2)).astype("float32")
    shifts = np.array([[0, 0], [1, -2], [-3, 1], [2, 2], [7, 0]], "int32")
    expected = np.zeros_like(images)
    for b, (dx, dy) in enumerate(shifts):
        for r in range(6):
            for c in range(7):
                if 0 <= r - dy < 6 and 0 <= c - dx < 7:
                    expected[b, r, c] = images[b, r - dy, c - dx]
    np.testing.assert_array_equal(ops.convert_to_numpy(transforms.shift(images, shifts)), expected)
    compiled = tf.function(lambda x, s: transforms.shift(x, s), jit_compile=True)
    np.testing.assert_array_equal(compiled(images, shifts).numpy(), expected)
    seed = keras.random.SeedGenerator(2)
    shifted = tf.function(lambda x: transforms.random_shift(x, 2, seed=seed), jit_compile=True)(images)
    assert shifted.shape == images.shape


@pytest.mark.parametrize("routing_name, pose", [("em", "matrix"), ("dynamic", "vector")])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_chunked_routing_equals_whole_batch(rng, routing_name, pose, jit_compile):
    # 3 x 3 x 3 = 27 receptive fields: chunks of 4 and 5 leave a padded last chunk, 100 one chunk.
    x = rng.normal(size=(3, 7, 7, 2, 16)).astype("float32")
    act = rng.uniform(0.1, 1.0, size=(3, 7, 7, 2)).astype("float32")
    weights = [rng.normal(size=shape).astype("float32")
               for shape in ((3, 3, 3, 3, 16), (3, 3, 3, 3), (3, 3, 3, 18, 3))]
    results = []
    for chunk in (None, 4, 5, 100):         # the whole batch first, each chunk size against it
        make = (lambda: EMRouting(3, 1.0, cost_normalization="standardize")) if routing_name == "em" \
            else (lambda: DynamicRouting(2))
        layer = ConvCapsules(3, 16, 3, 2, routing=make(), pose=pose, chunk_size=chunk)
        layer.build(x.shape)
        layer.kernel.assign(rng.normal(size=layer.kernel.shape).astype("float32") * 0.3
                            if chunk is None else results[0][-1])

        def loss_and_grads(layer=layer):
            xs, acts = tf.constant(x), tf.constant(act)
            with tf.GradientTape() as tape:
                tape.watch([xs, acts])
                result = layer.route(xs, acts)
                loss = sum(tf.reduce_sum(w * t) for w, t in zip(weights, result))
            grads = tape.gradient(loss, [xs, acts] + layer.trainable_variables,
                                  unconnected_gradients=tf.UnconnectedGradients.ZERO)
            return [*result, *grads]

        run = tf.function(loss_and_grads, jit_compile=jit_compile)
        results.append([t.numpy() for t in run()] + [layer.kernel.numpy()])
    for chunk, found in zip((4, 5, 100), results[1:]):
        for chunked, whole in zip(found[:-1], results[0][:-1]):
            scale = np.abs(whole).max()
            np.testing.assert_allclose(chunked, whole, rtol=0, atol=5e-5 * max(scale, 1e-6), err_msg=f"chunk {chunk}")


def test_chunk_size_is_checked_and_serialised():
    with pytest.raises(InputError, match="chunk_size must be an integer >= 1, or None"):
        ConvCapsules(3, 16, chunk_size=0)
    layer = ConvCapsules(3, 16, chunk_size=7)
    again = ConvCapsules.from_config(layer.get_config())
    assert again.chunk_size == 7
