"""A resumed call goes on with the settings its run was trained with; what it gives changes them."""

import dataclasses
import json
import os
import re

import pytest

from poecaps.distribute import PRECISIONS
from poecaps.errors import InputError
from poecaps.experiments import presets
from poecaps.experiments.configs import GenerativeConfig, ProbabilisticTrainConfig
from poecaps.experiments.runs import (
    RunDir,
    check_same_loss_scaling,
    config_to_resume,
    values_to_resume,
)


def _trained(tmp_path, kind, preset, name="run", **overrides):
    """A run directory whose `config.json` is as the pipelines write it: kind, preset, overrides, every setting."""
    config = dataclasses.replace(presets.get(kind, preset), **overrides)
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"kind": kind, "preset": preset, "overrides": overrides,
                                                 "settings": dataclasses.asdict(config)}))
    return str(run)


def test_a_resumed_layerwise_run_keeps_its_preset_and_settings_and_takes_the_given_ones(tmp_path):
    run = _trained(tmp_path, "layerwise", "hauser2019", seed=3, encoder_epochs=7, dataset="mnist")
    config, record = config_to_resume(run, "layerwise", None, {"decoder_epochs": "4"})   # text, as --set gives it
    assert config == dataclasses.replace(presets.get("layerwise", "hauser2019"), seed=3, encoder_epochs=7,
                                         dataset="mnist", decoder_epochs=4)
    assert record == {"kind": "layerwise", "preset": "hauser2019",
                      "overrides": {"seed": 3, "encoder_epochs": 7, "dataset": "mnist", "decoder_epochs": 4}}
    # naming the run's own preset changes nothing; naming another is refused, saying which the run has
    assert config_to_resume(run, "layerwise", "hauser2019", {"decoder_epochs": 4}) == (config, record)
    with pytest.raises(InputError, match="trained from preset 'hauser2019', not 'default'"):
        config_to_resume(run, "layerwise", "default", {})
    with pytest.raises(InputError, match="holds a layerwise run"):          # another kind of run
        config_to_resume(run, "baseline", None, {})


def test_a_resumed_baseline_keeps_its_settings_and_a_bad_value_is_refused(tmp_path):
    run = _trained(tmp_path, "baseline", "hinton2018-small", epochs=5, seed=1)
    config, record = config_to_resume(run, "baseline", None, {"learning_rate": 1e-4})
    assert config == dataclasses.replace(presets.get("baseline", "hinton2018-small"), epochs=5, seed=1,
                                         learning_rate=1e-4)
    assert record["preset"] == "hinton2018-small"
    with pytest.raises(InputError, match="epochs"):
        config_to_resume(run, "baseline", None, {"epochs": 0})


def test_a_run_with_nothing_recorded_resumes_from_the_preset(tmp_path):
    # no directory, or one with nothing trained: the pipeline says "nothing trained yet" and starts from the preset
    for run in (str(tmp_path / "missing"), str(tmp_path)):
        config, record = config_to_resume(run, "layerwise", None, {"seed": 2})
        assert config == dataclasses.replace(presets.get("layerwise", "default"), seed=2)
        assert record == {"kind": "layerwise", "preset": "default", "overrides": {"seed": 2}}
        config, record = config_to_resume(run, "baseline", "hinton2018", {})
        assert config == presets.get("baseline", "hinton2018") and record["preset"] == "hinton2018"


def test_the_programs_without_presets_resume_with_their_records_settings(tmp_path):
    recorded = {"data_dir": "/data/mnist", "epochs": 100, "batch_size": 8, "learning_rate": 1e-3, "canvas": 28,
                "seed": 4, "specialisation": 0.0, "within_sparsity": 0.0, "between_sparsity": 0.0}
    (tmp_path / "config.json").write_text(json.dumps({"kind": "probabilistic-capsules", "settings": recorded}))
    found = values_to_resume(str(tmp_path), "config.json", ProbabilisticTrainConfig, {"epochs": "120", "tto_steps": 3},
                             "probabilistic-capsules")
    assert found == {**recorded, "epochs": "120", "tto_steps": 3}        # given values win, checked later
    # another kind of record, or none, gives the values alone (the program then says what is wrong)
    assert values_to_resume(str(tmp_path), "config.json", ProbabilisticTrainConfig, {"seed": 1}, "other") == {"seed": 1}
    assert values_to_resume(str(tmp_path / "none"), "config.json", GenerativeConfig, {"seed": 1}) == {"seed": 1}
    # a setting the config does not declare is not carried over
    (tmp_path / "layer.json").write_text(json.dumps({"settings": {"parents": 3, "retired": 1}}))
    assert values_to_resume(str(tmp_path), "layer.json", GenerativeConfig, {}) == {"parents": 3}


def test_the_command_lines_resume_with_the_runs_settings(tmp_path, monkeypatch):
    from poecaps.experiments import api, baseline_evaluation, baselines, commands

    seen = {}
    monkeypatch.setattr(api, "run_layerwise",
                        lambda config, run_dir, record, **kw: seen.update(layerwise=(config, record)))
    monkeypatch.setattr(baselines, "train_baseline", lambda config, run_dir, record, resume, test_limit: seen.update(
        baseline=(config, record, resume), test_limit=test_limit))
    monkeypatch.setattr(baseline_evaluation, "evaluate_baseline", lambda run_dir, evaluation: {})

    run = _trained(tmp_path, "layerwise", "default", seed=3, limit=256, dataset="mnist", encoder_epochs=10)
    commands._train_layerwise(["--run-dir", run, "--resume"])
    config, record = seen["layerwise"]
    assert (config.seed, config.limit, config.dataset, config.encoder_epochs) == (3, 256, "mnist", 10)
    commands._train_layerwise(["--run-dir", run, "--resume", "--set", "decoder_epochs=6"])
    assert seen["layerwise"][0] == dataclasses.replace(config, decoder_epochs=6)
    commands._train_layerwise(["--run-dir", str(tmp_path / "new"), "--seed", "3"])     # a new run: the preset
    assert seen["layerwise"][0] == dataclasses.replace(presets.get("layerwise", "default"), seed=3)
    assert seen["layerwise"][1]["preset"] == "default"

    run = _trained(tmp_path, "baseline", "faria2019-uniform", "capsnet", epochs=4, seed=2)
    commands._baseline(["--run-dir", run, "--resume", "--epochs", "6"])
    config, record, resume = seen["baseline"]
    assert config == dataclasses.replace(presets.get("baseline", "faria2019-uniform"), epochs=6, seed=2)
    assert record["preset"] == "faria2019-uniform" and record["overrides"] == {"epochs": 6, "seed": 2} and resume
    assert seen["test_limit"] is None
    commands._baseline(["--run-dir", run, "--resume", "--test-limit", "7"])      # each epoch's test images too
    assert seen["test_limit"] == 7


def test_evaluate_only_refuses_the_training_flags_by_name(tmp_path, monkeypatch):
    """`baseline.py --evaluate-only` evaluates the run as it was trained: a preset or a setting given is refused."""
    from poecaps.experiments import baseline_evaluation, baselines, commands
    from poecaps.experiments.settings import SettingError

    evaluated = []
    monkeypatch.setattr(baselines, "train_baseline", lambda *args, **kw: pytest.fail("--evaluate-only trained"))
    monkeypatch.setattr(baseline_evaluation, "evaluate_baseline",
                        lambda run_dir, evaluation: evaluated.append(evaluation.seed) or {})
    run = _trained(tmp_path, "baseline", "sabour2017", epochs=2)
    for flags, named in ((["--preset", "hinton2018-small"], "--preset"), (["--set", "epochs=3"], "--set"),
                         (["--resume"], "--resume"), (["--epochs", "3"], "--epochs"),
                         (["--preset", "sabour2017", "--limit", "8"], "--preset, --limit")):
        with pytest.raises(SettingError, match=f"it takes no {named}\\.$"):
            commands._baseline(["--run-dir", run, "--evaluate-only", *flags])
    assert evaluated == []
    commands._baseline(["--run-dir", run, "--evaluate-only", "--seed", "4"])   # --seed draws the affine set
    assert evaluated == [4]


@pytest.mark.parametrize("kind, preset, model_change", [("baseline", "sabour2017", {"routing_iterations": 2}),
                                                         ("layerwise", "default", {"filters": 32})])
def test_a_run_stopped_before_its_state_refuses_another_model_or_loss_scaling_and_keeps_its_record(
        tmp_path, monkeypatch, kind, preset, model_change):
    """A run stopped in its first epoch has a `config.json` and checkpoints but no `state.json`. Resumed with
    another model, or with or without mixed_float16's loss scale, it is refused by the setting's name before
    anything is written; before, it failed only at the checkpoint, after `config.json` had taken the new
    settings, so that resuming again without them failed too."""
    from poecaps.experiments import baselines, layerwise

    pipeline = baselines if kind == "baseline" else layerwise
    train = pipeline.train_baseline if kind == "baseline" else pipeline.train_layerwise
    monkeypatch.setattr(pipeline, "load_images", lambda *args: pytest.fail("not refused: it went on to the images"))
    run = _trained(tmp_path, kind, preset, precision="mixed_float16")
    with open(os.path.join(run, "config.json")) as handle:
        written = handle.read()
    (name, _), = model_change.items()
    was = getattr(presets.get(kind, preset), name)
    scaling = ("trained with precision 'mixed_float16'; its checkpoints hold the loss scale of mixed_float16, so "
               "it cannot go on under 'float32'")
    for values, message in ((model_change, f"trained with other {name} (was {was}); resume it with the same values"),
                            ({"precision": "float32"}, scaling)):
        config, record = config_to_resume(run, kind, None, values)
        with pytest.raises(InputError, match=re.escape(message)):
            train(config, run, record, resume=True)
        with open(os.path.join(run, "config.json")) as handle:
            assert handle.read() == written


@pytest.mark.parametrize("was", PRECISIONS)
@pytest.mark.parametrize("now", PRECISIONS)
def test_only_a_change_to_or_from_mixed_float16_is_refused_on_resuming(tmp_path, was, now):
    """mixed_float16 alone keeps a loss scale in the optimizer's state; float32 and mixed_bfloat16 keep none,
    so either may go on from the other's checkpoints."""
    config = dataclasses.replace(presets.get("baseline", "sabour2017"), precision=now)
    run = RunDir(str(tmp_path), create=False)
    refused = {("mixed_float16", "float32"), ("mixed_float16", "mixed_bfloat16"),
               ("float32", "mixed_float16"), ("mixed_bfloat16", "mixed_float16")}
    if (was, now) in refused:
        with pytest.raises(InputError, match=f"trained with precision '{was}'"):
            check_same_loss_scaling(run, {"precision": was}, config)
    else:
        check_same_loss_scaling(run, {"precision": was}, config)
    check_same_loss_scaling(run, {}, config)          # a run that recorded no precision: nothing to compare
