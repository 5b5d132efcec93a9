"""A generative capsule layer learned on the frozen primary capsules of a trained CapsNet run (Kiefer et al., section 4).

`train_generative(run_dir, ...)` reads a CapsNet baseline run, computes its
primary capsules (the children, 1152 of 8-D on 28x28 digits) for the
training and test images, and learns `GenerativeCapsules` (10 parents of
16-D by default) on them by generalised EM. It writes `RUN/generative/`:
`generative.json` (held-out bound per child at initialisation and after each
epoch, coefficient entropy, linear probes on the inferred parents of the
learned layer and of the same layer with its initial random G),
`config.json` (the layer's settings, which a resumed call goes on with),
`samples.png` (digits decoded from parents drawn from the prior, beside
decoded test parents), `curves.png` (the held-out bound and entropy per
epoch, drawn), `curve.jsonl` (the held-out curve, kept by a resumed call)
and the layer (`models/generative.keras`, checkpoints under
`checkpoints/generative/`).
"""

import dataclasses
import math
import os
import time

import keras
import numpy as np
import tensorflow as tf

from poecaps import metrics
from poecaps.experiments import figures
from poecaps.experiments.configs import GenerativeConfig
from poecaps.experiments.progress import phase
from poecaps.experiments.runs import check_same_model, load_images, spread_indices
from poecaps.experiments.trained import load_capsnet
from poecaps.graphs import graph
from poecaps.models import GenerativeCapsules
from poecaps.models.saving import save_component
from poecaps.trainers.generative import GenerativeCapsuleTrainer, child_activations
from poecaps.trainers.resumable import fit_resumable

# The held-out curve of the layer, one JSON line per epoch, kept across resumed calls.
CURVE = os.path.join("generative", "curve.jsonl")
# The layer's settings, written when its training starts.
SETTINGS = os.path.join("generative", "config.json")
KIND = "generative-capsules"
# Settings that shape the layer's training: a resumed call keeps them.
SHAPE = ("parents", "parent_dim", "batch_size", "learning_rate", "iterations", "child_weights", "heldout", "seed")


def curves_figure(record, path):
    """Draw the layer's per-epoch `record` (`curve.jsonl`'s entries) at `path`: the held-out and training bound
    per child, and the held-out coefficient entropy over log J; return `path`."""
    series = lambda key: figures.per_epoch(record, key)
    figures.line_panels([[("bound per child (nats)", {"held out": series("heldout_bound_per_child"),
                                                      "train (running mean)": series("train_bound_per_child")}),
                          ("coefficient entropy / log J, held out", {"entropy": series("coefficient_entropy")})]],
                        path, title="generalised EM (epoch 0: at initialisation)", xlabel="epoch")
    return path


def primary_capsules(model, images, batch_size=250):
    """A CapsNet's squashed primary capsules `[N, I, 8]` of `images`."""
    step = graph(lambda x: model.primary(model.primary_conv(model.conv1(x))))
    return np.concatenate([step(images[s:s + batch_size]).numpy() for s in range(0, len(images), batch_size)])


class Inversion:
    """A layer's inference over many child sets, compiled once: one XLA computation for every batch.

    Each child is weighed as `child_weights` says (`trainers.generative.child_activations`). The last batch
    is padded with copies of its first child set and the padding dropped.
    """

    def __init__(self, layer, batch_size, iterations, child_weights="uniform"):
        def infer(x):
            a = child_activations(x, child_weights)
            found = layer.infer(x, a, iterations=iterations)
            return found.poses, found.coefficients, layer.log_joint(x, found.poses, found.coefficients, a)

        self.layer, self.batch_size = layer, batch_size
        self.step = graph(infer, jit_compile=True)

    def outputs(self, children):
        """`(parents [N, J, D], coefficients [N, I, J], bound [N])` of the inference on `children`."""
        parts = []
        for s in range(0, len(children), self.batch_size):
            batch = children[s:s + self.batch_size]
            padded = np.concatenate([batch, np.repeat(batch[:1], self.batch_size - len(batch), 0)])
            parts.append([p.numpy()[:len(batch)] for p in self.step(tf.constant(padded))])
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))

    def __call__(self, children):
        """`(bound per child, coefficient entropy over log J, parents [N, J, D])` on `children`."""
        poses, coefficients, bound = self.outputs(children)
        entropy = -np.sum(coefficients * np.log(coefficients + 1e-30), -1)
        return (float(np.mean(bound) / children.shape[1]),
                float(np.mean(entropy)) / math.log(self.layer.num_parents), poses)


class _HeldOut(keras.callbacks.Callback):
    """After each epoch: the held-out bound and coefficient entropy, appended to `curve.jsonl`."""

    def __init__(self, inversion, children, run):
        super().__init__()
        self.inversion, self.children, self.run = inversion, children, run

    def on_epoch_end(self, epoch, logs=None):
        bound, entropy, _ = self.inversion(self.children)
        self.run.append_jsonl(CURVE, {
            "epoch": epoch + 1, "heldout_bound_per_child": bound, "coefficient_entropy": entropy,
            "train_bound_per_child": float((logs or {}).get("bound_per_child", float("nan")))})
        print(f"[generative] epoch {epoch + 1}: held-out bound per child {bound:.4f}, "
              f"coefficient entropy / log J {entropy:.3f}", flush=True)


def _decoder(parents, images, seed, epochs=30):
    """An MLP from the flattened parents to images (sigmoid), trained on (parents, images)."""
    keras.utils.set_random_seed(seed)
    flat = parents.reshape(len(parents), -1)
    decoder = keras.Sequential([keras.Input(flat.shape[1:]), keras.layers.Dense(512, activation="relu"),
                                keras.layers.Dense(int(np.prod(images.shape[1:])), activation="sigmoid"),
                                keras.layers.Reshape(images.shape[1:])])
    decoder.compile(optimizer=keras.optimizers.Adam(1e-3), loss="binary_crossentropy")
    decoder.fit(flat, images, batch_size=64, epochs=epochs, verbose=0)
    return decoder


def train_generative(run_dir, parents=10, parent_dim=16, epochs=5, batch_size=32, learning_rate=3e-3,
                     iterations=10, child_weights="uniform", heldout=200, probe_train=1000, seed=0, resume=False):
    """Learn the generative layer on the run's primary capsules; write and return `generative.json`.

    Every inference (training steps, held-out bound, probes) runs `iterations` EM iterations and weighs
    each child as `child_weights` says: alike ("uniform") or by its length ("lengths"). The bound
    is followed on `heldout` test images; the linear probes train on `probe_train` training images and
    test on the whole test split; the decoder of the figure learns on the same `probe_train` images.
    The settings are checked (`configs.GenerativeConfig`) before the run is read.

    Training goes through `fit_resumable`, checkpointed in `RUN/checkpoints/generative/`: `resume=True`
    goes on from the newest checkpoint to `epochs` in all (refused if a setting that shapes the training
    changed), and keeps the curve measured so far (`api.generative_capsules` takes the settings a resumed
    call does not give from `RUN/generative/config.json`). `seconds` and `train_seconds` are this call's.
    """
    layer_config = GenerativeConfig(
        parents=parents, parent_dim=parent_dim, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
        iterations=iterations, child_weights=child_weights, heldout=heldout, probe_train=probe_train, seed=seed)
    run, config, model = load_capsnet(run_dir)
    if resume:
        check_same_model(run, (run.read_json(SETTINGS) or {}).get("settings") or {}, layer_config, SHAPE)
    # The CapsNet run's images before the layer's folder is touched: if they cannot be read, it stays as it was.
    train, train_labels, _ = load_images(config, "train")
    test, test_labels, _ = load_images(config, "test")
    os.makedirs(os.path.join(run_dir, "generative"), exist_ok=True)
    run.write_json(SETTINGS, {"kind": KIND, "settings": dataclasses.asdict(layer_config)})   # a resumed call's
    fresh = not resume or not run.per_epoch(CURVE)
    if not resume:                                   # a new layer: its own curve only
        run.start_afresh((CURVE,), os.path.join(run.checkpoints, "generative"), "generative layer")
    elif fresh:
        run.remove(CURVE)
    run.record_environment("generative layer")
    keras.utils.set_random_seed(seed)
    start = time.perf_counter()
    x_train, x_test = primary_capsules(model, train), primary_capsules(model, test)
    # An even spread of the test split (mnist-5k's is ordered by class) for the held-out bound.
    pick = spread_indices(len(x_test), heldout)
    few = spread_indices(len(x_train), probe_train)
    lengths = np.linalg.norm(x_train, axis=-1)
    layer = GenerativeCapsules(parents, parent_dim, x_train.shape[-1], kappa=5.0,
                               sigma=float(lengths.std()), seed=seed, name="generative_capsules")
    layer.build(x_train.shape)
    initial = layer.get_weights()                    # the same layer with G kept random, for the probe's reference
    invert = Inversion(layer, batch_size, iterations, child_weights)
    if fresh:
        bound0, entropy0, _ = invert(x_test[pick])
        run.append_jsonl(CURVE, {"epoch": 0, "heldout_bound_per_child": bound0, "coefficient_entropy": entropy0})
        print(f"[generative] at initialisation: held-out bound per child {bound0:.4f}, "
              f"coefficient entropy / log J {entropy0:.3f}", flush=True)
    trainer = GenerativeCapsuleTrainer(layer, iterations=iterations, child_weights=child_weights)
    trainer.compile(optimizer=keras.optimizers.Adam(learning_rate), jit_compile=True)
    usable = len(x_train) - len(x_train) % batch_size        # whole batches: one XLA computation
    shape = {name: getattr(layer_config, name) for name in SHAPE}
    if child_weights == "uniform":      # as every layer trained before the setting was: their checkpoints resume
        del shape["child_weights"]
    fit_resumable(trainer, x_train[:usable], epochs=epochs, batch_size=batch_size, seed=seed,
                  checkpoint_dir=os.path.join(run.checkpoints, "generative"), checkpoint_config=shape, resume=resume,
                  fault_log=run.file("faults.jsonl"), callbacks=[_HeldOut(invert, x_test[pick], run)])
    train_seconds = time.perf_counter() - start
    record = run.per_epoch(CURVE)
    with phase("generative", f"parents of {len(x_test)} test and {len(few)} training digits, G learned and random"):
        _, entropy, test_parents = invert(x_test)
        train_parents = invert(x_train[few])[2]
        # The same compiled inference, which reads the layer's variables, on the initial weights
        learned = layer.get_weights()
        layer.set_weights(initial)
        try:
            random_train, random_test = invert(x_train[few])[2], invert(x_test)[2]
        finally:
            layer.set_weights(learned)
    probe = lambda a, b: metrics.linear_probe(a.reshape(len(a), -1), train_labels[few], b.reshape(len(b), -1),
                                              test_labels)
    with phase("generative", "linear probes"):
        probes = {"learned": probe(train_parents, test_parents), "random_g": probe(random_train, random_test)}
    result = {
        "run": run_dir, "parents": parents, "parent_dim": parent_dim, "children": list(x_train.shape[1:]),
        "epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate,
        "iterations": iterations, "child_weights": child_weights, "seed": seed, "heldout_images": len(pick),
        "probe_train_images": len(few),
        "curve": record,
        "heldout_bound_per_child": {"initial": record[0]["heldout_bound_per_child"],
                                    "final": record[-1]["heldout_bound_per_child"]},
        "coefficient_entropy_over_log_j": entropy,
        "probe_accuracy": probes,
        "seconds": time.perf_counter() - start, "train_seconds": train_seconds,
    }
    out = os.path.join(run_dir, "generative")            # made when training started
    save_component(keras.Sequential([keras.Input(x_train.shape[1:]), layer]), os.path.join(run.models,
                                                                                          "generative.keras"))
    with phase("generative", "a decoder from parents to digits, for samples.png"):
        decoder = _decoder(train_parents, train[few], seed)
    rng = np.random.default_rng(seed)
    prior = rng.normal(size=(10, parents * parent_dim)).astype("float32")
    show = np.linspace(0, len(test) - 1, 10).round().astype(int)
    rows = [test[show], decoder.predict(test_parents[show].reshape(10, -1), verbose=0),
            decoder.predict(prior, verbose=0)]
    figures.image_grid(np.stack(rows), os.path.join(out, "samples.png"),
                       title="test digits; decoded from their inferred parents; decoded from parents ~ N(0, I)",
                       row_labels=["test", "inferred", "sampled"])
    result["figure"] = os.path.join(out, "samples.png")
    result["curves_figure"] = curves_figure(record, os.path.join(out, "curves.png"))
    run.write_json(os.path.join("generative", "generative.json"), result)
    return result
