"""Routing as inference: states moved down an energy in one compiled loop (Kiefer, Millidge et al., section 3).

`descend` is the loop every procedure here shares: gradient steps on the
smooth part of an energy and, for an L1 penalty on capsule lengths, its
proximal step (each penalised capsule's length shrunk by `lr * l1`, never
past 0), all inside one `tf.while_loop`. `toy_states` is the 3-3-1
predictive-coding toy of appendix B; `infer` frees the primary and class
capsules of a CapsNet trained without routing (appendix C).
"""

import tensorflow as tf

from poecaps.capsules import squash
from poecaps.errors import InputError
from poecaps.graphs import graph, kept
from poecaps.validation import (
    check_choice,
    check_flag,
    check_images,
    check_integer,
    check_labels,
    check_number,
    check_setting,
)

PENALTIES = ("none", "l1", "l2")
READINGS = ("output_only", "full")
# Floor inside the norms whose gradient the smooth energies need (|v| in the label term).
_EPS = 1e-12


def _norm(v):
    return tf.sqrt(tf.reduce_sum(tf.square(v), axis=-1) + _EPS)


def shrink(v, amount):
    """The proximal step of `amount * |v|` on capsules `[..., D]`: each length cut by `amount` (>= 0; a negative
    one would lengthen them), floored at 0."""
    check_setting(amount, "amount", minimum=0)
    length = _norm(v)[..., None]
    return v * tf.maximum(1.0 - amount / length, 0.0)


def descend(smooth_energy, states, steps, learning_rate, l1=None, record=None):
    """Minimise `smooth_energy(states) + sum_k l1[k] sum_capsules |states[k]|` from `states`, in one loop.

    Each step takes a gradient step on the smooth part for every state and,
    for each state k with an L1 weight `l1[k] > 0`, the proximal step of
    its L1 term (`shrink`): proximal gradient descent, which for a step below
    1 / (the smooth part's gradient Lipschitz constant) never raises the
    energy and, unlike a subgradient step, settles exactly at 0 where the
    L1 term puts a capsule. The loop is a `tf.while_loop`: no Python loop
    per step.

    Args:
        smooth_energy: function of the list of states returning `[B]`
            energies (independent chains along the first axis).
        states: list of tensors `[B, ...]`, the starting states.
        steps: number of steps (>= 0).
        learning_rate: step size (> 0: a negative one climbs the energy).
        l1: None or a list (one weight per state, 0 for none) of L1
            weights on capsule lengths (the states' last axis).
        record: None or a function of the states whose value is kept
            before each step and after the last.

    Returns:
        `(final states, energies [steps + 1, B])`, the total energy (L1
        included) before each step and after the last; with `record`, a
        third element, its values stacked `[steps + 1, ...]`.
    """
    states = [tf.convert_to_tensor(s) for s in states]
    steps = check_integer(steps, "steps", minimum=0)
    check_setting(learning_rate, "learning_rate", above=0)
    l1 = list(l1 or [0.0] * len(states))
    if not states or len(l1) != len(states):
        raise InputError(f"descend takes one or more states and one L1 weight per state. Received: {len(states)} "
                         f"states, {len(l1)} L1 weights")
    for weight in l1:
        check_number(weight, "l1", minimum=0)

    def total(xs):
        energy = smooth_energy(xs)
        for x, weight in zip(xs, l1):
            if weight:
                energy = energy + weight * tf.reduce_sum(_norm(x), axis=tuple(range(1, x.shape.rank - 1)))
        return energy

    keep = record or (lambda xs: tf.zeros((), xs[0].dtype))

    def body(k, xs, trace, kept):
        with tf.GradientTape() as tape:
            tape.watch(xs)
            energy = smooth_energy(xs)
        grads = tape.gradient(energy, xs)
        xs = [x - learning_rate * g for x, g in zip(xs, grads)]
        xs = [shrink(x, learning_rate * w) if w else x for x, w in zip(xs, l1)]
        return k + 1, xs, trace.write(k + 1, total(xs)), kept.write(k + 1, keep(xs))

    trace = tf.TensorArray(states[0].dtype, size=steps + 1).write(0, total(states))
    kept = tf.TensorArray(states[0].dtype, size=steps + 1).write(0, keep(states))
    _, final, trace, kept = tf.while_loop(lambda k, *_: k < steps, body, (tf.constant(0), states, trace, kept))
    return (final, trace.stack()) + ((kept.stack(),) if record else ())


def toy_energy(x, u, target, penalty, reading):
    """Appendix B's energy of the hidden states `x [B, 3]` of the 3-3-1 network (W1 = I, W2 = [1, 1, 1]).

    `e1 = x - u`, `e2 = sum(x) - t`; output-only: `e2^2 + P(x)`; full:
    `(e2^2 + P(x)) + (|e1|^2 + P(x))`, the penalty counted in both terms as
    in the authors' script. `P` is 0, `sum |x|` or `sum x^2`.
    """
    check_choice(penalty, "penalty", PENALTIES)
    check_choice(reading, "reading", READINGS)
    p = {"none": tf.zeros_like(x[:, 0]), "l1": tf.reduce_sum(tf.abs(x), -1),
         "l2": tf.reduce_sum(tf.square(x), -1)}[penalty]
    energy = tf.square(tf.reduce_sum(x, -1) - target) + p
    if reading == "full":
        energy = energy + tf.reduce_sum(tf.square(x - u), -1) + p
    return energy


def toy_states(penalty, reading, u=(-1.0, 5.0, 2.0), target=2.0, steps=500, learning_rate=0.01):
    """The toy's hidden states over plain gradient descent from `x = u` (the authors' script).

    Plain (sub)gradient steps, as the script takes them: the L1 term's
    gradient is `sign(x)`, with `sign(0) = 0`.

    Returns:
        `(trajectory [steps + 1, 3], energies [steps + 1])`, float64.
    """
    check_choice(penalty, "penalty", PENALTIES)
    check_choice(reading, "reading", READINGS)
    steps = check_integer(steps, "steps", minimum=0)
    learning_rate = check_number(learning_rate, "learning_rate", above=0)
    target = check_number(target, "target")
    if len(u) != 3:
        raise InputError(f"u must be the network's three inputs. Received: u={u!r}")
    u = [check_number(value, "u") for value in u]
    u = tf.constant([u], dtype=tf.float64)
    energy = lambda xs: toy_energy(xs[0], u, target, penalty, reading)

    def body(k, x, path):
        with tf.GradientTape() as tape:
            tape.watch(x)
            e = energy([x])
        x = x - learning_rate * tape.gradient(e, x)
        return k + 1, x, path.write(k + 1, x[0])

    path = tf.TensorArray(tf.float64, size=steps + 1).write(0, u[0])
    _, _, path = tf.while_loop(lambda k, *_: k < steps, body, (tf.constant(0), u, path))
    trajectory = path.stack()
    return trajectory, energy([trajectory])


def capsnet_energy(model, h, labels=None, label_weight=1.0):
    """The smooth part of appendix C's energy for a CapsNet, as a function of `[u, v]`.

        E = |u - squash(primary(h))|^2 + sum_j |v_j - squash(sum_i c0_ij W_ij u_i)|^2
            + kappa_y sum_j (|v_j| - y_j)^2

    with `h = ReLU(conv1(x))` fixed, the routing's first-round (uniform)
    coefficients c0, and the label term only when `labels` are given
    (kappa_y = `label_weight`, y one-hot). The L1 term `lambda sum_j |v_j|`
    is `descend`'s.

    Returns:
        `(energy, u0, predict)`: the energy of `[u, v]`, the primary
        capsules' feed-forward value, and `predict(u)`, the class capsules
        the primary capsules `u` predict.
    """
    primary_target = model.primary(model.primary_conv(h))
    num_in, in_dim = primary_target.shape[1:]
    c0 = model.class_capsules.routing.uniform_coefficient(num_in, model.num_classes)
    kernel = model.class_capsules.kernel
    # W [I, J, D_out, D_in] arranged once as [I * D_in, J * D_out]: the sum of votes is then one matmul.
    matrix = tf.reshape(tf.transpose(kernel, (0, 3, 1, 2)), (num_in * in_dim, -1))
    onehot = None if labels is None else tf.one_hot(labels, model.num_classes, dtype=h.dtype)

    def predict(u):
        # [B, I * D_in] x [I * D_in, J * D_out] -> [B, J, D_out] = squash(c0 sum_i W_ij u_i)
        flat = tf.matmul(tf.reshape(u, (-1, num_in * in_dim)), matrix)
        return squash(c0 * tf.reshape(flat, (-1, model.num_classes, kernel.shape[2])))

    def energy(states):
        u, v = states
        e = (tf.reduce_sum(tf.square(u - primary_target), axis=(1, 2))
             + tf.reduce_sum(tf.square(v - predict(u)), axis=(1, 2)))
        if onehot is not None:
            e = e + label_weight * tf.reduce_sum(tf.square(_norm(v) - onehot), axis=-1)
        return e

    return energy, primary_target, predict


def infer(model, images, labels=None, steps=500, learning_rate=0.01, l1=1.0, label_weight=1.0,
          record_lengths=False):
    """Iterative inference in a CapsNet trained without routing: primary and class capsules free.

    Starts from the feed-forward pass (primary capsules `u`, class capsules
    `v` with uniform coefficients) and runs `descend` on
    `capsnet_energy` plus `l1 sum_j |v_j|`, learning rate 0.01 and 500
    steps by default (section 3.1, appendix C). With `labels` the label term
    clamps the class-capsule lengths toward the one-hot label; without, the
    longest class capsule classifies.

    Args:
        model: a `poecaps.models.CapsNet` (routing as trained is ignored: the
            coefficients are the uniform first-round ones).
        images: `[B, H, W, C]` in [0, 1].
        labels: None or `[B]` integer labels (clamped).
        steps, learning_rate, l1, label_weight: as above.
        record_lengths: also return the class-capsule lengths of every step.

    Returns:
        dict with `primary` (u `[B, I, 8]`), `classes` (v `[B, K, 16]`),
        `lengths` (`|v|` `[B, K]`), `initial_lengths`, `energy`
        (`[steps + 1, B]`) and, with `record_lengths`, `length_trace`
        (`[steps + 1, B, K]`).

    Raises:
        InputError: for a model that is not a CapsNet, images that are not
            `[B, *model.image_shape]` finite pixels in [0, 1], labels that
            are not one integer in `[0, K)` per image, steps < 0, a learning
            rate <= 0, or a negative `l1` or `label_weight`.
    """
    # Imported here: the models import the routings, which import this module.
    from poecaps.models import CapsNet

    if not isinstance(model, CapsNet):
        raise InputError(f"infer frees the primary and class capsules of a CapsNet. Received: model of type "
                         f"{type(model).__name__}")
    steps = check_integer(steps, "steps", minimum=0)
    learning_rate = check_number(learning_rate, "learning_rate", above=0)
    l1, label_weight = check_number(l1, "l1", minimum=0), check_number(label_weight, "label_weight", minimum=0)
    record_lengths = check_flag(record_lengths, "record_lengths")
    images = check_images(images, "images", model.image_shape)
    if labels is not None:
        check_labels(labels, model.num_classes, len(images))
    run = _compiled_inference(model, steps, learning_rate, l1, label_weight, labels is not None, record_lengths)
    images = tf.convert_to_tensor(images, tf.float32)
    found = run(images, tf.zeros(tf.shape(images)[:1], tf.int32) if labels is None
                else tf.convert_to_tensor(labels, tf.int32))
    keys = ["primary", "classes", "lengths", "initial_lengths", "energy"] + ["length_trace"] * record_lengths
    return dict(zip(keys, found))


def _compiled_inference(model, steps, learning_rate, l1, label_weight, clamped, record_lengths):
    """`infer`'s work for one model and settings, as one XLA computation of `(images, labels)`, built once and
    kept on the model (`graphs.kept`): the graph reaches the model through a weak reference, so keeping it does
    not keep a model the caller has let go."""

    def make(ref):
        def run(images, labels):
            model = ref()
            h = model.conv1(images)
            energy, u0, predict = capsnet_energy(model, h, labels if clamped else None, label_weight)
            v0 = predict(u0)
            record = (lambda xs: _norm(xs[1])) if record_lengths else None
            found = descend(energy, [u0, v0], steps, learning_rate, [0.0, l1], record)
            (u, v), trace = found[:2]
            return (u, v, _norm(v), _norm(v0), trace) + tuple(found[2:])

        return graph(run, jit_compile=True)

    return kept(model, ("infer", steps, learning_rate, l1, label_weight, clamped, record_lengths), make)
