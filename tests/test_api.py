"""The Python API's baselines and routing table: the records and figures the command lines write."""

import json
import os

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
    with pytest.raises(SettingError, match="epochs"):
        api.baseline(str(tmp_path / "bad"), epochs=0)


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
