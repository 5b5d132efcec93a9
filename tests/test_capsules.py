import numpy as np
import pytest
from keras import ops

from poecaps import energy
from poecaps.capsules import capsules_to_code, primary_capsules, squash, unsquash
from poecaps.errors import InputError


def np_squash(z):
    n = np.linalg.norm(z, axis=-1, keepdims=True)
    return n**2 / (1 + n**2) * z / n


@pytest.mark.parametrize("max_length", [1.0, 1.5, 0.0, float("nan")])
def test_unsquash_refuses_a_clip_outside_the_unit_interval(max_length):
    """A clip at 1 or beyond gave infinite or NaN results (sqrt(l / (1 - l))), one at 0 or below zero vectors."""
    with pytest.raises(InputError, match=r"max_length must be a finite number > 0 and < 1"):
        unsquash(np.array([[0.6, 0.8]], "float32"), max_length=max_length)
    # a clip inside (0, 1) bounds the length at sqrt(l / (1 - l)): l = 0.8 gives 2
    np.testing.assert_allclose(ops.convert_to_numpy(unsquash(np.array([[0.6, 0.8]], "float32"), max_length=0.8)),
                               [[1.2, 1.6]], rtol=1e-6)


@pytest.mark.parametrize("epsilon", [0.0, -1e-7, float("inf")])
def test_frobenius_normalisation_refuses_an_epsilon_that_is_not_positive(epsilon):
    """epsilon = 0 made a zero matrix 0/0 = NaN, a negative one made small matrices NaN (a square root of less
    than zero), an infinite one zeroed every matrix."""
    from poecaps.layers.capsule_dense import frobenius_normalized

    with pytest.raises(InputError, match="epsilon must be a finite number > 0"):
        frobenius_normalized(np.zeros((1, 1, 2, 2), "float32"), epsilon)
    # W / sqrt(|W|_F^2 + eps) by hand: |W|_F^2 = 25, eps = 0 + 1e-7 default
    kernel = np.array([[[[3.0, 0.0], [0.0, 4.0]]]], "float32")
    np.testing.assert_allclose(ops.convert_to_numpy(frobenius_normalized(kernel)), kernel / np.sqrt(25 + 1e-7),
                               rtol=1e-6)


def test_squash_matches_hand_computation():
    z = np.array([[3.0, 4.0]], dtype="float32")  # |z| = 5 -> length 25/26
    out = ops.convert_to_numpy(squash(z))
    np.testing.assert_allclose(out, [[25 / 26 * 3 / 5, 25 / 26 * 4 / 5]], rtol=1e-6)


def test_squash_matches_numpy(rng):
    z = rng.normal(size=(5, 7, 8)).astype("float32") * 3
    np.testing.assert_allclose(ops.convert_to_numpy(squash(z)), np_squash(z), rtol=1e-5)


@pytest.mark.parametrize("dtype, smallest", [("float32", 1e-8), ("float64", 1e-70)])
def test_unsquash_inverts_squash_at_every_length_up_to_the_clip(rng, dtype, smallest):
    """unsquash(squash(z)) = z within the documented bound, relative error
    4 u (1 + |z|^2) + 8 u + 2 D tiny / |z|^4 (u the unit roundoff, tiny the smallest normal
    number: squares of coordinates of x = squash(z), |x| = |z|^2, that flush to zero),
    up to |z| = 300, below the clip at about 1000."""
    lengths = np.geomspace(smallest, 300.0, 400)
    directions = rng.normal(size=(400, 16))
    z = (directions / np.linalg.norm(directions, axis=-1, keepdims=True) * lengths[:, None]).astype(dtype)
    back = ops.convert_to_numpy(unsquash(squash(z))).astype("float64")
    u, tiny = np.finfo(dtype).eps / 2, np.finfo(dtype).tiny
    bound = 4 * u * (1 + lengths ** 2) + 8 * u + 2 * 16 * tiny / lengths ** 4
    error = np.linalg.norm(back - z.astype("float64"), axis=-1) / lengths
    assert np.all(error <= bound), (lengths[error > bound][:5], error[error > bound][:5])


def test_squash_and_unsquash_of_zero_are_zero_with_zero_gradient():
    import tensorflow as tf

    z = tf.zeros((2, 4))
    with tf.GradientTape() as tape:
        tape.watch(z)
        out = squash(z)
    np.testing.assert_array_equal(out.numpy(), 0.0)
    np.testing.assert_array_equal(tape.gradient(out, z).numpy(), 0.0)
    np.testing.assert_array_equal(ops.convert_to_numpy(unsquash(np.zeros((2, 4), "float32"))), 0.0)


def test_norm_root_and_ratio_are_exact_with_zero_gradient_where_undefined():
    import tensorflow as tf

    from poecaps.capsules import norm, ratio, root

    x = tf.constant([[3.0, 4.0], [0.0, 0.0]])
    with tf.GradientTape() as tape:
        tape.watch(x)
        n = norm(x)
    np.testing.assert_array_equal(n.numpy(), [5.0, 0.0])                         # no epsilon in the value
    np.testing.assert_allclose(tape.gradient(n, x).numpy(), [[0.6, 0.8], [0.0, 0.0]], rtol=1e-7)  # x / |x|, then 0
    sq = tf.constant([4.0, 0.0])
    with tf.GradientTape() as tape:
        tape.watch(sq)
        r = root(sq)
    np.testing.assert_array_equal(r.numpy(), [2.0, 0.0])
    np.testing.assert_array_equal(tape.gradient(r, sq).numpy(), [0.25, 0.0])       # 1 / (2 sqrt(4)), then 0
    num, den = tf.constant([3.0, 5.0]), tf.constant([2.0, 0.0])
    with tf.GradientTape() as tape:
        tape.watch([num, den])
        q = ratio(num, den)
    np.testing.assert_array_equal(q.numpy(), [1.5, 0.0])
    grad_num, grad_den = tape.gradient(q, [num, den])
    np.testing.assert_array_equal(grad_num.numpy(), [0.5, 0.0])                   # 1 / den, then 0
    np.testing.assert_array_equal(grad_den.numpy(), [-0.75, 0.0])                 # -num / den^2, then 0


def test_unsquash_clips_lengths_at_or_above_one():
    x = np.array([[1.0, 0.0], [3.0, 4.0]], dtype="float32")
    out = ops.convert_to_numpy(unsquash(x))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[1] / np.linalg.norm(out[1]), [0.6, 0.8], rtol=1e-5)


def test_p_on_equals_length_of_squashed_capsule(rng):
    x = ops.convert_to_numpy(squash(rng.normal(size=(4, 6, 3)).astype("float32")))
    w = rng.normal(size=(6, 5, 4, 3)).astype("float32")
    c = rng.dirichlet(np.ones(5), size=(4, 6)).astype("float32")
    z = np.einsum("bij,ijoe,bie->bjo", c, w, x)
    np.testing.assert_allclose(ops.convert_to_numpy(energy.p_on(x, w, c)),
                               np.linalg.norm(np_squash(z), axis=-1), rtol=1e-5)


def test_primary_capsules_reshape_and_inverse(rng):
    code = rng.normal(size=(2, 6, 6, 128)).astype("float32")
    caps = primary_capsules(code, 8)
    assert caps.shape == (2, 576, 8)
    np.testing.assert_array_equal(ops.convert_to_numpy(caps)[0, 1], code[0, 0, 0, 8:16])
    np.testing.assert_array_equal(ops.convert_to_numpy(capsules_to_code(caps, (6, 6, 128))), code)


def test_primary_capsules_of_a_code_whose_size_is_unknown_while_tracing(rng):
    """Traced for any batch, height and width, the capsules are the code's channels in groups, as a NumPy
    reshape gives them; before, an unknown height failed (None * None)."""
    import tensorflow as tf

    code = rng.normal(size=(3, 2, 5, 16)).astype("float32")
    traced = tf.function(lambda c: primary_capsules(c, 4), input_signature=[tf.TensorSpec([None, None, None, 16])])
    np.testing.assert_array_equal(traced(code).numpy(), code.reshape(3, 2 * 5 * 4, 4))
    assert traced.get_concrete_function().structured_outputs.shape.as_list() == [None, None, 4]


def test_primary_capsules_rejects_dimension_not_dividing_channels():
    with pytest.raises(InputError, match="capsule_dim=7"):
        primary_capsules(np.zeros((1, 2, 2, 16), "float32"), 7)


def test_capsules_fold_back_only_into_a_code_of_as_many_values():
    """Before, 4 examples of 9 x 8 capsules folded into a 3 x 3 x 16 code as 2 examples without a word (the
    reshape's -1 took up the difference), and capsule_dim 0 was Python's ZeroDivisionError. A size unknown while
    tracing passes."""
    import tensorflow as tf

    with pytest.raises(InputError, match=r"I \* D = 144 values per example for a code of shape \(3, 3, 16\). "
                                         r"Received: capsules of shape \(4, 9, 8\)"):
        capsules_to_code(np.zeros((4, 9, 8), "float32"), (3, 3, 16))
    with pytest.raises(InputError, match=r"Received: capsules of shape \(2, 18\)"):
        capsules_to_code(np.zeros((2, 18), "float32"), (3, 3, 2))
    assert tuple(capsules_to_code(np.zeros((4, 18, 8), "float32"), (3, 3, 16)).shape) == (4, 3, 3, 16)
    traced = tf.function(lambda c: capsules_to_code(c, (3, 3, 16)), input_signature=[tf.TensorSpec([None, None, 8])])
    assert tuple(traced(np.zeros((4, 18, 8), "float32")).shape) == (4, 3, 3, 16)
    with pytest.raises(InputError, match=r"capsule_dim must be an integer >= 1. Received: capsule_dim=0"):
        primary_capsules(np.zeros((1, 2, 2, 16), "float32"), 0)


def test_with_length_appends_the_length_and_keeps_it(rng):
    from poecaps.capsules import with_length

    x = rng.normal(size=(5, 3, 4)).astype("float32") * 0.3
    out = ops.convert_to_numpy(with_length(x))
    norm = np.sqrt(np.sum(x * x, axis=-1))
    np.testing.assert_allclose(out[..., :4], x / np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(out[..., 4], norm / np.sqrt(2.0), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), norm, rtol=1e-5)   # the same P(on)
    flipped = ops.convert_to_numpy(with_length(-x))
    np.testing.assert_allclose(flipped[..., 4], out[..., 4])                      # sides share the length
    np.testing.assert_allclose(ops.convert_to_numpy(with_length(np.zeros((2, 3), "float32"))), 0.0)
    with pytest.raises(InputError, match="last axis"):
        with_length(x, axis=1)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_with_length_keeps_its_inputs_dtype(rng, dtype):
    """Before, float64 (and float16) capsules failed: the divisor sqrt(2) was a float32 tensor."""
    from poecaps.capsules import with_length

    x = (rng.normal(size=(3, 4)) * 0.3).astype(dtype)
    out = with_length(ops.convert_to_tensor(x))
    assert ops.convert_to_numpy(out).dtype == dtype
    expected = np.concatenate([x, np.linalg.norm(x.astype("float64"), axis=-1, keepdims=True)], -1) / np.sqrt(2.0)
    # float16 (unit roundoff u = 4.9e-4): 4 squares and 3 sums (4u on the sum, 2u through the root), the
    # root and the division (u each): 4u < 3e-3
    np.testing.assert_allclose(ops.convert_to_numpy(out), expected, rtol=1e-12 if dtype == "float64" else 3e-3)
