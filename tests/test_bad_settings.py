"""Bad values for every declared setting, generated from the declarations, through every script.

For each field of each config, values outside its range, of the wrong type
and empty go through the command line that sets it, through every preset. Each
must end in one line, `error: ...` naming the field, exit status 2, and no
run directory written. A field declared without a range or choices cannot
exist (`Spec` refuses it), so no field escapes.
"""

import dataclasses
import os

import pytest

from poecaps.errors import InputError
from poecaps.experiments import commands, presets
from poecaps.experiments.configs import BaselineEvaluationConfig, EvaluationConfig, SampleConfig
from poecaps.experiments.settings import specs

pytestmark = pytest.mark.usefixtures("quick_error_exits")


def bad_values(spec):
    """Values the declaration must refuse: out of range, of the wrong type, empty (as command-line text)."""
    values = []
    if spec.kind in (int, float):
        step = 1 if spec.kind is int else 0.5
        values += [str(spec.minimum - step)] if spec.minimum is not None else []
        values += [str(spec.above)] if spec.above is not None else []
        values += [str(spec.maximum + step)] if spec.maximum is not None else []
        values += [str(spec.below)] if spec.below is not None else []
        values += ["ten", "1.5"] if spec.kind is int else ["ten", "nan", "inf"]
    elif spec.kind is bool:
        values += ["maybe", "2"]
    elif spec.choices:
        values += ["no-such-choice", spec.choices[0].upper() + "!"]
    return values + [""]


def _expect_one_error(capsys, run_main, argv, name, run_dir):
    with pytest.raises(SystemExit) as exit_info:
        run_main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith("error: ") and name in err[0], (argv, err)
    assert not os.path.exists(run_dir), argv


@pytest.fixture
def no_runs(monkeypatch):
    """Any run that starts fails the test: a bad value must stop before it."""
    from poecaps.experiments import api, baseline_evaluation, baselines, evaluation, sampling

    def started(*args, **kwargs):
        raise AssertionError("a run started on a bad setting")
    for module, name in ((api, "run_layerwise"), (baselines, "train_baseline"),
                         (baseline_evaluation, "evaluate_baseline"), (evaluation, "evaluate_run"),
                         (sampling, "sample_run")):
        monkeypatch.setattr(module, name, started)


@pytest.mark.parametrize("kind, script, main", [("layerwise", "train_layerwise.py", commands.train_layerwise),
                                                 ("baseline", "baseline.py", commands.baseline)])
def test_every_bad_value_of_every_setting_through_each_preset_is_one_error(tmp_path, capsys, no_runs, record_tries,
                                                                       kind, script, main):
    tried = 0
    for preset in presets.names(kind):
        for name, spec in specs(presets.get(kind, preset)).items():
            for value in bad_values(spec):
                run_dir = str(tmp_path / f"{preset}-{name}")
                _expect_one_error(capsys, main, ["--preset", preset, "--run-dir", run_dir, "--set",
                                                 f"{name}={value}"], name, run_dir)
                tried += 1
    record_tries(script, "bad values", tried)
    assert tried > 100


@pytest.mark.parametrize("config_cls, script, main, flags", [
    (EvaluationConfig, "evaluate.py", commands.evaluate, None),
    (SampleConfig, "sample.py", commands.sample, None),
    (BaselineEvaluationConfig, "baseline.py --evaluate-only", commands.baseline,
     {"test_limit": "--test-limit", "seed": "--seed"}),
])
def test_every_bad_value_of_a_scripts_own_flags_is_one_error(tmp_path, capsys, no_runs, record_tries,
                                                             config_cls, script, main, flags):
    tried = 0
    extra = ["--evaluate-only"] if "--evaluate-only" in script else []
    for name, spec in specs(config_cls).items():
        if flags is not None and name not in flags:
            continue
        flag = flags[name] if flags else "--" + name.replace("_", "-")
        for value in bad_values(spec):
            run_dir = str(tmp_path / name)
            _expect_one_error(capsys, main, ["--run-dir", run_dir, *extra, flag, value], name, run_dir)
            tried += 1
    record_tries(script, "bad values", tried)
    assert tried >= 3


def test_unknown_fields_and_malformed_assignments_are_one_error(tmp_path, capsys, no_runs):
    run_dir = str(tmp_path / "run")
    for argv, name in ((["--set", "num_capsule=3"], "num_capsules"), (["--set", "decoder_rule"], "--set"),
                       (["--preset", "hauser"], "--preset"), (["--stage", "encoderr"], "--stage"),
                       (["--set", "=3"], "--set")):
        _expect_one_error(capsys, commands.train_layerwise, ["--run-dir", run_dir, *argv], name, run_dir)


def test_the_bad_values_cover_every_rule_of_every_declaration():
    """Each bound and each choice list yields a value beyond it, so a new field is tried at once."""
    for config in [*(presets.get(k, n) for k in ("layerwise", "baseline") for n in presets.names(k)),
                   EvaluationConfig(), SampleConfig(), BaselineEvaluationConfig()]:
        for name, spec in specs(config).items():
            values = bad_values(spec)
            rules = [r for r in ("minimum", "maximum", "above", "below") if getattr(spec, r) is not None]
            assert len(values) >= len(rules) + 1, name
            for value in values:
                with pytest.raises(InputError, match=name):
                    spec.parse(name, value)
            assert dataclasses.is_dataclass(config)
