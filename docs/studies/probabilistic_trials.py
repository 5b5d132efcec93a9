"""Short trials of the probabilistic capsule model: do the top presences switch by class under other settings?

Usage: python docs/studies/probabilistic_trials.py OUT.json --data-dir ../shared/data/mnist-5k \
           [--epochs 8] [--c-min 0.1] [--temperature 1.0] [--top-prior P] [--specialisation W]
           [--within-sparsity A] [--between-sparsity B] [--detach-parts] [--equivariant-top] [--anchored-parts]
           [--localisation U] [--translate N] [--fixed-binding] [--free-bits LAMBDA]
           [--part-sparsity A B]
           [--refine-parts STEPS [--refine-every 4]] [--seed 0]

Trains `ProbabilisticCapsuleAutoencoder` (the spec's sizes, 40 x 40 canvas,
Adam 1e-3, batch 64; no VAE) for a few epochs with the pose spread's floor
`c_min` and the Concrete temperature given (and, with `--top-prior`, the
top capsules' prior presence `p` fixed at P instead of learned; with
`--specialisation`, the top presences' information weighted by W in the
training objective; with `--within-sparsity` / `--between-sparsity`,
Kosiorek et al.'s prior sparsity losses weighted by A / B, 10 classes;
with `--detach-parts`, the parts held constant in the top layer's terms;
with `--equivariant-top`, the top encoder reading the parts in their rigid
frame; with `--anchored-parts`, each part placed at its attention's mean
position; with `--localisation`, the parts' attention entropies weighted
by U taken from the training objective;
`ProbabilisticCapsuleAutoencoder`'s docstring; with `--translate N`, each
epoch's training digits shifted by whole pixels, each by its own draw in
[-N, N] across and down, as Sabour et al. train for affNIST; the probes
still read the centred digits; with `--fixed-binding`, the bindings
`rho_ij` of eq. 3 held at their initial 1 instead of learned; with
`--free-bits LAMBDA`, LAMBDA nats of presence KL per top capsule not
charged in training, `presence_free_bits`; with `--part-sparsity A B`,
the part presences' within- and between-image sparsity weighted by A and
B taken from the training objective, `PartSparsityAutoencoder`), then writes to
OUT.json:

- the trainer's running bound and terms after each epoch;
- the encoder's top presence probabilities `t0` on the 4,000 training
  digits: their mean and standard deviation over images per top capsule,
  and the share of each capsule's variance over images that lies between
  the class means (1 would be a presence set by the class alone);
- linear probes on `t0` and on `(t0, A0)`, trained on the unrotated training
  digits, tested on the test digits rotated by 0, 45, 90 and 180 degrees
  and under the probe table's affine stand-in (drawn at `--seed`): with
  `linear_probe`'s fixed penalty (`probes`) and with the penalty chosen by
  `metrics.probe_penalty` on the training digits (`probes_chosen_penalty`,
  `chosen_penalty`);
- how far the parts' rigid frame (`poecaps.frames`) turns when a test
  digit is rotated: the median over digits of the frame's turn, wrapped to
  (-180, 180], and of its distance from the digit's turn (0 for parts
  whose positions turn with the digit);
- where the parts attend (`_attention`): how many cells a part's attention
  spreads over, and whether its mean cell turns with the digit.
- how the parts choose their parents (`_parent_choice`), on the test
  digits;
- the top presences' KL from their prior per capsule (`_presence_kl`),
  on the upright test digits;
- with `--refine-parts STEPS`, the same probes and frame turns read after
  refining the parts alone (`refine(..., parts_only=True)`: STEPS Adam
  steps, learning rate 0.01, the top read by the top encoder from the
  refined parts) on every `--refine-every`-th training and test digit,
  beside the encoder's reading of the same digits (`refined_parts`).

A top layer like the paper's (a capsule per kind of digit, switched on and
off) has presences spread near 0.5 over images; the two runs in
docs/probabilistic_capsules.md spread by about 0.01.
"""

import argparse
import json
import time

import keras
import numpy as np
import tensorflow as tf

from poecaps import compositing, frames, metrics, transforms
from poecaps.experiments import probabilistic_capsules as study
from poecaps.models import ProbabilisticCapsuleAutoencoder, ProbabilisticCapsules
from poecaps.models.capsule_autoencoder import prior_sparsity
from poecaps.trainers.variational import VariationalTrainer


class PartSparsityAutoencoder(ProbabilisticCapsuleAutoencoder):
    """The model whose training objective is less `a S_within - b S_between` of the part presences:
    `prior_sparsity(part_logits, 2)`, 8 of the 16 parts on per image and each part on in half the batch
    (docs/probabilistic_part_sparsity.md). The bound and `refine` are unchanged."""

    def __init__(self, *args, part_sparsity=(0.0, 0.0), **kwargs):
        super().__init__(*args, **kwargs)
        self.part_sparsity = tuple(float(w) for w in part_sparsity)

    def bound_terms(self, images, part_logits, part_pose, *args, **kwargs):
        terms = super().bound_terms(images, part_logits, part_pose, *args, **kwargs)
        within, between = prior_sparsity(part_logits, 2)
        a, b = self.part_sparsity
        terms["objective"] = terms["objective"] - a * within - b * between
        return terms


def _encoded(model, images, infer=None):
    """The variational parameters of `images`, read 250 at a time and joined: `{name: array}`.

    `infer`: another map from a batch of images to variational parameters
    (default: the encoders', `variational_parameters`).
    """
    infer = infer or tf.function(lambda x: model.variational_parameters(x))
    batches = [infer(tf.constant(images[s:s + 250])) for s in range(0, len(images), 250)]
    return {name: np.concatenate([found[name].numpy() for found in batches]) for name in batches[0]}


def _features(model, images, infer=None):
    """`(t0 [B, K], A0 [B, 6K], the parts' frame angle in degrees [B])` of the encoder's output (`_encoded`)."""
    found = _encoded(model, images, infer)
    frame = frames.rigid_frame(tf.constant(found["part_pose"]) + tf.constant(compositing.IDENTITY),
                               tf.sigmoid(found["part_logits"])).numpy()
    return (tf.sigmoid(found["top_logits"]).numpy(), found["top_pose"].reshape(len(images), -1),
            np.degrees(np.arctan2(frame[:, 3], frame[:, 0])))


def _presence_kl(model, images):
    """Per top capsule, the mean over `images` of `KL(Bern(q) || Bern(p))` in nats: `q = sigmoid(l)` the
    encoder's presence probability, `p` the prior's (exact, no draws; from log-sigmoids, so that presences
    near 0 or 1 stay finite)."""
    logits = _encoded(model, images)["top_logits"].astype("float64")
    prior = tf.cast(model.generative.top_logits, tf.float64).numpy()[None]
    log_q, log_1mq = -np.logaddexp(0.0, -logits), -np.logaddexp(0.0, logits)
    log_p, log_1mp = -np.logaddexp(0.0, -prior), -np.logaddexp(0.0, prior)
    kl = np.exp(log_q) * (log_q - log_p) + np.exp(log_1mq) * (log_1mq - log_1mp)
    return kl.mean(0)


def _refined_features(model, images, steps, seed):
    """`_features` after `steps` Adam steps on the parts alone, the top read by the top encoder."""
    return _features(model, images, lambda x: model.refine(x, steps, seed=seed, parts_only=True))


def _read(train, y, tests, y_test):
    """Probes and frame turns of one reading: `train` `(t0, A0, angle)`; `tests` {condition: the same}."""
    t0, a0, _ = train
    features = {"t0": lambda t, a: t, "t0_A0": lambda t, a: np.hstack([t, a])}
    chosen = {name: metrics.probe_penalty(read(t0, a0), y) for name, read in features.items()}
    probes, probes_chosen, frame_turn = {}, {}, {}
    for condition, (t0_test, a0_test, angle) in tests.items():
        if condition not in ("0", "affine"):
            turn = _wrapped(angle - tests["0"][2])
            # `transforms.rotate` by +a degrees takes (x, y) = (0.5, 0) to (0, 0.5) in poecaps.compositing's frame
            # (y down the rows): a turn by +a of the frame's angle atan2(F_yx, F_xx)
            frame_turn[condition] = {"median_turn": float(np.median(turn)),
                                     "median_error": float(np.median(np.abs(_wrapped(turn - float(condition)))))}
        probes[condition] = {name: metrics.linear_probe(read(t0, a0), y, read(t0_test, a0_test), y_test)
                             for name, read in features.items()}
        probes_chosen[condition] = {
            name: metrics.linear_probe(read(t0, a0), y, read(t0_test, a0_test), y_test, l2=chosen[name]["penalty"])
            for name, read in features.items()}
    return {"probes": probes, "probes_chosen_penalty": probes_chosen, "chosen_penalty": chosen,
            "frame_turn": frame_turn}


def _attention(model, tests):
    """Where the parts attend: `tests` {condition: test images}, upright under "0".

    - `effective_cells`: the median over digits and parts of `exp(H)`, `H`
      the entropy of a part's attention over the cells of the last feature
      map (1: one cell; `cells`: spread evenly over all of them).
    - for each turned condition, over digits and parts, the median distance
      (in the canvas's [-1, 1] frame) of the attention's mean cell centre on
      the turned digit from the upright digit's one turned with the digit
      (`follows`, 0 if the attention turns with it), from the upright one
      where it was (`stays`), and how far turning moves the upright one
      (`turn_moves`).
    """
    def centres_and_entropy(images):
        a = np.concatenate([model.part_attention(tf.constant(images[s:s + 250])).numpy()       # [B, h, w, N]
                            for s in range(0, len(images), 250)])
        height, width = a.shape[1:3]
        ys, xs = np.meshgrid(compositing.pixel_centres(height, "float32").numpy(),
                             compositing.pixel_centres(width, "float32").numpy(), indexing="ij")
        mean = np.stack([np.einsum("bhwn,hw->bn", a, xs), np.einsum("bhwn,hw->bn", a, ys)], -1)  # [B, N, 2]
        entropy = -np.sum(a * np.log(np.maximum(a, 1e-30)), axis=(1, 2))                       # [B, N]
        return mean, entropy, height * width

    upright, entropy, cells = centres_and_entropy(tests["0"])
    result = {"cells": int(cells), "effective_cells": float(np.median(np.exp(entropy)))}
    for condition, images in tests.items():
        if condition in ("0", "affine"):
            continue
        angle = np.radians(float(condition))
        # `transforms.rotate` by +a takes (x, y) to (x cos a - y sin a, x sin a + y cos a) (the note in `_read`)
        turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        turned, _, _ = centres_and_entropy(images)
        expected = upright @ turn.T
        distance = lambda a, b: float(np.median(np.linalg.norm(a - b, axis=-1)))
        result[condition] = {"follows": distance(turned, expected), "stays": distance(turned, upright),
                             "turn_moves": distance(expected, upright)}
    return result


def _parent_choice(model, images, y):
    """How the parts choose their parents in eq. 3, read from the encoder's output on `images` (labels `y`).

    Presences are read as probabilities (`sigmoid` of the logits); the
    posterior over parents is the exact E-step (`route`), index 0 the dummy;
    the counts and shares of parents are over the parts that are on
    (presence above 0.5):

    - `binding_share_max`, `binding_entropy`: per part j, the largest share
      `rho_ij / sum_i rho_ij` over the K top capsules and that share's
      entropy over log K (1: the bindings prefer no parent);
    - `parents_per_image`: the median over images of the number of distinct
      top capsules that are some part's most probable parent, and the
      median share of parts whose most probable parent is the dummy;
    - `parent_constancy`: per part, the share of images whose most probable
      parent is the part's most frequent one, over all images (`overall`)
      and within each class (`within_class`, the mean over classes); means
      over parts. Parents fixed per part give 1 for both; parents chosen by
      the class, a within-class share well above the overall one;
    - `one_parent`: the parts' term `sum_j log p(t_j, P_j | top)` with the
      encoded presences, with every top capsule on, and with only the
      image's best single top capsule on (presences 1 - 1e-6 and 1e-6,
      poses as encoded), the medians over images of the differences
      (`encoded_minus_one`, `all_on_minus_one`), and of the top prior's
      Bernoulli log-probability of all on minus that of the best one alone
      under the learned `p_i` (`prior_all_on_minus_one`).
    """
    gen = model.generative
    rho = gen.bindings().numpy()[1:]                                                  # [K, N]
    share = rho / rho.sum(0, keepdims=True)
    k = share.shape[0]
    found = _encoded(model, images)
    latents = {"top_presence": tf.sigmoid(found["top_logits"]).numpy(), "top_pose": found["top_pose"],
               "part_presence": tf.sigmoid(found["part_logits"]).numpy(), "part_pose": found["part_pose"]}
    posterior = gen.route(*(tf.constant(value) for value in latents.values())).coefficients.numpy()  # [B, N, K + 1]
    parent = posterior.argmax(-1)                                                           # [B, N]
    on = latents["part_presence"] > 0.5
    distinct = [len(set(parent[b][on[b] & (parent[b] > 0)])) for b in range(len(parent))]
    dummy = [float(np.mean(parent[b][on[b]] == 0)) if on[b].any() else float("nan") for b in range(len(parent))]

    def constancy(rows):
        shares = []
        for j in range(parent.shape[1]):
            chosen = parent[rows, j][on[rows, j]]
            if len(chosen):
                shares.append(np.bincount(chosen).max() / len(chosen))
        return float(np.mean(shares))

    every = np.ones(len(parent), bool)
    term = tf.function(lambda tp, a, pp, pa: tf.reduce_sum(gen.part_marginal_log_likelihood(tp, a, pp, pa), -1))
    rest = [tf.constant(latents[key]) for key in ("top_pose", "part_presence", "part_pose")]
    encoded = term(tf.constant(latents["top_presence"]), *rest).numpy()
    shape = latents["top_presence"].shape
    all_on = term(tf.fill(shape, 1.0 - 1e-6), *rest).numpy()
    alone = np.stack([term(tf.constant(np.broadcast_to(np.where(np.arange(k) == i, 1.0 - 1e-6, 1e-6), shape),
                                       tf.float32), *rest).numpy() for i in range(k)], -1)   # [B, K]
    best = alone.argmax(-1)
    p = tf.sigmoid(gen.top_logits).numpy()
    prior_one = np.log(p[best]) + np.sum(np.log1p(-p)) - np.log1p(-p[best])
    return {"binding_share_max": float(np.mean(share.max(0))),
            "binding_entropy": float(np.mean(-np.sum(share * np.log(share), 0)) / np.log(k)),
            "parents_per_image": {"distinct_top_parents": float(np.median(distinct)),
                                  "dummy_share": float(np.nanmedian(dummy)), "parts_on": float(np.median(on.sum(1)))},
            "parent_constancy": {"overall": constancy(every),
                                 "within_class": float(np.mean([constancy(y == c) for c in range(10)]))},
            "one_parent": {"encoded_minus_one": float(np.median(encoded - alone.max(-1))),
                           "all_on_minus_one": float(np.median(all_on - alone.max(-1))),
                           "prior_all_on_minus_one": float(np.median(np.sum(np.log(p)) - prior_one)),
                           "best_one_capsules_used": len(set(best.tolist()))}}


def _wrapped(degrees):
    return (np.asarray(degrees) + 180.0) % 360.0 - 180.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--data-dir", required=True)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--c-min", type=float, default=0.1)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-prior", type=float, default=None, help="fix every p_i at this value (default: learned)")
    p.add_argument("--specialisation", type=float, default=0.0, help="weight of the top presences' information")
    p.add_argument("--within-sparsity", type=float, default=0.0, help="weight of S_within (prior sparsity)")
    p.add_argument("--between-sparsity", type=float, default=0.0, help="weight of S_between (prior sparsity)")
    p.add_argument("--detach-parts", action="store_true", help="hold the parts constant in the top layer's terms")
    p.add_argument("--equivariant-top", action="store_true", help="the top encoder reads the parts in their frame")
    p.add_argument("--anchored-parts", action="store_true", help="each part sits at its attention's mean position")
    p.add_argument("--localisation", type=float, default=0.0, help="weight of the attention entropies (nats/part)")
    p.add_argument("--translate", type=int, default=0, metavar="N",
                   help="shift each epoch's training digits by up to N whole pixels (default: 0, centred)")
    p.add_argument("--refine-parts", type=int, default=0, metavar="STEPS",
                   help="also read the probes after STEPS Adam steps on the parts alone (default: 0, off)")
    p.add_argument("--refine-every", type=int, default=4, help="refine every this many-th digit (default: 4)")
    p.add_argument("--fixed-binding", action="store_true", help="hold every rho_ij at 1 (default: learned)")
    p.add_argument("--part-sparsity", type=float, nargs=2, default=None, metavar=("A", "B"),
                   help="weights of the part presences' S_within and S_between (default: none)")
    p.add_argument("--free-bits", type=float, default=0.0, metavar="LAMBDA",
                   help="nats of presence KL per top capsule not charged in training (default: 0, off)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.translate < 0:
        p.error(f"--translate must be >= 0. Received: {args.translate}")
    if args.refine_parts < 0 or args.refine_every < 1:
        p.error(f"--refine-parts must be >= 0 and --refine-every >= 1. Received: {args.refine_parts}, "
                f"{args.refine_every}")
    if args.part_sparsity is not None and not min(args.part_sparsity) >= 0.0:
        p.error(f"--part-sparsity takes two weights >= 0. Received: {args.part_sparsity}")
    if not args.free_bits >= 0.0:
        p.error(f"--free-bits must be >= 0. Received: {args.free_bits}")
    if args.top_prior is not None and not 0.0 < args.top_prior < 1.0:
        p.error(f"--top-prior must be in (0, 1). Received: {args.top_prior}")
    x, y = study.load_digits(args.data_dir, "train", 40)
    x_test, y_test = study.load_digits(args.data_dir, "test", 40)
    keras.utils.set_random_seed(args.seed)
    kind = ProbabilisticCapsuleAutoencoder
    if args.part_sparsity is not None:
        kind = lambda *a, **k: PartSparsityAutoencoder(*a, part_sparsity=args.part_sparsity, **k)
    model = kind(
        ProbabilisticCapsules(image_size=(40, 40), c_min=args.c_min, temperature=args.temperature, seed=args.seed),
        specialisation=args.specialisation, within_sparsity=args.within_sparsity,
        between_sparsity=args.between_sparsity, detach_parts=args.detach_parts,
        equivariant_top=args.equivariant_top, anchored_parts=args.anchored_parts,
        localisation=args.localisation, presence_free_bits=args.free_bits, seed=args.seed)
    if args.top_prior is not None:
        model(tf.constant(x[:2]))                                        # builds the weights
        logits = model.generative.top_logits
        logits.assign(tf.fill(logits.shape, float(np.log(args.top_prior / (1.0 - args.top_prior)))))
        logits.trainable = False
    if args.fixed_binding:
        model(tf.constant(x[:2]))                                        # builds the weights; rho starts at 1
        model.generative.binding_raw.trainable = False
    trainer = VariationalTrainer(model, seed=args.seed)
    trainer.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=True)
    curve, start = [], time.perf_counter()
    placement = keras.random.SeedGenerator(args.seed + 1)          # the stand-in's draws use `args.seed`
    for epoch in range(args.epochs):
        shown = np.asarray(transforms.random_shift(x, args.translate, seed=placement))  # x itself when 0
        history = trainer.fit(shown, epochs=1, batch_size=64, verbose=0, shuffle=True)
        curve.append({k: float(v[-1]) for k, v in history.history.items()})
        print(f"epoch {epoch + 1}: bound {curve[-1]['bound']:.1f}, information {curve[-1]['top_information']:.3f}, "
              f"sparsity within {curve[-1]['top_sparsity_within']:.3f} between {curve[-1]['top_sparsity_between']:.1f}",
              flush=True)
    seconds = time.perf_counter() - start
    t0, a0, _ = _features(model, x)
    between = np.mean([np.square(t0[y == k].mean(0) - t0.mean(0)) for k in range(10)], 0)
    tests = {str(angle): np.asarray(transforms.rotate(x_test, float(angle))) for angle in (0, 45, 90, 180)}
    tests["affine"] = np.asarray(transforms.random_affine(x_test, seed=keras.random.SeedGenerator(args.seed),
                                                          **study.AFFINE))
    read = _read((t0, a0, None), y, {condition: _features(model, images) for condition, images in tests.items()},
                 y_test)
    probes, frame_turn = read["probes"], read["frame_turn"]
    for condition, found in probes.items():
        print(f"probe {condition}: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()) + "; chosen penalty: "
              + ", ".join(f"{k} {v:.3f}" for k, v in read["probes_chosen_penalty"][condition].items()), flush=True)
    print(f"chosen penalties: {read['chosen_penalty']}", flush=True)
    print(f"frame turn: {frame_turn}", flush=True)
    attention = _attention(model, tests)
    print(f"attention: {attention}", flush=True)
    parent_choice = _parent_choice(model, tests["0"], y_test)
    print(f"parent choice: {parent_choice}", flush=True)
    r = lambda a: np.round(np.asarray(a, "float64"), 4).tolist()
    result = {"settings": vars(args), "train_images": len(x), "test_images": len(x_test), "seconds": seconds,
              "curve": curve, "top_presence_mean": r(t0.mean(0)), "top_presence_std_over_images": r(t0.std(0)),
              "top_presence_between_class_share": r(between / np.maximum(t0.var(0), 1e-12)),
              "pose_spread_mean": float(model.generative.spreads().numpy().mean()),
              "prior_top_presence": r(tf.sigmoid(model.generative.top_logits).numpy()), "probes": probes,
              "probes_chosen_penalty": read["probes_chosen_penalty"], "chosen_penalty": read["chosen_penalty"],
              "frame_turn": frame_turn, "part_attention": attention, "parent_choice": parent_choice,
              "top_presence_kl": r(_presence_kl(model, tests["0"]))}
    print(f"presence KL per top capsule (nats): {result['top_presence_kl']}", flush=True)
    if args.refine_parts:
        every, start = args.refine_every, time.perf_counter()
        train, y_sub, y_test_sub = x[::every], y[::every], y_test[::every]
        subsets = {condition: images[::every] for condition, images in tests.items()}
        result["refined_parts"] = {
            "steps": args.refine_parts, "train_digits": len(train), "test_digits": len(y_test_sub),
            "encoder": _read(_features(model, train), y_sub, {c: _features(model, i) for c, i in subsets.items()},
                             y_test_sub),
            "refined": _read(_refined_features(model, train, args.refine_parts, args.seed), y_sub,
                             {c: _refined_features(model, i, args.refine_parts, args.seed)
                              for c, i in subsets.items()}, y_test_sub)}
        result["refined_parts"]["seconds"] = time.perf_counter() - start
        for reading in ("encoder", "refined"):
            found = result["refined_parts"][reading]
            print(f"{reading} on every {every}th digit: " + " | ".join(
                f"{c}: {v['t0']:.3f}, {v['t0_A0']:.3f}" for c, v in found["probes"].items())
                + f"; frame turn {found['frame_turn']}", flush=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps({k: result[k] for k in ("top_presence_std_over_images", "probes")}))


if __name__ == "__main__":
    main()
