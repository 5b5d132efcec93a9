"""Run directories: where a run's settings, checkpoints, models, logs and figures live.

A run directory holds `config.json` (what kind of run, its preset, the
overrides and every setting of the last call), `state.json` (what has been
trained, with the settings of each part), `environment.jsonl` (the
machine and software of each command that trained, sampled, evaluated
or studied it, one line each, `experiments.environment`; a new training
starts it afresh), `checkpoints/`, `logs/`
(TensorBoard), `metrics.jsonl`, `faults.jsonl`, `models/` and PNG figures.
"""

import json
import os

import numpy as np

from poecaps import data as data_lib
from poecaps.errors import InputError
from poecaps.experiments import environment, presets
from poecaps.experiments.configs import KINDS
from poecaps.experiments.settings import SettingError, specs, with_values
from poecaps.validation import check_images


def load_images(config, split):
    """A run's images, float32 `[N, H, W, C]` in [0, 1], labels and source; the training split
    shuffled with the run's seed and cut to its `limit`."""
    images, labels, source = data_lib.load_arrays(config.dataset, split, config.data_dir)
    if split == "train":
        order = np.random.default_rng(config.seed).permutation(len(images))[:config.limit or None]
        images, labels = images[order], labels[order]
    if len(images) == 0:
        raise InputError(f"The {split} split of {config.dataset} is empty.")
    return check_images(data_lib.to_float(images), f"{config.dataset} {split} images"), labels, source


def spread_indices(count, size):
    """`min(size, count)` indices spread evenly over `range(count)` (a split may be ordered by class: mnist-5k's is)."""
    return np.linspace(0, count - 1, min(size, count)).round().astype(int)


def limit_test_split(images, labels, limit):
    """`limit` of the test split's images and their labels, spread evenly over it (`spread_indices`); all of
    them for `limit=None`. The first `limit` would be one class where the split is ordered by class."""
    if limit is None:
        return images, labels
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
        raise InputError(f"test_limit must be an integer >= 1, or None for every test image. Received: {limit!r}")
    pick = spread_indices(len(images), int(limit))
    return images[pick], labels[pick]


def check_run_path(path, what="The run directory"):
    """`path` if it is a non-empty path (a str or `os.PathLike`); else an `InputError` (os.path's TypeError)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise InputError(f"{what} must be a path (a str or os.PathLike, --run-dir). Received: {path!r}")
    return path


class RunDir:
    """Paths and small JSON files of one run directory.

    Args:
        path: the directory.
        create: True makes it (and its subfolders) if missing; "later" leaves
            that to `make()`, so that a training call can read its existing
            files and load its data first, and a call that stops on bad input
            leaves no empty folder behind; False makes a missing directory an
            `InputError`.
    """

    def __init__(self, path, create=True):
        if not isinstance(create, bool) and create != "later":
            raise InputError(f'create must be True, False or "later". Received: {create!r}')
        check_run_path(path)
        self.path = path
        self.models = os.path.join(path, "models")
        self.checkpoints = os.path.join(path, "checkpoints")
        self.logs = os.path.join(path, "logs")
        if os.path.exists(path) and not os.path.isdir(path):
            raise InputError(f"The run directory {path} is a file; pass a folder (--run-dir).")
        if create is False and not os.path.isdir(path):
            raise InputError(f"No run directory at {path}; train one first or pass another run directory (--run-dir).")
        if create is True:
            self.make()

    def make(self):
        """Make the directory and its `models`, `checkpoints` and `logs` folders if missing."""
        for directory in (self.path, self.models, self.checkpoints, self.logs):
            os.makedirs(directory, exist_ok=True)

    def file(self, name):
        return os.path.join(self.path, name)

    def read_json(self, name, default=None):
        """The JSON object in `name`, or `default` if there is no such file; a damaged one is an error."""
        path = self.file(name)
        if not os.path.exists(path):
            return default
        try:
            with open(path) as handle:
                found = json.load(handle)
        except (OSError, ValueError) as error:
            raise InputError(f"{path} is not readable JSON ({error}); restore it or start a new run directory "
                             "(--run-dir).") from None
        if not isinstance(found, dict):
            raise InputError(f"{path} does not hold a JSON object; restore it or start a new run "
                             "directory (--run-dir).")
        return found

    def write_json(self, name, obj):
        tmp = self.file(name + ".tmp")
        with open(tmp, "w") as handle:
            json.dump(obj, handle, indent=2, sort_keys=True)
        os.replace(tmp, self.file(name))

    def record_environment(self, action):
        """Append what this process runs on (`environment.describe(action)`) to `environment.jsonl`."""
        with open(self.file("environment.jsonl"), "a") as handle:
            handle.write(json.dumps(environment.describe(action)) + "\n")

    def append_metrics(self, record):
        self.append_jsonl("metrics.jsonl", record)

    def append_jsonl(self, name, record):
        """Append `record` as one JSON line to `name` (its folder made if missing)."""
        os.makedirs(os.path.dirname(self.file(name)), exist_ok=True)
        with open(self.file(name), "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def per_epoch(self, name, **match):
        """The entries of JSON-lines file `name` whose fields equal `match`, the last of each `epoch`, in
        epoch order (a resumed run may have measured an epoch twice); [] without the file."""
        if not os.path.exists(self.file(name)):
            return []
        by_epoch = {}
        with open(self.file(name)) as handle:
            for line in handle:
                entry = json.loads(line)
                if all(entry.get(k) == v for k, v in match.items()):
                    by_epoch[entry["epoch"]] = entry
        return [by_epoch[e] for e in sorted(by_epoch)]

    def remove(self, name):
        """Delete file `name` if it exists."""
        if os.path.exists(self.file(name)):
            os.remove(self.file(name))

    def start_afresh(self, logs, checkpoints=None, what="run"):
        """Before a training call without resume: delete the earlier run's `logs` (file names) and say so.

        A new run replaces what it finds, its checkpoints included (those in
        the folder `checkpoints`, default all of the run's, are cleared by the
        caller or by `fit_resumable`); if an earlier run left logs or
        checkpoints here, one printed line says it is replaced and how to go
        on with it instead, so that a repeated command never drops a trained
        run unannounced. `what` names it in that line.
        """
        found = [name for name in logs if os.path.exists(self.file(name))]
        checkpointed = any(files for _, _, files in os.walk(checkpoints or self.checkpoints))
        for name in found:
            self.remove(name)
        if found or checkpointed:
            print(f"A new {what} in {self.path}: the earlier {what}'s checkpoints and logs there are replaced "
                  "(resuming, --resume, goes on with it instead).", flush=True)


def read_settings(run, config_cls):
    """The config a run was trained with (`config.json`), checked; errors say what is wrong with the run.

    A run of another kind (a baseline given where a layer-wise run is
    needed), a missing, damaged or foreign `config.json`, and settings its
    declarations refuse are each one `InputError`.
    """
    expected = next(kind for kind, cls in KINDS.items() if cls is config_cls)
    record = run_record(run, expected)
    if record is None:
        raise InputError(f"{run.path} has no config.json, so it holds no trained run; train one first "
                         "or pass another run directory (--run-dir).")
    settings = record.get("settings")
    if not isinstance(settings, dict):
        raise InputError(f"{run.file('config.json')} has no settings; restore it or start a new run "
                         "directory (--run-dir).")
    unknown = sorted(set(settings) - set(specs(config_cls)))
    if unknown:
        raise InputError(f"{run.file('config.json')} holds settings this version does not know "
                         f"({', '.join(unknown)}); it was written by another version of poecaps.")
    try:
        return config_cls(**settings)
    except SettingError as error:
        raise InputError(f"{run.file('config.json')}: {error}") from None


def config_to_resume(run_dir, kind, preset=None, values=None):
    """`(config, record)` of a resumed call: the settings `run_dir` was trained with, `values` changed.

    A resumed call goes on as the run was set up. What it does not give
    (epochs, learning rates, seed, data) comes from the run's `config.json`;
    what it gives (`values`, `{field: value or command-line text}`) changes
    it, each checked, and the pipeline then refuses a change of model. The
    record keeps the run's preset and adds `values` to its overrides.
    `preset`, if named, must be the run's own. A run with no `config.json`
    yet has nothing to go on from: `preset` (None: the kind's default) with
    `values`, as for a new run.
    """
    values = dict(values or {})
    run = RunDir(run_dir, create=False) if os.path.isdir(run_dir) else None
    record = run_record(run, kind) if run else None
    if record is None:
        return presets.configured(kind, preset, values)
    trained = read_settings(run, KINDS[kind])
    if preset is not None and preset != record.get("preset"):
        raise InputError(f"{run_dir} was trained from preset {record.get('preset')!r}, not {preset!r}; resume it "
                         "without a preset (it goes on with its own settings) or use a new run directory "
                         "(--run-dir).")
    config = with_values(trained, values)
    overrides = {**(record.get("overrides") or {}), **{k: getattr(config, k) for k in values}}
    return config, {"kind": kind, "preset": record.get("preset"), "overrides": overrides}


def values_to_resume(run_dir, name, config_cls, values, kind=None):
    """`values` over the settings of `config_cls` that `run_dir`'s `name` (`config.json`, say) recorded.

    How a resumed call of a program without presets goes on as its run was
    set up: what the call does not give (epochs, data folder, seed, ...)
    comes from the run's record, what it gives changes it, and the program
    refuses a change of model. Without a readable record of `kind` (a
    missing run, nothing trained yet, another kind of run) it is `values`
    alone, and the program says what is wrong.
    """
    found = RunDir(run_dir, create=False).read_json(name) if os.path.isdir(run_dir) else None
    if found is None or (kind is not None and found.get("kind") != kind) or not isinstance(found.get("settings"), dict):
        return dict(values)
    fields = specs(config_cls)
    return {**{k: v for k, v in found["settings"].items() if k in fields}, **values}


def run_record(run, kind):
    """The run's `config.json` record, or None for a new run; an `InputError` if it is damaged or holds
    another kind of run (a new run never writes over what it cannot tell apart)."""
    record = run.read_json("config.json")
    if record is not None and record.get("kind") != kind:
        raise InputError(f"{run.path} holds a {record.get('kind') or 'unknown'} run; this needs a {kind} run "
                         "(use another run directory, --run-dir).")
    return record


def check_resumable(run, trained, config, names):
    """Whether `config` may go on from `run`'s checkpoints: the same `names` (the model) as `trained` (the
    settings of the run's state, or of its `config.json` if it stopped before writing a state) and the same
    loss scaling. Checked before `config.json` is written, so a refused call leaves the run's record as it was."""
    check_same_model(run, trained, config, names)
    check_same_loss_scaling(run, trained, config)


def check_same_loss_scaling(run, trained, config):
    """An `InputError` if `config.precision` and the run's (`trained`, a state's settings) differ in loss
    scaling: under mixed_float16 Keras wraps the optimizer of each trainer that differentiates a loss (every
    one but the CD trainers) in a `LossScaleOptimizer`, whose scale and step count the checkpoints hold, so
    they cannot resume without it, nor a run without it with it. float32 and mixed_bfloat16 scale no loss and
    may take each other's place."""
    was = trained.get("precision")
    if was is not None and (was == "mixed_float16") != (config.precision == "mixed_float16"):
        raise InputError(f"{run.path} was trained with precision {was!r}; its checkpoints hold "
                         f"{'the' if was == 'mixed_float16' else 'no'} loss scale of mixed_float16, so it cannot go on "
                         f"under {config.precision!r}. Resume it with precision {was!r} or use a new run directory "
                         "(--run-dir).")


def check_same_model(run, trained, config, names):
    """An `InputError` naming each of `names` whose value in `trained` (a state's settings) differs from `config`."""
    changed = [k for k in names if k in trained and trained[k] != getattr(config, k)]
    if changed:
        raise InputError(f"{run.path} was trained with other {', '.join(changed)} (was "
                         f"{', '.join(repr(trained[k]) for k in changed)}); resume it with the same values "
                         "or use a new run directory (--run-dir).")
