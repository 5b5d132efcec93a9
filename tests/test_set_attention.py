"""The set-transformer blocks (MAB, ISAB, PMA) against NumPy, their symmetries, errors, fit and saving.

Tolerances: the NumPy reference runs in float64, the layers in float32
(unit roundoff 6e-8). Each output passes through about ten chained
operations on values of order 1 (the weights are drawn with scale 0.5),
and the layer norm divides by a standard deviation of order 1, so
rounding moves outputs by about 1e-6; 2e-5 leaves a wide margin, while
any wrong term (a missing bias, a softmax over the wrong axis, the
residual left out) moves them by order 0.1.
"""

import keras
import numpy as np
import pytest
from keras import ops

from poecaps.errors import InputError
from poecaps.layers import AttentionPooling, InducedSetAttention, MultiheadAttentionBlock

ATOL = 2e-5


def _randomise(layer, rng):
    """Every weight drawn at random, biases and layer-norm offsets included, so none is trivially zero or one."""
    for variable in layer.weights:
        variable.assign(rng.normal(0.0, 0.5, size=variable.shape).astype("float32"))


def _weights(layer):
    """`{path relative to the layer: array}` in float64."""
    prefix = layer.path + "/"
    return {v.path[len(prefix):]: np.asarray(v, "float64") for v in layer.weights}


def _layer_norm(z, gamma, beta, epsilon):
    mean = z.mean(-1, keepdims=True)
    variance = ((z - mean) ** 2).mean(-1, keepdims=True)
    return (z - mean) / np.sqrt(variance + epsilon) * gamma + beta


def _softmax(z, axis):
    z = z - z.max(axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis, keepdims=True)


def _mab(block, x, y):
    """MAB(X, Y) = LN(H + relu(H W + b)), H = LN(X + MultiHead(X, Y, Y)), written out head by head."""
    w = _weights(block)
    x, y = np.asarray(x, "float64"), np.asarray(y, "float64")
    key_dim = block.units // block.heads
    # [B, n, d] x [d, h, k] -> [B, n, h, k]; keys and values likewise from Y
    q = np.einsum("bnd,dhk->bnhk", x, w["attention/query/kernel"]) + w["attention/query/bias"]
    k = np.einsum("bmd,dhk->bmhk", y, w["attention/key/kernel"]) + w["attention/key/bias"]
    v = np.einsum("bmd,dhk->bmhk", y, w["attention/value/kernel"]) + w["attention/value/bias"]
    # [B, n, h, k] x [B, m, h, k] -> [B, h, n, m], a softmax over the m elements of Y
    attention = _softmax(np.einsum("bnhk,bmhk->bhnm", q, k) / np.sqrt(key_dim), axis=-1)
    heads = np.einsum("bhnm,bmhk->bnhk", attention, v)
    # [B, n, h, k] x [h, k, d] -> [B, n, d]
    out = (np.einsum("bnhk,hkd->bnd", heads, w["attention/attention_output/kernel"])
           + w["attention/attention_output/bias"])
    h = _layer_norm(x + out, w["norm1/gamma"], w["norm1/beta"], block.norm1.epsilon)
    f = np.maximum(h @ w["feed_forward/kernel"] + w["feed_forward/bias"], 0.0)
    return _layer_norm(h + f, w["norm2/gamma"], w["norm2/beta"], block.norm2.epsilon)


def test_mab_equals_numpy(rng):
    block = MultiheadAttentionBlock(units=8, heads=2)
    x = rng.normal(size=(3, 5, 8)).astype("float32")
    y = rng.normal(size=(3, 7, 4)).astype("float32")      # Y of another feature size
    block(x, y)
    _randomise(block, rng)
    got = ops.convert_to_numpy(block(x, y))
    assert got.shape == (3, 5, 8)
    np.testing.assert_allclose(got, _mab(block, x, y), rtol=0, atol=ATOL)


def test_isab_equals_numpy(rng):
    layer = InducedSetAttention(units=8, heads=4, inducing=3)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    layer(x)
    _randomise(layer, rng)
    points = np.repeat(np.asarray(layer.points, "float64"), 2, axis=0)
    expected = _mab(layer.broadcast, x, _mab(layer.summarise, points, x))
    np.testing.assert_allclose(ops.convert_to_numpy(layer(x)), expected, rtol=0, atol=ATOL)


def test_pma_equals_numpy(rng):
    layer = AttentionPooling(units=8, heads=2, seeds=2)
    x = rng.normal(size=(2, 6, 3)).astype("float32")      # any feature size
    layer(x)
    _randomise(layer, rng)
    w = _weights(layer)
    features = np.maximum(x @ w["feed_forward/kernel"] + w["feed_forward/bias"], 0.0)
    seeds = np.repeat(w["seed_vectors"], 2, axis=0)
    got = ops.convert_to_numpy(layer(x))
    assert got.shape == (2, 2, 8)
    np.testing.assert_allclose(got, _mab(layer.block, seeds, features), rtol=0, atol=ATOL)


def test_isab_is_permutation_equivariant_and_pma_invariant(rng):
    isab = InducedSetAttention(units=8, heads=2, inducing=4)
    pma = AttentionPooling(units=8, heads=2, seeds=3)
    x = rng.normal(size=(2, 9, 8)).astype("float32")
    isab(x), pma(x)
    _randomise(isab, rng), _randomise(pma, rng)
    order = rng.permutation(9)
    np.testing.assert_allclose(ops.convert_to_numpy(isab(x[:, order])), ops.convert_to_numpy(isab(x))[:, order],
                               rtol=0, atol=ATOL)
    np.testing.assert_allclose(ops.convert_to_numpy(pma(x[:, order])), ops.convert_to_numpy(pma(x)),
                               rtol=0, atol=ATOL)


def test_sets_of_any_size(rng):
    isab, pma = InducedSetAttention(units=8, heads=2, inducing=3), AttentionPooling(units=8, heads=2, seeds=2)
    for n in (1, 4, 11):
        x = rng.normal(size=(2, n, 8)).astype("float32")
        assert tuple(isab(x).shape) == (2, n, 8) == isab.compute_output_shape((2, n, 8))
        assert tuple(pma(x).shape) == (2, 2, 8) == pma.compute_output_shape((2, n, 8))


@pytest.mark.parametrize("make, message", [
    (lambda: MultiheadAttentionBlock(units=8, heads=3), "Received: units=8, heads=3"),
    (lambda: MultiheadAttentionBlock(units=8, heads=0), "Received: heads=0"),
    (lambda: InducedSetAttention(units=0), "Received: units=0"),
    (lambda: InducedSetAttention(inducing=2.5), "Received: inducing=2.5"),
    (lambda: AttentionPooling(seeds=True), "Received: seeds=True"),
    (lambda: AttentionPooling(seeds=-1), "Received: seeds=-1"),
])
def test_bad_sizes_are_refused(make, message):
    with pytest.raises(InputError, match=message):
        make()


def test_residual_width_is_checked():
    with pytest.raises(InputError, match=r"`units` = 8 features.*Received: shape=\(2, 5, 4\)"):
        InducedSetAttention(units=8, heads=2, inducing=3)(np.zeros((2, 5, 4), "float32"))


def test_residual_width_is_checked_on_every_call_not_only_at_build():
    """Once built, the blocks refused another width only by TensorFlow's reshape error from inside Keras'
    attention (before)."""
    isab = InducedSetAttention(units=8, heads=2, inducing=3)
    mab = MultiheadAttentionBlock(units=8, heads=2)
    assert isab(np.zeros((2, 5, 8), "float32")).shape == (2, 5, 8)
    assert mab(np.zeros((2, 5, 8), "float32"), np.zeros((2, 4, 3), "float32")).shape == (2, 5, 8)
    with pytest.raises(InputError, match=r"`units` = 8 features.*Received: shape=\(2, 5, 6\)"):
        isab(np.zeros((2, 5, 6), "float32"))
    with pytest.raises(InputError, match=r"`units` = 8 features.*Received: shape=\(2, 5, 6\)"):
        mab(np.zeros((2, 5, 6), "float32"), np.zeros((2, 4, 3), "float32"))


@pytest.mark.parametrize("call, message", [
    (lambda: AttentionPooling(8, 2, 1)(np.ones((2, 5), "float32")),
     r"AttentionPooling '\w+': x must be a set \[batch, elements, features\]\. Received: shape=\(2, 5\)"),
    (lambda: AttentionPooling(8, 2, 1)(np.ones((2, 5, 3, 3), "float32")), r"Received: shape=\(2, 5, 3, 3\)"),
    (lambda: InducedSetAttention(8, 2, 3)(np.ones((2, 8), "float32")), r"x must be a set .*shape=\(2, 8\)"),
    (lambda: MultiheadAttentionBlock(8, 2)(np.ones((2, 4, 8), "float32"), np.ones((2, 3), "float32")),
     r"y must be a set \[batch, elements, features\]\. Received: shape=\(2, 3\)"),
    (lambda: MultiheadAttentionBlock(8, 2)(np.ones((2, 4, 8), "float32"), np.ones((3, 3, 5), "float32")),
     r"x and y must share one batch size\. Received: shapes \(2, 4, 8\) and \(3, 3, 5\)"),
])
def test_sets_of_another_rank_or_batch_are_refused_by_name(call, message):
    """Before, TensorFlow's einsum (rank 2 or 4, two batch sizes) or Keras' Softmax (IndexError) failed inside
    MultiHeadAttention."""
    with pytest.raises(InputError, match=message):
        call()


def test_attention_pooling_refuses_another_feature_size_once_built():
    """Before, Keras' Dense named its own input spec ('feed_forward'); now the layer names the built width."""
    pool = AttentionPooling(8, 2, 1, name="pool")
    assert pool(np.ones((2, 5, 3), "float32")).shape == (2, 1, 8)
    with pytest.raises(InputError, match=r"'pool': x must have the 3 features it was built for\. "
                                         r"Received: shape=\(2, 5, 4\)"):
        pool(np.ones((2, 5, 4), "float32"))


def test_config_round_trip_with_non_default_values():
    for layer in (MultiheadAttentionBlock(units=12, heads=3, name="m"),
                  InducedSetAttention(units=12, heads=3, inducing=5, name="i"),
                  AttentionPooling(units=12, heads=6, seeds=4, name="p")):
        config = layer.get_config()
        again = type(layer).from_config(config)
        assert again.get_config() == config


def _set_model():
    inputs = keras.Input((6, 8))
    h = InducedSetAttention(units=8, heads=2, inducing=3)(inputs)
    pooled = AttentionPooling(units=8, heads=2, seeds=1)(h)
    return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Flatten()(pooled)))


def test_saves_and_reloads(tmp_path, rng):
    model = _set_model()
    for layer in model.layers[1:3]:
        _randomise(layer, rng)
    x = rng.normal(size=(4, 6, 8)).astype("float32")
    path = str(tmp_path / "set.keras")
    model.save(path)
    again = keras.saving.load_model(path)
    np.testing.assert_allclose(ops.convert_to_numpy(again(x)), ops.convert_to_numpy(model(x)), rtol=0, atol=1e-6)


def test_tiny_fit_learns_a_set_statistic(rng):
    """The largest first feature over the set: a symmetric function the blocks can express."""
    x = rng.normal(size=(256, 6, 8)).astype("float32")
    y = x[:, :, 0].max(axis=1, keepdims=True)
    model = _set_model()
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss="mse")
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=32, epochs=15, verbose=0, shuffle=False)
    assert model.evaluate(x, y, verbose=0) < 0.5 * before
