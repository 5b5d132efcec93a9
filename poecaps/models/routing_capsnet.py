"""The network of Faria's Table 1, which takes any router: the architecture of the routing comparison."""

import math

import keras
from keras import ops

from poecaps import distribute, losses
from poecaps import routing as routing_lib
from poecaps.errors import InputError
from poecaps.initializers import NearIdentity
from poecaps.layers import CapsuleDense, ConvCapsules, PrimaryMatrixCapsules
from poecaps.models.capsnet import check_classifier_arguments, check_loss_inputs
from poecaps.validation import (
    check_choice,
    check_image_batch,
    check_integer,
    check_integers,
    check_number,
    check_seed,
)

LOSSES = ("cross_entropy", "scaled_cross_entropy", "spread", "margin")
# the unpadded convolutions (kernel, stride), bottom up: conv1, primary capsules, ConvCaps1, ConvCaps2
CONVOLUTIONS = ((5, 2), (1, 1), (3, 2), (3, 1))
# Per capsule layer (ConvCaps1, ConvCaps2, class layer): the paper's settings of each learned router
# (section 5: Q = 4, 4, 10 Gaussians; Table 2: the hidden sizes of f_c and f_a).
# Similarity routing starts at lambda1 = 1 and theta1 = 1, not the author's 12 and N(0, 0.1): with those
# the coefficients start uniform and the activations ignore the kernel, and in 5 epochs on mnist-5k the
# network barely leaves chance (docs/routing_table.md, "Before the protocol").
_SIMILARITY_START = {"entropy_weight": 1.0, "kernel_weight": 1.0}
LAYER_SETTINGS = {
    "similarity": [{"num_kernels": 4, **_SIMILARITY_START}, {"num_kernels": 4, **_SIMILARITY_START},
                   {"num_kernels": 10, **_SIMILARITY_START}],
    "connectionist": [{"units": 16, "compatibility_hidden": (), "activation_hidden": ()},
                      {"units": 16, "compatibility_hidden": (32, 32), "activation_hidden": (64, 64)},
                      {"units": 16, "compatibility_hidden": (64, 64), "activation_hidden": (124, 124)}],
}


def frobenius_unit(poses):
    """Each pose `[..., 16]` over its Frobenius norm: a capsule layer reads directions, presence is its activation."""
    return poses / ops.sqrt(ops.sum(ops.square(poses), axis=-1, keepdims=True) + 1e-7)


def layer_routers(routing, iterations=3, seed=0, dtype=None, **options):
    """The three routers of the network (ConvCaps1, ConvCaps2, class layer) for a routing name.

    Learned routers get the paper's per-layer sizes (`LAYER_SETTINGS`);
    `options` go to every router (for EM, `final_lambda`, ...), `dtype` (the
    network's policy) to all three. `"uniform"`
    is one round of dynamic routing whatever `iterations` says;
    `"sparse_inference"` is the uniform network with the class layer's
    parents inferred at test time (500 steps, L1 weight 1). Dynamic routing
    and its uniform ablation normalise over the parents, as Sabour's does.
    """
    if routing == "sparse_inference":
        # The uniform network, whose class capsules are inferred at test time (Kiefer et al.).
        return [routing_lib.get("uniform", agreement="dot", dtype=dtype),
                routing_lib.get("uniform", agreement="dot", dtype=dtype),
                routing_lib.get("sparse_inference", dtype=dtype, **options)]
    if routing in ("uniform", "dynamic"):
        options = {"agreement": "dot", **options}
    if routing == "uniform":
        return [routing_lib.get("uniform", dtype=dtype, **options) for _ in range(3)]
    seeded = routing in LAYER_SETTINGS
    return [routing_lib.get(routing, iterations=iterations, dtype=dtype, **layer, **options,
                            **({"seed": seed + 100 * k} if seeded else {}))
            for k, layer in enumerate(LAYER_SETTINGS.get(routing, [{}] * 3))]


@keras.saving.register_keras_serializable(package="poecaps")
class RoutingCapsNet(keras.Model):
    """Faria's Table 1 network: matrix capsules with Frobenius-normalised votes, any router in each layer.

    conv 5x5 stride 2 (64 channels), ReLU, batch norm -> primary matrix
    capsules (1x1, 8 types, 4x4 pose, logistic activation) -> ConvCaps1
    (K=3, stride 2, 16 types) -> ConvCaps2 (K=3, stride 1, 16 types) ->
    class capsules over every position, with one transformation per
    (position, type, class) (unshared: the paper's 86K parameters without
    routing on smallNORB need it). Every capsule layer votes with
    `V_ij = P_i W_ij / |W_ij|_F` (Faria eq. 1; Hinton's order of the
    product), W starting at I + U(-0.1, 0.1), and hands the votes and child
    activations to its router.

    Every capsule layer reads its input poses divided by their Frobenius norm
    (`frobenius_unit`), the primary ones as the paper has it and, a
    departure, the deeper ones too: a pose carries a direction, the
    activation carries presence. Without it, routers whose poses are squashed
    (dynamic, uniform) shrink every layer's lengths quadratically, and the
    class capsules of this three-layer network start at lengths near 1e-20. On 28x28 input the capsule maps are
    12x12, 5x5 and 3x3. The class scores are the class capsules'
    activations.

    Losses (`loss_terms`): "cross_entropy" (the author's code: softmax
    cross-entropy with the class activations as logits), "scaled_cross_entropy"
    (the same with logits `s a_k`, `s = exp(log_logit_scale)` a learned
    scale starting at `logit_scale`: activations in [0, 1] as logits bound
    the loss below by `log(1 + (K - 1) / e)`, 1.46 for ten classes), "spread" (Hinton
    et al., margin 0.2 -> 0.9 over `margin_steps`) or "margin" (Sabour's).

    Args:
        image_shape: (H, W, C) of the input.
        num_classes: K.
        routing: a routing name (`poecaps.routing.get`: each layer gets its
            own router, learned ones with the paper's per-layer sizes, see
            `layer_routers`) or a sequence of three routers (names, configs
            or instances) for ConvCaps1, ConvCaps2 and the class layer.
        routing_iterations: rounds of each named router (3 in the paper).
        loss: "cross_entropy", "scaled_cross_entropy", "spread" or "margin".
        logit_scale: the initial scale `s` of "scaled_cross_entropy" (> 0).
            Adam moves `log s` by about the learning rate a step, so the
            start sets how soon the activations' [0, 1] range can express a
            confident class: with `s` the best probability is
            `e^s / (e^s + K - 1)` (1: 0.23 for ten classes; 10: 0.9996).
        margin_steps: steps over which the spread loss's margin rises.
        filters, primary_types, conv_types: sizes (64, 8, 16).
        chunk_capsules: lower capsules whose votes and routing are computed
            together in ConvCaps1 and ConvCaps2 (`ConvCapsules(chunk_size=
            max(1, chunk_capsules // (9 * types in)))`, receptive fields at a
            time), or None for all at once. Same result to rounding; chunks
            pay inside an XLA computation (bench/learned_step.py).
        seed: seed of the initial weights of `conv1`, the three capsule
            layers and the routers that learn. The primary capsules' two
            1x1 convolutions draw theirs from Keras' global random state:
            call `keras.utils.set_random_seed` first (the scripts do, with
            `--seed`) for a network that repeats.

    Call arguments:
        images: `[B, H, W, C]` in [0, 1].

    Returns:
        dict with `scores` (class activations `[B, K]`), `poses` `[B, K, 16]`
        and the class layer's routing `coefficients` `[B, I, K]`.
    """

    def __init__(self, image_shape, num_classes, routing="similarity", routing_iterations=3,
                 loss="cross_entropy", logit_scale=1.0, margin_steps=10000, filters=64, primary_types=8, conv_types=16,
                 chunk_capsules=None, seed=0, **kwargs):
        super().__init__(**kwargs)
        filters, primary_types, conv_types, margin_steps = check_integers(
            filters=filters, primary_types=primary_types, conv_types=conv_types, margin_steps=margin_steps)
        routing_iterations = check_integer(routing_iterations, "routing_iterations", minimum=0)
        chunk_capsules = check_integer(chunk_capsules, "chunk_capsules", allow_none=True)
        image_shape, num_classes = check_classifier_arguments(image_shape, num_classes, CONVOLUTIONS)
        check_choice(loss, "loss", LOSSES)
        self.image_shape = image_shape
        self.num_classes = num_classes
        self.routing_iterations = routing_iterations
        self.loss = loss
        self.logit_scale = check_number(logit_scale, "logit_scale", above=0)
        self.margin_steps = margin_steps
        self.filters, self.primary_types, self.conv_types = filters, primary_types, conv_types
        self.chunk_capsules = chunk_capsules
        self.seed = seed = check_seed(seed)
        chunk = lambda types: None if chunk_capsules is None else max(1, chunk_capsules // (9 * types))
        if isinstance(routing, str):
            routers = layer_routers(routing, routing_iterations, seed, dtype=self.dtype_policy)
        else:
            routers = [routing_lib.get(r, dtype=self.dtype_policy) for r in routing]
            if len(routers) != 3:
                raise InputError(f"routing needs one router per capsule layer (3). Received: {len(routers)}")
        init = lambda k: NearIdentity(0.1, seed=seed + k)
        conv_init = lambda k: keras.initializers.GlorotUniform(seed=seed + k)
        dtype = self.dtype_policy  # every layer's, as Keras layers hand theirs on
        self.conv1 = keras.layers.Conv2D(filters, 5, strides=2, activation="relu", kernel_initializer=conv_init(0),
                                         name="conv1", dtype=dtype)
        self.batch_norm = distribute.batch_normalization(name="batch_norm", dtype=dtype)
        self.primary = PrimaryMatrixCapsules(primary_types, name="primary_capsules", dtype=dtype)
        self.conv_caps1 = ConvCapsules(conv_types, 16, 3, 2, routing=routers[0], kernel_initializer=init(1),
                                       frobenius_votes=True, chunk_size=chunk(primary_types), name="conv_caps1",
                                       dtype=dtype)
        self.conv_caps2 = ConvCapsules(conv_types, 16, 3, 1, routing=routers[1], kernel_initializer=init(2),
                                       frobenius_votes=True, chunk_size=chunk(conv_types), name="conv_caps2",
                                       dtype=dtype)
        self.class_capsules = CapsuleDense(num_classes, 16, routing=routers[2], pose="matrix",
                                           kernel_initializer=init(3), frobenius_votes=True, name="class_capsules",
                                           dtype=dtype)
        if loss == "scaled_cross_entropy":
            self.log_logit_scale = self.add_weight(name="log_logit_scale", shape=(),
                                                   initializer=keras.initializers.Constant(math.log(logit_scale)))
        self.build()

    def build(self, input_shape=None):
        self.call(ops.zeros((1, *self.image_shape)))

    @property
    def routers(self):
        """The routing layers, bottom up: ConvCaps1, ConvCaps2, class capsules."""
        return [self.conv_caps1.routing, self.conv_caps2.routing, self.class_capsules.routing]

    @property
    def loss_term_names(self):
        if self.loss == "scaled_cross_entropy":
            return ("scaled_cross_entropy_loss", "logit_scale")
        return ("spread_loss", "margin") if self.loss == "spread" else (f"{self.loss}_loss",)

    def encode(self, images, training=None):
        """The class layer's `RoutingResult` (poses `[B, K, 16]`, activations `[B, K]`)."""
        check_image_batch(images, self.image_shape[:2], type(self).__name__, self.image_shape[2])
        poses, act = self.primary(self.batch_norm(self.conv1(images), training=training))
        r1 = self.conv_caps1.route(frobenius_unit(poses), act, training=training)
        r2 = self.conv_caps2.route(frobenius_unit(r1.poses), r1.activations, training=training)
        _, h, w, types, dim = r2.poses.shape
        flat_poses = ops.reshape(frobenius_unit(r2.poses), (-1, h * w * types, dim))
        flat_act = ops.reshape(r2.activations, (-1, h * w * types))
        return self.class_capsules.route(flat_poses, flat_act, training=training)

    def call(self, images, training=None):
        result = self.encode(images, training)
        return {"scores": result.activations, "poses": result.poses, "coefficients": result.coefficients}

    def loss_terms(self, images, labels, training=False, step=None):
        """`(loss, scores [B, K], {term: value})` of the chosen loss on a batch: `labels` `[B]` class indices,
        `step` the training step of the spread loss's margin (`check_loss_inputs`; None: the final margin)."""
        result = self.encode(images, training)
        labels = check_loss_inputs(self, images, labels, step)
        scores = ops.cast(result.activations, distribute.full_precision_dtype(result.activations))
        if self.loss == "spread":
            margin = losses.spread_margin(self.margin_steps if step is None else step, self.margin_steps)
            loss = ops.mean(losses.spread_loss(labels, scores, margin))
            return loss, scores, {"spread_loss": loss, "margin": margin}
        if self.loss == "scaled_cross_entropy":
            scale = ops.exp(self.log_logit_scale)
            loss = ops.mean(losses.softmax_cross_entropy(labels, scale * scores))
            return loss, scores, {"scaled_cross_entropy_loss": loss, "logit_scale": scale}
        if self.loss == "margin":
            loss = ops.mean(losses.margin_loss(labels, scores))
        else:
            loss = ops.mean(losses.softmax_cross_entropy(labels, scores))
        return loss, scores, {f"{self.loss}_loss": loss}

    def get_config(self):
        return {**super().get_config(),  # name, trainable, dtype
                "image_shape": list(self.image_shape), "num_classes": self.num_classes,
                "routing": [keras.saving.serialize_keras_object(r) for r in self.routers],
                "routing_iterations": self.routing_iterations, "loss": self.loss,
                "logit_scale": self.logit_scale,
                "margin_steps": self.margin_steps, "filters": self.filters, "primary_types": self.primary_types,
                "conv_types": self.conv_types, "chunk_capsules": self.chunk_capsules, "seed": self.seed}
