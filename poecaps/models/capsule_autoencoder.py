"""Amortised variational inference in the probabilistic capsule model (Smith et al., section 2.2, supplement A-B).

The approximate posterior inverts the generative order, layer by layer:

    q(t_j, A_j | X)        part encoder (CNN, attention pooling):  t_j ~ BinConcrete(l_j, tau), A_j a point
    q(t_i, A_i | t_., A_.) top encoder (set transformer):          t_i ~ BinConcrete(l_i, tau), A_i a point

and the bound (eq. 8) with the parent choices summed out exactly and the
poses as point estimates (MAP, as the paper trains), one reparameterised
draw of the relaxed presences:

    L = log p(X | t_j, A_j) + sum_j log sum_i pi_ij f_ij + log p(t_i, A_i)
        - sum_j log q(t_j) - sum_i log q(t_i).

Part encoder: the image with two coordinate channels (x and y of each pixel
centre in the [-1, 1] frame of `poecaps.compositing`, so that the pooled
poses can say where a part is), 3x3 convolutions of 32 channels, stride 2,
2, 1, 1, ELU, then
a 1x1 convolution giving every part its 7 numbers (presence logit, 6 pose
entries) and an attention logit at each position, pooled by a softmax over
the positions (stacked capsule autoencoders' attention pooling). Top
encoder: each part's `(t_j, A_j)` standardised over the batch, per part and
entry (batch normalisation; moving statistics outside training), then with
its one-hot index `j` embedded to 128, four induced
set-attention blocks (32 inducing points, 4 heads, layer norm), pooling by
attention to one vector, a linear map to 32, then a one-hidden-layer MLP of
128 units for each variational parameter (presence logits, poses).

The standardisation is not in the spec. The parts' poses differ between
images by a small fraction of the canvas, beside a one-hot index of size 1;
read raw, they barely move the top encoder, and training without it made
the top encoder's output constant, the same top capsules for every image
(docs/probabilistic_capsules.md).

Specialisation (optional, not in the paper; weight 0 by default). With
`specialisation = w > 0` training ascends `bound + w I` instead of the
bound, where `I` is the information the batch's top presences carry about
the image: with `q_b(i) = t_bi / sum_k t_bk` (the encoder's presence
probabilities `t = sigmoid(l)` normalised over the top capsules),

    I = H(mean_b q_b) - mean_b H(q_b),     0 <= I <= log K,

the mutual information between the image and a top capsule drawn from
`q` (information maximisation, as in discriminative clustering). It is
large when each image turns on a few top capsules and different images
turn on different ones. Kosiorek et al. (stacked capsule autoencoders)
ask the same of their object capsules with their within- and
between-example sparsity losses; Smith et al. use none. `I` is a
batch-level quantity: test-time optimisation (`refine`) and every figure
of the bound ignore it.

Prior sparsity (optional, not in the paper; weights 0 by default).
Kosiorek et al.'s l2 prior sparsity losses on the top presence
probabilities `t = sigmoid(l)` of a batch of `B` images, `K` top capsules
and `C` expected classes:

    S_within  = mean_b (sum_k t_bk - K / C)^2      (each image turns on K / C capsules)
    S_between = mean_k (sum_b t_bk - B / C)^2      (each capsule is on in B / C images)

and training ascends `bound + w I - a S_within - b S_between`. Unlike `I`,
whose gradient vanishes when every image has the same presences, these
push from there: a capsule on for every image is pulled down by
`S_between`, one off for every image up; all presences at `1 / C` for
every image meet both at no cost. Kosiorek et al. train with these
beside entropy losses of `I`'s kind. Batch-level too: `refine` and the
bound ignore them.

Detached parts (optional, not in the paper; off by default). With
`detach_parts=True`, training holds the parts constant in the top
layer's terms (the top encoder's input and `log p(t_j, P_j | top)`), as
Kosiorek et al. stop the gradient into their part capsules from the
object capsules' likelihood: the part encoder then learns from
`log p(X | parts)` and its own entropy alone, and cannot shape the parts
to suit the top layer. The bound's value is unchanged; `refine` and
evaluation (`training` false) take the full gradient.

Equivariant top encoder (optional, not in the paper; off by default).
With `equivariant_top=True` the top encoder reads the parts in their own
rigid frame `F` (`poecaps.frames.rigid_frame` of the part poses `P_j`
weighted by their presences: their centre, principal axis and the side of
its third moment) and places the top capsules in it:

    (l_i, Q_i) = set transformer(t_j, F^-1 P_j),     P_i = F Q_i.

The generative model is unchanged by one rotation and translation `R` of
every pose (`N(R P_j; R P_i M_ij, c^2)` equals `N(P_j; P_i M_ij, c^2)`, `R`
being orthogonal on each column of the 2 x 3 pose), and this encoder
matches it: if every part pose moves by `R`, the top presences stay and
the top poses move by `R`. The frame is held constant in the gradient
(it turns fast where the parts' spread is nearly round), so the encoders
learn through `F^-1 P_j` and `F Q_i` with `F` fixed.

Anchored parts (optional, not in the paper; off by default). With
`anchored_parts=True` a part's position is where its attention falls: the
part encoder reads the image without coordinate channels, and at each
position `l` of its last feature map (cell centre `x_l` in the image's
[-1, 1] frame) the head's translation entries are an offset from `x_l`,

    (tx_j, ty_j) = sum_l w_lj (x_l + o_lj),     w_.j = softmax_l(a_lj),

so that a part found elsewhere in the image is placed elsewhere, whatever
the encoder learned. Moving the image's content by whole cells of the
feature map (4 pixels) moves the attention with it away from the borders;
the coordinate channels, by contrast, let the encoder place a part
wherever it learned to on upright digits.

Localised attention (optional, not in the paper; weight 0 by default).
Trained by the bound alone, a part's attention spreads over nearly every
cell (docs/probabilistic_anchored_parts.md). With `localisation = u > 0`
training ascends the objective minus `u sum_j H_j`, `H_j = -sum_l w_lj
log w_lj` the entropy (nats) of part j's attention over the cells, which
pulls each part's attention onto few cells. Like the other extra terms it
is not part of the bound, which `refine` and every figure use.

Free bits on the top presences (optional, not in the paper; 0 by
default). With `presence_free_bits = lambda > 0` training ascends

    objective + sum_i (K_i - max(K_i, lambda)),
    K_i = mean_b [log q(t_bi) - log p(t_bi)]

at the drawn relaxed presences (Kingma et al.'s free bits, per top
capsule over the batch): `K_i` is the bound's own one-draw estimate of
capsule i's presence KL, so while `K_i < lambda` the added term's
gradient cancels the bound's pull of `q(t_i)` towards the prior `p(t_i)`
(and of the prior towards `q`) exactly, and above `lambda` nothing
changes. Batch-level, not part of the bound; `refine` ignores it.

Args:
    generative: a `ProbabilisticCapsules` (or its config dict) of the model's
        precision (made with the model's `dtype`, if one is given).
    channels, hidden, encoding, blocks, inducing, heads: encoder sizes
        (32, 128, 32, 4, 32, 4).
    specialisation: the weight `w >= 0` of `I` in the training objective,
        in nats per image (0: the paper's bound alone).
    within_sparsity, between_sparsity: the weights `a, b >= 0` of
        `S_within` and `S_between` (0: none; Kosiorek et al. use 2 and 0.35).
    sparsity_classes: `C > 0` in their targets (10).
    detach_parts: hold the parts constant in the top layer's terms in
        training (False).
    equivariant_top: read the parts in their rigid frame and place the top
        capsules in it (False).
    anchored_parts: place each part at its attention's mean position
        (False: the encoder outputs the position, reading coordinate channels).
    localisation: the weight `u >= 0` of the attention entropies in the
        training objective, in nats per part (0: none).
    presence_free_bits: `lambda >= 0`, the nats of presence KL per top
        capsule that training does not charge (0: none).
    seed: seed of the part encoder's initial weights and of the part
        embedding's and the encoding layer's; the set transformer and the
        MLP heads draw theirs from Keras' global random state, so a whole
        model repeats after `keras.utils.set_random_seed`, as the scripts call it.

Call arguments:
    images: `[B, H, W, 1]` in [0, 1].
    training: batch statistics in the top encoder's standardisation (the
        trainer passes True to `bound`); otherwise its moving statistics.

Returns (call): dict of the encoders' means (presences `sigmoid(l)`, poses)
and `reconstructions`, the image rendered from the parts' means.
"""

import keras
import tensorflow as tf
from keras import ops

from poecaps import compositing, concrete, distribute, frames, graphs
from poecaps.errors import InputError
from poecaps.layers import AttentionPooling, InducedSetAttention
from poecaps.models.probabilistic_capsules import ProbabilisticCapsules
from poecaps.validation import (
    check_choice,
    check_finite,
    check_flag,
    check_image_batch,
    check_integer,
    check_integers,
    check_number,
    check_seed,
    check_seed_pair,
    shape_fits,
    static_shape,
)


def _coordinates(images):
    """`[B, H, W, 2]`: x and y of every pixel centre in [-1, 1] (`poecaps.compositing`'s frame)."""
    height, width = images.shape[1], images.shape[2]
    ys, xs = tf.meshgrid(compositing.pixel_centres(height, images.dtype),
                         compositing.pixel_centres(width, images.dtype), indexing="ij")
    grid = tf.stack([xs, ys], axis=-1)[None]
    return tf.broadcast_to(grid, tf.concat([tf.shape(images)[:1], [height, width, 2]], 0))


def prior_sparsity(top_logits, classes):
    """`(S_within, S_between)`: Kosiorek et al.'s l2 prior sparsity of a batch's top presences (scalars).

    `t = sigmoid(top_logits)` (`[B, K]`); `S_within = mean_b (sum_k t_bk - K / classes)^2`,
    `S_between = mean_k (sum_b t_bk - B / classes)^2`.
    """
    t = tf.sigmoid(top_logits)
    batch, num_top = tf.cast(tf.shape(t)[0], t.dtype), tf.cast(tf.shape(t)[1], t.dtype)
    within = tf.reduce_mean(tf.square(tf.reduce_sum(t, axis=1) - num_top / classes))
    between = tf.reduce_mean(tf.square(tf.reduce_sum(t, axis=0) - batch / classes))
    return within, between


def presence_information(top_logits):
    """`I`: the information a batch's top presences carry about the image, in nats (a scalar).

    `q_b = t_b / sum(t_b)` with `t = sigmoid(top_logits)` (`[B, K]`);
    `I = H(mean_b q_b) - mean_b H(q_b)`, computed from `log_sigmoid` in
    log space, so that presences near 0 stay finite.
    """
    log_t = tf.math.log_sigmoid(top_logits)
    log_q = log_t - tf.reduce_logsumexp(log_t, axis=-1, keepdims=True)
    q = tf.exp(log_q)
    conditional = -tf.reduce_mean(tf.reduce_sum(q * log_q, axis=-1))
    log_marginal = tf.reduce_logsumexp(log_q, axis=0) - tf.math.log(tf.cast(tf.shape(log_q)[0], log_q.dtype))
    return -tf.reduce_sum(tf.exp(log_marginal) * log_marginal) - conditional


OPTIMIZERS = ("adam", "sgd")


def _check_finite_values(images, parameters):
    """Run eagerly, an `InputError` unless the images and the parameters (a dict, or None) are all finite: a NaN
    pixel made every refined parameter and bound NaN without a word. In a traced call, nothing."""
    if not tf.executing_eagerly():
        return
    check_finite(ops.convert_to_numpy(images), "images", "pixels")
    for name, value in (parameters or {}).items():
        check_finite(ops.convert_to_numpy(value), f"parameters[{name!r}]")


def _ascent(model, images, values, names, steps, learning_rate, seed, optimizer, beta1=0.9, beta2=0.999, eps=1e-8):
    """`steps` steps ascending `sum(bound)` in `values` (a list of tensors); the model's weights fixed.

    `optimizer` "adam": Adam's update (Kingma and Ba, algorithm 1); "sgd":
    plain gradient ascent, `x <- x + learning_rate * grad`. Step `t` draws the
    presences with the stateless seed `[seed, t]`. The loop is compiled by
    XLA: its CPU reductions run in a fixed order, so a run repeats bit for
    bit in a new process, which the threaded eager kernels do not promise.
    XLA's stateless draws differ from the eager kernels' at the same seed.
    `steps`, `learning_rate` and `seed` enter the compiled loop as tensors,
    and the loop is kept with the model (`poecaps.graphs.kept`), so calls
    that differ only in them, or in the values, reuse one compilation per
    shape.
    """
    key = ("ascent", tuple(names), optimizer, beta1, beta2, eps)
    run = graphs.kept(model, key, lambda ref: graphs.graph(
        lambda *args: _ascent_loop(ref(), names, optimizer, beta1, beta2, eps, *args), jit_compile=True))
    return list(run(images, values, tf.constant(steps, tf.int32), tf.constant(learning_rate, images.dtype),
                    tf.constant(seed, tf.int64)))


def _ascent_loop(model, names, optimizer, beta1, beta2, eps, images, values, steps, learning_rate, seed):
    """The body of `_ascent`, traced into one XLA while loop."""
    def step(t, values, first, second):
        with tf.GradientTape() as tape:
            tape.watch(values)
            draw = tf.stack([seed, tf.cast(t, tf.int64)])
            bound = model.bound_terms(images, **dict(zip(names, values)), seed=draw)["bound"]
            loss = -tf.reduce_sum(bound)
        grads = tape.gradient(loss, values)
        if optimizer == "sgd":
            return t + 1, [x - learning_rate * g for x, g in zip(values, grads)], first, second
        first = [beta1 * m + (1.0 - beta1) * g for m, g in zip(first, grads)]
        second = [beta2 * v + (1.0 - beta2) * tf.square(g) for v, g in zip(second, grads)]
        k = tf.cast(t + 1, images.dtype)
        scale = learning_rate * tf.sqrt(1.0 - beta2 ** k) / (1.0 - beta1 ** k)
        values = [x - scale * m / (tf.sqrt(v) + eps) for x, m, v in zip(values, first, second)]
        return t + 1, values, first, second

    zeros = [tf.zeros_like(v) for v in values]
    return tf.while_loop(lambda t, *_: t < steps, step, (tf.constant(0), values, zeros, list(zeros)))[1]


@keras.saving.register_keras_serializable(package="poecaps")
class ProbabilisticCapsuleAutoencoder(keras.Model):
    __doc__ = __doc__
    TERMS = ("bound", "image", "parts", "top", "part_entropy", "top_entropy", "top_information",
             "top_sparsity_within", "top_sparsity_between")

    def __init__(self, generative=None, channels=32, hidden=128, encoding=32, blocks=4, inducing=32, heads=4,
                 specialisation=0.0, within_sparsity=0.0, between_sparsity=0.0, sparsity_classes=10,
                 detach_parts=False, equivariant_top=False, anchored_parts=False, localisation=0.0,
                 presence_free_bits=0.0, seed=0, **kwargs):
        super().__init__(**kwargs)
        seed = check_seed(seed)
        self.specialisation = check_number(specialisation, "specialisation", minimum=0)
        self.within_sparsity = check_number(within_sparsity, "within_sparsity", minimum=0)
        self.between_sparsity = check_number(between_sparsity, "between_sparsity", minimum=0)
        self.sparsity_classes = check_number(sparsity_classes, "sparsity_classes", above=0)
        self.detach_parts = check_flag(detach_parts, "detach_parts")
        self.equivariant_top = check_flag(equivariant_top, "equivariant_top")
        self.anchored_parts = check_flag(anchored_parts, "anchored_parts")
        self.localisation = check_number(localisation, "localisation", minimum=0)
        self.presence_free_bits = check_number(presence_free_bits, "presence_free_bits", minimum=0)
        if generative is None:
            generative = ProbabilisticCapsules(seed=seed, dtype=self.dtype_policy)
        elif isinstance(generative, dict):
            generative = keras.saving.deserialize_keras_object(generative)
        if not isinstance(generative, ProbabilisticCapsules):
            raise InputError(f"generative must be a ProbabilisticCapsules or its config. Received: {generative!r}")
        full = distribute.full_precision_dtype(self)
        if generative.compute_dtype != full:
            raise InputError(
                f"generative computes in {generative.compute_dtype}, but this model's likelihoods are computed in "
                f"{full} (its dtype policy is {self.dtype_policy.name}); make the ProbabilisticCapsules with "
                f"dtype={self.dtype_policy.name!r}. Received: generative.dtype_policy={generative.dtype_policy.name}")
        self.generative = generative
        channels, hidden, encoding, inducing, heads = check_integers(
            channels=channels, hidden=hidden, encoding=encoding, inducing=inducing, heads=heads)
        blocks = check_integer(blocks, "blocks", minimum=0)
        self.channels, self.hidden, self.encoding = channels, hidden, encoding
        self.blocks, self.inducing, self.heads, self.seed = blocks, inducing, heads, seed
        k, n = generative.num_top, generative.num_parts
        init = lambda i: keras.initializers.GlorotUniform(seed=seed + i)
        dtype = self.dtype_policy  # every layer's, as Keras layers hand theirs on
        self.convs = [keras.layers.Conv2D(channels, 3, strides=s, padding="same", activation="elu",
                                          kernel_initializer=init(i), name=f"part_conv{i}", dtype=dtype)
                      for i, s in enumerate((2, 2, 1, 1))]
        self.part_head = keras.layers.Conv2D(n * 8, 1, kernel_initializer=init(4), name="part_head", dtype=dtype)
        self.part_normalisation = distribute.batch_normalization(name="part_normalisation", dtype=dtype)
        self.embed = keras.layers.Dense(hidden, kernel_initializer=init(5), name="part_embedding", dtype=dtype)
        self.isabs = [InducedSetAttention(hidden, heads, inducing, name=f"isab{i}", dtype=dtype)
                      for i in range(blocks)]
        self.pool = AttentionPooling(hidden, heads, 1, name="pool", dtype=dtype)
        self.to_encoding = keras.layers.Dense(encoding, kernel_initializer=init(6), name="encoding", dtype=dtype)
        self.top_presence_mlp = keras.Sequential([keras.layers.Dense(hidden, activation="elu", dtype=dtype),
                                                  keras.layers.Dense(k, dtype=dtype)], name="top_presence")
        self.top_pose_mlp = keras.Sequential([keras.layers.Dense(hidden, activation="elu", dtype=dtype),
                                              keras.layers.Dense(k * 6, dtype=dtype)], name="top_pose")
        scale = generative.part_scale - 1.0
        self.part_pose_offset = tf.constant([scale, 0.0, 0.0, 0.0, scale, 0.0])
        self.build((None, *generative.image_size, 1))

    def build(self, input_shape):
        self.call(ops.zeros((1, *self.generative.image_size, 1)))

    def _part_cells(self, images):
        """`(cells [B, h w, N, 8], (h, w))`: each part's 8 numbers at every cell of the last feature map.

        Per part: the presence logit, 6 pose entries (with `anchored_parts`,
        the translation entries offset from the cell centre) and the
        attention logit. In float32 under a mixed policy (the convolutions' low precision cast up).
        """
        check_image_batch(images, self.generative.image_size, type(self).__name__)
        h = images if self.anchored_parts else ops.concatenate([images, _coordinates(images)], axis=-1)
        for conv in self.convs:
            h = conv(h)
        n, (height, width) = self.generative.num_parts, h.shape[1:3]
        head = ops.reshape(self.part_head(h), (-1, height, width, n, 8))
        head = ops.cast(head, distribute.full_precision_dtype(head))
        if self.anchored_parts:          # the translation entries (2 and 5 of the pose) offset from the cell centre
            place = tf.constant([[0.0] * 3 + [1.0] + [0.0] * 4, [0.0] * 6 + [1.0, 0.0]], head.dtype)  # x -> 3, y -> 6
            anchor = ops.matmul(_coordinates(h[..., :1]), place)                   # [B, h, w, 8]
            head = head + anchor[:, :, :, None, :]                                 # the same offset for every part
        return ops.reshape(head, (-1, height * width, n, 8)), (height, width)

    def part_attention(self, images):
        """`[B, h, w, N]`: each part's attention over the cells of the last feature map (sums to 1 per part)."""
        cells, (height, width) = self._part_cells(images)
        return ops.reshape(ops.softmax(cells[..., 7], axis=1), (-1, height, width, self.generative.num_parts))

    def encode_parts(self, images):
        """`(presence logits [B, N], poses A_j [B, N, 6])` of q(t_j, A_j | X)."""
        return self._encode_parts(images)[:2]

    def _encode_parts(self, images):
        """`encode_parts` and, with `localisation`, the entropies `H_j [B, N]` (nats) of the parts' attention
        over the cells (else None)."""
        cells, _ = self._part_cells(images)
        weights = ops.softmax(cells[..., 7], axis=1)                                # over the positions
        pooled = ops.sum(weights[..., None] * cells[..., :7], axis=1)               # [B, N, 7]
        entropy = None
        if self.localisation:
            entropy = -ops.sum(weights * tf.nn.log_softmax(cells[..., 7], axis=1), axis=1)
        return pooled[..., 0], pooled[..., 1:] + tf.cast(self.part_pose_offset, pooled.dtype), entropy

    def encode_top(self, part_presence, part_pose, training=False):
        """`(presence logits [B, K], poses A_i [B, K, 6])` of q(t_i, A_i | t_j, A_j), from the parts' presences
        `[B, N]` and poses `[B, N, 6]`."""
        self.generative._check_latents(part_presence=part_presence, part_pose=part_pose)
        n = self.generative.num_parts
        identity = tf.constant(compositing.IDENTITY, part_pose.dtype)
        if self.equivariant_top:
            frame = tf.stop_gradient(frames.rigid_frame(part_pose + identity, part_presence))
            part_pose = frames.to_frame(frame, part_pose + identity) - identity
        parts = ops.reshape(ops.concatenate([part_presence[..., None], part_pose], axis=-1), (-1, n * 7))
        parts = ops.reshape(self.part_normalisation(parts, training=training), (-1, n, 7))
        index = ops.broadcast_to(ops.eye(n, dtype=parts.dtype)[None], (ops.shape(part_pose)[0], n, n))
        h = self.embed(ops.concatenate([parts, index], axis=-1))
        for block in self.isabs:
            h = block(h)
        code = self.to_encoding(self.pool(h)[:, 0])
        k = self.generative.num_top
        dtype = distribute.full_precision_dtype(part_pose)                  # float32 under a mixed policy
        top_pose = ops.cast(ops.reshape(self.top_pose_mlp(code), (-1, k, 6)), dtype)
        if self.equivariant_top:
            top_pose = frames.from_frame(frame, top_pose + identity) - identity
        return ops.cast(self.top_presence_mlp(code), dtype), top_pose

    def call(self, images, training=False):
        part_logits, part_pose = self.encode_parts(images)
        part_presence = ops.sigmoid(part_logits)
        top_logits, top_pose = self.encode_top(part_presence, part_pose, training=bool(training))
        return {"part_presence": part_presence, "part_pose": part_pose, "top_presence": ops.sigmoid(top_logits),
                "top_pose": top_pose, "reconstructions": self.generative.render(part_presence, part_pose)}

    def bound_terms(self, images, part_logits, part_pose, top_logits=None, top_pose=None, seed=None,
                    training=False):
        """The bound's terms per image `[B]` at the given variational parameters (one draw of the presences).

        Without `top_logits` / `top_pose` the top encoder gives them from the
        drawn parts (`training`: with batch statistics, and with
        `detach_parts` the parts held constant in the top layer's terms).
        `seed`: a stateless seed `[2]` or None. Keys: `bound`, `image` (log p(X | parts)), `parts` (sum_j log p(t_j, P_j | top)),
        `top` (log p(t_i, A_i)), `part_entropy`, `top_entropy` (-log q);
        `top_information`, `top_sparsity_within`, `top_sparsity_between`:
        the batch's `I`, `S_within`, `S_between` (module docstring) repeated
        for each image, not part of the bound; `objective`, what training
        ascends, `bound + specialisation * I - within_sparsity * S_within -
        between_sparsity * S_between`, and with `presence_free_bits` the
        free bits' term (module docstring).
        """
        g = self.generative
        check_image_batch(images, g.image_size, type(self).__name__)
        if (top_logits is None) != (top_pose is None):
            raise InputError("bound_terms takes top_logits and top_pose together, or neither (the top encoder then "
                             f"reads the drawn parts). Received: only {'top_pose' if top_logits is None else 'top_logits'}")
        seed = check_seed_pair(seed, allow_none=True)
        seeds = [None, None] if seed is None else tf.unstack(tf.random.experimental.stateless_split(seed, 2))
        part_presence = concrete.sample(part_logits, g.temperature, seeds[0])
        seen_presence, seen_pose = part_presence, part_pose                 # the parts as the top layer sees them
        if self.detach_parts and training:
            seen_presence, seen_pose = tf.stop_gradient(part_presence), tf.stop_gradient(part_pose)
        if top_logits is None:
            top_logits, top_pose = self.encode_top(seen_presence, seen_pose, training=training)
        top_presence = concrete.sample(top_logits, g.temperature, seeds[1])
        top_log_q = concrete.log_prob(top_presence, top_logits, g.temperature)             # [B, K]
        terms = {
            "image": g.image_log_likelihood(images, part_presence, part_pose),
            "parts": tf.reduce_sum(g.part_marginal_log_likelihood(top_presence, top_pose, seen_presence, seen_pose), -1),
            "top": g.top_log_prior(top_presence, top_pose),
            "part_entropy": -tf.reduce_sum(concrete.log_prob(part_presence, part_logits, g.temperature), -1),
            "top_entropy": -tf.reduce_sum(top_log_q, -1),
        }
        terms["bound"] = terms["image"] + terms["parts"] + terms["top"] + terms["part_entropy"] + terms["top_entropy"]
        each = lambda value: tf.fill(tf.shape(terms["bound"]), value)
        terms["top_information"] = each(presence_information(top_logits))
        within, between = prior_sparsity(top_logits, self.sparsity_classes)
        terms["top_sparsity_within"], terms["top_sparsity_between"] = each(within), each(between)
        terms["objective"] = (terms["bound"] + self.specialisation * terms["top_information"]
                              - self.within_sparsity * terms["top_sparsity_within"]
                              - self.between_sparsity * terms["top_sparsity_between"])
        if self.presence_free_bits:
            kl = tf.reduce_mean(top_log_q - concrete.log_prob(top_presence, g.top_logits[None], g.temperature), 0)
            terms["objective"] = terms["objective"] + tf.reduce_sum(kl - tf.maximum(kl, self.presence_free_bits))
        return terms

    def bound(self, images, seed=None, training=False):
        """`bound_terms` at the encoders' output; with `localisation`, its objective less `u sum_j H_j`."""
        part_logits, part_pose, entropy = self._encode_parts(images)
        terms = self.bound_terms(images, part_logits, part_pose, seed=seed, training=training)
        if self.localisation:
            terms["objective"] = terms["objective"] - self.localisation * ops.sum(entropy, axis=-1)
        return terms

    def variational_parameters(self, images):
        """The encoders' variational parameters, the starting point of `refine`.

        Dict of `part_logits [B, N]`, `part_pose [B, N, 6]`, `top_logits
        [B, K]` and `top_pose [B, K, 6]` (the top encoder reads the parts'
        presence means).
        """
        part_logits, part_pose = self.encode_parts(images)
        top_logits, top_pose = self.encode_top(tf.sigmoid(part_logits), part_pose)
        return {"part_logits": part_logits, "part_pose": part_pose, "top_logits": top_logits, "top_pose": top_pose}

    def _check_parameters(self, images, parameters):
        """Raise `InputError` unless `parameters` is `variational_parameters`' dict for `images`, with or without
        the top's two keys (`bound_terms` then reads the top from the drawn parts), shaped `[B, N]`,
        `[B, N, 6]`, `[B, K]`, `[B, K, 6]` for the images' batch size B."""
        g = self.generative
        batch = static_shape(images)[0]
        expected = {"part_logits": (batch, g.num_parts), "part_pose": (batch, g.num_parts, 6),
                    "top_logits": (batch, g.num_top), "top_pose": (batch, g.num_top, 6)}
        keys = set(parameters) if isinstance(parameters, dict) else None
        if keys not in (set(expected), set(list(expected)[:2])):
            found = sorted(keys) if keys is not None else type(parameters).__name__
            raise InputError(f"parameters must be the dict of variational_parameters: keys {sorted(expected)}, "
                             f"or the parts' two alone. Received: {found}")
        for name, shape in ((name, shape) for name, shape in expected.items() if name in parameters):
            found = static_shape(parameters[name])
            if not shape_fits(found, shape):
                raise InputError(f"parameters[{name!r}] must be {list(shape)} for {batch} images (K = {g.num_top} "
                                 f"top capsules, N = {g.num_parts} parts). Received: shape={found}")

    def mean_bound(self, images, parameters, draws=8, seed=0):
        """The bound per image `[B]` at `parameters`, averaged over `draws` (>= 1) draws of the presences.

        The draws are a pure function of `seed`: two parameter sets compared
        at one seed see the same noise (common random numbers).
        """
        draws = check_integer(draws, "draws")
        check_image_batch(images, self.generative.image_size, type(self).__name__)
        self._check_parameters(images, parameters)
        _check_finite_values(images, parameters)
        seeds = tf.random.experimental.stateless_split(tf.constant([check_seed(seed), 1], tf.int64), draws)
        total = 0.0
        for d in range(draws):
            total += self.bound_terms(images, **parameters, seed=seeds[d])["bound"]
        return total / draws

    def refine(self, images, steps, learning_rate=0.01, parameters=None, seed=0, optimizer="adam", parts_only=False):
        """Test-time optimisation: `steps` gradient steps on the bound in each image's variational parameters.

        From the encoders' output (or `parameters`), with the model's weights
        fixed, ascend `bound_terms` (one fresh draw of the presences per
        step, a pure function of `seed`; compiled by XLA, so a run repeats
        bit for bit in a new process). `optimizer`: "adam" (the default)
        or "sgd", plain gradient ascent `x <- x + learning_rate * dL/dx` (the
        paper's "basic gradient descent"). Adam moves each coordinate by
        about `learning_rate` per step whatever the size of its gradient;
        plain ascent moves it in proportion to its gradient, so its stable rate
        is set by the coordinates of largest curvature. Both act coordinate-wise on the
        sum of the images' bounds, so each image's parameters follow their
        own bound alone. With `parts_only`, only the parts' parameters
        (`part_logits`, `part_pose`) are refined, and the top layer's
        posterior stays amortised: in each step's bound the top encoder
        reads the drawn parts (so the parts also follow the gradient through
        the top encoder), and the returned `top_logits`, `top_pose` are the
        top encoder's reading of the refined parts' presence means, as in
        `variational_parameters`. Returns the refined parameters (the dict of
        `variational_parameters`).
        """
        steps = check_integer(steps, "steps", minimum=0)
        learning_rate = check_number(learning_rate, "learning_rate", above=0)
        check_choice(optimizer, "optimizer", OPTIMIZERS)
        images = tf.convert_to_tensor(images)
        parts_only = check_flag(parts_only, "parts_only")
        check_image_batch(images, self.generative.image_size, type(self).__name__)
        if parameters is not None:
            self._check_parameters(images, parameters)
        _check_finite_values(images, parameters)
        start = self.variational_parameters(images) if parameters is None else parameters
        names = ["part_logits", "part_pose"] if parts_only else sorted(start)
        found = dict(zip(names, _ascent(self, images, [tf.convert_to_tensor(start[n]) for n in names], names,
                                        steps, learning_rate, check_seed(seed), optimizer)))
        if parts_only:
            found["top_logits"], found["top_pose"] = self.encode_top(tf.sigmoid(found["part_logits"]),
                                                                     found["part_pose"])
        return found

    def get_config(self):
        return {**super().get_config(),  # name, trainable, dtype
                "generative": keras.saving.serialize_keras_object(self.generative), "channels": self.channels,
                "hidden": self.hidden, "encoding": self.encoding, "blocks": self.blocks,
                "inducing": self.inducing, "heads": self.heads, "specialisation": self.specialisation,
                "within_sparsity": self.within_sparsity, "between_sparsity": self.between_sparsity,
                "sparsity_classes": self.sparsity_classes, "detach_parts": self.detach_parts,
                "equivariant_top": self.equivariant_top, "anchored_parts": self.anchored_parts,
                "localisation": self.localisation, "presence_free_bits": self.presence_free_bits,
                "seed": self.seed}
