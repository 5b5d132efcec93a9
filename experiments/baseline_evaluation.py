"""Evaluate a supervised baseline run: accuracy, robustness, routing statistics, figures."""

import dataclasses
import os

import keras
import numpy as np

from poecaps import transforms
from poecaps.errors import InputError
from poecaps.experiments import figures
from poecaps.experiments.configs import BaselineConfig, BaselineEvaluationConfig
from poecaps.experiments.runs import RunDir, limit_test_split, load_images, read_settings
from poecaps.experiments.settings import config_or_default
from poecaps.graphs import graph
from poecaps.metrics import hoyer_sparsity
from poecaps.models.saving import load_component
from poecaps.validation import check_integer

ROTATIONS = (0, 45, 90, 135, 180)


def compiled_predictor(model, jit_compile=False):
    """The model's inference pass compiled once: `images -> (scores, coefficients)`.

    One graph (XLA when `jit_compile`, as the run was trained) instead of
    an eager call per batch; `predict_in_batches` keeps the batch shape fixed
    so it is traced once.
    """
    def predict(images):
        out = model(images, training=False)
        return out["scores"], out["coefficients"]

    return graph(predict, jit_compile=jit_compile)


def predict_in_batches(predict, images, batch_size):
    """`predict` over batches of one size (the last padded with zeros, dropped again): `batch_size` an integer
    >= 1, `images` at least one (an `InputError` otherwise: a zero batch size failed in `range`, and no images
    gave no outputs to unpack)."""
    batch_size = check_integer(batch_size, "batch_size")
    if len(images) == 0:
        raise InputError(f"images is empty; predict_in_batches needs at least one. Received: shape "
                         f"{np.shape(images)}")
    batch_size = min(batch_size, len(images))
    results = []
    for start in range(0, len(images), batch_size):
        batch = images[start:start + batch_size]
        n = len(batch)
        if n < batch_size:
            batch = np.concatenate([batch, np.zeros((batch_size - n, *batch.shape[1:]), batch.dtype)])
        results.append([keras.ops.convert_to_numpy(t)[:n] for t in predict(batch)])
    return tuple(np.concatenate(parts) for parts in zip(*results))


def _accuracy(predict, images, labels, batch_size):
    scores, _ = predict_in_batches(predict, images, batch_size)
    return float(np.mean(np.argmax(scores, axis=-1) == labels))


def _transformed(fn, images, batch_size):
    return np.concatenate([keras.ops.convert_to_numpy(fn(images[s:s + batch_size]))
                           for s in range(0, len(images), batch_size)])


def coefficient_entropy(coefficients, normalizes="parents"):
    """The mean entropy of the coefficients `[N, I, J]` along the axis they sum to 1 over, and that over its log.

    `normalizes="parents"`: `-sum_j c_ij log c_ij` averaged over examples and
    children, over log J; "children": `-sum_i c_ij log c_ij` averaged over
    examples and parents, over log I. 1 means uniform coefficients. Any other
    `normalizes`, coefficients not `[N, I, J]`, or one capsule along the axis
    (entropy over log 1) is an `InputError`.
    """
    if normalizes not in ("parents", "children"):
        raise InputError(f"normalizes must be 'parents' or 'children' (a router's `normalizes`). "
                         f"Received: {normalizes!r}")
    coefficients = np.asarray(coefficients)
    axis = -1 if normalizes == "parents" else -2
    if coefficients.ndim != 3 or coefficients.shape[axis] < 2:
        raise InputError(f"coefficients must be [N, I, J] with at least two {normalizes} (the axis they sum "
                         f"to 1 over). Received: shape {coefficients.shape}")
    c = np.clip(coefficients, 1e-12, 1.0)
    entropy = float(np.mean(-np.sum(c * np.log(c), axis=axis)))
    return entropy, entropy / float(np.log(coefficients.shape[axis]))


def routing_statistics(model, coefficients):
    """The class layer's coefficient entropy along its router's axis (`coefficient_entropy`)."""
    normalizes = model.class_capsules.routing.normalizes
    entropy, normalised = coefficient_entropy(coefficients, normalizes)
    return {"normalizes": normalizes, "coefficient_entropy": entropy, "coefficient_entropy_normalised": normalised}


def parameter_counts(model):
    """`{"routing": n, "other": m}`: trainable parameters of the routers and of the rest of the network."""
    size = lambda weights: int(sum(np.prod(w.shape) for w in weights))
    routing = size(w for router in model.routers for w in router.trainable_weights)
    return {"routing": routing, "other": size(model.trainable_weights) - routing}


def _figures(model, run, images, labels, config):
    out = model(images[:12], training=False)
    if "reconstruction" not in out:
        return []
    recon = keras.ops.convert_to_numpy(out["reconstruction"])
    figures.image_grid(np.stack([images[:12], recon]), run.file("reconstructions.png"),
                       title="test images (top) and reconstructions from the longest class capsule",
                       row_labels=["data", "capsnet"])
    steps = np.linspace(-0.25, 0.25, 11).astype("float32")
    written = [run.file("reconstructions.png")]
    for k in range(config.perturb_examples):
        poses = keras.ops.convert_to_numpy(out["poses"][k])             # [K, D]
        winner = int(np.argmax(keras.ops.convert_to_numpy(out["scores"][k])))
        dim = poses.shape[-1]
        batch = np.repeat(poses[None, None], dim * len(steps), axis=0).reshape(
            dim, len(steps), *poses.shape)
        for d in range(dim):
            batch[d, :, winner, d] += steps
        flat = batch.reshape(-1, *poses.shape)
        decoded = keras.ops.convert_to_numpy(model.reconstruct(
            keras.ops.convert_to_tensor(flat), np.full(len(flat), winner)))
        path = run.file(f"perturbations_{k}.png")
        figures.image_grid(decoded.reshape(dim, len(steps), *decoded.shape[1:]), path,
                           title=f"each dimension of capsule {winner} (label {labels[k]}) "
                                 "perturbed by -0.25..0.25",
                           column_labels=[f"{s:+.2f}" for s in steps])
        written.append(path)
    return written


def evaluate_baseline(run_dir, config=None):
    """Compute and write `run_dir/eval.json`; returns the dict (`config`: a `BaselineEvaluationConfig`)."""
    config = config_or_default(config, BaselineEvaluationConfig)
    run = RunDir(run_dir, create=False)
    train_config = read_settings(run, BaselineConfig)
    path = os.path.join(run.models, "model.keras")
    if not os.path.exists(path):
        raise InputError(f"No trained network at {path}; train it first with scripts/baseline.py.")
    model = load_component(path)
    test, labels, _ = load_images(train_config, "test")
    run.record_environment("evaluate")                  # once the images have loaded: a failed call leaves no line
    test, labels = limit_test_split(test, labels, config.test_limit)
    predict = compiled_predictor(model, jit_compile=train_config.xla)
    scores, coefficients = predict_in_batches(predict, test, config.batch_size)
    seed = keras.random.SeedGenerator(config.seed)
    affine = _transformed(lambda x: transforms.random_affine(x, seed=seed), test, config.batch_size)
    result = {
        "model": train_config.model, "dataset": train_config.dataset, "test_images": len(test),
        "evaluation": dataclasses.asdict(config),
        "routing_iterations": train_config.routing_iterations,
        "test_accuracy": float(np.mean(np.argmax(scores, axis=-1) == labels)),
        "affine_accuracy": _accuracy(predict, affine, labels, config.batch_size),
        "rotation_accuracy": {
            str(angle): _accuracy(predict, _transformed(lambda x, a=angle: transforms.rotate(x, a),
                                                      test, config.batch_size),
                                  labels, config.batch_size)
            for angle in ROTATIONS},
        "routing": {"router": train_config.router, **routing_statistics(model, coefficients),
                    "class_score_hoyer_sparsity": hoyer_sparsity(scores)},
        "parameters": parameter_counts(model),
        "train": run.read_json("state.json", {}),
    }
    result["train"].pop("settings", None)
    result["figures"] = _figures(model, run, test, labels, config)
    figures.image_grid(np.stack([test[:12], affine[:12]]), run.file("affine_examples.png"),
                       title="test images and their random affine transforms",
                       row_labels=["data", "affine"])
    if os.path.exists(run.file("metrics.jsonl")):
        figures.training_curves(run.file("metrics.jsonl"), run.file("training_curves.png"))
    run.write_json("eval.json", result)
    return result


__all__ = ["BaselineEvaluationConfig", "evaluate_baseline"]
