"""A small, seeded fuzz check: damaged data files and checkpoints, random run directories, random command
lines built from the declarations. Each must end in a correct result or one line of error, never a traceback."""

import dataclasses
import gzip
import json
import os

import keras
import numpy as np
import pytest

from poecaps import data
from poecaps.capsules import squash
from poecaps.errors import CheckpointError, InputError
from poecaps.experiments import commands, presets
from poecaps.experiments.settings import specs
from poecaps.experts import CapsuleExperts
from poecaps.trainers.cd import CDTrainer, default_optimizer
from poecaps.trainers.checkpoints import CheckpointManager
from poecaps.trainers.resumable import fit_resumable


def _mutants(raw, rng, count):
    """Byte flips (half of them in the first 32 bytes, where the headers are) and truncations of `raw`."""
    for _ in range(count):
        mutant = bytearray(raw)
        if rng.random() < 0.3:
            mutant = mutant[:int(rng.integers(0, len(raw)))]
        else:
            for _ in range(int(rng.integers(1, 9))):
                where = int(rng.integers(0, 32)) if rng.random() < 0.5 else int(rng.integers(0, len(raw)))
                mutant[where] = int(rng.integers(0, 256))
        yield bytes(mutant)


def test_damaged_idx_files_give_one_error_or_the_right_arrays(tmp_path, mnist_dir, record_tries):
    rng = np.random.default_rng(0)
    names = ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    raw = {}
    for name in names:
        with gzip.open(os.path.join(mnist_dir, name + ".gz")) as handle:
            raw[name] = handle.read()
    tried = 0
    for target in names:
        for k, mutant in enumerate(_mutants(raw[target], rng, 30)):
            folder = tmp_path / f"{target}-{k}"
            folder.mkdir()
            for name in names:
                content = mutant if name == target else raw[name]
                compressed = k % 3 != 0   # a third of them stored without gzip
                path = folder / (name + (".gz" if compressed else ""))
                path.write_bytes(gzip.compress(content) if compressed else content)
            if k % 5 == 4:   # and some with the gzip stream itself damaged
                path = folder / (target + ".gz")
                if path.exists():
                    stream = bytearray(path.read_bytes())
                    stream[len(stream) // 2] ^= 0xFF
                    path.write_bytes(bytes(stream))
            try:
                images, labels, _ = data.load_arrays("mnist", "test", str(folder), source="idx")
            except InputError as error:
                assert "\n" not in str(error) and str(folder) in str(error), str(error)
            else:
                assert len(images) == len(labels) and images.dtype == np.uint8
            tried += 1
    record_tries("data files (IDX)", "damaged files", tried)


def test_damaged_checkpoints_fall_back_or_give_one_error(tmp_path, record_tries):
    rng = np.random.default_rng(1)
    x = np.asarray(squash(rng.normal(size=(32, 6, 3)))).astype("float32")

    def trainer():
        keras.utils.set_random_seed(0)
        layer = CapsuleExperts(2, 4)
        layer.build((None, 6, 3))
        t = CDTrainer(layer)
        t.compile(optimizer=default_optimizer(0.05, 4))
        return t

    directory = str(tmp_path / "ckpt")
    fit_resumable(trainer(), x, epochs=2, batch_size=8, seed=0, checkpoint_dir=directory, save_every=3,
                  verbose=0)
    manager = CheckpointManager(directory, log=lambda *a: None)
    newest = manager.paths()[0]
    with open(newest, "rb") as handle:
        raw = handle.read()
    tried = 0
    for mutant in _mutants(raw, rng, 40):
        with open(newest, "wb") as handle:
            handle.write(mutant)
        try:
            header = manager.restore(trainer())
        except CheckpointError as error:
            assert "\n" not in str(error)
        else:
            assert header is not None and header["global_step"] in (4, 6, 8), header
        tried += 1
    record_tries("checkpoints", "damaged files", tried)


JUNK = ["", "-1", "0", "1", "2.5", "1e30", "nan", "true", "none", "delta", "winning", "mnist", "x" * 40, "[1]",
        "{}", "\u00e9t\u00e9", "3 4"]


@pytest.mark.usefixtures("quick_error_exits")
def test_random_command_lines_from_the_declarations(tmp_path, capsys, monkeypatch, record_tries):
    """1-4 settings set to values drawn from the declarations' own examples and from junk: the run gets
    exactly the values typed, or the command ends in one line of error naming a setting or flag."""
    from poecaps.experiments import api, baselines

    started = {}
    monkeypatch.setattr(api, "run_layerwise", lambda config, *a, **k: started.update(config=config))
    monkeypatch.setattr(baselines, "train_baseline", lambda config, *a, **k: started.update(config=config))
    from poecaps.experiments import baseline_evaluation
    monkeypatch.setattr(baseline_evaluation, "evaluate_baseline", lambda *a, **k: {})
    rng = np.random.default_rng(2)
    tried = {"train_layerwise.py": 0, "baseline.py": 0}
    for k in range(150):
        kind = ("layerwise", "baseline")[k % 2]
        script, main = (("train_layerwise.py", commands.train_layerwise) if kind == "layerwise"
                        else ("baseline.py", commands.baseline))
        preset = str(rng.choice(list(presets.names(kind))))
        declared = specs(presets.get(kind, preset))
        names = list(rng.choice(list(declared), size=int(rng.integers(1, 5)), replace=False))
        if rng.random() < 0.1:
            names.append("no_such_setting")
        values = {}
        for name in names:
            default = getattr(presets.get(kind, preset), name, None)
            pool = JUNK + ([str(default).lower()] if default is not None else [])
            values[name] = str(rng.choice(pool))
        argv = ["--preset", preset, "--run-dir", str(tmp_path / "run")]
        for name, value in values.items():
            argv += ["--set", f"{name}={value}"]
        started.clear()
        try:
            main(argv)
            code = 0
        except SystemExit as exit_info:
            code = exit_info.code
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        if code == 0:
            config = started["config"]
            for name, value in values.items():
                assert getattr(config, name) == declared[name].parse(name, value), (name, value)
        else:
            assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (argv, err)
            assert any(name in err[0] for name in values), (argv, err)
        tried[script] += 1
    for script, count in tried.items():
        record_tries(script, "random command lines", count)


@pytest.mark.usefixtures("quick_error_exits")
def test_random_run_directories(tmp_path, capsys, record_tries):
    """config.json and state.json of random content, models of random bytes: sample, evaluate and
    baseline evaluation answer in one line (none of these directories holds a usable run)."""
    rng = np.random.default_rng(3)
    valid = {"kind": "layerwise", "preset": "default", "overrides": {},
             "settings": dataclasses.asdict(presets.get("layerwise", "default"))}
    tried = 0
    for k in range(40):
        run = tmp_path / f"run{k}"
        (run / "models").mkdir(parents=True)
        choice = int(rng.integers(0, 5))
        record = json.loads(json.dumps(valid))
        if choice == 0:
            content = bytes(rng.integers(0, 256, size=int(rng.integers(0, 64))).astype("uint8"))
        elif choice == 1:
            scalars = [1, "x", None, [1, 2], True]
            content = json.dumps(scalars[int(rng.integers(0, len(scalars)))]).encode()
        elif choice == 2:
            name = str(rng.choice(list(record["settings"])))
            record["settings"][name] = str(rng.choice(JUNK))
            content = json.dumps(record).encode()
        elif choice == 3:
            record["kind"] = str(rng.choice(["baseline", "nope", ""]))
            content = json.dumps(record).encode()
        else:
            content = json.dumps(record).encode()
        (run / "config.json").write_bytes(content)
        for name in ("autoencoder", "encoder", "decoder", "model"):
            if rng.random() < 0.5:
                (run / "models" / f"{name}.keras").write_bytes(
                    bytes(rng.integers(0, 256, size=int(rng.integers(0, 200))).astype("uint8")))
        for main, extra in ((commands.sample, []), (commands.evaluate, []), (commands.baseline, ["--evaluate-only"])):
            with pytest.raises(SystemExit) as exit_info:
                main(["--run-dir", str(run), *extra])
            err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
            assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (k, err)
            tried += 1
    record_tries("sample.py, evaluate.py, baseline.py --evaluate-only", "random run directories", tried)
