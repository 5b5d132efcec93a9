"""The Python API of a run: train from a preset, draw the result grid, evaluate; the supervised baselines.

    from poecaps.experiments import api

    run = api.train("runs/quick", preset="default", dataset="mnist", limit=2000)
    api.sample(run)          # run/samples.png, run/samples.npz
    print(api.evaluate(run)["result_grid"])
    rbm = api.load(run, "rbm")                # a trained component, as Keras loads it

    figures = api.baseline("runs/capsnet", preset="sabour2017", epochs=2)   # trained, then eval.json
    results, table = api.compare_routing("runs/routing", epochs=1)          # the routing table

    # the research programs: Smith et al.'s model, and Kiefer et al.'s two on a trained CapsNet run
    table = api.probabilistic_capsules("runs/smith", data_dir="../shared/data/mnist-5k", epochs=100)
    layer = api.generative_capsules("runs/capsnet", epochs=5)              # runs/capsnet/generative/
    found = api.sparse_inference("runs/capsnet", l1=0.5)                    # runs/capsnet/inference/
    states = api.toy_routing("runs/toy")                                   # Kiefer et al.'s appendix B

Each function takes the run directory; settings are the preset's (or the
program's declared config's: `configs.ProbabilisticTrainConfig` and the
others), changed by keyword and checked as `--set` checks them, before any
work starts. The command lines call the same functions.
"""

import dataclasses
import os
import time

from poecaps.experiments import generative_capsules as generative
from poecaps.experiments import presets
from poecaps.experiments import probabilistic_capsules as study
from poecaps.experiments.baseline_evaluation import evaluate_baseline
from poecaps.experiments.baselines import train_baseline
from poecaps.experiments.capsnet_inference import infer_run
from poecaps.experiments.configs import (
    STAGES,
    BaselineEvaluationConfig,
    EvaluationConfig,
    GenerativeConfig,
    ProbabilisticTrainConfig,
    SparseInferenceConfig,
    ToyRoutingConfig,
    probabilistic_configs,
)
from poecaps.experiments.evaluation import evaluate_run
from poecaps.experiments.generative_capsules import train_generative
from poecaps.experiments.layerwise import train_layerwise
from poecaps.experiments.routing_comparison import compare_routing as _compare_routing
from poecaps.experiments.runs import config_to_resume, values_to_resume
from poecaps.experiments.sampling import sample_run
from poecaps.experiments.settings import SettingError, config_or_default, with_values
from poecaps.experiments.toy_routing import toy_routing as _toy_routing
from poecaps.experiments.trained import load_saved


def layerwise_config(preset="default", **settings):
    """`(config, record)`: the layer-wise preset with `settings` changed, and what `config.json` keeps of it."""
    return presets.configured("layerwise", preset, settings)


def train(run_dir, preset=None, stages=STAGES, resume=False, **settings):
    """Train the layer-wise stages of `preset` (None: "default") with `settings` changed into `run_dir`; returns
    `run_dir`. With `resume` the run goes on with its own settings, `settings` changed (`runs.config_to_resume`)."""
    config, record = (config_to_resume(run_dir, "layerwise", preset, settings) if resume
                      else presets.configured("layerwise", preset, settings))
    train_layerwise(config, run_dir, record, stages=stages, resume=resume)
    return run_dir


def sample(run_dir, rows=None, domain=None, seed=0):
    """Draw the run's result grid (`samples.png`, `samples.npz`); returns the paths and shape."""
    return sample_run(run_dir, rows=rows, domain=domain, seed=seed)


def evaluate(run_dir, config=None, **settings):
    """Write and return the run's `eval.json`: `config` (an `EvaluationConfig`, None: its defaults) with
    `settings` (its fields, as `scripts/evaluate.py` takes them: `rows=3`) changed."""
    return evaluate_run(run_dir, with_values(config_or_default(config, EvaluationConfig), settings))


def load(run_dir, component):
    """A trained component of any run, as Keras loads it from `run_dir/models/<component>.keras`.

    A layer-wise run holds "autoencoder", "encoder", "decoder", "rbm" (and
    after evaluation "reference_classifier"); a baseline run "model"; the
    research programs their own (`scripts/probabilistic_capsules.py`:
    "capsules", "vae"; the generative layer: "generative"). An unknown name
    is an `InputError` that lists what the run holds.
    """
    return load_saved(run_dir, component)


def run_layerwise(config, run_dir, record=None, stages=STAGES, resume=False, evaluate=True):
    """The main job: `train_layerwise`, then the result grid and `eval.json`.

    Returns what `scripts/train_layerwise.py` prints as its result: the run
    directory, the seconds of every trained stage in training order (a
    resumed run lists the stages trained before too), and the paths of
    `samples.png` and `eval.json` (None with `evaluate=False`).
    """
    seconds = train_layerwise(config, run_dir, record, stages, resume)
    result = {"run_dir": run_dir, "stage_seconds": {stage: round(s, 1) for stage, s in seconds.items()},
              "samples": None, "eval": None}
    if evaluate:
        start = time.perf_counter()
        found = sample_run(run_dir)
        print(f"wrote {found['png']} and {found['npz']} (images {found['shape']}) in "
              f"{time.perf_counter() - start:.1f} s", flush=True)
        evaluate_run(run_dir)
        result.update(samples=found["png"], eval=os.path.join(run_dir, "eval.json"))
    return result


def _evaluation(test_limit):
    return with_values(BaselineEvaluationConfig(), {"test_limit": test_limit})


def baseline(run_dir, preset=None, resume=False, test_limit=None, **settings):
    """Train a supervised baseline from `preset` (with `settings` changed) into `run_dir`, then evaluate it.

    As `scripts/baseline.py --preset PRESET --set FIELD=VALUE ...`: `config.json`
    records the preset (None: "sabour2017") and the changed settings; with
    `resume` the run goes on with its own settings, `settings` changed
    (`runs.config_to_resume`). `test_limit` uses only that many test
    images, spread over the split: each epoch's test figures and the
    evaluation. The affine test set is drawn from seed 0, whatever seed
    trains the network, as the script and `compare_routing` draw it.
    Returns the run's `eval.json` figures.
    """
    evaluation = _evaluation(test_limit)   # checked before any training, as the script does
    config, record = (config_to_resume(run_dir, "baseline", preset, settings) if resume
                      else presets.configured("baseline", preset, settings))
    train_baseline(config, run_dir, record, resume=resume, test_limit=evaluation.test_limit)
    return evaluate_baseline(run_dir, evaluation)


def compare_routing(root, rows=None, test_limit=None, **settings):
    """The routing table, as `scripts/compare_routing.py`: `(results {preset: eval.json}, the table as Markdown)`.

    Each row (`rows`: presets of `presets.routing_table()`, default all) is
    read, evaluated, resumed or trained in `root/<preset>` with `settings`
    changed in every row's preset.
    """
    return _compare_routing(root, settings, rows, _evaluation(test_limit))


def probabilistic_capsules(run_dir, resume=False, evaluate_only=False, jit_compile=True, **settings):
    """Smith et al.'s model and its VAE, as `scripts/probabilistic_capsules.py`; returns the run's `eval.json`.

    Trains both models into `run_dir` (`data_dir`, a folder of MNIST IDX
    files, is required; `resume` goes on with the run's own settings,
    `settings` changed), then refines at test time,
    probes and draws. `settings` are fields of `ProbabilisticTrainConfig`
    and `ProbabilisticEvaluationConfig` (`seed` sets both); with
    `evaluate_only` the trained run is only evaluated and a training
    setting is refused. `jit_compile`: XLA for the training steps.
    """
    if evaluate_only and resume:
        raise SettingError("evaluate_only evaluates the run as it was trained; it takes no resume.")
    if resume:
        settings = values_to_resume(run_dir, "config.json", ProbabilisticTrainConfig, settings, study.KIND)
    train, evaluation = probabilistic_configs(settings, evaluate_only)
    if not evaluate_only:
        study.train_run(run_dir, resume=resume, jit_compile=jit_compile, **dataclasses.asdict(train))
    return study.evaluate_run(run_dir, **dataclasses.asdict(evaluation))


def generative_capsules(capsnet_run_dir, resume=False, **settings):
    """A generative capsule layer on a CapsNet run's primary capsules, as `scripts/generative_capsules.py`.

    `settings` are fields of `GenerativeConfig`; `resume` goes on from the
    layer's newest checkpoint with the layer's own settings, `settings`
    changed. Writes `capsnet_run_dir/generative/` and returns its
    `generative.json`.
    """
    if resume:
        settings = values_to_resume(capsnet_run_dir, generative.SETTINGS, GenerativeConfig, settings, generative.KIND)
    config = with_values(GenerativeConfig(), settings)
    return train_generative(capsnet_run_dir, resume=resume, **dataclasses.asdict(config))


def sparse_inference(capsnet_run_dir, **settings):
    """Sparse iterative inference on a CapsNet run without routing, as `scripts/sparse_inference.py`.

    `settings` are fields of `SparseInferenceConfig` (`l1="auto"` or None,
    the default, chooses the weight on training digits). Writes
    `capsnet_run_dir/inference/` and returns its `inference.json`.
    """
    return infer_run(capsnet_run_dir, **dataclasses.asdict(with_values(SparseInferenceConfig(), settings)))


def toy_routing(run_dir, **settings):
    """Kiefer et al.'s appendix B toy, as `scripts/toy_routing.py`: the six final hidden states.

    `settings` are fields of `ToyRoutingConfig`. Writes
    `run_dir/toy_routing.png` and returns `{reading: {penalty: [x1, x2, x3]}}`.
    """
    return _toy_routing(run_dir, **dataclasses.asdict(with_values(ToyRoutingConfig(), settings)))
