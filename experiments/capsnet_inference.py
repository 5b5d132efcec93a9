"""Sparse iterative inference on a trained CapsNet baseline run: measured (appendix C, Figure 1 B-E).

Runs `poecaps.inference.infer` on the run's test digits four ways (L1 weight
0 or `l1`, label clamped or not) and writes `RUN/inference/`:
`inference.json` (the figures below), `lengths.png` (class-capsule lengths
over the steps for a few digits, each of the four ways: Figure 1 B-E's
counterpart) and `energy.png` (the mean energy over the steps).

Figures, for the unclamped runs: mean energy at the start and after the
last step; Hoyer sparsity of the class-capsule lengths with and without L1;
the share of non-target class capsules shorter than 0.02; accuracy of the
longest class capsule after inference against the feed-forward pass.

The L1 weight that suits a network depends on how long its class capsules
are. `l1="auto"` (the script's default) calibrates it on training digits,
never on the test digits it reports: of `L1_GRID`, largest first, the
first weight whose unclamped inference reads those digits at least as
accurately as the feed-forward pass (`calibrate_l1`).
"""

import os
import time

import numpy as np

from poecaps import inference
from poecaps.errors import InputError
from poecaps.experiments import figures
from poecaps.experiments.configs import SparseInferenceConfig
from poecaps.experiments.runs import load_images, spread_indices
from poecaps.experiments.trained import load_capsnet
from poecaps.metrics import hoyer_sparsity

SHORT = 0.02
# Candidate L1 weights of `calibrate_l1`, largest first.
L1_GRID = (1.0, 0.7, 0.5, 0.3, 0.2, 0.1)


def batched_infer(model, images, labels, batch_size, **settings):
    """`inference.infer` over `images` in batches: lengths `[N, K]` and energies `[steps + 1, N]` of all of them."""
    parts = [inference.infer(model, images[s:s + batch_size], None if labels is None else labels[s:s + batch_size],
                             **settings) for s in range(0, len(images), batch_size)]
    return {key: np.concatenate([np.asarray(p[key]) for p in parts], axis=-1 if key == "energy" else 0)
            for key in ("lengths", "initial_lengths", "energy")}


def even_spread(images, labels, examples):
    """`examples` of `images` at evenly spaced indices (a split may be ordered by class: mnist-5k's test is)."""
    pick = spread_indices(len(images), examples)
    return images[pick], labels[pick]


def largest_harmless_weight(accuracies, feed_forward):
    """Of `accuracies` (L1 weight -> accuracy, in the order tried), the first weight not below `feed_forward`.

    None when every weight costs accuracy.
    """
    return next((weight for weight, accuracy in accuracies.items() if accuracy >= feed_forward), None)


def calibrate_l1(model, images, labels, grid=L1_GRID, batch_size=250, **settings):
    """The largest L1 weight of `grid` whose unclamped inference is as accurate as the feed-forward pass.

    Tries the weights in `grid`'s order (largest first) on `images`
    (training digits) and stops at the first whose longest capsule after
    inference is right at least as often as the feed-forward pass's; the
    smallest weight of the grid when none is.

    Returns:
        `(weight, record)`, `record` holding the digits' feed-forward
        accuracy and each tried weight's accuracy.

    Raises:
        InputError: `grid` is empty or holds a negative or non-finite weight.
    """
    grid = tuple(grid)
    if not grid or not all(np.isfinite(w) and w >= 0 for w in grid):
        raise InputError(f"grid must hold at least one finite L1 weight >= 0. Received: {grid}")
    accuracies, feed_forward = {}, None
    for weight in grid:
        found = batched_infer(model, images, None, batch_size, l1=weight, **settings)
        if feed_forward is None:
            feed_forward = float(np.mean(np.argmax(found["initial_lengths"], -1) == labels))
        accuracies[weight] = float(np.mean(np.argmax(found["lengths"], -1) == labels))
        print(f"[calibration] L1 {weight}: {accuracies[weight]:.3f} (feed-forward {feed_forward:.3f})", flush=True)
        chosen = largest_harmless_weight(accuracies, feed_forward)
        if chosen is not None:
            break
    chosen = min(grid) if chosen is None else chosen
    return chosen, {"examples": len(images), "split": "train", "feed_forward_accuracy": feed_forward,
                    "accuracy_by_l1": {str(w): a for w, a in accuracies.items()}, "l1": chosen}


def infer_run(run_dir, examples=1000, steps=500, learning_rate=0.01, l1=None, batch_size=250, shown=4):
    """Run the four inferences on the first `examples` test digits; write and return `inference.json`.

    `l1` is the L1 weight, or None (or `"auto"`) to choose it by
    `calibrate_l1` on `examples` training digits first. The settings are
    checked (`configs.SparseInferenceConfig`) before the run is read.
    """
    l1 = SparseInferenceConfig(examples=examples, steps=steps, learning_rate=learning_rate, l1=l1,
                               batch_size=batch_size, shown=shown).l1
    run, config, model = load_capsnet(run_dir)
    start = time.perf_counter()
    calibration_images = even_spread(*load_images(config, "train")[:2], examples) if l1 is None else None
    load_seconds = time.perf_counter() - start
    images, labels = even_spread(*load_images(config, "test")[:2], examples)
    run.record_environment("sparse inference")          # once the images have loaded: a failed call leaves no line
    settings = {"steps": steps, "learning_rate": learning_rate}
    calibration, calibration_seconds = None, 0.0
    if l1 is None:
        start = time.perf_counter()
        l1, calibration = calibrate_l1(model, *calibration_images, batch_size=batch_size, **settings)
        calibration_seconds = load_seconds + time.perf_counter() - start      # the training images' loading too
    out = os.path.join(run_dir, "inference")
    os.makedirs(out, exist_ok=True)
    runs, seconds = {}, {}
    for name, weight, clamp in (("free", 0.0, False), ("free_l1", l1, False), ("clamped", 0.0, True),
                                ("clamped_l1", l1, True)):
        start = time.perf_counter()
        runs[name] = batched_infer(model, images, labels if clamp else None, batch_size, l1=weight, **settings)
        seconds[name] = time.perf_counter() - start
        print(f"[inference] {name}: {seconds[name]:.1f} s", flush=True)
    feed_forward = runs["free"]["initial_lengths"]
    nontarget = np.ones_like(feed_forward, dtype=bool)
    nontarget[np.arange(len(labels)), labels] = False
    accuracy = lambda lengths: float(np.mean(np.argmax(lengths, -1) == labels))
    result = {
        "run": run_dir, "examples": len(images), "steps": steps, "learning_rate": learning_rate, "l1": l1,
        "feed_forward_accuracy": accuracy(feed_forward),
        "calibration": calibration, "calibration_seconds": calibration_seconds,
        "seconds": seconds, "seconds_total": sum(seconds.values()) + calibration_seconds,
    }
    for name, found in runs.items():
        energy = found["energy"].mean(axis=-1)
        lengths = found["lengths"]
        result[name] = {
            "energy_start": float(energy[0]), "energy_end": float(energy[-1]),
            "energy_rises": int(np.sum(np.diff(found["energy"], axis=0) > 1e-4 * (1 + np.abs(found["energy"][:-1])))),
            "hoyer_sparsity": hoyer_sparsity(lengths),
            "nontarget_shorter_than_0_02": float(np.mean(lengths[nontarget] < SHORT)),
            "accuracy": accuracy(lengths),
        }
    if shown:
        show = np.linspace(0, len(images) - 1, shown).round().astype(int)     # digits of several classes
        panels = [[] for _ in range(shown)]
        for name in runs:
            clamp, weight = "clamped" in name, l1 if name.endswith("l1") else 0.0
            found = inference.infer(model, images[show], labels[show] if clamp else None, l1=weight,
                                    record_lengths=True, **settings)["length_trace"]
            for k in range(shown):
                panels[k].append((f"digit {labels[show[k]]}, {name.replace('_', ' + ')}",
                                  {f"class {j}": np.asarray(found[:, k, j]) for j in range(found.shape[-1])}))
        figures.line_panels(panels, os.path.join(out, "lengths.png"), ylabel="class-capsule length",
                            title=f"class-capsule lengths over {steps} inference steps (L1 weight {l1})")
    figures.line_panels([[("mean energy", {name: found["energy"].mean(axis=-1) for name, found in runs.items()})]],
                        os.path.join(out, "energy.png"), ylabel="energy")
    run.write_json(os.path.join("inference", "inference.json"), result)
    return result
