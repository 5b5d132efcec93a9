"""The probabilistic capsule model on digits (Smith et al.): training, test-time optimisation, probes, figures.

`train_run(run_dir, ...)` trains `ProbabilisticCapsuleAutoencoder` (the
spec's sizes) and the VAE baseline on the same digits, epochs, batch and
optimizer, each through `fit_resumable` (checkpoints, `resume=True` goes
on). Digits are padded to a `canvas` x `canvas` frame (40: affNIST's size,
so that rotated and affine-transformed digits keep their corners). It
writes `RUN/train.json`: parameter counts, the bound and reconstruction
error per epoch on the training digits (the trainer's running means) and on
the test digits (a fixed draw), the test MSE of predicting the mean
training image, minutes; and `RUN/training_curves.png`, those curves drawn.

`evaluate_run(run_dir, ...)` reads the trained models and writes
`RUN/eval.json` and the figures:

- test-time optimisation (`ProbabilisticCapsuleAutoencoder.refine`) on
  `tto_images` test digits spread evenly over the split: the bound before
  and after (averaged over the same draws), and the reconstruction error
  of the same digits rotated by 90 degrees before and after;
- linear probes (`poecaps.metrics.linear_probe`) trained on the unrotated
  training digits' `t0` (top presences), `(t0, A0)` (with the top poses)
  and the VAE's `(mu, sigma)`, tested at 0, 45, 90, 135 and 180 degrees
  under random affine transforms (`poecaps.transforms.random_affine`, a
  stand-in for affNIST, which is not available offline), and with each
  digit turned by its own angle uniform in +-45, 90, 135 or 180 degrees
  (the likely reading of the paper's rotated columns);
- `templates.png`, `reconstructions.png`, `rotation.png` (a rotated digit
  before and after test-time optimisation: the paper's Figure 3) and
  `samples.png` (images drawn from the model).
"""

import dataclasses
import os
import time

import keras
import numpy as np
import tensorflow as tf

from poecaps import data as data_lib
from poecaps import metrics, transforms
from poecaps.errors import InputError
from poecaps.experiments import figures
from poecaps.experiments.configs import ProbabilisticEvaluationConfig, ProbabilisticTrainConfig
from poecaps.experiments.runs import RunDir, spread_indices
from poecaps.graphs import graph
from poecaps.models import (
    ProbabilisticCapsuleAutoencoder,
    ProbabilisticCapsules,
    VariationalAutoencoder,
)
from poecaps.models.saving import save_component
from poecaps.trainers.resumable import fit_resumable
from poecaps.trainers.variational import VariationalTrainer
from poecaps.validation import check_images

KIND = "probabilistic-capsules"
ANGLES = (0, 45, 90, 135, 180)
# Each digit turned by its own angle, uniform in +-limit: the likely reading of the paper's rotated columns.
RANGES = (45, 90, 135, 180)
# The affine stand-in for affNIST: rotation, shear, scales, translation (share of the canvas).
AFFINE = {"max_rotation": 20.0, "max_shear": 0.2, "scale_range": (0.8, 1.2), "max_translation": 0.1}
EVAL_BATCH = 250


def load_digits(data_dir, split, canvas):
    """MNIST digits of `split` from the IDX files in `data_dir`, padded to `canvas` x `canvas`: `(images, labels)`."""
    images, labels, _ = data_lib.load_arrays("mnist", split, data_dir)
    images = check_images(data_lib.to_float(images), f"mnist {split} images")
    pad = canvas - images.shape[1]
    if pad < 0 or canvas - images.shape[2] != pad:
        raise InputError(f"canvas must be at least the digits' size {images.shape[1:3]}. Received: canvas={canvas}")
    before = pad // 2
    return np.pad(images, ((0, 0), (before, pad - before), (before, pad - before), (0, 0))), labels


def _batched(step, images):
    """`step` over `images` in batches of `EVAL_BATCH` or fewer (the last padded to the same size, so that a
    compiled step sees one shape): dict of concatenated NumPy arrays."""
    parts, size = [], min(EVAL_BATCH, len(images))
    for s in range(0, len(images), size):
        batch = images[s:s + size]
        padded = np.concatenate([batch, np.repeat(batch[:1], size - len(batch), 0)])
        parts.append({k: v.numpy()[:len(batch)] for k, v in step(tf.constant(padded)).items()})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class _TestCurve(keras.callbacks.Callback):
    """After each epoch: the bound (one fixed draw) and reconstruction error on the test digits."""

    def __init__(self, model, images, run, label):
        super().__init__()
        self.images, self.run, self.label = images, run, label
        self.step = graph(lambda x: {"bound": model.bound(x, seed=tf.constant([0, 0], tf.int64))["bound"],
                                     "mse": tf.reduce_mean(tf.square(model(x)["reconstructions"] - x),
                                                           axis=(1, 2, 3))})

    def on_epoch_end(self, epoch, logs=None):
        found = _batched(self.step, self.images)
        entry = {"model": self.label, "epoch": epoch + 1, "test_bound": float(found["bound"].mean()), "test_mse": float(found["mse"].mean()),
                 **{f"train_{k}": float(v) for k, v in (logs or {}).items()}}
        self.run.append_metrics(entry)
        print(f"[{self.label}] epoch {epoch + 1}: bound {entry['train_bound']:.1f} (test {entry['test_bound']:.1f}), "
              f"mse {entry['train_mse']:.4f} (test {entry['test_mse']:.4f})", flush=True)


def _fit(name, model, run, x_train, x_test, epochs, batch_size, learning_rate, seed, resume, settings, jit_compile):
    trainer = VariationalTrainer(model, seed=seed)
    trainer.compile(optimizer=keras.optimizers.Adam(learning_rate), jit_compile=jit_compile)
    fit_resumable(trainer, x_train, epochs=epochs, batch_size=batch_size, seed=seed,
                  checkpoint_dir=os.path.join(run.checkpoints, name), checkpoint_config=settings, resume=resume,
                  fault_log=run.file("faults.jsonl"), callbacks=[_TestCurve(model, x_test, run, name)], verbose=0)
    save_component(model, os.path.join(run.models, f"{name}.keras"))
    return _curve(run, name)


def _curve(run, name):
    """The per-epoch entries of model `name` in `RUN/metrics.jsonl`, the last of each epoch."""
    return run.per_epoch("metrics.jsonl", model=name)


def build_capsules(canvas, seed, specialisation=0.0, within_sparsity=0.0, between_sparsity=0.0):
    """The capsule model a run trains: the spec's sizes on a `canvas` x `canvas` frame, weights from `seed`.

    `specialisation`, `within_sparsity`, `between_sparsity`: the weights of the top presences' information
    and of the prior sparsity terms in the training objective (`ProbabilisticCapsuleAutoencoder`; 0, the
    default, trains on the paper's bound alone).

    Seeds Keras's global generator with `seed` first (some encoder layers draw their initial weights from
    it), so the same `seed` builds the same weights.
    """
    keras.utils.set_random_seed(seed)
    return ProbabilisticCapsuleAutoencoder(ProbabilisticCapsules(image_size=(canvas, canvas), seed=seed),
                                           specialisation=specialisation, within_sparsity=within_sparsity,
                                           between_sparsity=between_sparsity, seed=seed)


# training terms added after the first runs, and the value a run written before them trained with
LATER_TERMS = {"specialisation": 0.0, "within_sparsity": 0.0, "between_sparsity": 0.0}


def train_run(run_dir, epochs=100, batch_size=64, learning_rate=1e-3, canvas=40, data_dir=None, seed=0,
              resume=False, jit_compile=True, specialisation=0.0, within_sparsity=0.0, between_sparsity=0.0):
    """Train the capsule model and the VAE on the same digits and budget; write and return `RUN/train.json`.

    `specialisation`, `within_sparsity`, `between_sparsity`: see `build_capsules` (the VAE is unaffected).

    `jit_compile`: compile the training steps with XLA (several times faster per step on a CPU, slower to
    compile; False suits a few steps).

    Every setting is checked (`configs.ProbabilisticTrainConfig`) before anything is read or written.
    """
    config = ProbabilisticTrainConfig(data_dir=data_dir, epochs=epochs, batch_size=batch_size,
                                      learning_rate=learning_rate, canvas=canvas, seed=seed,
                                      specialisation=specialisation, within_sparsity=within_sparsity,
                                      between_sparsity=between_sparsity)
    if config.data_dir is None:
        raise InputError("data_dir is required: a folder of MNIST IDX files (e.g. ../shared/data/mnist-5k).")
    run = RunDir(run_dir, create="later")
    settings = {**dataclasses.asdict(config), "data_dir": os.path.abspath(data_dir)}
    found = run.read_json("config.json")
    if found is not None and found.get("kind") != KIND:
        raise InputError(f"{run.path} holds a {found.get('kind') or 'unknown'} run; use another run "
                         "directory (--run-dir).")
    if resume and found is not None:
        keys = ("batch_size", "learning_rate", "canvas", "seed", *LATER_TERMS)
        changed = [k for k in keys if found["settings"].get(k, LATER_TERMS.get(k)) != settings[k]]
        if changed:
            raise InputError(f"{run.path} was trained with other {', '.join(changed)}; resume with the same values.")
    # The data before the run is touched: digits that cannot be read leave the run as it was.
    x_train, _ = load_digits(data_dir, "train", canvas)
    x_test, _ = load_digits(data_dir, "test", canvas)
    run.make()
    run.write_json("config.json", {"kind": KIND, "settings": settings})
    if not resume:
        run.start_afresh(("metrics.jsonl", "environment.jsonl"))      # a new run: its own records only
    run.record_environment("train")
    start = time.perf_counter()
    capsules = build_capsules(canvas, seed, specialisation, within_sparsity, between_sparsity)
    shape = {"batch_size": batch_size, "canvas": canvas, "seed": seed}
    curve = _fit("capsules", capsules, run, x_train, x_test, epochs, batch_size, learning_rate, seed, resume, shape,
                 jit_compile)
    capsule_seconds = time.perf_counter() - start
    vae = VariationalAutoencoder(image_size=(canvas, canvas), seed=seed)
    vae_curve = _fit("vae", vae, run, x_train, x_test, epochs, batch_size, learning_rate, seed, resume, shape,
                 jit_compile)
    mean_image_mse = float(np.mean(np.square(x_test - x_train.mean(0))))
    generative = capsules.generative.count_params()
    result = {
        "settings": settings, "train_images": len(x_train), "test_images": len(x_test),
        "generative_parameters": generative,
        "encoder_parameters": capsules.count_params() - generative,
        "vae_parameters": vae.count_params(),
        "curve": curve, "vae_curve": vae_curve,
        "test_mse": curve[-1]["test_mse"] if curve else None, "mean_image_test_mse": mean_image_mse,
        "capsule_minutes": capsule_seconds / 60.0, "minutes": (time.perf_counter() - start) / 60.0,
    }
    print(f"generative parameters: {generative}; test MSE {result['test_mse']} against {mean_image_mse:.4f} "
          f"for the mean image; capsule model trained in {result['capsule_minutes']:.1f} minutes", flush=True)
    result["figure"] = training_curves(run, curve, vae_curve, mean_image_mse)
    run.write_json("train.json", result)
    return result


def training_curves(run, curve, vae_curve, mean_image_mse):
    """`RUN/training_curves.png`: the bound and reconstruction error of both models per epoch, and the capsule
    bound's terms; its path (None when no epoch is recorded)."""
    if not curve and not vae_curve:
        return None
    models = (("capsules", curve), ("VAE", vae_curve))
    epochs = [e["epoch"] for _, entries in models for e in entries]
    panels = [[
        ("bound per image (nats)", {f"{name}, {side}": figures.per_epoch(entries, f"{side}_bound")
                                    for name, entries in models for side in ("train", "test")}),
        ("reconstruction MSE", {**{f"{name}, {side}": figures.per_epoch(entries, f"{side}_mse")
                                   for name, entries in models for side in ("train", "test")},
                                "mean image, test": {min(epochs): mean_image_mse, max(epochs): mean_image_mse}}),
        ("capsule bound's terms, train (nats)", {term: figures.per_epoch(curve, f"train_{term}")
                                                 for term in ("image", "parts", "top")}),
    ]]
    path = run.file("training_curves.png")
    figures.line_panels(panels, path, title="training (train: the epoch's running mean; test: one fixed draw)",
                        xlabel="epoch")
    return path


def load_trained(run_dir):
    """`(run, settings, capsule model, VAE)` of a trained run."""
    from poecaps.models.saving import load_component

    run = RunDir(run_dir, create=False)
    found = run.read_json("config.json")
    if found is not None and found.get("kind") != KIND:
        raise InputError(f"{run.path} holds a {found.get('kind') or 'unknown'} run, not a probabilistic capsule "
                         "model; give the run directory of one (--run-dir).")
    if found is None:
        raise InputError(f"{run.path} holds no trained probabilistic capsule model; train one first.")
    paths = [os.path.join(run.models, f"{name}.keras") for name in ("capsules", "vae")]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise InputError(f"{run.path} has no {', '.join(missing)}; finish its training first "
                         "(resume=True; --resume on the command line).")
    return run, found["settings"], load_component(paths[0]), load_component(paths[1])


def probe_features(t0, a0, t0_logits=None):
    """The probe table's feature sets from `t0 [B, K]` and `A0 [B, K, ...]` (flattened to `[B, 6K]`; or given so).

    `{"t0": t0, "t0_A0": [t0, A0]}`; given the presences' logits `[B, K]`
    (`t0 = sigmoid(t0_logits)`) also `{"t0_logits": ..., "t0_logits_A0": [t0_logits, A0]}`,
    the paper's reading of `t0` (its supplement D classifies from the logit
    of the posterior over `t0`).
    """
    t0, a0 = np.asarray(t0), np.asarray(a0)
    fits = t0.ndim == 2 and a0.ndim >= 2 and len(a0) == len(t0) and np.prod(a0.shape[1:]) % max(t0.shape[1], 1) == 0
    if not fits or (t0_logits is not None and np.shape(t0_logits) != t0.shape):
        raise InputError(f"probe_features needs t0 [B, K], A0 [B, K, ...] or [B, K * pose size] and t0_logits "
                         f"[B, K] of one B and K. Received: t0 {t0.shape}, A0 {a0.shape}"
                         + ("" if t0_logits is None else f", t0_logits {np.shape(t0_logits)}"))
    a0 = a0.reshape(len(t0), -1)
    sets = {"t0": t0, "t0_A0": np.hstack([t0, a0])}
    if t0_logits is not None:
        t0_logits = np.asarray(t0_logits)
        sets.update(t0_logits=t0_logits, t0_logits_A0=np.hstack([t0_logits, a0]))
    return sets


def parameter_features(parameters):
    """`probe_features` of a dict of variational parameters (`variational_parameters`, `refine`)."""
    logits = parameters["top_logits"]
    return probe_features(tf.sigmoid(logits).numpy(), parameters["top_pose"].numpy(), logits.numpy())


def load_study(run_dir, seed):
    """A trained run made ready for a study of its probes (Keras seeded with `seed` first).

    Returns `(run, capsules, vae, (x_train, y_train), (x_test, y_test),
    table_train)`, where `table_train` holds the `probe_features` of the
    encoder's output on every training digit: what the probe table's probes
    are trained on.
    """
    run, settings, capsules, vae = load_trained(run_dir)
    keras.utils.set_random_seed(seed)
    train = load_digits(settings["data_dir"], "train", settings["canvas"])
    test = load_digits(settings["data_dir"], "test", settings["canvas"])
    full = _batched(_features(capsules, vae), train[0])
    return run, capsules, vae, train, test, probe_features(full["t0"], full["A0"], full["t0_logits"])


def _features(capsules, vae):
    """A compiled step: each image's probe features (`t0`, its logits, `A0`, the VAE's `(mu, sigma)`)."""
    def step(x):
        parameters = capsules.variational_parameters(x)
        encoded = vae(x)
        return {"t0": tf.sigmoid(parameters["top_logits"]), "t0_logits": parameters["top_logits"],
                "A0": tf.reshape(parameters["top_pose"], [len(x), -1]),
                "vae": tf.concat([encoded["mu"], encoded["sigma"]], -1)}
    return graph(step, jit_compile=True)


def probe_table(capsules, vae, x_train, y_train, x_test, y_test, seed):
    """Linear-probe accuracy of `t0`, `(t0, A0)`, both again with `t0`'s logits, and the VAE's `(mu, sigma)`.

    Tested on the test digits turned by each of `ANGLES` (conditions "0" ...
    "180"), under the affine stand-in ("affine"), and turned each by its own
    angle uniform in +-limit for each of `RANGES` ("up_to_45" ...).
    """
    features = _features(capsules, vae)
    train = _batched(features, x_train)
    train_sets = {**probe_features(train["t0"], train["A0"], train["t0_logits"]), "vae": train["vae"]}
    tests = {f"{angle}": np.asarray(transforms.rotate(x_test, float(angle))) for angle in ANGLES}
    tests["affine"] = np.asarray(transforms.random_affine(x_test, seed=keras.random.SeedGenerator(seed), **AFFINE))
    for limit in RANGES:
        tests[f"up_to_{limit}"] = np.asarray(transforms.random_rotation(
            x_test, float(limit), seed=keras.random.SeedGenerator(1000 * seed + limit)))
    classes = int(max(y_train.max(), y_test.max())) + 1
    probes = {name: metrics.fit_linear_probe(train_features, y_train, classes)
              for name, train_features in train_sets.items()}
    table = {name: {} for name in train_sets}
    for condition, images in tests.items():
        found = _batched(features, images)
        sets = {**probe_features(found["t0"], found["A0"], found["t0_logits"]), "vae": found["vae"]}
        for name, probe in probes.items():
            table[name][condition] = probe(sets[name], y_test)
        print(f"[probe] {condition}: " + ", ".join(f"{n} {table[n][condition]:.3f}" for n in table), flush=True)
    return table, tests


def _render(capsules, parameters):
    return capsules.generative.render(tf.sigmoid(parameters["part_logits"]), parameters["part_pose"])


def test_time_optimisation(capsules, images, rotated, steps, learning_rate, seed):
    """Bound per image before and after `refine` on `images`; reconstruction error of `rotated` before and after."""
    before = capsules.variational_parameters(images)
    after = capsules.refine(images, steps, learning_rate, before, seed=seed)
    bound = lambda p: capsules.mean_bound(images, p, draws=8, seed=seed + 1).numpy()
    bound_before, bound_after = bound(before), bound(after)
    rot_before = capsules.variational_parameters(rotated)
    rot_after = capsules.refine(rotated, steps, learning_rate, rot_before, seed=seed)
    mse = lambda p: np.mean(np.square(_render(capsules, p).numpy() - rotated), axis=(1, 2, 3))
    mse_before, mse_after = mse(rot_before), mse(rot_after)
    return {
        "images": len(images), "steps": steps, "learning_rate": learning_rate,
        "bound_before": float(bound_before.mean()), "bound_after": float(bound_after.mean()),
        "share_improved": float(np.mean(bound_after > bound_before)),
        "rotated_90_mse_before": float(mse_before.mean()), "rotated_90_mse_after": float(mse_after.mean()),
        "rotated_90_mse_fall": float(1.0 - mse_after.mean() / mse_before.mean()),
    }, (rot_before, rot_after)


def _figures(run, capsules, x_test, rotated, rotated_parameters, seed):
    show = spread_indices(len(x_test), 10)
    templates = capsules.generative.templates().numpy()
    drawn = templates[..., :1] * templates[..., 1:]                                    # intensity times alpha
    figures.image_grid(drawn[None], run.file("templates.png"), title="learned templates (intensity x alpha)")
    recon = _batched(graph(lambda x: {"r": capsules(x)["reconstructions"]}), x_test[show])["r"]
    figures.image_grid(np.stack([x_test[show], recon]), run.file("reconstructions.png"),
                       title="test digits and their reconstructions (encoder means)", row_labels=["data", "recon"])
    before, after = (_render(capsules, p).numpy()[show] for p in rotated_parameters)
    figures.image_grid(np.stack([rotated[show], before, after]), run.file("rotation.png"),
                       title="digits rotated by 90 degrees: reconstruction before and after test-time optimisation",
                       row_labels=["rotated", "encoder", "refined"])
    samples = capsules.generative.generate(20, seed=seed)["means"].numpy()
    figures.image_grid(samples.reshape(2, 10, *samples.shape[1:]), run.file("samples.png"),
                       title="images drawn from the model (mean of the pixels)")
    return [run.file(name) for name in ("templates.png", "reconstructions.png", "rotation.png", "samples.png")]


def evaluate_run(run_dir, tto_images=200, tto_steps=200, tto_learning_rate=0.01, seed=0):
    """Test-time optimisation, the probe table and the figures of a trained run; write and return `RUN/eval.json`.

    The settings are checked (`configs.ProbabilisticEvaluationConfig`) before the run is read.
    """
    ProbabilisticEvaluationConfig(tto_images=tto_images, tto_steps=tto_steps, tto_learning_rate=tto_learning_rate,
                                  seed=seed)
    run, settings, capsules, vae = load_trained(run_dir)
    keras.utils.set_random_seed(seed)
    start = time.perf_counter()
    x_train, y_train = load_digits(settings["data_dir"], "train", settings["canvas"])
    x_test, y_test = load_digits(settings["data_dir"], "test", settings["canvas"])
    run.record_environment("evaluate")                  # once the digits have loaded: a failed call leaves no line
    table, tests = probe_table(capsules, vae, x_train, y_train, x_test, y_test, seed)
    pick = spread_indices(len(x_test), tto_images)
    print(f"[tto] {tto_steps} steps of test-time optimisation on {len(pick)} test digits, upright and turned by "
          f"90 degrees ...", flush=True)
    tto, rotated_parameters = test_time_optimisation(capsules, tf.constant(x_test[pick]), tests["90"][pick],
                                                     tto_steps, tto_learning_rate, seed)
    print(f"[tto] bound {tto['bound_before']:.1f} -> {tto['bound_after']:.1f}, improved on "
          f"{tto['share_improved']:.1%}; 90-degree MSE {tto['rotated_90_mse_before']:.4f} -> "
          f"{tto['rotated_90_mse_after']:.4f} ({tto['rotated_90_mse_fall']:.1%} lower)", flush=True)
    result = {"run": run_dir, "seed": seed, "probe_train_images": len(x_train), "probe_test_images": len(x_test),
              "affine_stand_in": {k: list(v) if isinstance(v, tuple) else v for k, v in AFFINE.items()},
              "probe_accuracy": table, "test_time_optimisation": tto,
              "figures": _figures(run, capsules, x_test[pick], tests["90"][pick], rotated_parameters, seed),
              "seconds": time.perf_counter() - start}
    run.write_json("eval.json", result)
    return result
