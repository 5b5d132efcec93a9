"""One encoder CD step (Hauser Algorithm 1): poecaps against a plain reference.

Batch 128, 576 8-D capsules to 20 16-D, 4 rounds of cosine routing (three
agreement updates, the `default` preset's setting). The
reference does what the original capsule code does: tiled votes
`[B, I, J, D_out, D_in]` and per-example outer products for the update.
poecaps is timed three ways: one TensorFlow graph, one XLA computation, and
the batch cut into `--shards` parts, each its own XLA computation, in one
graph that runs them at the same time (what `CDTrainer(shards=...)` does);
the best counts. Before it is timed, the reference's statistic must equal
poecaps' to 1e-5 (the run stops otherwise). Last line: RESULT images_per_s=<n> vs_reference=<ratio>
matmul_fraction=<f>, where matmul_fraction = achieved FLOP/s (the
algorithm's contractions) / dense-matmul FLOP/s measured in the same run.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from common import best_seconds, count, cpu_allocator, dense_matmul_flops_per_s, machine

from poecaps.capsules import squash
from poecaps.experts import CapsuleExperts
from poecaps.routing import DynamicRouting
from poecaps.trainers.cd import sharded_cd_step


def reference_cd_step(x, w, rounds):
    """Algorithm 1 the straightforward way: tile, matmul per pair, outer products per example."""
    b, i, j = x.shape[0], w.shape[0], w.shape[1]
    w_tiled = tf.tile(w[None], [b, 1, 1, 1, 1])                        # [B, I, J, Do, Di]
    x_tiled = tf.tile(x[:, :, None, :, None], [1, 1, j, 1, 1])         # [B, I, J, Di, 1]
    votes = tf.squeeze(tf.matmul(w_tiled, x_tiled), -1)                # [B, I, J, Do]
    logits = tf.zeros((b, i, j))
    unit_votes = votes / tf.norm(votes + 1e-12, axis=-1, keepdims=True)
    for _ in range(rounds - 1):       # the last round's agreement update is never used
        c = tf.nn.softmax(logits, axis=2)
        v = squash(tf.reduce_sum(c[..., None] * votes, axis=1))
        v_unit = v / tf.norm(v + 1e-12, axis=-1, keepdims=True)
        logits += tf.reduce_sum(unit_votes * v_unit[:, None], axis=-1)
    c = tf.nn.softmax(logits, axis=2)
    z = tf.reduce_sum(c[..., None] * votes, axis=1)                    # [B, J, Do]
    upper = tf.tile(squash(z)[:, None, :, :, None], [1, i, 1, 1, 1])  # [B, I, J, Do, 1]
    x_neg = squash(tf.reduce_sum(c[..., None] * tf.squeeze(
        tf.matmul(w_tiled, upper, transpose_a=True), -1), axis=2))    # [B, I, Di]
    votes_neg = tf.squeeze(tf.matmul(w_tiled, tf.tile(x_neg[:, :, None, :, None], [1, 1, j, 1, 1])), -1)
    z_neg = tf.reduce_sum(c[..., None] * votes_neg, axis=1)

    def stat(z, x):
        f = z / (1 + tf.reduce_sum(z * z, -1, keepdims=True))
        return 2 * c[..., None, None] * f[:, None, :, :, None] * x[:, :, None, None, :]

    return tf.reduce_mean(stat(z, x) - stat(z_neg, x_neg), axis=0)


def algorithm_flops(batch, num_in, num_out, d_in, d_out, rounds):
    """FLOPs of the contractions Algorithm 1 needs with cosine routing (see energy.py)."""
    unit = 2 * batch * num_in * num_out * d_in * d_out
    # routing: R weighted sums, R - 1 agreements, vote norms (Gram: d_in/d_out of a unit);
    # CD: reconstruction, negative pre-activation, and the two-phase update (2 units).
    return unit * (rounds + (rounds - 1) + d_in / d_out + 1 + 1 + 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=count(), default=128)
    p.add_argument("--rounds", type=count(0), default=4, help="routing rounds (Sabour's r)")
    p.add_argument("--seed", type=count(0), default=0)
    p.add_argument("--repeats", type=count(), default=5)
    p.add_argument("--shards", type=count(), default=2, help="parts of the batch in the sharded timing")
    p.add_argument("--skip-reference", action="store_true")
    args = p.parse_args()
    keras.utils.set_random_seed(args.seed)
    b, i, j, d_in, d_out = args.batch, 576, 20, 8, 16
    x = squash(tf.random.normal((b, i, d_in)))
    experts = CapsuleExperts(j, d_out, routing=DynamicRouting(args.rounds, "cosine"))
    experts.build((None, i, d_in))
    matmul = dense_matmul_flops_per_s()
    flops = algorithm_flops(b, i, j, d_in, d_out, args.rounds)
    one_shard = tf.function(lambda x, chain, targets: experts.cd_gradients(x), jit_compile=True)
    steps = {
        "graph": tf.function(lambda x: experts.cd_gradients(x)[0][0]),
        "XLA": tf.function(lambda x: experts.cd_gradients(x)[0][0], jit_compile=True),
        f"{args.shards} XLA shards": tf.function(lambda x: sharded_cd_step(one_shard, x, args.shards)[0][0]),
    }
    results = {}
    for name, step in steps.items():
        seconds = best_seconds(lambda step=step: step(x).numpy(), repeats=args.repeats)
        results[name] = seconds
        print(f"poecaps, {name:13}: {seconds * 1e3:7.1f} ms/step  "
              f"{b / seconds:7.0f} images/s  {flops / seconds / 1e9:5.1f} GFLOP/s", flush=True)
    seconds = min(results.values())
    if args.skip_reference:
        reference = float("nan")
    else:
        ref = tf.function(lambda x: reference_cd_step(x, experts.kernel, args.rounds))
        # the same statistic from both, to float32 sums in another order (~1e-6), or the timing compares nothing
        mine, theirs = experts.cd_gradients(x)[0][0].numpy(), ref(x).numpy()
        difference = np.abs(mine - theirs).max() / np.abs(theirs).max()
        print(f"the reference's CD statistic against poecaps': relative difference {difference:.1e}", flush=True)
        if difference > 1e-5:
            raise SystemExit("the reference computes another statistic than poecaps; its timing compares nothing")
        reference = best_seconds(lambda: ref(x).numpy(), warmup=1, repeats=2)
        print(f"reference (tiled, no XLA): {reference * 1e3:7.1f} ms/step  {b / reference:7.0f} images/s")
    print(f"machine: {machine()}")
    print(f"dense matmul: {matmul / 1e9:.1f} GFLOP/s; algorithm: {flops / 1e9:.2f} GFLOP/step; "
          f"CPU allocator: {cpu_allocator()}")
    print(f"RESULT images_per_s={b / seconds:.0f} vs_reference={reference / seconds:.2f} "
          f"matmul_fraction={flops / seconds / matmul:.3f}")


if __name__ == "__main__":
    main()
