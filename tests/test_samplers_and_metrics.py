import re

import keras
import numpy as np
import pytest
from keras import ops

from poecaps import metrics, samplers
from poecaps.errors import InputError
from poecaps.experts import CapsuleExperts
from poecaps.layers import ConvAutoencoder
from poecaps.models import CapsulePipeline
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting


def _built(layer, input_shape):
    layer.build((None, *input_shape))
    return layer


@pytest.fixture
def pipeline(rng):
    ae = _built(ConvAutoencoder(filters=8, kernel_size=5, seed=0), (16, 16, 1))
    num_lower = ae.code_shape[0] * ae.code_shape[1] * 2
    encoder = _built(CapsuleExperts(3, 4, routing=DynamicRouting(2, "cosine")), (num_lower, 4))
    decoder = _built(CapsuleExperts(num_lower, 4, routing=DynamicRouting(2, "cosine", "children"),
                                    kernel_initializer=keras.initializers.RandomNormal(stddev=1.0, seed=1)),
                     (3, 4))
    directions = rng.normal(size=(3, 4)).astype("float32")
    return CapsulePipeline(ae, encoder, decoder, capsule_dim=4, mean_directions=directions)


def test_the_pipeline_decodes_only_upper_capsules_of_its_shape(pipeline):
    """Before, capsules of another J failed inside XLA ('Incompatible shapes'), and, once capsules of the right
    shape had been decoded, capsules of another D were decoded silently (the kept graph, retraced, had
    relaxed the pose axis to unknown)."""
    assert pipeline.decode(np.zeros((2, 3, 4), "float32")).shape == (2, 16, 16, 1)
    for shape in ((2, 3, 3), (2, 4, 4), (3, 4)):
        with pytest.raises(InputError, match=rf"^upper capsules must be \[N, 3, 4\] \(J upper capsules of D "
                                             rf"dimensions\)\. Received: shape={re.escape(str(shape))}$"):
            pipeline.decode(np.zeros(shape, "float32"))


def test_the_pipeline_refuses_a_batch_size_below_one_before_decoding(pipeline, monkeypatch):
    """`decode(upper, batch_size=0)` was refused only after the capsule decoder had run over every row."""
    calls = []
    decode_capsules = pipeline.decode_capsules
    monkeypatch.setattr(pipeline, "decode_capsules", lambda x: calls.append(1) or decode_capsules(x))
    for batch_size in (0, -1, 2.5):
        with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
            pipeline.decode(np.zeros((2, 3, 4), "float32"), batch_size)
    assert calls == []
    assert pipeline.decode(np.zeros((2, 3, 4), "float32"), 1).shape == (2, 16, 16, 1)
    assert calls


def test_the_pipeline_refuses_components_and_statistics_it_would_misuse(pipeline):
    """Before, any object was taken as a component (an encoder as the autoencoder failed at its first use:
    'no attribute encode'); a code mean of [C] or [W, C] was broadcast against the code without a word, one of
    NaN made every image NaN, and directions of NaN, or of the wrong shape, failed in NumPy's broadcasting when
    the sampler used them, or with NaN picked a half of capsule space that meant nothing."""
    ae, encoder = pipeline.autoencoder, pipeline.encoder
    height, width, channels = ae.code_shape
    refused = [
        (lambda: CapsulePipeline(encoder), (r"^autoencoder must be a poecaps.layers.ConvAutoencoder. Received: "
                                           r"CapsuleExperts$")),
        (lambda: CapsulePipeline(ae, decoder=ae), r"^decoder must be a poecaps.experts.CapsuleExperts, or None"),
        (lambda: CapsulePipeline(ae, capsule_dim=2.5), r"^capsule_dim must be an integer >= 1"),
        (lambda: CapsulePipeline(ae, code_mean=np.zeros(channels)),
         (rf"^code_mean must have shape \[{height}, {width}, {channels}\] \(\[H, W, C\]\)\. Received: shape "
         rf"\({channels},\)$")),
        (lambda: CapsulePipeline(ae, code_mean=np.zeros((width, channels))), r"^code_mean must have shape"),
        (lambda: CapsulePipeline(ae, code_mean=np.full(ae.code_shape, np.nan)), r"^code_mean holds \d+ NaN"),
        (lambda: CapsulePipeline(ae, encoder, capsule_dim=4, mean_directions=np.ones((4, 4))),
         r"^mean_directions must have shape \[3, 4\] \(\[J, D\]\)\. Received: shape \(4, 4\)$"),
        (lambda: CapsulePipeline(ae, encoder, capsule_dim=4, winning_axes=np.full((3, 4), np.nan)),
         r"^winning_axes holds 12 NaN"),
        (lambda: CapsulePipeline(ae, winning_axes=np.ones(4)), r"^winning_axes must have shape \[J, D\]"),
        # components that do not fit: each was refused only at its first call, as a shape it did not expect
        (lambda: CapsulePipeline(ae, encoder, capsule_dim=2), (r"^The encoder reads lower capsules \[32, 4\] \[I, D\], "
                                                              r"not the \[64, 2\] the autoencoder's code forms")),
        (lambda: CapsulePipeline(ae, decoder=pipeline.decoder, capsule_dim=8), r"^The decoder writes lower capsules"),
        (lambda: CapsulePipeline(ae, encoder, _built(CapsuleExperts(32, 4), (5, 4)), capsule_dim=4),
         r"^The decoder reads upper capsules \[5, 4\], not the encoder's \[3, 4\]"),
        (lambda: CapsulePipeline(ae, capsule_dim=3), r"^capsule_dim must divide the number of channels \(8\)"),
    ]
    for make, message in refused:
        with pytest.raises(InputError, match=message):
            make()
    with pytest.raises(InputError, match=r"^mean_directions must have shape \[3, 4\]"):     # set afterwards
        pipeline.mean_directions = np.ones((3, 5))
    pipeline.code_mean = np.zeros(ae.code_shape, "float64")                               # kept as float32
    assert pipeline.code_mean.dtype == np.float32 and pipeline.encode(np.zeros((1, 16, 16, 1), "float32")).shape == (1, 3, 4)


def test_capsule_sampler_grid_shape_and_range(pipeline):
    sampler = samplers.get("capsule", pipeline=pipeline, seed=0)
    images = sampler.sample(rows=5)["images"]
    assert images.shape == (5, 3, 16, 16, 1)
    assert images.min() >= 0.0 and images.max() <= 1.0


def test_capsule_sampler_draws_are_standard_normal(pipeline):
    """Statistical check of the draws: mean 0 and variance 1 within 4 standard errors."""
    draws = samplers.get("capsule", pipeline=pipeline, seed=1).sample(rows=400)["draws"]
    n = draws.size
    assert abs(draws.mean()) < 4 / np.sqrt(n)
    assert abs(draws.var() - 1.0) < 4 * np.sqrt(2 / n)


def test_restricted_domain_keeps_draws_on_the_training_half_sphere(pipeline):
    result = samplers.get("capsule", pipeline=pipeline, seed=2).sample(rows=200, domain="restricted")
    dots = np.sum(result["draws"] * pipeline.mean_directions[None], axis=-1)
    assert np.all(dots >= 0)
    full = samplers.get("capsule", pipeline=pipeline, seed=2).sample(rows=200)["draws"]
    np.testing.assert_allclose(np.abs(full), np.abs(result["draws"]))  # only signs flip
    assert np.any(full != result["draws"])


def test_pose_second_moments_against_numpy_unsquash(rng):
    z = rng.normal(size=(50, 3, 4))
    sq = np.sum(z * z, axis=-1, keepdims=True)
    upper = (sq / (1 + sq) * z / np.sqrt(sq)).astype("float32")      # squash, written out
    expected = np.einsum("njd,nje->jde", z, z) / len(z)
    np.testing.assert_allclose(metrics.pose_second_moments(upper), expected, rtol=2e-3, atol=1e-4)
    with pytest.raises(InputError, match="N, J, D"):
        metrics.pose_second_moments(upper[0])


def test_longest_pose_second_moments_hand_computed():
    z = np.array([[[3.0, 0.0], [1.0, 0.0], [0.0, 0.5]],     # capsule 0 longest
                  [[0.0, 1.0], [0.0, 4.0], [0.5, 0.0]],     # capsule 1 longest
                  [[2.0, 2.0], [1.0, 1.0], [0.0, 0.1]]])    # capsule 0 longest
    sq = np.sum(z * z, axis=-1, keepdims=True)
    upper = (sq / (1 + sq) * z / np.sqrt(sq)).astype("float32")      # squash, written out
    moments, wins = metrics.longest_pose_second_moments(upper)
    np.testing.assert_array_equal(wins, [2, 1, 0])
    expected = np.stack([[[6.5, 2.0], [2.0, 2.0]],                  # ([3,0][3,0]' + [2,2][2,2]') / 2
                         [[0.0, 0.0], [0.0, 16.0]],                 # [0,4][0,4]'
                         [[0.25 / 3, 0.0], [0.0, 0.26 / 3]]])       # never longest: all 3 images
    np.testing.assert_allclose(moments, expected, rtol=2e-3, atol=1e-4)


def test_principal_share_hand_computed():
    moments = np.stack([np.diag([4.0, 1.0, 0.0]), np.eye(3), np.diag([0.0, 2.0, 0.0])])
    np.testing.assert_allclose(metrics.principal_share(moments), [0.8, 1 / 3, 1.0])
    rotation = np.linalg.qr(np.arange(9.0).reshape(3, 3) + np.eye(3))[0]
    np.testing.assert_allclose(metrics.principal_share(rotation @ moments[:1] @ rotation.T), [0.8])
    with pytest.raises(InputError, match="J, D, D"):
        metrics.principal_share(np.eye(3))


def test_each_column_decodes_its_own_capsule_alone(pipeline):
    """Image (r, j) is the decoding of a code whose capsule j is squash(draw r, j), all others 0."""
    result = samplers.CapsuleSampler(pipeline, seed=0).sample(rows=2)
    draws = result["draws"]
    for r in range(2):
        for j in range(3):
            code = np.zeros((1, 3, 4), "float32")
            z = draws[r, j].astype("float64")
            code[0, j] = z * np.linalg.norm(z) / (1 + z @ z)             # squash, written out
            expected = ops.convert_to_numpy(pipeline.decode_upper(code))[0]
            np.testing.assert_allclose(result["images"][r, j], expected, rtol=1e-4, atol=1e-5)
    # a code with a second capsule on decodes otherwise, so the check above can fail
    code[0, (j + 1) % 3] = code[0, j]
    assert np.abs(ops.convert_to_numpy(pipeline.decode_upper(code))[0] - expected).max() > 1e-3


def test_rbm_sampler_draws_each_unit_clamped_on_as_a_numpy_reference_does(rng):
    """The documented procedure in NumPy, from NumPy's generator of the same seed (v drawn first, then h):
    v ~ Bernoulli(sigmoid(b + W e_j)), h ~ Bernoulli(sigmoid(a + v W)) with h_j set to 1, image sigmoid(b + W h).
    Weights of size 2 make the draws far from certain, so a wrong clamp or a swapped draw shows."""
    rbm = _built(BernoulliRBM(4, seed=0), (6,))
    W, b, a = rng.normal(size=(6, 4)) * 2, rng.normal(size=6), rng.normal(size=4)
    for weight, value in zip((rbm.kernel, rbm.visible_bias, rbm.hidden_bias), (W, b, a)):
        weight.assign(value.astype("float32"))
    images = samplers.get("rbm", rbm=rbm, image_shape=(3, 2, 1), seed=5).sample(rows=3)["images"]
    sigmoid = lambda z: 1 / (1 + np.exp(-z))
    draws = np.random.default_rng(5)
    expected = np.zeros((3, 4, 6))
    v = np.zeros((3, 4, 6))
    for row in range(3):
        for j in range(4):
            v[row, j] = draws.random(6) < sigmoid(b + W[:, j])
    for row in range(3):
        for j in range(4):
            h = draws.random(4) < sigmoid(a + v[row, j] @ W)
            h[j] = 1
            expected[row, j] = sigmoid(b + W @ h)
    # every draw u lies at least 8e-4 from its probability here, so float32's rounding of p decides none of them
    np.testing.assert_allclose(images, expected.reshape(3, 4, 3, 2, 1), atol=1e-5)   # float32 sigmoids of |z| < 20


@pytest.mark.parametrize("rows, image_shape, message", [
    (0, (3, 2, 1), r"rows must be an integer >= 1. Received: rows=0"),
    (2, (3, 3, 1), r"image_shape \(3, 3, 1\) must hold the RBM's 6 visible units"),
    # not (H, W, C): before, (6,) drew [rows, units, 6] images and (-3, -2, 1) failed in NumPy's reshape
    (2, (6,), r"image_shape must be \(height, width, channels\), three integers >= 1\. Received: image_shape=\(6,\)"),
    (2, (-3, -2, 1), r"Received: image_shape=\(-3, -2, 1\)"),
])
def test_rbm_sampler_refuses_rows_and_image_shapes_it_cannot_draw(rows, image_shape, message):
    rbm = _built(BernoulliRBM(4, seed=0), (6,))
    with pytest.raises(InputError, match=message):
        samplers.RBMSampler(rbm, image_shape).sample(rows)


def test_rbm_sampler_refuses_an_rbm_without_weights():
    """Before, an unbuilt RBM failed with AttributeError 'kernel' in `visible_probabilities`."""
    with pytest.raises(InputError, match=r"has no weights yet; build it"):
        samplers.RBMSampler(BernoulliRBM(4, seed=0), (3, 2, 1)).sample(2)


def test_samplers_refuse_a_model_of_another_kind(pipeline):
    """Before, any object was taken, and the first draw failed with an AttributeError ('num_upper',
    'num_hidden')."""
    with pytest.raises(InputError, match=r"^pipeline must be a poecaps.models.CapsulePipeline. Received: NoneType$"):
        samplers.CapsuleSampler(None)
    with pytest.raises(InputError, match=r"^pipeline must be a poecaps.models.CapsulePipeline. Received: ConvAutoe"):
        samplers.CapsuleSampler(pipeline.autoencoder)
    with pytest.raises(InputError, match=r"^rbm must be a poecaps.rbm.BernoulliRBM. Received: CapsuleExperts$"):
        samplers.RBMSampler(pipeline.encoder, (4, 4, 1))


def test_unknown_sampler():
    with pytest.raises(InputError, match="name='gibbs'"):
        samplers.get("gibbs")
    with pytest.raises(InputError, match=r"name=\['rbm'\]$"):       # before: TypeError, unhashable list
        samplers.get(["rbm"])


def test_sampler_rejects_zero_rows(pipeline):
    with pytest.raises(InputError, match="rows=0"):
        samplers.CapsuleSampler(pipeline).sample(rows=0)


def test_reconstruction_through_the_capsule_path_is_an_image(pipeline, rng):
    images = rng.uniform(size=(2, 16, 16, 1)).astype("float32")
    assert ops.convert_to_numpy(pipeline.reconstruct(images)).shape == images.shape


def test_centered_code_round_trips_through_lower_capsules(pipeline, rng):
    images = rng.uniform(size=(2, 16, 16, 1)).astype("float32")
    pipeline.code_mean = rng.uniform(size=pipeline.autoencoder.code_shape).astype("float32")
    lower = pipeline.lower_capsules(images)
    direct = pipeline.autoencoder.decode(pipeline.autoencoder.encode(images))
    np.testing.assert_allclose(ops.convert_to_numpy(pipeline.decode_lower(lower)),
                               ops.convert_to_numpy(direct), atol=1e-4)


def test_specialisation_hand_computed():
    predicted = np.array([[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 1, 3]])
    result = metrics.specialisation(predicted, classes=4)
    assert result["majority"] == [0, 1, 3]
    assert result["purity"] == [0.75, 0.75, 0.75]
    assert result["classes_covered"] == 3
    # Before, a class >= classes counted as a class of its own (a capsule whose samples the classifier put in
    # class 4 of 4 was pure and covered one more class); -1 or float classes failed inside NumPy's bincount.
    for bad, message in ((predicted + 1, r"^predicted must lie in \[0, 4\)\. Received: 1 to 4$"),
                         (predicted - 1, r"^predicted must lie in \[0, 4\)\. Received: -1 to 2$"),
                         (predicted.astype("float64"), r"^predicted must be integers"),
                         (predicted[0], r"^specialisation needs predicted classes \[rows, J\]")):
        with pytest.raises(InputError, match=message):
            metrics.specialisation(bad, classes=4)


def test_class_selectivity_hand_computed():
    # Unit 0 is long on class 1 only; unit 1 is the same on every class.
    activity = np.array([[0.1, 0.5], [0.3, 0.5], [0.9, 0.5], [0.7, 0.5], [0.2, 0.5]])
    labels = np.array([0, 0, 1, 1, 2])
    result = metrics.class_selectivity(activity, labels, classes=4)   # class 3 absent
    assert result["preferred"] == [1, 0]
    np.testing.assert_allclose(result["spread"], [0.8 - 0.2, 0.0], atol=1e-12)
    np.testing.assert_allclose(result["mean_spread"], 0.3, atol=1e-12)
    assert result["classes_preferred"] == 2
    with pytest.raises(InputError, match="activity"):
        metrics.class_selectivity(activity[:, 0], labels, classes=4)
    # no examples failed inside NumPy's min; no units gave a NaN mean spread with a RuntimeWarning
    for empty, empty_labels in ((activity[:0], labels[:0]), (activity[:, :0], labels)):
        with pytest.raises(InputError, match=re.escape("activity [N, J] and labels [N], N and J > 0")):
            metrics.class_selectivity(empty, empty_labels, classes=4)


def test_keep_longest_hand_computed():
    upper = np.zeros((2, 3, 2))
    upper[0] = [[0.3, 0.0], [0.0, 0.5], [0.4, 0.0]]    # lengths 0.3, 0.5, 0.4
    upper[1] = [[0.6, 0.0], [0.1, 0.1], [0.0, -0.2]]   # lengths 0.6, 0.14, 0.2
    one = metrics.keep_longest(upper)
    np.testing.assert_array_equal(one[0], [[0, 0], [0, 0.5], [0, 0]])
    np.testing.assert_array_equal(one[1], [[0.6, 0], [0, 0], [0, 0]])
    two = metrics.keep_longest(upper, k=2)
    np.testing.assert_array_equal(two[0], [[0, 0], [0, 0.5], [0.4, 0]])
    np.testing.assert_array_equal(two[1], [[0.6, 0], [0, 0], [0, -0.2]])
    with pytest.raises(InputError, match="k="):
        metrics.keep_longest(upper, k=4)
    for k in (2.5, "2", True):       # before: a slice error, a TypeError from <=, and True kept one capsule
        with pytest.raises(InputError, match=rf"^k must be an integer >= 1\. Received: k={re.escape(repr(k))}$"):
            metrics.keep_longest(upper, k=k)


def test_longest_capsule_clusters_hand_computed():
    # Capsule 0 is longest on images 0, 1, 2 (classes 1, 1, 2); capsule 2 on
    # images 3, 4 (classes 0, 0); capsule 1 on none.
    lengths = np.array([[0.9, 0.1, 0.2], [0.8, 0.5, 0.1], [0.7, 0.6, 0.0],
                        [0.1, 0.2, 0.3], [0.2, 0.1, 0.9]])
    labels = np.array([1, 1, 2, 0, 0])
    result = metrics.longest_capsule_clusters(lengths, labels, classes=3)
    assert result["size"] == [3, 0, 2]
    assert result["majority"] == [1, None, 0]
    np.testing.assert_allclose(result["purity"][0], 2 / 3)
    assert result["purity"][1] is None and result["purity"][2] == 1.0
    np.testing.assert_allclose(result["overall_purity"], 4 / 5)
    np.testing.assert_allclose(result["mean_purity"], (2 / 3 + 1.0) / 2)   # capsule 1 wins none
    assert result["classes_covered"] == 2
    with pytest.raises(InputError, match="lengths"):
        metrics.longest_capsule_clusters(lengths, labels[:4], classes=3)


def test_principal_axes_point_to_the_mean_direction_side():
    moments = np.array([np.diag([4.0, 1.0]), np.diag([1.0, 9.0])])
    directions = np.array([[-0.6, 0.8], [0.6, 0.8]])
    np.testing.assert_allclose(metrics.principal_axes(moments, directions), [[-1.0, 0.0], [0.0, 1.0]],
                               atol=1e-12)
    with pytest.raises(InputError, match="directions"):
        metrics.principal_axes(moments, directions[:1])


def _side_capsules():
    """Three 2-D capsules on ten images (hand-made; see the test below)."""
    d = np.array([1.0, 1.0]) / np.sqrt(2.0)
    upper = np.zeros((10, 3, 2))
    # Images 0-3: capsule 0 wins, three poses on -e1 and one on +e1.
    upper[0:3, 0] = [-0.8, 0.0]
    upper[3, 0] = [0.8, 0.0]
    # Images 4-9: capsule 1 wins along the diagonal d, four on +d, two on -d;
    # capsule 0 is short there but on +e1, so its mean direction is +e1.
    upper[4:8, 1], upper[8:10, 1] = 0.9 * d, -0.9 * d
    upper[4:10, 0] = [0.2, 0.0]
    upper[0:4, 1] = 0.05 * d
    # Capsule 2 wins nothing; its poses lie on e2, seven of ten on the - side.
    upper[:, 2] = [0.0, -0.01]
    upper[7:, 2] = [0.0, 0.01]
    return upper, d


def test_winning_side_axes_hand_computed():
    upper, d = _side_capsules()
    axes = metrics.winning_side_axes(upper)
    # Capsule 0: the axis e1, signed to the side of 3 of its 4 winning poses,
    # against its mean training direction (+e1 on 7 of 10 images).
    np.testing.assert_allclose(axes, [[-1.0, 0.0], d, [0.0, -1.0]], atol=1e-12)
    unit = upper / np.linalg.norm(upper, axis=-1, keepdims=True)
    assert unit[:, 0].mean(axis=0) @ axes[0] < 0
    # Given moments are used as given: capsule 0's axis from a moment along e2.
    moments = np.stack([np.diag([1.0, 4.0]), np.outer(d, d), np.eye(2) + np.diag([0.0, 1.0])])
    np.testing.assert_allclose(metrics.winning_side_axes(upper, moments)[0], [0.0, 1.0], atol=1e-12)
    with pytest.raises(InputError, match="moments"):
        metrics.winning_side_axes(upper, moments[:2])
    with pytest.raises(InputError, match="upper capsules"):
        metrics.winning_side_axes(upper[:, 0])


def test_restricted_domain_on_the_winning_side(pipeline, rng):
    pipeline.winning_axes = rng.normal(size=(3, 4)).astype("float32")
    sampler = samplers.CapsuleSampler(pipeline, seed=5)
    winning = sampler.sample(rows=200, domain="winning")["draws"]
    assert np.all(np.sum(winning * pipeline.winning_axes[None], axis=-1) >= 0)
    mean = sampler.sample(rows=200, domain="restricted")["draws"]
    np.testing.assert_allclose(np.abs(winning), np.abs(mean))       # only signs differ
    assert np.any(winning != mean)
    with pytest.raises(InputError, match="domain"):
        sampler.sample(rows=2, domain="median")
    pipeline.winning_axes = None
    with pytest.raises(InputError, match="winning_axes"):
        sampler.sample(rows=2, domain="winning")


def test_longest_capsule_side_clusters_hand_computed():
    # Two 2-D capsules, axes e1 and e2. Longest capsule and side of each image:
    # 0: capsule 0, +   1: capsule 0, -   2: capsule 0, -   3: capsule 1, +
    # 4: capsule 1, +   5: capsule 0, +
    upper = np.array([[[0.9, 0.1], [0.1, 0.1]], [[-0.8, 0.0], [0.0, 0.3]], [[-0.7, 0.2], [0.1, 0.0]],
                      [[0.1, 0.0], [0.2, 0.6]], [[0.0, 0.1], [-0.3, 0.5]], [[0.5, -0.5], [0.0, 0.1]]])
    labels = np.array([2, 1, 1, 0, 0, 2])
    result = metrics.longest_capsule_side_clusters(upper, labels, 3, axes=np.eye(2))
    both = result["both_sides"]
    assert both["size"] == [2, 2, 2, 0]
    assert both["majority"] == [2, 1, 0, None]
    assert both["purity"] == [1.0, 1.0, 1.0, None]
    assert both["overall_purity"] == 1.0 and both["classes_covered"] == 3
    visited = result["visited_side"]
    assert visited["size"] == [2, 2] and visited["majority"] == [2, 0]
    assert visited["overall_purity"] == 1.0 and visited["classes_covered"] == 2
    np.testing.assert_allclose(result["visited_share"], 4 / 6)
    # Unsigned, capsule 0's images mix classes 2, 1, 1, 2.
    np.testing.assert_allclose(metrics.longest_capsule_clusters(
        np.linalg.norm(upper, axis=-1), labels, 3)["purity"][0], 0.5)
    with pytest.raises(InputError, match="axes"):
        metrics.longest_capsule_side_clusters(upper, labels, 3, axes=np.eye(3))


def test_linear_probe_separates_separable_features(rng):
    labels = rng.integers(0, 3, size=300)
    features = np.eye(3)[labels] * 3 + rng.normal(size=(300, 3)) * 0.1
    assert metrics.linear_probe(features[:200], labels[:200], features[200:], labels[200:]) > 0.95
    noise = rng.normal(size=(300, 3))
    assert metrics.linear_probe(noise[:200], labels[:200], noise[200:], labels[200:]) < 0.6


@pytest.mark.parametrize("train_labels, test_labels, test_features, message", [
    (lambda y: y[:, None], None, None, (r"^train_labels must be one integer per example, shape \[200\]\. "
                                        r"Received: shape \(200, 1\)$")),
    (None, lambda y: y[:, None], None, r"^test_labels must be one integer per example, shape \[100\]"),
    (lambda y: y - 1, None, None, r"^train_labels must lie in \[0, 3\)\. Received: -1 to 1$"),
    (lambda y: y.astype("float32"), None, None, r"^train_labels must be integers\. Received: dtype float32$"),
    (lambda y: y[:-1], None, None, r"^train_labels must be one integer per example, shape \[200\]"),
    (None, None, lambda x: x[:, :2], r"^test_features must have the training features' 3 values per example"),
    (None, None, lambda x: np.where(np.arange(3) == 1, np.nan, x), r"^test_features holds 100 NaN or infinite"),
])
def test_linear_probe_refuses_labels_and_features_it_would_misread(rng, train_labels, test_labels, test_features,
                                                                   message):
    """Labels other than one integer in [0, classes) per example, and test features of another width or not
    finite, are an `InputError` naming them. Before, a column of labels `[N, 1]` broadcast against `[N]` into a
    wrong accuracy (about 1/3 for these separable features, whose flat labels score above 0.95), a label -1
    indexed the last class, and the rest failed inside NumPy or SciPy."""
    labels = rng.integers(0, 3, size=300)
    features = np.eye(3)[labels] * 3 + rng.normal(size=(300, 3)) * 0.1
    same = lambda values: values
    x, y = features[:200], (train_labels or same)(labels[:200])
    xt, yt = (test_features or same)(features[200:]), (test_labels or same)(labels[200:])
    with pytest.raises(InputError, match=message):
        metrics.fit_linear_probe(x, y, 3)(xt, yt)


@pytest.mark.parametrize("l2", [1e-4, 0.3])
def test_linear_probe_decides_as_the_penalised_logistic_regression_solved_by_another_method(rng, l2):
    """The probe's contract, solved independently: standardise with the training statistics (std + 1e-6),
    append a bias, minimise mean softmax cross-entropy + l2/2 |W without bias|^2 with scipy's BFGS on
    finite-difference gradients. Overlapping classes, so the optimum is finite and unique; every test point
    whose two best reference logits differ by more than 1e-3 (far beyond both solvers' tolerance) gets the
    same class from the probe, read off its `accuracy` one point and one candidate label at a time."""
    from scipy import optimize, special

    classes, n_train = 3, 120
    labels = rng.choice(classes, size=n_train + 60, p=[0.6, 0.3, 0.1])   # unequal: the bias matters
    features = rng.normal(size=(classes, 4))[labels] + rng.normal(size=(len(labels), 4)) * 1.5
    features[:, 3] = 5.0 + 20.0 * features[:, 3]                     # a shifted, wide column: standardised
    x, y, test = features[:n_train], labels[:n_train], features[n_train:]
    mean, std = x.mean(0), x.std(0) + 1e-6

    def design(f):
        return np.hstack([(f - mean) / std, np.ones((len(f), 1))])

    def objective(flat):
        w = flat.reshape(5, classes)
        z = design(x) @ w
        return np.mean(special.logsumexp(z, axis=1) - z[np.arange(n_train), y]) + 0.5 * l2 * np.sum(w[:-1] ** 2)

    w = optimize.minimize(objective, np.zeros(5 * classes), method="BFGS", options={"gtol": 1e-9}).x
    logits = design(test) @ w.reshape(5, classes)
    top_two = np.sort(logits, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 1e-3
    assert clear.sum() >= 55
    accuracy = metrics.fit_linear_probe(x, y, classes, l2=l2)
    decided = np.array([[accuracy(row[None], np.array([c])) for c in range(classes)] for row in test])
    assert np.all(decided.sum(axis=1) == 1)                          # one class per point
    np.testing.assert_array_equal(decided.argmax(1)[clear], logits.argmax(1)[clear])


def test_probe_penalty_is_the_best_mean_fold_accuracy_largest_on_ties(rng):
    labels = rng.integers(0, 3, size=90)
    features = np.eye(12)[labels] * 0.6 + rng.normal(size=(90, 12))    # a weak signal in 3 of 12 features
    penalties = (1e-4, 1e-1, 10.0)
    found = metrics.probe_penalty(features, labels, penalties, folds=3, seed=4, max_iterations=50)
    # Reference: the folds and scores written out.
    order = np.random.default_rng(4).permutation(90)
    held = [order[:30], order[30:60], order[60:]]
    expected = []
    for l2 in penalties:
        # each fold fitted on the others in the permuted order, so the sums run as in `probe_penalty`
        kept = [np.concatenate([p for j, p in enumerate(held) if j != k]) for k in range(3)]
        scores = [metrics.linear_probe(features[rows], labels[rows], features[h], labels[h], max_iterations=50,
                                       l2=l2) for rows, h in zip(kept, held)]
        expected.append(np.mean(scores))
    np.testing.assert_allclose(found["accuracy"], expected, rtol=0, atol=1e-12)
    assert found["penalty"] == max(l2 for l2, a in zip(penalties, expected) if a == max(expected))
    assert len(set(expected)) > 1                                       # the choice was not a tie
    # Separable classes: every penalty scores 1, so the largest wins.
    clean = np.eye(3)[labels] * 3 + rng.normal(size=(90, 3)) * 0.1
    tie = metrics.probe_penalty(clean, labels, (1e-4, 1e-1, 1e-2), folds=3)
    assert tie["accuracy"] == [1.0, 1.0, 1.0] and tie["penalty"] == 1e-1
    with pytest.raises(InputError, match="folds"):
        metrics.probe_penalty(clean, labels, folds=1)
    with pytest.raises(InputError, match="penalties"):
        metrics.probe_penalty(clean, labels, penalties=(-1.0,))


_PROBE_X = np.eye(2)[np.arange(12) % 2] + 0.1 * np.arange(24).reshape(12, 2) / 24
_PROBE_Y = np.arange(12) % 2


@pytest.mark.parametrize("call, message", [
    (lambda: metrics.linear_probe(_PROBE_X, _PROBE_Y, _PROBE_X, _PROBE_Y, l2=float("nan")), "l2=nan"),
    (lambda: metrics.linear_probe(_PROBE_X, _PROBE_Y, _PROBE_X, _PROBE_Y, l2=-1.0),
     r"^l2 must be a finite number >= 0. Received: l2=-1.0$"),
    (lambda: metrics.linear_probe(_PROBE_X, _PROBE_Y, _PROBE_X, _PROBE_Y, max_iterations=0),
     r"^max_iterations must be an integer >= 1. Received: max_iterations=0$"),
    (lambda: metrics.linear_probe(_PROBE_X, _PROBE_Y, _PROBE_X, _PROBE_Y, max_iterations=2.5), "max_iterations=2.5"),
    (lambda: metrics.fit_linear_probe(_PROBE_X, _PROBE_Y, 2.5), r"^classes must be an integer >= 1. Received: classes=2.5$"),
    (lambda: metrics.fit_linear_probe(_PROBE_X, _PROBE_Y, True), "classes=True"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, folds=2.5), r"^folds must be an integer >= 2. Received: folds=2.5$"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, penalties=(1.0, float("nan"))),
     r"^penalties\[1\] must be a finite number >= 0. Received: penalties\[1\]=nan$"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, penalties=1.0),
     r"^penalties must be a non-empty list of numbers >= 0. Received: penalties=1.0$"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, penalties="ab"), "penalties='ab'"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, seed=-1), r"^seed must be an integer >= 0. Received: seed=-1$"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, seed=1.5), "seed=1.5"),
    (lambda: metrics.probe_penalty(_PROBE_X, _PROBE_Y, max_iterations=0), "max_iterations=0"),
    (lambda: metrics.reference_classifier((8, 8, 1), 0), r"^classes must be an integer >= 1. Received: classes=0$"),
    (lambda: metrics.reference_classifier((8, 8, 1), 2, seed=1.5), "seed=1.5"),
    (lambda: metrics.reference_classifier((8, 8), 2), r"^input_shape must be \(height, width, channels\)"),
])
def test_probe_and_reference_classifier_settings_are_refused_by_name(call, message):
    """Before, a NaN or negative `l2` was minimised as given (NaN weights, or an objective unbounded below,
    whose accuracy was still reported), `max_iterations` of 0 or 2.5 went to SciPy as they were, 2.5 classes
    or folds and a NaN or single penalty failed in NumPy or were chosen (a NaN penalty could win), and the
    reference classifier's classes, seed and input shape failed in Keras' words."""
    with pytest.raises(InputError, match=message):
        call()


def test_kmeans_recovers_separated_blobs_and_matches_a_plain_lloyd_step(rng):
    centres = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    truth = rng.integers(0, 3, size=300)
    points = centres[truth] + rng.normal(size=(300, 2)) * 0.5
    centroids, assignment = metrics.kmeans(points, 3, seed=0)
    # Each found cluster is one blob, whole: the same partition up to names.
    assert len({(a, t) for a, t in zip(assignment, truth)}) == 3
    for j in range(3):
        np.testing.assert_allclose(centroids[j], points[assignment == j].mean(axis=0))
        assert np.min(np.linalg.norm(centres - centroids[j], axis=1)) < 0.2
    # At convergence every point is nearest its own centroid (written out).
    distances = np.array([[np.sum((p - c) ** 2) for c in centroids] for p in points])
    np.testing.assert_array_equal(assignment, np.argmin(distances, axis=1))
    with pytest.raises(InputError, match="k="):
        metrics.kmeans(points, 301)
    # before: 0 iterations returned no assignment (None), 2.5 failed in range(), a float k in NumPy's choice
    for name, kwargs in (("iterations", {"iterations": 0}), ("iterations", {"iterations": 2.5}),
                         ("k", {"k": 2.5})):
        with pytest.raises(InputError, match=rf"^{name} must be an integer >= 1\. Received: {name}="):
            metrics.kmeans(points, **{"k": 3, **kwargs}, seed=0)
    # before: a seed of -1 or 1.5 failed in NumPy's words, one NaN put every point in one cluster with a NaN
    # centroid, and centroids of another width failed in a matrix product
    with pytest.raises(InputError, match=r"^seed must be an integer >= 0\. Received: seed=-1$"):
        metrics.kmeans(points, 3, seed=-1)
    with pytest.raises(InputError, match=r"^points holds 1 NaN or infinite values"):
        metrics.kmeans(np.where(np.arange(600).reshape(300, 2) == 5, np.nan, points), 3)
    with pytest.raises(InputError, match=r"^points must have shape \[N, \?\]\. Received: shape \(300,\)$"):
        metrics.kmeans(points[:, 0], 3)
    with pytest.raises(InputError, match=r"^centroids must have shape \[N, 2\]\. Received: shape \(3, 3\)$"):
        metrics.nearest_centroid(points, np.zeros((3, 3)))


def _with_nan(array, index):
    array = np.array(array, "float32")
    array[index] = np.nan
    return array


_UPPER = np.random.default_rng(0).normal(size=(20, 3, 4)).astype("float32") * 0.3
_CLASSES = np.arange(20) % 2
_MOMENTS = np.stack([np.diag([4.0, 3.0, 2.0, 1.0])] * 3)


@pytest.mark.parametrize("call, name", [
    (lambda: metrics.mean_directions(_with_nan(_UPPER, (0, 1, 0))), "upper"),
    (lambda: metrics.pose_second_moments(_with_nan(_UPPER, (3, 0, 2))), "upper"),
    (lambda: metrics.longest_pose_second_moments(_with_nan(_UPPER, (3, 0, 2))), "upper"),
    (lambda: metrics.principal_share(_with_nan(_MOMENTS, (0, 0, 0))), "moments"),
    (lambda: metrics.class_selectivity(_with_nan(np.ones((20, 3)), (0, 2)), _CLASSES, 2), "activity"),
    (lambda: metrics.keep_longest(_with_nan(_UPPER, (0, 1, 0))), "upper"),
    (lambda: metrics.principal_axes(_with_nan(_MOMENTS, (1, 2, 3)), np.ones((3, 4))), "moments"),
    (lambda: metrics.principal_axes(_MOMENTS, _with_nan(np.ones((3, 4)), (2, 0))), "directions"),
    (lambda: metrics.winning_side_axes(_with_nan(_UPPER, (0, 1, 0))), "upper"),
    (lambda: metrics.winning_side_axes(_UPPER, _with_nan(_MOMENTS, (0, 0, 0))), "moments"),
    (lambda: metrics.longest_capsule_side_clusters(_with_nan(_UPPER, (0, 1, 0)), _CLASSES, 2, np.ones((3, 4))),
     "upper"),
    (lambda: metrics.longest_capsule_side_clusters(_UPPER, _CLASSES, 2, _with_nan(np.ones((3, 4)), (0, 0))), "axes"),
    (lambda: metrics.longest_capsule_clusters(_with_nan(np.ones((20, 3)), (0, 2)), _CLASSES, 2), "lengths"),
])
def test_capsule_statistics_refuse_values_that_are_not_finite(call, name):
    """Before, one NaN was taken silently: NumPy's argmax counted it as the longest capsule (a win for its
    cluster), eigh returned an arbitrary axis for a moment of NaN, and the directions, shares and spreads came
    out NaN or wrong without a word."""
    with pytest.raises(InputError, match=rf"^{name} holds 1 NaN or infinite values; they must all be finite\.$"):
        call()


def test_cluster_purity_hand_computed():
    result = metrics.cluster_purity(np.array([0, 0, 0, 1, 1, 2]), np.array([1, 1, 2, 0, 0, 0]), 3, 4)
    assert result["size"] == [3, 2, 1, 0]
    assert result["majority"] == [1, 0, 0, None]
    np.testing.assert_allclose(result["purity"][:3], [2 / 3, 1.0, 1.0])
    np.testing.assert_allclose(result["overall_purity"], 5 / 6)
    assert result["classes_covered"] == 2
    with pytest.raises(InputError, match="assignment"):
        metrics.cluster_purity(np.array([0, 1]), np.array([0]), 2, 2)
    # An image assigned outside the `count` clusters was left out of every cluster but still counted in
    # overall_purity's denominator (5 / 7 here, without a word); float clusters were compared by ==.
    labels = np.array([1, 1, 2, 0, 0, 0, 1])
    for bad, message in ((np.array([0, 0, 0, 1, 1, 2, 4]), r"^assignment must lie in \[0, 4\)\. Received: 0 to 4$"),
                         (np.array([0, 0, 0, 1, 1, 2, 1.5]), r"^assignment must be integers")):
        with pytest.raises(InputError, match=message):
            metrics.cluster_purity(bad, labels, 3, 4)


def test_mean_directions_hand_computed():
    upper = np.array([[[0.3, 0.4], [0.0, -0.5]], [[0.0, 0.2], [0.1, 0.0]]])
    # capsule 0: unit poses (0.6, 0.8) and (0, 1), mean (0.3, 0.9); capsule 1: (0, -1) and (1, 0)
    expected = np.array([[0.3, 0.9] / np.sqrt(0.9), [0.5, -0.5] / np.sqrt(0.5)])
    np.testing.assert_allclose(metrics.mean_directions(upper), expected, rtol=1e-9)
    with pytest.raises(InputError, match="N, J, D"):
        metrics.mean_directions(upper[0])


def test_hoyer_sparsity_by_hand():
    assert metrics.hoyer_sparsity(np.ones((3, 4))) == pytest.approx(0.0, abs=1e-12)        # all equal
    assert metrics.hoyer_sparsity(np.array([0.0, -3.0, 0.0, 0.0])) == pytest.approx(1.0)   # one entry on
    assert metrics.hoyer_sparsity(np.zeros((2, 5))) == 1.0                                # nothing on
    # [1, 1, 0, 0]: |s|_1 / |s|_2 = 2 / sqrt(2), so (2 - sqrt(2)) / (2 - 1); the mean with an all-equal vector
    half = 2.0 - np.sqrt(2.0)
    assert metrics.hoyer_sparsity(np.array([[1.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])) == pytest.approx(half / 2)
    with pytest.raises(InputError, match="at least 2 entries. Received shape"):
        metrics.hoyer_sparsity(np.ones((4, 1)))
    # Before, a NaN score made its vector's |s|_2 > 0 false, so it counted as "nothing on", sparsity 1; no
    # vectors at all averaged to NaN with a RuntimeWarning.
    with pytest.raises(InputError, match=r"^scores holds 1 NaN or infinite scores"):
        metrics.hoyer_sparsity(np.array([np.nan, 1.0]))
    with pytest.raises(InputError, match=r"^scores is empty"):
        metrics.hoyer_sparsity(np.ones((0, 4)))


def test_mse_by_hand():
    images = np.array([[0.0, 1.0], [0.5, 0.5]])
    assert metrics.mse(images, np.array([[0.0, 0.5], [0.5, 1.0]])) == pytest.approx(0.125)    # (0.25 + 0.25) / 4
    assert np.isnan(metrics.mse(images, np.array([[0.0, np.nan], [0.5, 1.0]])))               # a diverged model shows
    # Before, one image against three reconstructions broadcast to a figure of the wrong pairs, without a word.
    with pytest.raises(InputError, match=r"^mse needs reconstructions of the images' shape"):
        metrics.mse(images[:1], np.stack([images[0]] * 3))
    with pytest.raises(InputError, match=r"not empty"):
        metrics.mse(np.ones((0, 2)), np.ones((0, 2)))


@pytest.mark.parametrize("name, call", [
    ("class_selectivity", lambda a, u, y: metrics.class_selectivity(a, y, 3)),
    ("longest_capsule_clusters", lambda a, u, y: metrics.longest_capsule_clusters(a, y, 3)),
    ("longest_capsule_side_clusters", lambda a, u, y: metrics.longest_capsule_side_clusters(u, y, 3, np.eye(4, 2))),
    ("cluster_purity", lambda a, u, y: metrics.cluster_purity(np.argmax(a, 1), y, 3, 4)),
])
def test_the_class_figures_refuse_labels_outside_the_classes(rng, name, call):
    """Labels must be one integer in [0, classes) per example. Before, class_selectivity left out the examples
    of a label outside [0, classes) and returned its figures without them; the clusters counted a label equal
    to `classes` as a class of its own, and failed inside NumPy's bincount on a label -1 or float labels."""
    upper = rng.normal(size=(40, 4, 2))
    lengths = np.linalg.norm(upper, axis=-1)
    labels = rng.integers(0, 3, size=40)
    call(lengths, upper, labels)                                   # valid labels pass
    for bad, message in ((labels - 1, r"^labels must lie in \[0, 3\)\. Received: -1 to 1$"),
                         (labels + 1, r"^labels must lie in \[0, 3\)\. Received: 1 to 3$"),
                         (labels.astype("float64"), r"^labels must be integers")):
        with pytest.raises(InputError, match=message):
            call(lengths, upper, bad)
