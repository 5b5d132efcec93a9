"""Declared settings, presets and `--set`: one declaration per field, read by every way in."""

import argparse
import dataclasses
import json
import re

import numpy as np
import pytest

from poecaps.experiments import cli, presets
from poecaps.experiments.configs import (
    KINDS,
    BaselineConfig,
    BaselineEvaluationConfig,
    EvaluationConfig,
    LayerwiseConfig,
)
from poecaps.experiments.settings import (
    SettingError,
    Spec,
    parse_assignment,
    setting,
    specs,
    with_values,
)

CONFIGS = [LayerwiseConfig, BaselineConfig, EvaluationConfig, BaselineEvaluationConfig]


@pytest.mark.parametrize("config_cls", CONFIGS)
def test_every_field_is_declared_with_help_and_a_range_or_choices(config_cls):
    for name, spec in specs(config_cls).items():
        assert spec.help.strip(), name
        if spec.kind in (int, float):
            assert (spec.minimum, spec.maximum, spec.above, spec.below) != (None,) * 4, name
        if spec.kind is str:
            assert spec.choices or name == "data_dir", name


def test_a_declaration_without_a_range_is_refused():
    with pytest.raises(TypeError, match="needs a range"):
        Spec(int, "a count")
    with pytest.raises(TypeError, match="needs choices"):
        Spec(str, "a name")
    with pytest.raises(SettingError, match="default must be an integer >= 1. Received: default=0"):
        setting(0, "a count", minimum=1)


@pytest.mark.parametrize("kind, text, value", [
    (int, " 7", 7), (float, "1e-3", 1e-3), (float, "2", 2.0), (bool, "false", False), (bool, "On", True),
    (str, "delta", "delta"),
])
def test_parse_reads_command_line_text(kind, text, value):
    rules = {"minimum": 0} if kind in (int, float) else {"choices": ("delta",)} if kind is str else {}
    parsed = Spec(kind, "x", **rules).parse("x", text)
    assert parsed == value and type(parsed) is kind


def test_numpy_numbers_are_taken_as_python_numbers_and_the_config_stays_json():
    config = LayerwiseConfig(num_capsules=np.int64(12), dropout=np.float32(0.25), cd_learning_rate=np.int32(2),
                             center_code=np.bool_(False))
    assert (config.num_capsules, config.dropout, config.cd_learning_rate, config.center_code) == (12, 0.25, 2.0, False)
    assert [type(v) for v in (config.num_capsules, config.dropout, config.cd_learning_rate, config.center_code)] == [
        int, float, float, bool]
    json.dumps(dataclasses.asdict(config))
    for values, message in (({"num_capsules": np.float64(12.0)}, "num_capsules must be an integer >= 1"),
                            ({"num_capsules": np.bool_(True)}, "num_capsules must be an integer >= 1"),
                            ({"center_code": np.int64(1)}, "center_code must be true or false"),
                            ({"dropout": np.float32("nan")}, "dropout must be a finite number >= 0 and < 1"),
                            ({"cd_learning_rate": 10**400}, "cd_learning_rate must be a finite number > 0")):
        with pytest.raises(SettingError, match=message):
            LayerwiseConfig(**values)


@pytest.mark.parametrize("value, shown", [
    (-3, "-3"), (np.int64(-3), "np.int64(-3)"), (np.float32(-0.5), "np.float32(-0.5)"),
    (10**400, "1" + "0" * 39 + "... (401 characters)")], ids=["int", "np.int64", "np.float32", "10**400"])
def test_a_value_given_from_python_is_shown_as_given_not_as_converted(value, shown):
    """Before, the refusal showed the float the value had been read as (`-3.0`), and all 401 digits of 10**400."""
    with pytest.raises(SettingError) as raised:
        LayerwiseConfig(cd_learning_rate=value)
    assert str(raised.value) == f"cd_learning_rate must be a finite number > 0. Received: cd_learning_rate={shown}"


@pytest.mark.parametrize("values, message", [
    ({"num_capsules": "0"}, "num_capsules must be an integer >= 1. Received: num_capsules=0"),
    ({"num_capsules": "2.5"}, "num_capsules must be an integer >= 1. Received: num_capsules='2.5'"),
    # a number out of range is shown as typed, not as read (1.5, inf)
    ({"dropout": "1.50"}, "dropout must be a finite number >= 0 and < 1. Received: dropout=1.50"),
    ({"cd_learning_rate": " 1e400"}, "cd_learning_rate must be a finite number > 0. Received: cd_learning_rate=1e400"),
    ({"dropout": "nan"}, "dropout must be a finite number >= 0 and < 1. Received: dropout=nan"),
    ({"center_code": "maybe"}, "center_code must be true or false. Received: center_code='maybe'"),
    ({"decoder_rule": ""}, "decoder_rule must be one of 'section41', 'delta'. Received: decoder_rule=''"),
    ({"limit": "none"}, None),
    ({"num_capsule": "3"}, "LayerwiseConfig has no setting 'num_capsule'. Did you mean num_capsules"),
    ({"sample_rows": "20", "routing_iterations": "-1"}, "routing_iterations must be an integer >= 0"),
])
def test_with_values_checks_each_value_by_its_declaration(values, message):
    if message is None:
        assert with_values(LayerwiseConfig(limit=5), values).limit is None
        return
    with pytest.raises(SettingError, match=message.replace("(", r"\(").replace(")", r"\)")):
        with_values(LayerwiseConfig(), values)


def test_a_none_word_stands_for_none_in_python_and_on_the_command_line():
    spec = Spec(float, "a weight, or auto", minimum=0.0, optional=True, none_word="auto")
    for value in ("auto", "none", " AUTO ", None):
        assert spec.parse("w", value) is None
    assert spec.check("w", "auto") is None and spec.check("w", 0.5) == 0.5
    with pytest.raises(SettingError, match="w must be a finite number >= 0, or auto. Received: w='x'"):
        spec.parse("w", "x")
    with pytest.raises(SettingError, match="w must be a finite number >= 0. Received: w='auto'"):
        Spec(float, "a weight", minimum=0.0).check("w", "auto")         # not optional: the word is text
    assert Spec(str, "a folder", optional=True).check("d", "none") == "none"  # in Python a path is a path


def test_python_construction_is_checked_by_the_same_declarations():
    with pytest.raises(SettingError, match="num_capsules must be an integer >= 1. Received: num_capsules=0"):
        LayerwiseConfig(num_capsules=0)
    assert LayerwiseConfig(cd_learning_rate=1).cd_learning_rate == 1.0           # ints read as floats
    assert type(LayerwiseConfig(cd_learning_rate=1).cd_learning_rate) is float
    with pytest.raises(SettingError, match="capsule_dim must divide filters"):
        LayerwiseConfig(capsule_dim=7)


def test_parse_assignment():
    assert parse_assignment("decoder-rule=delta") == ("decoder_rule", "delta")
    assert parse_assignment("data_dir=a=b") == ("data_dir", "a=b")
    with pytest.raises(SettingError, match="--set takes FIELD=VALUE. Received: 'decoder_rule'"):
        parse_assignment("decoder_rule")


def test_presets_are_configs_and_the_defaults_are_the_default_preset():
    assert presets.get("layerwise", "default") == LayerwiseConfig()
    assert presets.get("baseline", "sabour2017") == BaselineConfig()
    for kind, config_cls in KINDS.items():
        for name in presets.names(kind):
            assert isinstance(presets.get(kind, name), config_cls), name
    with pytest.raises(SettingError, match="Unknown layerwise preset 'hauser'; known: default, hauser2019"):
        presets.get("layerwise", "hauser")


@pytest.mark.parametrize("name", ["", 0, False, ["default"]])
def test_only_none_stands_for_the_default_preset(name):
    """Before, an empty name, 0 or False configured the default preset without a word (`name or DEFAULT`), and
    a list failed with Python's unhashable-type error."""
    assert presets.configured("layerwise", None)[1]["preset"] == "default"
    with pytest.raises(SettingError, match=re.escape(f"Unknown layerwise preset {name!r}; known: default")):
        presets.configured("layerwise", name)


def test_hauser2019_differs_from_the_default_preset_in_the_departures_its_docstring_lists():
    paper, default = presets.get("layerwise", "hauser2019"), presets.get("layerwise", "default")
    changed = {f.name for f in dataclasses.fields(LayerwiseConfig)
               if getattr(paper, f.name) != getattr(default, f.name)}
    assert changed == {"routing_iterations", "center_code", "sparsity_cost", "population_sparsity_cost",
                       "decoder_rule", "decoder_input", "decoder_length", "sample_domain", "sample_rows"}
    doc = presets.default.__doc__
    for name in changed - {"sample_rows"}:
        assert f"`{name}=" in doc, name
    assert (paper.routing_iterations, paper.decoder_rule, paper.center_code) == (3, "section41", False)


def test_baseline_presets_count_routing_rounds():
    assert presets.get("baseline", "sabour2017").routing_iterations == 3        # Sabour's r = 3
    small, full = presets.get("baseline", "hinton2018-small"), presets.get("baseline", "hinton2018")
    assert (small.model, small.em_size, small.routing_iterations) == ("em", "small", 3)
    assert (full.model, full.em_size) == ("em", "paper")


def test_config_from_args_applies_shortcuts_then_set_and_records_them():
    args = argparse.Namespace(preset="hauser2019", set=["decoder_rule=delta"], seed="4",
                              dataset="mnist", data_dir=None, limit=None)
    config, record = cli.config_from_args("layerwise", args, ("seed", "dataset", "data_dir", "limit"))
    assert config == dataclasses.replace(presets.get("layerwise", "hauser2019"), decoder_rule="delta", seed=4,
                                         dataset="mnist")
    assert record == {"kind": "layerwise", "preset": "hauser2019",
                      "overrides": {"seed": 4, "dataset": "mnist", "decoder_rule": "delta"}}


def test_a_research_scripts_flags_and_set_reach_its_config():
    from poecaps.experiments.configs import GenerativeConfig

    p = cli.parser("a research script", run_dir_default=None)
    cli.add_config_flags(p, GenerativeConfig, ("epochs", "seed"))
    cli.add_set_flag(p, GenerativeConfig)
    args = p.parse_args(["--epochs", "3", "--set", "iterations=4", "--set", "learning_rate=1e-2", "--set", "seed=7",
                         "--seed", "7"])
    config = cli.config_from_flags(GenerativeConfig, args)
    assert config == dataclasses.replace(GenerativeConfig(), epochs=3, iterations=4, learning_rate=0.01, seed=7)
    assert "  iterations = 10: EM iterations of every inference (an integer >= 1)" in p.format_help()
    with pytest.raises(SettingError, match="GenerativeConfig has no setting 'iteration'. Did you mean iterations"):
        cli.config_from_flags(GenerativeConfig, p.parse_args(["--set", "iteration=4"]))


def test_a_flags_help_shows_the_default_or_none_s_own_word():
    @dataclasses.dataclass(frozen=True)
    class Flags:
        steps: int = setting(5, "steps", minimum=1)
        l1: float = setting(None, "a weight, or auto", kind=float, minimum=0.0, none_word="auto")
        folder: str = setting(None, "a folder; none: the run's", kind=str)

    p = argparse.ArgumentParser()
    cli.add_config_flags(p, Flags)
    text = " ".join(p.format_help().split())
    assert "--steps VALUE steps (default: 5)" in text
    assert "--l1 VALUE a weight, or auto (default: auto)" in text
    assert "--folder VALUE a folder; none: the run's" in text and "(default: None)" not in text


def test_a_true_or_false_flag_alone_means_true_and_takes_a_word():
    from poecaps.experiments.configs import EvaluationConfig

    p = cli.parser("evaluate")
    cli.add_config_flags(p, EvaluationConfig, ("diagnostics", "rows"))
    read = {argv: cli.config_from_flags(EvaluationConfig, p.parse_args(argv)).diagnostics
            for argv in ((), ("--diagnostics",), ("--diagnostics", "false"), ("--diagnostics", "true"),
                         ("--diagnostics", "--rows", "3"))}
    assert read == {(): False, ("--diagnostics",): True, ("--diagnostics", "false"): False,
                    ("--diagnostics", "true"): True, ("--diagnostics", "--rows", "3"): True}
    assert "(default: false)" in " ".join(p.format_help().split())
    with pytest.raises(SettingError, match="diagnostics"):
        cli.config_from_flags(EvaluationConfig, p.parse_args(["--diagnostics", "maybe"]))

    shortcut = cli.parser("layer-wise", kind="layerwise", default_preset="default")
    cli.add_shortcuts(shortcut, "layerwise", ("persistent",))
    config, record = cli.config_from_args("layerwise", shortcut.parse_args(["--persistent"]), ("persistent",))
    assert config.persistent is True and record["overrides"] == {"persistent": True}


def test_a_setting_given_twice_with_two_values_is_refused_naming_both():
    """`--seed 3 --set seed=4` (or `--set seed=4 --seed 3`) took the --set value whatever the order on the line
    (flags are read first); it is a SettingError now. `--set` twice takes the last, as the line reads (a base
    command with an override appended); the same value twice, and distinct fields, pass."""
    declared = cli.shortcut_specs("baseline", ["seed", "epochs"])
    args = argparse.Namespace(seed="3", epochs=None, set=["seed=4"])
    with pytest.raises(SettingError, match=re.escape("seed is given twice, as --seed 3 and --set seed=4")):
        cli.flag_values(args, declared)
    args = argparse.Namespace(set=["batch-size=8", "batch_size=16"])
    assert cli.flag_values(args, {}) == {"batch_size": "16"}
    args = argparse.Namespace(seed="3", epochs="2", set=["seed=3", "lr=0.1"])
    assert cli.flag_values(args, declared) == {"seed": "3", "epochs": "2", "lr": "0.1"}


def test_a_setting_given_by_flag_and_set_in_two_spellings_of_one_value_passes():
    """`--persistent` (read as the text "true") with `--set persistent=True`, or `--cd-learning-rate 0.1` with
    `--set cd_learning_rate=0.10`, give one value: they were refused as two because the texts were compared.
    Two values in any spelling (`--persistent` with `--set persistent=no`) are still refused."""
    p = cli.parser("layer-wise", kind="layerwise", default_preset="default")
    cli.add_shortcuts(p, "layerwise", ("persistent", "cd_learning_rate"))
    names = ("persistent", "cd_learning_rate")
    config, _ = cli.config_from_args("layerwise", p.parse_args(
        ["--persistent", "--set", "persistent=True", "--cd-learning-rate", "0.1", "--set", "cd_learning_rate=0.10"]),
        names)
    assert config.persistent is True and config.cd_learning_rate == 0.1
    with pytest.raises(SettingError, match=re.escape("persistent is given twice, as --persistent true and --set "
                                                     "persistent=no")):
        cli.config_from_args("layerwise", p.parse_args(["--persistent", "--set", "persistent=no"]), names)
    with pytest.raises(SettingError, match="cd_learning_rate is given twice"):
        cli.config_from_args("layerwise", p.parse_args(["--cd-learning-rate", "0.1", "--set",
                                                        "cd_learning_rate=0.2"]), names)
    with pytest.raises(SettingError, match="cd_learning_rate is given twice"):     # not a number: not the same
        cli.config_from_args("layerwise", p.parse_args(["--cd-learning-rate", "0.1", "--set",
                                                        "cd_learning_rate=x"]), names)
