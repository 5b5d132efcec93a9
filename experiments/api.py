"""The Python API of a run: train from a preset, draw the result grid, evaluate.

    from poecaps.experiments import api

    run = api.train("runs/quick", preset="default", dataset="mnist", limit=2000)
    api.sample(run)          # run/samples.png, run/samples.npz
    print(api.evaluate(run)["result_grid"])

Each function takes the run directory; settings are the preset's, changed
by keyword (checked as `--set` checks them). The command lines call the
same functions.
"""

import time

from poecaps.experiments import presets
from poecaps.experiments.configs import STAGES
from poecaps.experiments.evaluation import evaluate_run
from poecaps.experiments.layerwise import train_layerwise
from poecaps.experiments.sampling import sample_run
from poecaps.experiments.settings import with_values


def layerwise_config(preset="default", **settings):
    """`(config, record)`: the layer-wise preset with `settings` changed, and what `config.json` keeps of it."""
    config = with_values(presets.get("layerwise", preset), settings)
    return config, {"kind": "layerwise", "preset": preset,
                    "overrides": {name: getattr(config, name) for name in settings}}


def train(run_dir, preset="default", stages=STAGES, resume=False, **settings):
    """Train the layer-wise stages of `preset` (with `settings` changed) into `run_dir`; returns `run_dir`."""
    config, record = layerwise_config(preset, **settings)
    train_layerwise(config, run_dir, record, stages=stages, resume=resume)
    return run_dir


def sample(run_dir, rows=None, domain=None, seed=0):
    """Draw the run's result grid (`samples.png`, `samples.npz`); returns the paths and shape."""
    return sample_run(run_dir, rows=rows, domain=domain, seed=seed)


def evaluate(run_dir, config=None):
    """Write and return the run's `eval.json` (`config`: an `EvaluationConfig`)."""
    return evaluate_run(run_dir, config)


def run_layerwise(config, run_dir, record=None, stages=STAGES, resume=False, evaluate=True):
    """The main job: `train_layerwise`, then the result grid and `eval.json`; returns `{stage: seconds}`."""
    timings = train_layerwise(config, run_dir, record, stages, resume)
    if evaluate:
        start = time.perf_counter()
        found = sample_run(run_dir)
        print(f"wrote {found['png']} and {found['npz']} (images {found['shape']}) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        evaluate_run(run_dir)
    return timings
