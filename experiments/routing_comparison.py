"""One table of every routing: each row is a preset of the routing network, trained and evaluated alike.

The rows are the baseline presets whose model is `routingnet` (Faria's
Table 1 network), in the order `poecaps.experiments.presets` registers
them, so a new router joins the table by adding one preset. Each row trains
into `ROOT/<preset>` with the same overrides (data, epochs, seed), is
evaluated by `evaluate_baseline`, and the table is written to
`ROOT/routing_table.md` and `ROOT/routing_table.json`. A row whose run is
already trained and evaluated with the same settings (training and
evaluation) is read, not redone; one trained but not evaluated, or evaluated
with other evaluation settings (seed, batch size, test limit, ...), is
evaluated; one stopped while training (its `config.json` has the same
settings) resumes from its last checkpoint. A row whose run has other
settings is trained again from the start.
"""

import dataclasses
import json
import os

from poecaps.errors import InputError
from poecaps.experiments import presets
from poecaps.experiments.baseline_evaluation import evaluate_baseline
from poecaps.experiments.baselines import train_baseline
from poecaps.experiments.configs import BaselineEvaluationConfig
from poecaps.experiments.runs import RunDir, check_run_path
from poecaps.experiments.settings import with_values

HEADER = ("routing", "test accuracy", "affine", "rotated 45 / 90 / 180", "parameters: routing / other",
          "s / step", "step peak MiB", "entropy / log n: init -> trained")


def _has_settings(run_dir, name, config):
    """True if the run's `name` (`config.json` or `state.json`) records exactly `config`'s settings."""
    if not os.path.exists(os.path.join(run_dir, name)):
        return False
    return RunDir(run_dir, create=False).read_json(name, {}).get("settings") == dataclasses.asdict(config)


def row(name, result):
    """One table row (strings) from a run's `eval.json`."""
    train, routing, params = result["train"], result["routing"], result["parameters"]
    rotated = result["rotation_accuracy"]
    peak = train.get("step_peak_bytes")
    percent = lambda x: f"{100 * x:.1f} %"
    return (name, percent(result["test_accuracy"]), percent(result["affine_accuracy"]),
            " / ".join(f"{100 * rotated[a]:.1f}" for a in ("45", "90", "180")),
            f"{params['routing']:,} / {params['other']:,}",
            "-" if train.get("seconds_per_step") is None else f"{train['seconds_per_step']:.3f}",
            "-" if peak is None else f"{peak / 2 ** 20:.0f}",
            (f"{train['initial_routing']['coefficient_entropy_normalised']:.4f} -> "
            f"{routing['coefficient_entropy_normalised']:.4f} ({routing['normalizes']})"))


def markdown(rows):
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def compare_routing(root, settings=None, names=None, evaluation=None):
    """Train and evaluate each row's preset with `settings` changed; returns `{preset: eval.json}`.

    Args:
        root: folder of the runs, one per preset (`root/<preset>`).
        settings: `{field: value}` applied to every preset (dataset, epochs, seed, ...).
        names: the presets to run (default: `presets.routing_table()`), in table order.
        evaluation: a `BaselineEvaluationConfig`.
    """
    check_run_path(root, "The runs' root")
    known = presets.routing_table()
    if names is not None and (not isinstance(names, (list, tuple)) or len(names) == 0):
        raise InputError(f"rows must be a non-empty list of the table's presets, or None for all of them. Received: "
                         f"{names!r}")
    names = list(known if names is None else names)
    unknown = [name for name in names if not isinstance(name, str) or name not in known]
    if unknown:
        raise InputError(f"{', '.join(map(str, unknown))} is not a preset of the routing network; the table's "
                         f"presets are {', '.join(known)}.")
    settings = settings or {}
    evaluation = evaluation or BaselineEvaluationConfig()
    configs = {name: with_values(presets.get("baseline", name), settings) for name in names}
    if os.path.exists(root) and not os.path.isdir(root):
        raise InputError(f"{root} is a file; pass a folder as the runs' root (--run-dir).")
    results = {}
    for name, config in configs.items():
        run_dir = os.path.join(root, name)
        trained = _has_settings(run_dir, "state.json", config)
        found = RunDir(run_dir, create=False).read_json("eval.json", {}) if trained else {}
        if found.get("evaluation") == dataclasses.asdict(evaluation):
            print(f"[routing table] {name}: already trained and evaluated in {run_dir}", flush=True)
        else:
            if trained:
                again = " again, with this call's evaluation settings" if found else ""
                print(f"[routing table] {name}: already trained in {run_dir}; evaluating{again}", flush=True)
            else:
                resume = _has_settings(run_dir, "config.json", config)
                print(f"[routing table] {name}: {'resuming' if resume else 'training'} into {run_dir}", flush=True)
                record = {"kind": "baseline", "preset": name,
                          "overrides": {field: getattr(config, field) for field in settings}}
                train_baseline(config, run_dir, record, resume=resume, test_limit=evaluation.test_limit)
            found = evaluate_baseline(run_dir, evaluation)
        results[name] = found
    table = markdown([row(name, result) for name, result in results.items()])
    with open(os.path.join(root, "routing_table.md"), "w") as handle:
        handle.write(table + "\n")
    with open(os.path.join(root, "routing_table.json"), "w") as handle:
        json.dump({"settings": settings, "rows": results}, handle, indent=2, sort_keys=True)
    return results, table
