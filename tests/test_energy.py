"""The closed-form CD update (Hauser eq. 18) against autodiff and NumPy."""

import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import energy
from poecaps.capsules import squash
from poecaps.errors import InputError
from poecaps.routing import DynamicRouting


def _layer(rng, batch, num_in, num_out, d_in, d_out):
    x = ops.convert_to_numpy(squash(rng.normal(size=(batch, num_in, d_in)) * 2)).astype("float64")
    w = rng.normal(size=(num_in, num_out, d_out, d_in)) * 0.5
    return x, w


def _autodiff_cd(x, w, c, x_neg):
    w_var = tf.Variable(w)
    with tf.GradientTape() as tape:
        objective = tf.reduce_mean(energy.free_energy(x, w_var, c) - energy.free_energy(x_neg, w_var, c))
    return -tape.gradient(objective, w_var).numpy()


@pytest.mark.parametrize("iterations", [0, 1, 2, 3])
@pytest.mark.parametrize("agreement", ["dot", "cosine"])
def test_encoder_cd_gradient_equals_autodiff(rng, iterations, agreement):
    x, w = _layer(rng, batch=5, num_in=9, num_out=4, d_in=3, d_out=6)
    routing = DynamicRouting(iterations, agreement=agreement)
    c = ops.convert_to_numpy(routing.route_linear(x, w).coefficients).astype("float64")
    x_neg, _ = energy.mix(x, w, c)
    closed = ops.convert_to_numpy(energy.encoder_cd_gradient(x, w, c))
    auto = _autodiff_cd(x, w, c, ops.convert_to_numpy(x_neg))
    np.testing.assert_allclose(closed, auto, rtol=1e-5, atol=1e-12 * np.abs(auto).max())
    assert np.abs(closed).max() > 1e-6  # a vanishing gradient would pass trivially


@pytest.mark.parametrize("iterations", [0, 1, 2, 3])
def test_decoder_cd_gradient_equals_autodiff(rng, iterations):
    # Decoder: visible = 4 upper capsules of 6-D, hidden = 9 lower capsules of 3-D.
    upper, u = _layer(rng, batch=5, num_in=4, num_out=9, d_in=6, d_out=3)
    routing = DynamicRouting(iterations, agreement="cosine", normalize="children")
    e = ops.convert_to_numpy(routing.route_linear(upper, u).coefficients).astype("float64")
    upper_neg, _ = energy.decoder_mix(upper, u, e)
    closed = ops.convert_to_numpy(energy.decoder_cd_gradient(upper, u, e))
    auto = _autodiff_cd(upper, u, e, ops.convert_to_numpy(upper_neg))
    np.testing.assert_allclose(closed, auto, rtol=1e-5, atol=1e-12 * np.abs(auto).max())


def test_cd_gradient_matches_numpy_formula(rng):
    """Eq. 18 written out with per-example outer products."""
    x, w = _layer(rng, batch=3, num_in=5, num_out=2, d_in=3, d_out=4)
    c = rng.dirichlet(np.ones(2), size=(3, 5))
    z = np.einsum("bij,ijoe,bie->bjo", c, w, x)
    x_neg = ops.convert_to_numpy(squash(np.einsum("bij,ijoe,bjo->bie", c, w, ops.convert_to_numpy(squash(z)))))
    z_neg = np.einsum("bij,ijoe,bie->bjo", c, w, x_neg)
    expected = np.zeros_like(w)
    for b in range(3):
        for i in range(5):
            for j in range(2):
                pos = np.outer(z[b, j], x[b, i]) / (1 + z[b, j] @ z[b, j])
                neg = np.outer(z_neg[b, j], x_neg[b, i]) / (1 + z_neg[b, j] @ z_neg[b, j])
                expected[i, j] += 2 * c[b, i, j] * (pos - neg) / 3
    np.testing.assert_allclose(ops.convert_to_numpy(energy.encoder_cd_gradient(x, w, c)),
                               expected, rtol=1e-6)


def test_free_energy_is_energy_marginalised_over_hidden(rng):
    """exp(-F(x)) = sum over h in {0,1}^J of exp(-E(x, h)) (eq. 8-10)."""
    import itertools

    x, w = _layer(rng, batch=2, num_in=4, num_out=3, d_in=2, d_out=3)
    c = rng.dirichlet(np.ones(3), size=(2, 4))
    total = sum(np.exp(-ops.convert_to_numpy(energy.energy(x, np.array([h, h], float), w, c)))
                for h in itertools.product([0.0, 1.0], repeat=3))
    np.testing.assert_allclose(np.exp(-ops.convert_to_numpy(energy.free_energy(x, w, c))), total,
                               rtol=1e-5)


def test_mix_rejects_zero_steps(rng):
    x, w = _layer(rng, batch=1, num_in=2, num_out=2, d_in=2, d_out=2)
    with pytest.raises(InputError, match="steps=0"):
        energy.mix(x, w, np.full((1, 2, 2), 0.5), steps=0)


def test_children_normalisation_is_parents_with_weights_scaled_by_i_over_j(rng):
    """Uniform coefficients are 1/J over parents and 1/I over children, and every
    pass is linear in c W: so children with W' = (I/J) W is the parents' model
    (same P(on), same mixing), and its CD update is J/I of the parents' (hence
    the learning rate (I/J)^2 and L2 (J/I)^2 of the README's "routing axis").
    With agreement updates the two routings part."""
    num_in, num_out = 12, 3
    x, w = _layer(rng, batch=5, num_in=num_in, num_out=num_out, d_in=3, d_out=4)
    k = num_in / num_out

    def model(iterations, normalize, kernel):
        c = DynamicRouting(iterations, agreement="cosine", normalize=normalize).route_linear(x, kernel).coefficients
        c = ops.convert_to_numpy(c).astype("float64")
        return (ops.convert_to_numpy(energy.p_on(x, kernel, c)),
                ops.convert_to_numpy(energy.mix(x, kernel, c)[0]),
                ops.convert_to_numpy(energy.encoder_cd_gradient(x, kernel, c)))

    p_par, mix_par, grad_par = model(0, "parents", w)
    p_ch, mix_ch, grad_ch = model(0, "children", k * w)
    assert 0.05 < p_par.mean() < 0.95  # neither all off nor saturated
    np.testing.assert_allclose(p_ch, p_par, rtol=1e-6)
    np.testing.assert_allclose(mix_ch, mix_par, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(grad_ch, grad_par / k, rtol=1e-6, atol=1e-12 * np.abs(grad_par).max())
    # At the unscaled W, children start k^2 times shorter in |z|^2: nearly off.
    assert model(0, "children", w)[0].mean() < 0.2 * p_par.mean()
    p_par3, _, _ = model(3, "parents", w)
    p_ch3, _, _ = model(3, "children", k * w)
    assert np.abs(p_ch3 - p_par3).max() > 1e-3


_B, _I, _J, _DO, _DI = 2, 4, 3, 5, 6


@pytest.mark.parametrize("call, message", [
    # each of these was broadcast and gave a result without a word
    (lambda x, k, c, h, v: energy.free_energy(x, k, c[:, :1]), r"c must be \[B, I, J\] \(B=2, I=4, J=3\)"),
    (lambda x, k, c, h, v: energy.p_on(x, k, c[:1]), r"c must be \[B, I, J\]"),
    (lambda x, k, c, h, v: energy.energy(x, h[:, :1], k, c), r"h must be \[B, J\] \(B=2, J=3\)"),
    (lambda x, k, c, h, v: energy.energy(x, h[:1], k, c), r"h must be \[B, J\]"),
    (lambda x, k, c, h, v: energy.mix(x, k, c[:1]), r"c must be \[B, I, J\]"),
    (lambda x, k, c, h, v: energy.encoder_cd_gradient(x, k, c, c_neg=c[:1]), r"c_neg must be"),
    (lambda x, k, c, h, v: energy.reconstruct(v[:1], k, c), r"c must be \[B, I, J\] \(B=1"),
    # these failed inside TensorFlow
    (lambda x, k, c, h, v: energy.free_energy(x[:1], k, c), r"c must be \[B, I, J\] \(B=1"),
    (lambda x, k, c, h, v: energy.routed_sum(x, k, c[..., :1]), r"c must be"),
    (lambda x, k, c, h, v: energy.encoder_cd_gradient(x, k, c, x_neg=x[:1]), r"x_neg must be \[B, I, D_in\]"),
    (lambda x, k, c, h, v: energy.transpose_votes(v[:, :1], k), r"v must be \[B, J, D_out\] \(B=2, J=3, D_out=5\)"),
    (lambda x, k, c, h, v: energy.free_energy(x, k[0], c), r"kernel must be \[I, J, D_out, D_in\]"),
])
def test_energy_functions_refuse_arrays_that_do_not_fit_the_kernel(rng, call, message):
    x = rng.normal(size=(_B, _I, _DI)).astype("float32")
    kernel = rng.normal(size=(_I, _J, _DO, _DI)).astype("float32")
    c = rng.uniform(size=(_B, _I, _J)).astype("float32")
    h, v = np.ones((_B, _J), "float32"), rng.normal(size=(_B, _J, _DO)).astype("float32")
    with pytest.raises(InputError, match=message):
        call(x, kernel, c, h, v)
