"""Every state a run directory can be in, given to every script: one line of answer, never a traceback."""

import dataclasses
import json
import os
import re

import numpy as np
import pytest

from poecaps.experiments import baseline_evaluation, baselines, commands, layerwise
from poecaps.experiments.configs import BaselineConfig, LayerwiseConfig

pytestmark = pytest.mark.usefixtures("quick_error_exits")

TINY = {"filters": 4, "kernel_size": 3, "capsule_dim": 2, "num_capsules": 2, "upper_dim": 2, "batch_size": 8,
        "heldout_size": 4, "jit_cd": False, "encoder_epochs": 1, "decoder_epochs": 1}
TINY_SET = [a for k, v in TINY.items() for a in ("--set", f"{k}={str(v).lower()}")]


def _record(kind, config):
    return {"kind": kind, "preset": None, "overrides": {}, "settings": dataclasses.asdict(config)}


def _write(path, name, content):
    os.makedirs(os.path.dirname(os.path.join(path, name)) or path, exist_ok=True)
    with open(os.path.join(path, name), "w" if isinstance(content, str) else "wb") as handle:
        handle.write(content)


LAYERWISE = json.dumps(_record("layerwise", LayerwiseConfig(**TINY)))
BASELINE = json.dumps(_record("baseline", BaselineConfig()))


def _states(kind):
    """`{state: function(path) that makes it}` for a run directory that should hold a `kind` run."""
    own, other = (LAYERWISE, BASELINE) if kind == "layerwise" else (BASELINE, LAYERWISE)
    settings = json.loads(own)["settings"]
    return {
        "missing": lambda p: None,
        "a file": lambda p: _write(os.path.dirname(p), os.path.basename(p), "not a folder"),
        "empty": lambda p: os.makedirs(p),
        "unreadable config.json": lambda p: _write(p, "config.json", b"\x00{not json"),
        "config.json not an object": lambda p: _write(p, "config.json", "[1, 2, 3]"),
        "config.json of another kind": lambda p: _write(p, "config.json", other),
        "config.json of another version": lambda p: _write(p, "config.json", json.dumps(
            {**json.loads(own), "settings": {**settings, "pose_constraint": "none"}})),
        "config.json with a bad setting": lambda p: _write(p, "config.json", json.dumps(
            {**json.loads(own), "settings": {**settings, "batch_size": 0}})),
        "unreadable state.json": lambda p: (_write(p, "config.json", own), _write(p, "state.json", "{{{")),
        "state.json of another shape": lambda p: (_write(p, "config.json", own), _write(
            p, "state.json", json.dumps({"kind": kind, "stages": {"encoder": 3}, "settings": settings}
                                        if kind == "layerwise" else {"kind": kind, "settings": "x"}))),
        "models missing": lambda p: (_write(p, "config.json", own), os.makedirs(os.path.join(p, "models"))),
        "damaged models": lambda p: [_write(p, f"models/{name}.keras", b"PK\x03\x04 damaged")
                                     for name in ("autoencoder", "encoder", "decoder", "model")]
                                    + [_write(p, "config.json", own)],
        "checkpoint folders without checkpoints": lambda p: (
            _write(p, "config.json", own), os.makedirs(os.path.join(p, "checkpoints", "autoencoder")),
            os.makedirs(os.path.join(p, "checkpoints", "baseline"))),
    }


FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")      # a command-line flag named in a text


def _answer(capsys, main, argv):
    """(exit status, stdout, stderr lines) of a script's main; any other exception fails the test."""
    code = 0
    try:
        main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


@pytest.fixture
def tiny_data(monkeypatch):
    """Runs that start train on 16 random images of 9 x 9 (baselines: 28 x 28), and baselines take no step: nor
    do they measure their routing at initialisation or a step's peak memory (each compiled the preset's full
    network once per run directory)."""
    rng = np.random.default_rng(0)

    def load(config, split):
        side = 28 if isinstance(config, BaselineConfig) else 9
        images = rng.uniform(size=(16, side, side, 1)).astype("float32")
        return images, np.arange(16) % 10, "random"
    for module in (layerwise, baselines, baseline_evaluation):
        monkeypatch.setattr(module, "load_images", load)
    monkeypatch.setattr(baselines, "fit_resumable", lambda trainer, *a, **k: {"loss": [1.0]})
    monkeypatch.setattr(baselines, "_routing_now", lambda network, test, config: {})
    monkeypatch.setattr(baselines, "peak_step_bytes", lambda trainer, images, labels: None)


SCRIPTS = {
    "train_layerwise.py": (commands.train_layerwise, "layerwise", ["--no-evaluate", "--stage", "autoencoder"]),
    "train_layerwise.py --resume": (commands.train_layerwise, "layerwise",
                                    ["--resume", "--no-evaluate", "--stage", "autoencoder"]),
    "sample.py": (commands.sample, "layerwise", []),
    "evaluate.py": (commands.evaluate, "layerwise", []),
    "baseline.py --resume": (commands.baseline, "baseline", ["--resume", "--set", "epochs=1"]),
    "baseline.py --evaluate-only": (commands.baseline, "baseline", ["--evaluate-only"]),
}
# The states in which a script has nothing to refuse and runs (each with its note where it has one).
_FRESH = {"missing", "empty", "models missing", "checkpoint folders without checkpoints", "damaged models"}
RUNS = {("train_layerwise.py", s) for s in _FRESH | {"config.json of another version",
                                                      "config.json with a bad setting", "unreadable state.json",
                                                      "state.json of another shape"}}
RUNS |= {(script, s) for s in _FRESH for script in ("train_layerwise.py --resume", "baseline.py --resume")}
NOTES = {("train_layerwise.py --resume", "checkpoint folders without checkpoints"): "No checkpoint in ",
         ("train_layerwise.py --resume", "empty"): "Nothing trained yet in "}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_every_run_directory_state_gets_one_line(tmp_path, capsys, monkeypatch, tiny_data, record_tries, script):
    main, kind, extra = SCRIPTS[script]
    if script == "baseline.py --resume":   # a run that trains is evaluated elsewhere
        monkeypatch.setattr(baseline_evaluation, "evaluate_baseline", lambda run_dir, config=None: {"stub": 1})
    flags = set(FLAG.findall(_answer(capsys, main, ["--help"])[1]))
    tried = 0
    for state, make in _states(kind).items():
        run_dir = str(tmp_path / state.replace(" ", "_") / "run")
        os.makedirs(os.path.dirname(run_dir))
        make(run_dir)
        settings = TINY_SET if script.startswith("train") else []
        code, out, err = _answer(capsys, main, ["--run-dir", run_dir, *extra, *settings])
        tried += 1
        if (script, state) in RUNS:
            assert code in (0, None), (script, state, err)
            if (script, state) in NOTES:
                assert NOTES[script, state] in "\n".join(err), (script, state, err[-5:], out[-300:])   # progress: stderr
        else:
            assert code == 2, (script, state, code, out[-300:], err)
            assert len(err) == 1 and err[0].startswith("error: "), (script, state, err)
            assert set(FLAG.findall(err[0])) <= flags, (script, state, err)     # it names only flags it has
            assert "Traceback" not in out
    record_tries(script, "run-directory states", tried)


def test_a_routing_table_root_that_is_a_file_gets_one_line_naming_the_flag(tmp_path, capsys):
    root = tmp_path / "runs"
    root.write_text("not a folder")
    code, _, err = _answer(capsys, commands.compare_routing, ["--run-dir", str(root), "--row", "faria2019-uniform"])
    assert code == 2 and err == [f"error: {root} is a file; pass a folder as the runs' root (--run-dir)."], err
    assert "--run-dir" in _answer(capsys, commands.compare_routing, ["--help"])[1]


def test_the_routing_table_is_printed_alone_on_stdout(tmp_path, capsys, monkeypatch):
    # What the rows print as they train and evaluate goes to stderr, so `compare_routing.py > table.md` is the table.
    from poecaps.experiments import routing_comparison

    def compare_routing(root, settings, rows, evaluation):
        print("[routing table] faria2019-uniform: training into ...")
        return {}, "| router | accuracy |"
    monkeypatch.setattr(routing_comparison, "compare_routing", compare_routing)
    code, out, err = _answer(capsys, commands.compare_routing, ["--run-dir", str(tmp_path)])
    assert (code, out) == (0, "| router | accuracy |\n")
    assert err == ["[routing table] faria2019-uniform: training into ..."]


def test_a_run_keeps_the_last_entry_of_each_epoch_of_a_json_lines_file(tmp_path):
    # A resumed run may measure an epoch twice; its curve keeps the later entry, in epoch order.
    from poecaps.experiments.runs import RunDir

    run = RunDir(str(tmp_path / "run"))
    assert run.per_epoch("sub/curve.jsonl") == []                      # no file yet
    for entry in ({"epoch": 1, "model": "a", "x": 1}, {"epoch": 2, "model": "a", "x": 2},
                  {"epoch": 1, "model": "b", "x": 3}, {"epoch": 2, "model": "a", "x": 4},
                  {"epoch": 0, "model": "a", "x": 5}):
        run.append_jsonl("sub/curve.jsonl", entry)                      # the folder is made
    assert [e["x"] for e in run.per_epoch("sub/curve.jsonl", model="a")] == [5, 1, 4]
    assert [e["x"] for e in run.per_epoch("sub/curve.jsonl")] == [5, 3, 4]
    run.remove("sub/curve.jsonl")
    run.remove("sub/curve.jsonl")                                       # gone already: nothing to do
    assert run.per_epoch("sub/curve.jsonl") == []


def test_a_new_run_clears_the_earlier_runs_logs_and_says_so(tmp_path, capsys):
    from poecaps.experiments.runs import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.start_afresh(("metrics.jsonl",))                                # nothing there: nothing said
    assert capsys.readouterr().out == ""
    run.append_metrics({"epoch": 1})
    run.append_jsonl("faults.jsonl", {"step": 3})
    run.start_afresh(("metrics.jsonl", "faults.jsonl", "environment.jsonl"))
    assert not os.path.exists(run.file("metrics.jsonl")) and not os.path.exists(run.file("faults.jsonl"))
    said = capsys.readouterr().out.splitlines()
    assert said == [(f"A new run in {run.path}: the earlier run's checkpoints and logs there are replaced "
                     "(resuming, --resume, goes on with it instead).")]
    # checkpoints alone (an epoch written, no log yet) are an earlier run too; only those in the folder named count
    _write(run.checkpoints, os.path.join("capsnet", "ckpt-1.weights.h5"), b"\0")
    run.start_afresh(("metrics.jsonl",))
    assert capsys.readouterr().out.startswith(f"A new run in {run.path}: the earlier run's")
    run.start_afresh(("metrics.jsonl",), os.path.join(run.checkpoints, "generative"), "generative layer")
    assert capsys.readouterr().out == ""
    _write(run.checkpoints, os.path.join("generative", "ckpt-1.weights.h5"), b"\0")
    run.start_afresh(("metrics.jsonl",), os.path.join(run.checkpoints, "generative"), "generative layer")
    assert capsys.readouterr().out.startswith(f"A new generative layer in {run.path}: the earlier generative layer's")
    other = RunDir(str(tmp_path / "other"))
    os.makedirs(os.path.join(other.checkpoints, "capsnet"))
    other.start_afresh(("metrics.jsonl",))                              # empty folders hold no run
    assert capsys.readouterr().out == ""


def _snapshot(path):
    """`{relative path: bytes}` of every file under `path`."""
    found = {}
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                found[os.path.relpath(os.path.join(folder, name), path)] = handle.read()
    return found


def _earlier_run(path, record):
    """A run directory as a finished run leaves it: settings, logs, a checkpoint, a model."""
    _write(path, "config.json", record)
    _write(path, "metrics.jsonl", '{"epoch": 1}\n')
    _write(path, "environment.jsonl", '{"action": "train"}\n')
    _write(path, os.path.join("checkpoints", "autoencoder", "ckpt-1.weights.h5"), b"\0weights")
    _write(path, os.path.join("models", "model.keras"), b"PK\x03\x04 a model")


TRAINING = {
    "train_layerwise.py": (commands.train_layerwise, LAYERWISE, ["--dataset", "mnist", "--no-evaluate", *TINY_SET]),
    "baseline.py": (commands.baseline, BASELINE, ["--dataset", "mnist", "--epochs", "1"]),
    "probabilistic_capsules.py": (commands.probabilistic_capsules,
                                  json.dumps({"kind": "probabilistic-capsules", "settings": {"seed": 0}}), []),
}


@pytest.mark.parametrize("script", list(TRAINING))
def test_a_data_folder_that_cannot_be_read_leaves_the_earlier_run_as_it_was(tmp_path, capsys, script):
    # A new training call replaces the run it finds; a mistyped --data-dir must fail before it replaces anything.
    main, record, extra = TRAINING[script]
    run_dir, empty = str(tmp_path / "run"), str(tmp_path / "no_digits")
    os.makedirs(empty)
    _earlier_run(run_dir, record)
    before = _snapshot(run_dir)
    code, out, err = _answer(capsys, main, ["--run-dir", run_dir, "--data-dir", empty, *extra])
    assert code == 2 and len(err) == 1, (code, err)
    assert err[0].startswith("error: Could not load 'mnist' split 'train'") and empty in err[0], err
    assert "replaced" not in out + "\n".join(err)     # stdout, or stderr for a command that prints a result
    assert _snapshot(run_dir) == before


def test_a_capsnet_run_whose_images_are_gone_leaves_its_generative_layer_as_it_was(tmp_path, monkeypatch):
    from poecaps.errors import InputError
    from poecaps.experiments import generative_capsules
    from poecaps.experiments.runs import RunDir

    run_dir, gone = str(tmp_path / "capsnet"), str(tmp_path / "moved")
    config = BaselineConfig(dataset="mnist", data_dir=gone)
    monkeypatch.setattr(generative_capsules, "load_capsnet", lambda path: (RunDir(path), config, None))
    _write(run_dir, generative_capsules.SETTINGS, json.dumps({"kind": generative_capsules.KIND, "settings": {}}))
    _write(run_dir, generative_capsules.CURVE, '{"epoch": 1}\n')
    _write(run_dir, os.path.join("checkpoints", "generative", "ckpt-1.weights.h5"), b"\0weights")
    before = _snapshot(run_dir)
    with pytest.raises(InputError, match="Could not load 'mnist' split 'train'"):
        generative_capsules.train_generative(run_dir)
    assert _snapshot(run_dir) == before


FIRST_RUNS = {**{script: (main, extra) for script, (main, _, extra) in TRAINING.items()},
              "compare_routing.py": (commands.compare_routing, ["--dataset", "mnist", "--row", "faria2019-uniform"])}


@pytest.mark.parametrize("script", list(FIRST_RUNS))
def test_a_data_folder_that_cannot_be_read_leaves_no_new_run_folder(tmp_path, capsys, script):
    # A first training call that stops on its images leaves nothing behind, not an empty run skeleton.
    main, extra = FIRST_RUNS[script]
    run_dir, empty = str(tmp_path / "new" / "run"), str(tmp_path / "no_digits")
    os.makedirs(empty)
    code, _, err = _answer(capsys, main, ["--run-dir", run_dir, "--data-dir", empty, *extra])
    # one error line, last; before it at most the routing table's progress line for its row
    assert code == 2 and err[-1].startswith("error: Could not load 'mnist' split 'train'"), err
    assert all(line.startswith("[routing table] ") for line in err[:-1]), err
    assert not os.path.exists(tmp_path / "new")


def test_a_run_directory_made_later_is_made_by_make_only(tmp_path):
    from poecaps.errors import InputError
    from poecaps.experiments.runs import RunDir

    path = str(tmp_path / "run")
    run = RunDir(path, create="later")
    assert run.read_json("config.json") is None and not os.path.exists(path)    # readable before it exists
    run.make()
    assert sorted(os.listdir(path)) == ["checkpoints", "logs", "models"]
    run.write_json("config.json", {"kind": "x"})
    assert RunDir(path, create=False).read_json("config.json") == {"kind": "x"}
    for create in ("yes", 1, None):
        with pytest.raises(InputError, match='create must be True, False or "later"'):
            RunDir(path, create=create)


def _evaluations(gone):
    """`{name: (module, the name it loads its run by, what that returns for a path, call)}` of the commands
    that read a trained run and its images; each finds the images moved to `gone`."""
    from poecaps.experiments import capsnet_inference, evaluation, probabilistic_capsules
    from poecaps.experiments.runs import RunDir

    capsnet = BaselineConfig(dataset="mnist", data_dir=gone)
    return {
        "evaluate.py": (evaluation, "load_pipeline", lambda *a: None, evaluation.evaluate_run),
        "baseline.py --evaluate-only": (baseline_evaluation, "load_component", lambda *a: None,
                                        baseline_evaluation.evaluate_baseline),
        "probabilistic_capsules.py evaluate": (
            probabilistic_capsules, "load_trained",
            lambda path: (RunDir(path, create=False), {"data_dir": gone, "canvas": 40}, None, None),
            probabilistic_capsules.evaluate_run),
        "sparse_inference.py, l1 given": (capsnet_inference, "load_capsnet",
                                          lambda path: (RunDir(path, create=False), capsnet, None),
                                          lambda path: capsnet_inference.infer_run(path, l1=0.1)),
        "sparse_inference.py, l1 calibrated": (capsnet_inference, "load_capsnet",
                                               lambda path: (RunDir(path, create=False), capsnet, None),
                                               capsnet_inference.infer_run),
    }


@pytest.mark.parametrize("command", list(_evaluations("moved")))
def test_a_trained_run_whose_images_are_gone_is_left_as_it_was_by_the_commands_that_read_it(
        tmp_path, monkeypatch, command):
    # No line in environment.jsonl, no folder, no file for a command that stopped before it read an image.
    from poecaps.errors import InputError

    run_dir, gone = str(tmp_path / "run"), str(tmp_path / "moved")
    module, name, loaded, call = _evaluations(gone)[command]
    monkeypatch.setattr(module, name, loaded)
    settings = (LayerwiseConfig(**TINY, dataset="mnist", data_dir=gone) if command == "evaluate.py"
                else BaselineConfig(dataset="mnist", data_dir=gone))
    kind = "layerwise" if command == "evaluate.py" else "baseline"
    _write(run_dir, "config.json", json.dumps(_record(kind, settings)))
    _write(run_dir, os.path.join("models", "model.keras"), b"PK\x03\x04 a model")
    _write(run_dir, "environment.jsonl", '{"action": "train"}\n')
    before = _snapshot(run_dir)
    with pytest.raises(InputError, match="Could not load 'mnist' split"):
        call(run_dir)
    assert _snapshot(run_dir) == before and sorted(os.listdir(run_dir)) == ["config.json", "environment.jsonl",
                                                                            "models"]


@pytest.mark.parametrize("stages", ["autoencoder", [], None])
def test_layerwise_training_refuses_stages_it_would_misread_and_leaves_the_run(tmp_path, stages):
    """Before, one stage name as a string was refused as eleven unknown stages, one per letter, and an empty
    list replaced the run's checkpoints and logs with a run that trained nothing."""
    _write(str(tmp_path), "checkpoints/autoencoder/kept", "earlier run")
    with pytest.raises(layerwise.InputError, match=r"^stages must be a non-empty list of stages among "):
        layerwise.train_layerwise(LayerwiseConfig(**TINY), str(tmp_path), stages=stages)
    assert os.listdir(tmp_path / "checkpoints" / "autoencoder") == ["kept"]


@pytest.mark.parametrize("stages, message", [
    (["encoder"], (r"^The 'encoder' stage starts from a trained autoencoder, and .* has none; train the "
                  r"'autoencoder' stage first \(or with it\)\.$")),
    (["decoder", "rbm"], (r"^The 'decoder' stage starts from a trained autoencoder and encoder, .* train the "
                         r"'autoencoder', 'encoder' stages first")),
])
def test_layerwise_training_refuses_a_stage_without_its_prerequisites_and_leaves_the_run(tmp_path, stages,
                                                                                         message):
    """Before, the run's logs and checkpoints were discarded first and the stage then failed on the missing
    model: `--stage decoder` on a run whose autoencoder alone was trained lost the autoencoder's curves."""
    _write(str(tmp_path), "checkpoints/autoencoder/kept", "earlier run")
    _write(str(tmp_path), "metrics.jsonl", "{}\n")
    with pytest.raises(layerwise.InputError, match=message):
        layerwise.train_layerwise(LayerwiseConfig(**TINY), str(tmp_path), stages=stages)
    assert os.listdir(tmp_path / "checkpoints" / "autoencoder") == ["kept"]
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"
    # A trained autoencoder in the run's models is enough for the encoder stage (checked before any work).
    _write(str(tmp_path), "models/autoencoder.keras", "")
    layerwise._check_prerequisites(layerwise.RunDir(str(tmp_path), create=False), ["encoder"])
    with pytest.raises(layerwise.InputError, match=r"starts from a trained encoder, "):
        layerwise._check_prerequisites(layerwise.RunDir(str(tmp_path), create=False), ["decoder"])


def test_layerwise_training_trains_each_given_stage_once_in_training_order(tmp_path, monkeypatch):
    """Stages given out of order, or twice, train each once with an encoder after its autoencoder (before, in
    the order given: the encoder before the autoencoder it reads, the decoder twice)."""
    trained = []
    monkeypatch.setattr(layerwise, "load_images", lambda config, split: (np.zeros((8, 28, 28, 1), "float32"),
                                                                          None, "zeros"))
    monkeypatch.setattr(layerwise, "train_stage", lambda stage, *args: trained.append(stage))
    monkeypatch.setattr(layerwise, "train_rbm", lambda *args: trained.append("rbm"))
    seconds = layerwise.train_layerwise(LayerwiseConfig(**TINY), str(tmp_path),
                                        stages=["rbm", "decoder", "encoder", "autoencoder", "decoder"])
    assert trained == ["autoencoder", "encoder", "decoder", "rbm"] == list(seconds)
