import keras
import numpy as np
import pytest
from keras import ops

from poecaps.constraints import IsometricPoses
from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.layers import CapsuleDense
from poecaps.trainers.cd import CDTrainer, default_optimizer


def _maps(kernel):
    """Each upper capsule's map `M_j [D_out, I * D_in]` from `W [I, J, D_out, D_in]`."""
    kernel = np.asarray(kernel, "float64")
    return np.transpose(kernel, (1, 2, 0, 3)).reshape(kernel.shape[1], kernel.shape[2], -1)


def test_isometric_poses_is_the_polar_factor_at_the_rms_singular_value(rng):
    kernel = rng.normal(size=(7, 3, 4, 2)) * np.array([3.0, 1.0, 0.2, 0.05])[:, None]  # unequal rows
    constrained = ops.convert_to_numpy(IsometricPoses()(kernel.astype("float32")))
    for before, after in zip(_maps(kernel), _maps(constrained)):
        u, s, vt = np.linalg.svd(before, full_matrices=False)        # independent of the layer's eigh
        np.testing.assert_allclose(after, np.sqrt(np.mean(s ** 2)) * u @ vt, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(np.linalg.svd(after, compute_uv=False), np.sqrt(np.mean(s ** 2)),
                                   rtol=1e-4)
        np.testing.assert_allclose(np.linalg.norm(after), np.linalg.norm(before), rtol=1e-5)
    # A map with equal singular values is left as it is.
    np.testing.assert_allclose(ops.convert_to_numpy(IsometricPoses()(constrained)), constrained,
                               rtol=1e-4, atol=2e-5)


def test_isometric_poses_arguments_are_checked():
    with pytest.raises(InputError, match=r"^epsilon must be a finite number > 0\. Received: epsilon=0\.0$"):
        IsometricPoses(epsilon=0.0)
    with pytest.raises(InputError, match=r"kernel \[I, J, D_out, D_in\]"):
        IsometricPoses()(np.ones((3, 4), "float32"))


def test_isometric_poses_refuses_maps_with_fewer_columns_than_rows(rng):
    # M_j [D_out, I * D_in] has at most I * D_in nonzero singular values, so D_out equal ones do not exist
    # when I * D_in < D_out. Before, the inverse square root of M_j M_j^T's near-zero eigenvalues turned
    # rounding noise into a map of unequal singular values and another Frobenius norm, without a word.
    kernel = rng.normal(size=(1, 2, 16, 8)).astype("float32")
    with pytest.raises(InputError, match=r"I \* D_in = 8 < D_out = 16"):
        IsometricPoses()(kernel)
    # A layer with such a kernel says so when it is built, not at its first optimizer update.
    layer = CapsuleDense(2, 16, kernel_constraint=IsometricPoses())
    with pytest.raises(InputError, match=r"I \* D_in = 8 < D_out = 16"):
        layer(np.ones((3, 1, 8), "float32"))
    # I * D_in = D_out (square maps) is accepted: each map becomes its RMS singular value times an orthogonal
    # matrix. The maps have singular values in [1, 2], so float32 eigh resolves each to ~1e-6.
    square = np.zeros((2, 2, 16, 8))
    for j in range(2):
        u, _ = np.linalg.qr(rng.normal(size=(16, 16)))
        v, _ = np.linalg.qr(rng.normal(size=(16, 16)))
        m = u @ np.diag(np.linspace(1.0, 2.0, 16)) @ v.T                        # M_j [D_out, I * D_in]
        square[:, j] = np.stack([m[:, :8], m[:, 8:]])
    for m in _maps(ops.convert_to_numpy(IsometricPoses()(square.astype("float32")))):
        np.testing.assert_allclose(np.linalg.svd(m, compute_uv=False), np.sqrt(np.mean(np.linspace(1, 2, 16) ** 2)),
                                   rtol=1e-4)


def test_cd_training_keeps_each_capsules_singular_values_equal(rng):
    x = (rng.normal(size=(48, 6, 3)) * np.array([2.0, 0.5, 0.1])).astype("float32")
    layers = {}
    for constraint in (None, IsometricPoses()):
        layer = CapsuleExperts(3, 4, kernel_constraint=constraint,
                               kernel_initializer=keras.initializers.RandomNormal(stddev=0.5, seed=0))
        layer.build(x.shape)
        trainer = CDTrainer(layer, l2=0.0)
        trainer.compile(optimizer=default_optimizer(0.5, 10))
        trainer.fit(x, epochs=2, batch_size=16, verbose=0)
        layers[constraint is None] = _maps(ops.convert_to_numpy(layer.kernel))
    spread = lambda maps: [np.ptp(s) / s.max() for s in np.linalg.svd(maps, compute_uv=False)]
    assert max(spread(layers[False])) < 1e-4
    assert min(spread(layers[True])) > 1e-2    # without it CD makes them unequal


def test_capsule_dense_serialises_its_constraint():
    layer = CapsuleDense(3, 4, kernel_constraint=IsometricPoses(epsilon=1e-9))
    clone = CapsuleDense.from_config(layer.get_config())
    assert isinstance(clone.kernel_constraint, IsometricPoses)
    assert clone.kernel_constraint.epsilon == 1e-9


def test_capsule_dense_refuses_isometric_poses_for_matrix_poses():
    with pytest.raises(InputError, match="pose='matrix'"):
        CapsuleDense(3, 16, pose="matrix", kernel_constraint=IsometricPoses())
