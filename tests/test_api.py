"""The Python API's baselines and routing table: the records and figures the command lines write."""

import json
import os
import re

import pytest


@pytest.mark.slow
def test_baseline_records_its_preset_and_evaluates_as_the_script_does(tmp_path, mnist_dir):
    from poecaps.experiments import api
    from poecaps.experiments.settings import SettingError

    run = str(tmp_path / "capsnet")
    settings = {"dataset": "mnist", "data_dir": mnist_dir, "limit": 16, "epochs": 1, "batch_size": 16, "seed": 2}
    found = api.baseline(run, preset="sabour2017", test_limit=16, **settings)
    with open(os.path.join(run, "config.json")) as handle:
        record = json.load(handle)
    assert (record["kind"], record["preset"], record["overrides"]) == ("baseline", "sabour2017", settings)
    assert record["settings"]["routing_iterations"] == 3                   # the preset's, unchanged
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle) == json.loads(json.dumps(found))
    # the affine test set is seed 0's whatever seed trained the network, as the script draws it, so
    # evaluating the run again, as `scripts/baseline.py --evaluate-only` does, gives the same figures
    from poecaps.experiments.baseline_evaluation import evaluate_baseline
    from poecaps.experiments.configs import BaselineEvaluationConfig

    assert found["evaluation"]["seed"] == 0
    assert evaluate_baseline(run, BaselineEvaluationConfig(test_limit=16)) == found
    _check_spread_test_images(run, found, mnist_dir, 16)
    with pytest.raises(SettingError, match="epochs"):
        api.baseline(str(tmp_path / "bad"), epochs=0)


def _check_spread_test_images(run, found, mnist_dir, limit):
    """`test_limit`: `limit` test images spread over the split, for the evaluation and for each epoch's test
    figures. mnist-5k's test split is ordered by class: its first 16 images are all 0s, so the first `limit`
    would test one class; spread, they hold every class."""
    import keras
    import numpy as np

    from poecaps import data

    test, labels, _ = data.load_arrays("mnist", "test", mnist_dir)
    assert set(labels[:limit].tolist()) == {0}
    pick = [round(k * (len(test) - 1) / (limit - 1)) for k in range(limit)]   # 0, 66.6 -> 67, ..., 999
    assert set(labels[pick].tolist()) == set(range(10))
    network = keras.saving.load_model(os.path.join(run, "models", "model.keras"))
    scores = network.predict(data.to_float(test[pick]), verbose=0)["scores"]
    accuracy = float(np.mean(np.argmax(scores, -1) == labels[pick]))
    assert found["test_images"] == found["train"]["test_images"] == limit
    assert found["test_accuracy"] == accuracy
    with open(os.path.join(run, "metrics.jsonl")) as handle:
        last = [json.loads(line) for line in handle][-1]      # the last epoch's, on the weights saved
    assert last["test_images"] == limit
    assert last["test_accuracy"] == pytest.approx(accuracy, rel=1e-6)      # Keras' float32 mean of k / limit


def test_a_test_limit_takes_images_spread_over_the_split_and_refuses_a_count_below_one():
    import numpy as np

    from poecaps.errors import InputError
    from poecaps.experiments.runs import limit_test_split

    images, labels = np.arange(10.0)[:, None] * 10, np.arange(10) // 5       # ordered by class: 0 x 5, 1 x 5
    picked, classes = limit_test_split(images, labels, 4)
    # 0, 9/3, 18/3, 9: rows 0, 3, 6 and 9, two of each class
    np.testing.assert_array_equal(picked[:, 0], [0, 30, 60, 90])
    np.testing.assert_array_equal(classes, [0, 0, 1, 1])
    assert limit_test_split(images, labels, 1)[0].tolist() == [[0.0]]
    assert limit_test_split(images, labels, np.int64(25))[0].shape == (10, 1)      # more than the split: all
    assert limit_test_split(images, labels, None)[0] is images
    for bad in (0, -2, 2.0, True, "3"):
        with pytest.raises(InputError, match=rf"^test_limit must be an integer >= 1, or None for every test "
                                             rf"image\. Received: {re.escape(repr(bad))}$"):
            limit_test_split(images, labels, bad)


def test_compare_routing_passes_its_rows_settings_and_evaluation_on(tmp_path, monkeypatch):
    from poecaps.experiments import api

    seen = {}

    def compare_routing(*args):
        seen["args"] = args
        return {}, "table"

    monkeypatch.setattr(api, "_compare_routing", compare_routing)
    assert api.compare_routing(str(tmp_path), rows=["faria2019-uniform"], test_limit=5, epochs=2) == ({}, "table")
    root, settings, rows, evaluation = seen["args"]
    assert (root, settings, rows) == (str(tmp_path), {"epochs": 2}, ["faria2019-uniform"])
    assert (evaluation.test_limit, evaluation.seed) == (5, 0)


def test_the_research_programs_check_their_settings_before_any_work(tmp_path):
    from poecaps.experiments import api
    from poecaps.experiments.settings import SettingError

    run = tmp_path / "run"
    refusals = [
        (lambda: api.probabilistic_capsules(str(run), data_dir="d", epochs=0), "epochs must be an integer >= 1"),
        (lambda: api.probabilistic_capsules(str(run), data_dir="d", tto_learning_rate=0.0),
         "tto_learning_rate must be a finite number > 0"),
        (lambda: api.probabilistic_capsules(str(run), data_dir="d", within_sparsity=float("inf")),
         "within_sparsity must be a finite number >= 0"),
        # a field of neither config, with the close one named
        (lambda: api.probabilistic_capsules(str(run), data_dir="d", tto_step=3),
         ("Neither ProbabilisticTrainConfig nor ProbabilisticEvaluationConfig has a setting 'tto_step'. Did you "
          "mean tto_steps")),
        # a trained run is evaluated as it was trained
        (lambda: api.probabilistic_capsules(str(run), evaluate_only=True, canvas=28), "it takes no canvas"),
        (lambda: api.probabilistic_capsules(str(run), evaluate_only=True, resume=True), "it takes no resume"),
        (lambda: api.generative_capsules(str(run), parent_dim=0), "parent_dim must be an integer >= 1"),
        (lambda: api.generative_capsules(str(run), parent=3), "Did you mean parents"),
        (lambda: api.sparse_inference(str(run), l1=-0.5), "l1 must be a finite number >= 0"),
        (lambda: api.sparse_inference(str(run), steps=2.5), "steps must be an integer >= 1"),
        (lambda: api.toy_routing(str(run), learning_rate=-1), "learning_rate must be a finite number > 0"),
        (lambda: api.toy_routing(str(run), step=3), "ToyRoutingConfig has no setting 'step'. Did you mean steps"),
        # before, the baseline trained first and refused its test_limit only when it came to evaluate
        (lambda: api.baseline(str(run), test_limit=0), "test_limit must be an integer >= 1"),
        (lambda: api.compare_routing(str(run), test_limit=-2), "test_limit must be an integer >= 1"),
    ]
    for call, message in refusals:
        with pytest.raises(SettingError, match=message):
            call()
    assert not run.exists()                                   # refused before a directory was made
    # the evaluation's own settings are accepted with evaluate_only (the missing run is then what is refused)
    from poecaps.errors import InputError

    with pytest.raises(InputError, match="No run directory"):
        api.probabilistic_capsules(str(run), evaluate_only=True, seed=3, tto_steps=1)


def test_sample_checks_rows_domain_and_seed_before_reading_the_run(tmp_path):
    """Before, the run was read and its models loaded first: a missing run was all one heard of a bad setting,
    and with a run the sampler refused it only after the load."""
    from poecaps.errors import InputError
    from poecaps.experiments import api

    missing = str(tmp_path / "missing")
    for settings, message in [({"rows": 0}, r"^rows must be an integer >= 1, or None. Received: rows=0$"),
                              ({"rows": 2.5}, "rows=2.5"),
                              ({"domain": "half"}, r"^domain must be one of 'full', 'restricted', 'winning'"),
                              ({"seed": -1}, r"^seed must be an integer >= 0. Received: seed=-1$")]:
        with pytest.raises(InputError, match=message):
            api.sample(missing, **settings)
    with pytest.raises(InputError, match="No run directory"):           # good settings: the run is read
        api.sample(missing, rows=2, domain="winning", seed=3)


def test_toy_routing_refuses_a_file_for_its_folder_before_running(tmp_path, monkeypatch):
    """Before, the six settings ran first and then `os.makedirs` failed: '[Errno 17] File exists'."""
    from poecaps import inference
    from poecaps.errors import InputError
    from poecaps.experiments import api

    def ran(*args, **kwargs):
        raise AssertionError("the toy ran before its folder was checked")
    monkeypatch.setattr(inference, "toy_states", ran)
    path = tmp_path / "a_file"
    path.write_text("")
    with pytest.raises(InputError, match=r"^The run directory .*a_file is a file; pass a folder \(--run-dir\)\.$"):
        api.toy_routing(str(path))


@pytest.mark.parametrize("call", ["train", "sample", "evaluate", "baseline", "compare_routing", "sparse_inference",
                                  "generative_capsules", "toy_routing", "load"])
def test_every_api_function_refuses_a_run_directory_that_is_not_a_path(call):
    """Before, a number or None failed inside os.path with TypeError ('expected str, bytes or os.PathLike
    object'), and '' failed in os.makedirs, read as no run, or (`compare_routing`) began training the table's
    first row into the working directory."""
    from poecaps.errors import InputError
    from poecaps.experiments import api

    extra = ("rbm",) if call == "load" else ()
    for path in (5, None, ""):
        with pytest.raises(InputError, match=rf"must be a path \(a str or os.PathLike, --run-dir\)\. Received: "
                                             rf"{re.escape(repr(path))}$"):
            getattr(api, call)(path, *extra)


def test_the_research_functions_defaults_are_their_configs():
    # Called directly, the experiment functions default to what the scripts and the API declare.
    import dataclasses
    import inspect

    from poecaps.experiments import (
        capsnet_inference,
        generative_capsules,
        probabilistic_capsules,
        toy_routing,
    )
    from poecaps.experiments.configs import (
        GenerativeConfig,
        ProbabilisticEvaluationConfig,
        ProbabilisticTrainConfig,
        SparseInferenceConfig,
        ToyRoutingConfig,
    )

    pairs = [(probabilistic_capsules.train_run, ProbabilisticTrainConfig),
             (probabilistic_capsules.evaluate_run, ProbabilisticEvaluationConfig),
             (generative_capsules.train_generative, GenerativeConfig),
             (capsnet_inference.infer_run, SparseInferenceConfig),
             (toy_routing.toy_routing, ToyRoutingConfig)]
    for function, config_cls in pairs:
        parameters = inspect.signature(function).parameters
        for field in dataclasses.fields(config_cls):
            default = parameters[field.name].default
            assert default == field.default, (function.__name__, field.name)


def test_load_returns_a_runs_trained_component_and_names_what_the_run_holds(tmp_path):
    import numpy as np

    from poecaps import partition
    from poecaps.errors import InputError
    from poecaps.experiments import api
    from poecaps.experiments.runs import RunDir
    from poecaps.models.saving import save_component
    from poecaps.rbm import BernoulliRBM

    run = RunDir(str(tmp_path / "run"))
    rbm = BernoulliRBM(3, seed=1)
    rbm.build((None, 5))
    rbm.set_weights([np.random.default_rng(0).normal(size=w.shape) for w in rbm.get_weights()])
    save_component(rbm, f"{run.models}/rbm.keras")
    open(f"{run.models}/encoder.tmp.keras", "w").close()         # a save cut short is not a component
    loaded = api.load(run.path, "rbm")
    assert isinstance(loaded, BernoulliRBM)
    for saved, found in zip(rbm.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(saved, found)
    assert partition.exact_log_partition(loaded, verbose=0) == partition.exact_log_partition(rbm, verbose=0)
    with pytest.raises(InputError, match=r"has no trained component 'encoder'; it holds 'rbm'\."):
        api.load(run.path, "encoder")
    with pytest.raises(InputError, match="no trained component yet"):
        api.load(RunDir(str(tmp_path / "empty")).path, "rbm")
    with pytest.raises(InputError, match="No run directory"):
        api.load(str(tmp_path / "missing"), "rbm")


def test_the_evaluations_take_their_config_or_its_fields_and_refuse_anything_else(tmp_path, monkeypatch):
    """Before, a dict given as the config failed with an AttributeError inside the evaluation, after the
    reference classifier had started training; `api.evaluate` now also takes the config's fields by keyword."""
    from poecaps.experiments import api, baseline_evaluation, evaluation
    from poecaps.experiments.configs import EvaluationConfig
    from poecaps.experiments.settings import SettingError

    seen = []
    monkeypatch.setattr(api, "evaluate_run", lambda run_dir, config: seen.append(config))
    api.evaluate("run", rows=3)
    api.evaluate("run", EvaluationConfig(seed=2), draws=1)
    api.evaluate("run")
    assert seen == [EvaluationConfig(rows=3), EvaluationConfig(seed=2, draws=1), EvaluationConfig()]
    with pytest.raises(SettingError, match="EvaluationConfig has no setting 'row'. Did you mean rows"):
        api.evaluate("run", row=3)
    run = str(tmp_path / "run")
    for call in (lambda: api.evaluate(run, {"rows": 3}), lambda: evaluation.evaluate_run(run, {"rows": 3}),
                 lambda: baseline_evaluation.evaluate_baseline(run, EvaluationConfig())):
        with pytest.raises(SettingError, match=r"^config must be an? \w*EvaluationConfig \(or None for its defaults\)"
                                               r"\. Received: (dict|EvaluationConfig)$"):
            call()
