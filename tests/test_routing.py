"""Dynamic routing against a plain NumPy reference written here."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from poecaps import routing
from poecaps.errors import InputError
from poecaps.routing import DynamicRouting, RoutingResult


def numpy_dynamic_routing(votes, iterations, agreement, normalize, activations=None):
    """Sabour's Procedure 1 with loops, straight from the paper: r rounds, each ending with an
    update of b (the last round's update is never used); r = 0 runs one round, uniform c."""
    batch, num_in, num_out, _ = votes.shape
    a = np.ones((batch, num_in)) if activations is None else activations
    b = np.zeros((batch, num_in, num_out))

    def softmax(logits):
        axis = 2 if normalize == "parents" else 1
        e = np.exp(logits - logits.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)

    def squash(z):
        n2 = (z * z).sum(-1, keepdims=True)
        return n2 / (1 + n2) * z / np.sqrt(n2)

    for _ in range(max(iterations, 1)):
        c = softmax(b)
        v = np.zeros((batch, num_out, votes.shape[-1]))
        for n in range(batch):
            for j in range(num_out):
                for i in range(num_in):
                    v[n, j] += c[n, i, j] * a[n, i] * votes[n, i, j]
        v = squash(v)
        for n in range(batch):
            for i in range(num_in):
                for j in range(num_out):
                    dot = votes[n, i, j] @ v[n, j]
                    if agreement == "cosine":
                        lengths = np.linalg.norm(votes[n, i, j]) * np.linalg.norm(v[n, j])
                        dot = dot / lengths if lengths > 0 else 0.0
                    b[n, i, j] += dot
    return v, c


@pytest.mark.parametrize("agreement", ["dot", "cosine"])
@pytest.mark.parametrize("normalize", ["parents", "children"])
@pytest.mark.parametrize("iterations", [0, 1, 2, 3])
def test_matches_numpy_reference(rng, agreement, normalize, iterations):
    votes = rng.normal(size=(2, 5, 3, 4))
    activations = rng.uniform(size=(2, 5))
    layer = DynamicRouting(iterations, agreement=agreement, normalize=normalize)
    result = layer(votes, activations)
    poses, c = numpy_dynamic_routing(votes, iterations, agreement, normalize, activations)
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), c, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ops.convert_to_numpy(result.poses), poses, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ops.convert_to_numpy(result.activations),
                               np.linalg.norm(poses, axis=-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalize", ["parents", "children"])
def test_cosine_agreement_is_exact_at_small_lengths(rng, normalize):
    """Votes of length ~1e-3 (squash makes v ~1e-6 long, as early in CD training): the reference still
    holds, and the coefficients are those of the same votes 1000 times longer, as a cosine's must be."""
    votes = rng.normal(size=(2, 5, 3, 4))
    small = DynamicRouting(3, agreement="cosine", normalize=normalize)(votes * 1e-3)
    _, c = numpy_dynamic_routing(votes * 1e-3, 3, "cosine", normalize)
    np.testing.assert_allclose(ops.convert_to_numpy(small.coefficients), c, rtol=1e-5, atol=1e-7)
    large = DynamicRouting(3, agreement="cosine", normalize=normalize)(votes)
    np.testing.assert_allclose(ops.convert_to_numpy(small.coefficients),
                               ops.convert_to_numpy(large.coefficients), rtol=1e-5, atol=1e-7)
    x, w = rng.normal(size=(3, 7, 4)), rng.normal(size=(7, 5, 6, 4))
    layer = DynamicRouting(3, agreement="cosine", normalize=normalize)
    np.testing.assert_allclose(ops.convert_to_numpy(layer.route_linear(x, w * 1e-3).coefficients),
                               ops.convert_to_numpy(layer.route_linear(x, w).coefficients), rtol=1e-5, atol=1e-7)


def test_cosine_agreement_with_a_zero_vote_has_finite_gradients(rng):
    import tensorflow as tf

    votes = rng.normal(size=(2, 5, 3, 4)).astype("float32")
    votes[0, 1, 2] = 0.0                                 # one vote exactly 0: its agreement is 0
    votes = tf.constant(votes)
    with tf.GradientTape() as tape:
        tape.watch(votes)
        result = DynamicRouting(3, agreement="cosine")(votes)
        total = tf.reduce_sum(result.poses)
    assert np.all(np.isfinite(tape.gradient(total, votes).numpy()))
    _, c = numpy_dynamic_routing(votes.numpy().astype("float64"), 3, "cosine", "parents")
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), c, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("agreement", ["dot", "cosine"])
@pytest.mark.parametrize("normalize", ["parents", "children"])
@pytest.mark.parametrize("with_activations", [False, True])
def test_linear_route_equals_routing_on_votes(rng, agreement, normalize, with_activations):
    x = rng.normal(size=(3, 7, 4))
    w = rng.normal(size=(7, 5, 6, 4)) * 0.3
    a = rng.uniform(size=(3, 7)) if with_activations else None
    layer = DynamicRouting(2, agreement=agreement, normalize=normalize)
    votes = np.einsum("ijoe,bie->bijo", w, x)
    on_votes, linear = layer(votes, a), layer.route_linear(x, w, a)
    for a, b in zip(on_votes, linear):
        np.testing.assert_allclose(ops.convert_to_numpy(a), ops.convert_to_numpy(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("x_shape, a_shape, message", [
    ((7, 4), None, "x of shape"),            # one example's capsules: was read as a batch of 7 examples of 4
    ((3, 6, 4), None, "x of shape"),         # another I: failed in a TensorFlow reshape
    ((3, 7, 5), None, "x of shape"),         # another D_in: likewise
    ((3, 7, 4), (3, 1), r"activations must be \[B, I\] = \[3, 7\]"),   # broadcast over the 7 capsules
    ((3, 7, 4), (1, 7), r"activations must be \[B, I\] = \[3, 7\]"),   # broadcast over the batch
])
def test_linear_route_refuses_capsules_that_do_not_fit_the_kernel(rng, x_shape, a_shape, message):
    """Each of these gave a result without a word, or failed inside TensorFlow, before."""
    w = rng.normal(size=(7, 5, 6, 4))
    a = None if a_shape is None else rng.uniform(size=a_shape)
    with pytest.raises(InputError, match=message):
        DynamicRouting(2).route_linear(rng.normal(size=x_shape), w, a)


@pytest.mark.parametrize("iterations", [0, 1])
def test_zero_and_one_round_give_uniform_coefficients(rng, iterations):
    votes = rng.normal(size=(2, 5, 4, 3))
    result = DynamicRouting(iterations)(votes)
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), 0.25)
    result = DynamicRouting(iterations, normalize="children")(votes)
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), 0.2)
    # the poses are the squashed plain mean of the votes
    z = votes.mean(axis=1)
    n2 = np.sum(z * z, -1, keepdims=True)
    np.testing.assert_allclose(ops.convert_to_numpy(result.poses), n2 / (1 + n2) * z / np.sqrt(n2),
                               rtol=1e-5, atol=1e-7)


def test_three_rounds_make_two_agreement_updates(rng):
    """Sabour's r = 3: c = softmax(u.v1 + u.v2), with v1 from uniform c and v2 from softmax(u.v1)."""
    votes = rng.normal(size=(1, 4, 3, 2))
    softmax = lambda b: np.exp(b) / np.exp(b).sum(-1, keepdims=True)
    squash = lambda z: z * np.linalg.norm(z, axis=-1, keepdims=True) / (1 + np.sum(z * z, -1, keepdims=True))
    v1 = squash(votes.mean(axis=1) * 4 / 3)                       # c = 1/3 over the 3 parents
    b1 = np.einsum("bijd,bjd->bij", votes, v1)
    v2 = squash(np.einsum("bij,bijd->bjd", softmax(b1), votes))
    b2 = b1 + np.einsum("bijd,bjd->bij", votes, v2)
    result = DynamicRouting(3, "dot")(votes)
    np.testing.assert_allclose(ops.convert_to_numpy(result.coefficients), softmax(b2), rtol=1e-5, atol=1e-7)


def test_coefficients_sum_to_one_over_the_chosen_axis(rng):
    votes = rng.normal(size=(2, 6, 4, 3))
    c = ops.convert_to_numpy(DynamicRouting(3, normalize="parents")(votes).coefficients)
    np.testing.assert_allclose(c.sum(axis=2), 1.0, rtol=1e-5)
    c = ops.convert_to_numpy(DynamicRouting(3, normalize="children")(votes).coefficients)
    np.testing.assert_allclose(c.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("name", routing.names())
def test_every_router_sums_its_coefficients_over_the_axis_it_declares(rng, name):
    # The routing statistics read `normalizes`; a router whose coefficients summed over the
    # other axis would have its entropy taken over the wrong one. Float32 sums of 4 or 9 terms
    # of at most 1 are exact to a few ulps.
    layer = routing.get(name)
    votes = rng.normal(size=(3, 9, 4, 16)).astype("float32")
    c = ops.convert_to_numpy(layer(votes, rng.uniform(0.1, 1.0, size=(3, 9)).astype("float32")).coefficients)
    axis = {"parents": 2, "children": 1}[layer.normalizes]
    np.testing.assert_allclose(c.sum(axis=axis), 1.0, atol=1e-5)


@pytest.mark.parametrize("name", routing.names())
def test_every_router_routes_an_empty_batch(name):
    # The one routing interface: a batch of no examples routes to empty results of the usual shapes,
    # eagerly as in a graph traced for any batch size, as Keras traces one (dynamic routing's softmax
    # used ops.max, which refuses any empty tensor when run eagerly, while every other router took one).
    layer = routing.get(name)
    votes = np.zeros((0, 5, 3, 4), "float32")
    graph = tf.function(lambda v, a: layer(v, a), input_signature=[tf.TensorSpec((None, 5, 3, 4)),
                                                                    tf.TensorSpec((None, 5))])
    for run in (layer, graph):
        result = run(votes, np.zeros((0, 5), "float32"))
        shapes = [tuple(ops.convert_to_numpy(part).shape) for part in result]
        assert shapes == [(0, 3, 4), (0, 3), (0, 5, 3)]


@pytest.mark.parametrize("kwargs, message", [
    ({"iterations": -1}, "iterations=-1"),
    ({"agreement": "euclid"}, "agreement='euclid'"),
    ({"normalize": "rows"}, "normalize='rows'"),
])
def test_invalid_arguments(kwargs, message):
    with pytest.raises(InputError, match=message):
        DynamicRouting(**kwargs)


def test_get_resolves_names_configs_and_instances():
    assert routing.get("cosine").agreement == "cosine"
    assert routing.get("dynamic", iterations=5).iterations == 5
    layer = DynamicRouting(4, "cosine", "children")
    assert routing.get(layer) is layer
    clone = routing.get(keras.saving.serialize_keras_object(layer))
    assert clone.get_config() == layer.get_config()
    with pytest.raises(InputError, match="routing='nope'"):
        routing.get("nope")


@pytest.mark.parametrize("identifier, kwargs, message", [
    (lambda: DynamicRouting(2), {"iterations": 5}, r"holds its own settings.*Received: iterations=5 with a Routing$"),
    (lambda: keras.saving.serialize_keras_object(DynamicRouting(2)), {"agreement": "cosine"},
     r"Received: agreement='cosine' with a config$"),
    (lambda: "uniform", {"iterations": 3}, r"^'uniform' routing is one round.*Received: iterations=3$"),
])
def test_get_refuses_settings_it_would_ignore(identifier, kwargs, message):
    """Settings given with a router or its config, which hold their own, were dropped without a word (the
    router kept 2 rounds when 5 were asked), and `"uniform"` with 3 rounds was 3-round dynamic routing."""
    with pytest.raises(InputError, match=message):
        routing.get(identifier(), **kwargs)
    assert routing.get("uniform", iterations=1).iterations == 1


def test_get_refuses_a_config_that_is_not_a_router_s():
    """Before, a config of another layer gave that layer (a Dense as the router), one without a class gave the
    dict back, and a class Keras cannot find failed in Keras' TypeError."""
    refused = [
        (keras.saving.serialize_keras_object(keras.layers.Dense(3)),
         r"^A routing config must describe a poecaps Routing\. Received: a config of 'Dense', which gave a Dense$"),
        ({"config": {"iterations": 2}}, r"Received: a config of 'no class_name', which gave a dict$"),
        ({"class_name": "Nope", "config": {}}, r"^The routing config could not be read: Could not locate class 'Nope'"),
    ]
    for config, message in refused:
        with pytest.raises(InputError, match=message):
            routing.get(config)


def test_config_round_trip_with_non_default_arguments():
    layer = DynamicRouting(iterations=5, agreement="cosine", normalize="children", name="r")
    clone = DynamicRouting.from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


def test_result_is_a_routing_result(rng):
    result = DynamicRouting(1)(rng.normal(size=(2, 3, 2, 4)))
    assert isinstance(result, RoutingResult)
    assert result.poses.shape == (2, 2, 4) and result.coefficients.shape == (2, 3, 2)


@pytest.mark.parametrize("name, axis, letter", [
    ("em", 2, "J"), ("similarity", 2, "J"), ("generative", 2, "J"), ("connectionist", 3, "D")])
def test_a_built_router_refuses_votes_its_weights_do_not_fit(rng, name, axis, letter):
    """EM, similarity and generative routing keep weights per parent, the connectionist LSTM reads 2 D + 2
    values per pair. Before, votes of another J failed in TensorFlow ('Incompatible shapes'), and the LSTM
    routed votes of another D silently with the wrong rows of its kernel."""
    votes = rng.normal(size=(2, 6, 3, 4)).astype("float32")
    router = routing.get(name)
    router(votes)
    other = votes[:, :, :2] if axis == 2 else votes[..., :3]
    message = (f"{type(router).__name__} '{router.name}' was built for votes [B, I, J, D] with {letter} = "
               f"{votes.shape[axis]}, which its weights fix. Received: votes of shape {list(other.shape)}")
    with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
        router(other)
    assert router(votes[:, :4]).poses.shape == (2, 3, 4)      # other children: any number
