"""Named presets: code-defined configurations, one function each, overridable field by field.

`get(kind, name)` returns the preset's config; `names(kind)` lists them with
their first docstring lines. A preset is a function of no arguments that
returns a config; its docstring says where every value comes from. A run
records its preset and the overrides it was given (`config.json`). Free of
TensorFlow.

Routing counts rounds everywhere (Sabour's r): `routing_iterations=3` is
three softmax passes and two agreement updates. Before version 0.2
`DynamicRouting` counted agreement updates, so the earlier default of 3 is
the `default` preset's 4 here (same computation), and CapsNet's earlier 2 is
`sabour2017`'s 3.
"""

import dataclasses

from poecaps.experiments.configs import BaselineConfig, LayerwiseConfig
from poecaps.experiments.settings import SettingError, with_values
from poecaps.validation import check_choice

_PRESETS = {"layerwise": {}, "baseline": {}}
# The preset a new run of each kind starts from when none is named.
DEFAULT = {"layerwise": "default", "baseline": "sabour2017"}


def _preset(kind, name):
    def register(function):
        _PRESETS[kind][name] = function
        return function
    return register


@_preset("layerwise", "default")
def default():
    """Products of expert capsules that learn specific objects: Hauser's network with five departures.

    The recipe under which each of the 20 capsules' samples show one kind of
    garment (docs/fashion_mnist.md, "The decoder shrank one capsule's
    code"). It is `hauser2019` with these changes, none of them in the paper:

    - `center_code=True`: the mean code is subtracted before the capsules
      are formed (otherwise every capsule's direction collapses to one
      vector);
    - `sparsity_cost=5`, `sparsity_target=0.1`: a lifetime sparsity penalty
      on each capsule's mean P(on);
    - `population_sparsity_cost=15`: each image asked to turn on few capsules;
    - `decoder_input="longest"`, `decoder_length=True`: the decoder learns
      from each image's longest capsule alone, reading its length;
    - `decoder_rule="delta"`: the decoder's U by the wake-sleep delta rule;
    - `routing_iterations=4` (4 rounds: three agreement updates, the setting
      the recipe was found with) and the result grid drawn on each
      capsule's winning side (`sample_domain="winning"`), 20 rows.
    """
    return LayerwiseConfig()


@_preset("layerwise", "hauser2019")
def hauser2019():
    """Hauser (2019), "Training products of expert capsules with mixing by dynamic routing".

    From the paper: conv filters [9, 9, 1, 128] and [9, 9, 128, 128] with
    leaky ReLU and dropout, 576 capsules of 8-D, 20 capsules of 16-D,
    cosine agreement, W ~ N(0, 0.01) (read as a standard deviation), SGD
    with momentum, learning-rate decay and L2, CD-1 with mixing by dynamic
    routing (Algorithm 1), the decoder's rule as section 4.1 prints it
    (`decoder_rule="section41"`), capsules formed from the raw code
    (`center_code=False`), no sparsity terms, and Figure 2's grid: 4 draws
    per capsule on the restricted domain.

    Not in the paper, so chosen here: 3 routing rounds (Sabour's), batch
    128, 1 autoencoder epoch (Adam 1e-3), 3 encoder and 3 decoder epochs,
    learning rates 0.1 (encoder) and 1.0 (decoder), momentum 0.9, decay
    0.9 per epoch, L2 1e-4, dropout 0.1, stride 2 (the paper's 6 x 6 code
    implies it).

    One departure: the coefficients sum to 1 over parents, as section 2.2's
    words and Sabour's procedure have it; the paper's formulas sum over
    children, which at N(0, 0.01) never turns a capsule on
    (`normalize="children"` gives that reading).
    """
    return dataclasses.replace(
        LayerwiseConfig(), routing_iterations=3, center_code=False, sparsity_cost=0.0,
        population_sparsity_cost=0.0, decoder_rule="section41", decoder_input="all",
        decoder_length=False, sample_domain="restricted", sample_rows=4)


@_preset("baseline", "sabour2017")
def sabour2017():
    """CapsNet (Sabour, Frosst and Hinton 2017) as the paper trains it on MNIST.

    Conv 256 9x9, 32 primary capsule types of 8-D, one 16-D capsule per
    class, 3 routing rounds (dot-product agreement), margin loss, the
    reconstruction decoder with weight 0.0005, Adam 1e-3 decayed 0.96 per
    epoch, batch 128, random shifts of up to 2 pixels. One epoch by default.
    """
    return BaselineConfig()


def _hinton2018(size):
    return dataclasses.replace(BaselineConfig(), model="em", em_size=size, max_shift=0,
                               routing_iterations=3, em_cost_normalization="standardize", em_final_lambda=1.0)


@_preset("baseline", "hinton2018-small")
def hinton2018_small():
    """Matrix capsules with EM routing (Hinton, Sabour and Frosst 2018), small: A=64, B=8, C=D=16.

    From the paper: ReLU conv 5x5 stride 2, primary matrix capsules, ConvCaps1
    (K=3, stride 2), ConvCaps2 (K=3, stride 1), class capsules with
    coordinate addition, 3 EM rounds, spread loss with the margin rising from
    0.2 to 0.9. Adam 1e-3 decayed 0.96 per epoch, batch 128, no shifts.
    Departures: the EM costs are standardised over the parents before the
    logistic (as widely used reimplementations do) with inverse-temperature
    scale 1: with the paper's costs (eq. 27) every activation saturates
    together and the network learns slower here (`EMRouting`); the
    transformation matrices start at I + U(-0.1, 0.1) (`MatrixCapsNet`),
    which docs/em_study.md found to matter most.
    """
    return _hinton2018("small")


@_preset("baseline", "hinton2018")
def hinton2018():
    """`hinton2018-small` at the paper's sizes: A=B=C=D=32."""
    return _hinton2018("paper")


def _faria2019(routing):
    return dataclasses.replace(BaselineConfig(), model="routingnet", routing=routing, loss="scaled_cross_entropy",
                               logit_scale=10.0, routing_iterations=3, epochs=5, batch_size=32, learning_rate=3e-3,
                               decay_rate=0.96, max_shift=2)


@_preset("baseline", "faria2019-similarity")
def faria2019_similarity():
    """Faria (2019), "Learning to compute inner consensus": the Table 1 network with similarity routing.

    From the paper: the Table 1 network (`poecaps.models.RoutingCapsNet`),
    similarity routing (section 4.1) with Q = 4, 4, 10 Gaussians, 3
    iterations, Adam 3e-3 with exponential decay, MNIST shifted by up to 2
    pixels; from the author's code: softmax cross-entropy on the class
    activations. The paper trains 100 epochs on a GPU; here 5 epochs of
    batch 32 (the routing comparison's budget), decay 0.96 per epoch
    (the paper gives no rate). Departure, in every routing network preset:
    the activations are multiplied by a learned scale starting at 10
    before the softmax (`loss="scaled_cross_entropy"`, `logit_scale=10`);
    activations in [0, 1] as logits cannot express a confident class, and
    in the budget a scale starting at 1 grows too slowly (the validation on
    held-out training digits that chose it: docs/routing_table.md).
    """
    return _faria2019("similarity")


@_preset("baseline", "faria2019-connectionist")
def faria2019_connectionist():
    """The Table 1 network with connectionist (LSTM) routing, Table 2's sizes; otherwise `faria2019-similarity`."""
    return _faria2019("connectionist")


@_preset("baseline", "faria2019-em")
def faria2019_em():
    """The Table 1 network with EM routing (3 rounds, costs as `hinton2018-small`); otherwise `faria2019-similarity`."""
    return dataclasses.replace(_faria2019("em"), em_cost_normalization="standardize", em_final_lambda=1.0)


@_preset("baseline", "faria2019-dynamic")
def faria2019_dynamic():
    """The Table 1 network with dynamic routing (3 rounds, over the children); otherwise `faria2019-similarity`."""
    return _faria2019("dynamic")


@_preset("baseline", "faria2019-uniform")
def faria2019_uniform():
    """The Table 1 network with uniform coefficients (no routing); otherwise `faria2019-similarity`."""
    return _faria2019("uniform")


@_preset("baseline", "faria2019-sparse-inference")
def faria2019_sparse_inference():
    """The uniform-routing Table 1 network, class capsules by sparse iterative inference at test time (Kiefer et al.).

    Trains exactly as `faria2019-uniform` (the router returns the
    feed-forward prediction while training); at test time the class
    capsules descend 500 steps (0.01) on the energy of
    `poecaps.routing.SparseInferenceRouting` with L1 weight 1 (the router's default).
    """
    return _faria2019("sparse_inference")


@_preset("baseline", "faria2019-generative")
def faria2019_generative():
    """The Table 1 network routed by MAP-EM inversion of a generative capsule model (Kiefer et al. section 4).

    `poecaps.routing.GenerativeRouting` in every capsule layer: each child's
    vote has a von Mises-Fisher direction and a Gaussian length around the
    parent it picks, parents N(0, I); 3 exact E/M rounds; concentration 5
    and length spread 0.25 to start, learned per parent type. Otherwise
    `faria2019-similarity`.
    """
    return _faria2019("generative")


def names(kind):
    """`{preset name: first line of its docstring}` for `kind` ("layerwise" or "baseline")."""
    return {name: (function.__doc__ or "").strip().splitlines()[0]
            for name, function in _PRESETS[kind].items()}


def routing_table():
    """The presets of the routing network (model `routingnet`), in registration order: the routing table's rows."""
    return [name for name in _PRESETS["baseline"] if get("baseline", name).model == "routingnet"]


def get(kind, name):
    """The config of preset `name` of `kind`; an unknown name is a `SettingError` listing the known ones."""
    check_choice(kind, "kind", _PRESETS, SettingError)
    if not isinstance(name, str) or name not in _PRESETS[kind]:
        raise SettingError(f"Unknown {kind} preset {name!r}; known: {', '.join(_PRESETS[kind])}.")
    return _PRESETS[kind][name]()


def configured(kind, name=None, values=None):
    """`(config, record)`: preset `name` of `kind` (None: `DEFAULT[kind]`) with `values` set, each checked.

    `record` is what `config.json` keeps of it: `{"kind", "preset",
    "overrides"}`, the overrides as checked values.
    """
    name = DEFAULT[kind] if name is None else name
    values = dict(values or {})
    config = with_values(get(kind, name), values)
    return config, {"kind": kind, "preset": name, "overrides": {k: getattr(config, k) for k in values}}
