"""The command-line scripts end to end on real digits (small sizes)."""

import functools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["train_layerwise.py", "sample.py", "evaluate.py", "baseline.py"]


def _run(script, *args, stderr=False, code=0):
    """The script's stdout (and its stderr with `stderr=True`); it must exit with `code`."""
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                            check=False, capture_output=True, text=True, timeout=900)
    assert result.returncode == code, result.stdout[-2000:] + result.stderr[-3000:]
    return (result.stdout, result.stderr) if stderr else result.stdout


def _run_here(monkeypatch, capsys, script, *args, code=0):
    """As `_run(script, *args, stderr=True)`, in this process: the script's `main`, with `sys.argv` as the
    script would have it. Each script's first calls here run in a new interpreter; the calls after them
    need not pay its start (importing TensorFlow: 7 s of CPU on a slow CPU)."""
    from poecaps.experiments import commands

    main = {"train_layerwise.py": commands.train_layerwise, "evaluate.py": commands.evaluate,
            "baseline.py": commands.baseline}[script]
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "scripts", script), *args])
    status = 0
    try:
        main()
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    assert status == code, out[-2000:] + err[-3000:]
    return out, err


def _flags(help_text):
    return sorted(set(re.findall(r"(?m)^  (--[a-z0-9-]+)", help_text)) - {"--help"})


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_at_most_a_dozen_flags_and_the_presets(script):
    out = _run(script, "--help")
    flags = _flags(out)
    assert "--run-dir" in flags and len(flags) <= 12, flags
    if script in ("train_layerwise.py", "baseline.py"):
        assert {"--preset", "--set", "--seed", "--resume", "--dataset", "--data-dir"} <= set(flags)
        names = ["default", "hauser2019"] if script == "train_layerwise.py" else [
            "sabour2017", "hinton2018-small", "hinton2018"]
        for name in names:
            assert f"\n  {name}: " in out, name
        assert "  routing_iterations = " in out     # every setting is listed for --set


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_imports_no_tensorflow(script):
    """--help answers at once: the flags come from declarations; TensorFlow loads after parsing."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{script!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({os.path.join(ROOT, 'scripts', script)!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('loaded:', sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                            timeout=120)
    assert "--run-dir" in result.stdout
    assert result.stdout.rstrip().endswith("loaded: []"), result.stdout[-300:]


def _small(mnist_dir, run, *extra):
    # 8 hidden units: evaluation's exact log Z of the RBM sums 2^8 states, not the preset's 2^20 (the slowest
    # part of each evaluation here)
    return ["--run-dir", run, "--dataset", "mnist", "--data-dir", mnist_dir, "--seed", "3", "--limit", "256",
            *[a for pair in (("--set", f"{k}={v}") for k, v in (
                ("batch_size", 64), ("heldout_size", 64), ("filters", 16), ("num_capsules", 4),
                ("upper_dim", 4), ("encoder_epochs", 1), ("decoder_epochs", 1), ("jit_cd", "false"),
                ("sample_rows", 3), ("rbm_hidden", 8))) for a in pair], *extra]


@pytest.mark.slow
def test_main_job_trains_samples_evaluates_and_resumes(tmp_path, mnist_dir, monkeypatch, capsys):
    run = str(tmp_path / "run")
    out, err = _run("train_layerwise.py", *_small(mnist_dir, run), stderr=True)
    assert "[decoder] done" in err and "wrote " in err         # the progress goes to stderr
    printed = json.loads(out)                                   # stdout is the result alone
    assert printed["run_dir"] == run and list(printed["stage_seconds"]) == ["autoencoder", "encoder", "decoder", "rbm"]
    assert printed["samples"] == os.path.join(run, "samples.png") and printed["eval"] == os.path.join(run, "eval.json")
    for name in ("config.json", "state.json", "metrics.jsonl", "filters.png", "training_curves.png",
                 "models/autoencoder.keras", "models/encoder.keras", "models/decoder.keras",
                 "models/rbm.keras", "models/code_mean.npy", "models/mean_directions.npy",
                 "models/winning_axes.npy", "samples.png", "samples.npz", "eval.json", "reconstructions.png"):
        assert os.path.exists(os.path.join(run, name)), name
    with open(os.path.join(run, "config.json")) as handle:
        record = json.load(handle)
    assert record["kind"] == "layerwise" and record["preset"] == "default"
    assert record["overrides"] == {"seed": 3, "dataset": "mnist", "data_dir": mnist_dir, "limit": 256,
                                   "batch_size": 64, "heldout_size": 64, "filters": 16, "num_capsules": 4,
                                   "upper_dim": 4, "encoder_epochs": 1, "decoder_epochs": 1,
                                   "jit_cd": False, "sample_rows": 3, "rbm_hidden": 8}
    assert record["settings"]["decoder_rule"] == "delta" and record["settings"]["num_capsules"] == 4
    with np.load(os.path.join(run, "samples.npz")) as samples:
        assert samples["images"].shape == (3, 4, 28, 28, 1)
        assert str(samples["domain"]) == "winning" and int(samples["seed"]) == 0
    with open(os.path.join(run, "eval.json")) as handle:
        result = json.load(handle)
    assert result["result_grid"]["rows"] == 3 and result["result_grid"]["domain"] == "winning"
    assert "[evaluate] the result grid (samples.npz, winning domain, 3 rows): " in err

    resumed, err = _run("train_layerwise.py", *_small(mnist_dir, run, "--set", "encoder_epochs=2", "--resume",
                                                       "--no-evaluate"), stderr=True)
    assert err.count("already trained") == 4
    # resumed, every stage's seconds are the run's own (none trained by this call); nothing drawn or evaluated
    assert json.loads(resumed) == {**printed, "samples": None, "eval": None}
    with open(os.path.join(run, "state.json")) as handle:
        stages = json.load(handle)["stages"]
    with open(os.path.join(run, "config.json")) as handle:
        assert json.load(handle)["settings"]["encoder_epochs"] == 2   # the last call's settings
    assert {stage: stages[stage]["settings"]["encoder_epochs"] for stage in stages} == {
        "autoencoder": 1, "encoder": 1, "decoder": 1, "rbm": 1}   # each stage's own
    with open(os.path.join(run, "config.json")) as handle:
        before = json.load(handle)
    # --resume alone goes on with the run's own settings (seed 3, its data, 2 encoder epochs), not the preset's
    _, err = _run_here(monkeypatch, capsys, "train_layerwise.py", "--run-dir", run, "--resume", "--no-evaluate")
    assert err.count("already trained") == 4
    with open(os.path.join(run, "config.json")) as handle:
        assert json.load(handle) == before
    # another decoder rule is another decoder: refused, naming the setting
    _, err = _run_here(monkeypatch, capsys, "train_layerwise.py",
                       *_small(mnist_dir, run, "--set", "decoder_rule=section41", "--resume"), code=2)
    assert "decoder_rule" in err and "was 'delta'" in err and "Traceback" not in err

    _run("sample.py", "--run-dir", run, "--rows", "2", "--domain", "full", "--seed", "4")
    with np.load(os.path.join(run, "samples.npz")) as samples:
        assert samples["images"].shape == (2, 4, 28, 28, 1) and str(samples["domain"]) == "full"
        np.testing.assert_array_equal(samples["draws"], _draws(4, 2, 4, 4))

    diagnostics = ("autoencoder_only_mse", "one_capsule_reconstruction_class_accuracy",
                   "one_capsule_decoded_clusters", "one_capsule_decoded_side_clusters")
    assert not set(diagnostics) & set(result["poecaps"]) and "pixel_kmeans" not in result   # opt-in
    out, err = _run("evaluate.py", "--run-dir", run, "--rows", "5", "--draws", "3", "--diagnostics", "true",
                    stderr=True)
    result = json.loads(out)   # stdout is the JSON alone; the progress goes to stderr
    assert {k: result["evaluation"][k] for k in ("seed", "rows", "draws", "diagnostics")} == {
        "seed": 0, "rows": 5, "draws": 3, "diagnostics": True}                 # eval.json says how it was made
    for step in ("reference classifier", "linear probes", "one-capsule decodings and the autoencoder alone",
                 "pixel k-means reference (4 clusters)", "Bernoulli RBM"):
        assert f"[evaluate] {step}: " in err, err[-2000:]
    assert set(diagnostics) <= set(result["poecaps"]) and len(result["pixel_kmeans"]["clusters"]["size"]) == 4
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle) == result
    _check_sampler_draws(run, result["poecaps"], result["result_grid"], err)
    _check_class_mean_reference(run, result["class_mean_reference"])
    _check_groups(run, result)
    # training, its result grid and evaluation, the two resumed trainings, sample.py, evaluate.py; the refused
    # resume adds nothing
    _check_environment(run, ["train", "sample", "evaluate", "train", "train", "sample", "evaluate"],
                       ["train_layerwise.py"] * 5 + ["sample.py", "evaluate.py"])
    # a run without its grid or its RBM (not drawn, a stage not trained): evaluated without them, and says so
    for name in ("samples.npz", os.path.join("models", "rbm.keras")):
        os.remove(os.path.join(run, name))
    out, err = _run_here(monkeypatch, capsys, "evaluate.py", "--run-dir", run, "--rows", "2", "--draws", "1")
    assert "result_grid" not in json.loads(out) and "rbm" not in json.loads(out)
    assert "[evaluate] no samples.npz: the result grid is left out" in err
    assert "[evaluate] no trained Bernoulli RBM (models/rbm.keras): its figures are left out" in err


def _check_environment(run, actions, scripts):
    """`environment.jsonl` has a line per command that trained or evaluated, naming this machine's software."""
    import keras
    import tensorflow as tf

    with open(os.path.join(run, "environment.jsonl")) as handle:
        records = [json.loads(line) for line in handle]
    assert [r["action"] for r in records] == actions
    assert [os.path.basename(r["argv"][0]) for r in records] == scripts
    for record in records:
        assert (record["tensorflow"], record["keras"], record["numpy"]) == (tf.__version__, keras.__version__,
                                                                            np.__version__)
        assert record["logical_cpus"] == os.cpu_count() and 1 <= record["usable_cpus"] <= os.cpu_count()
        assert "/physical_device:CPU:0" in record["devices"]
        assert "cpu_id" in record          # the CPU's identity, or None where the system does not tell it


def _draws(seed, rows, capsules, dim):
    return np.random.default_rng(seed).standard_normal((rows, capsules, dim)).astype("float32")


def _classify(run, images):
    import keras

    classifier = keras.saving.load_model(os.path.join(run, "models", "reference_classifier.keras"))
    return np.argmax(classifier.predict(images.reshape(-1, 28, 28, 1), verbose=0), -1)


def _specialisation(labels):
    """Classes covered and mean purity of `[rows, J]` labels, by hand."""
    majority = [np.bincount(column).argmax() for column in labels.T]
    return len(set(majority)), np.mean([np.mean(column == m) for column, m in zip(labels.T, majority)])


def _check_sampler_draws(run, figures, grid, err):
    """`--draws 3`: draw k is CapsuleSampler(seed=k), labelled and counted here; the grid likewise."""
    from poecaps.experiments.configs import LayerwiseConfig
    from poecaps.experiments.runs import RunDir, read_settings
    from poecaps.experiments.trained import load_pipeline
    from poecaps.samplers import CapsuleSampler

    pipeline = load_pipeline(RunDir(run, create=False), read_settings(RunDir(run, create=False), LayerwiseConfig))
    for domain in ("full", "restricted", "winning"):
        draws = figures[f"samples_{domain}_draws"]
        assert draws["sampler_seeds"] == [0, 1, 2]
        for k in range(3):
            images = CapsuleSampler(pipeline, seed=k).sample(5, domain)["images"]
            covered, purity = _specialisation(_classify(run, images).reshape(5, -1))
            assert draws["classes_covered"][k] == covered
            np.testing.assert_allclose(draws["mean_purity"][k], purity, rtol=1e-6)
        assert f"[evaluate] N(0, I), {domain} domain, 3 draws: classes " in err
    with np.load(os.path.join(run, "samples.npz")) as samples:
        covered, purity = _specialisation(_classify(run, samples["images"]).reshape(2, -1))
    assert grid["classes_covered"] == covered and grid["domain"] == "full" and grid["rows"] == 2
    np.testing.assert_allclose(grid["mean_purity"], purity, rtol=1e-6)


def _check_class_mean_reference(run, reference):
    """Each class's mean training image, labelled here by the run's classifier."""
    from poecaps.experiments.configs import LayerwiseConfig
    from poecaps.experiments.runs import RunDir, load_images, read_settings

    config = read_settings(RunDir(run, create=False), LayerwiseConfig)
    train, labels, _ = load_images(config, "train")
    present = sorted(set(labels.tolist()))
    named = _classify(run, np.stack([train[labels == c].mean(0) for c in present]))
    assert reference["classes"] == present and reference["named"] == named.tolist()
    assert reference["named_as_itself"] == int(np.sum(named == present))
    assert reference["classes_covered"] == len(set(named.tolist()))


def _check_groups(run, result):
    """The groups by longest capsule and the share of training images each capsule wins, recomputed."""
    from poecaps.experiments.configs import LayerwiseConfig
    from poecaps.experiments.runs import RunDir, load_images, read_settings
    from poecaps.experiments.trained import load_pipeline
    from poecaps.graphs import batched

    config = read_settings(RunDir(run, create=False), LayerwiseConfig)
    pipeline = load_pipeline(RunDir(run, create=False), config)
    test, test_labels, _ = load_images(config, "test")
    train, _, _ = load_images(config, "train")
    winners = np.argmax(np.linalg.norm(batched(pipeline.encode, test), axis=-1), axis=1)
    clusters = result["poecaps"]["longest_capsule_clusters"]
    assert clusters["size"] == np.bincount(winners, minlength=4).tolist()
    for j in range(4):
        if clusters["size"][j]:
            counts = np.bincount(test_labels[winners == j], minlength=10)
            assert clusters["majority"][j] == int(np.argmax(counts))
            np.testing.assert_allclose(clusters["purity"][j], counts.max() / counts.sum())
    train_winners = np.argmax(np.linalg.norm(batched(pipeline.encode, train), axis=-1), axis=1)
    assert result["poecaps"]["training_images_longest"] == np.bincount(train_winners, minlength=4).tolist()
    sides = result["poecaps"]["longest_capsule_side_clusters"]
    assert [a + b for a, b in zip(sides["both_sides"]["size"][::2], sides["both_sides"]["size"][1::2])] \
        == clusters["size"]


def _baseline(mnist_dir, run, preset, *extra):
    """Train a baseline on 64 digits and evaluate on 64; its printed result."""
    out, err = _run("baseline.py", "--preset", preset, "--dataset", "mnist", "--data-dir", mnist_dir, "--run-dir", run,
                    "--seed", "1", "--limit", "64", "--set", "batch_size=32", "--test-limit", "64", *extra, stderr=True)
    # what the command prints as it works (the data, the epochs' figures) goes to stderr: stdout is the JSON alone
    assert "64 training images" in err and "accuracy: " in err, err[-2000:]
    return json.loads(out)


def _run_both(script, *args):
    return _run(script, *args, stderr=True)


def _evaluated_again(run, result, *extra, run_script=_run_both):
    """`--evaluate-only` on the saved network, run by `run_script` (which returns stdout and stderr); its
    result, checked to repeat `result`'s figures (the affine test set's only when drawn from the same seed)."""
    out, _ = run_script("baseline.py", "--run-dir", run, "--evaluate-only", "--test-limit", "64", *extra)
    again = json.loads(out)
    assert again["test_accuracy"] == result["test_accuracy"]
    if again["evaluation"]["seed"] == result["evaluation"]["seed"]:
        assert again["affine_accuracy"] == result["affine_accuracy"]
    return again


def _tensorboard_scalars(folder):
    """`{(tag, step): value}` of every scalar in a TensorBoard run's event files, read with TensorFlow's own reader."""
    import tensorflow as tf

    found = {}
    for name in sorted(os.listdir(folder)):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(folder, name)):
            for value in event.summary.value:
                found[(value.tag, event.step)] = float(tf.make_ndarray(value.tensor))
    return found


@pytest.mark.slow
def test_baseline_trains_resumes_and_evaluates(tmp_path, mnist_dir, monkeypatch, capsys):
    run = str(tmp_path / "sabour2017")
    _baseline(mnist_dir, run, "sabour2017", "--epochs", "1")
    result = _baseline(mnist_dir, run, "sabour2017", "--epochs", "2", "--resume")
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle)["test_accuracy"] == result["test_accuracy"]
    assert result["train"]["epochs_this_call"] == 1          # the first epoch was not redone
    assert set(result["rotation_accuracy"]) == {"0", "45", "90", "135", "180"}
    assert result["rotation_accuracy"]["0"] == result["test_accuracy"]    # rotating by 0 changes nothing
    assert result["routing_iterations"] == 3
    with open(os.path.join(run, "metrics.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    assert [line["epoch"] for line in lines] == [0, 1]
    # --test-limit 64: each epoch's test figures and the evaluation are on the same 64 test images
    assert result["test_images"] == result["train"]["test_images"] == 64
    assert [line["test_images"] for line in lines] == [64, 64]
    # the fit's validation data is the test split, and its figures say so
    assert all("test_accuracy" in line and not any(k.startswith("val_") for k in line) for line in lines)
    # TensorBoard's runs too: each epoch's figures as metrics.jsonl has them, validation under test/
    assert sorted(os.listdir(os.path.join(run, "logs"))) == ["test", "train"]
    for split, prefix in (("train", ""), ("test", "test_")):
        scalars = _tensorboard_scalars(os.path.join(run, "logs", split))
        for line in lines:
            assert scalars[("epoch_accuracy", line["epoch"])] == pytest.approx(line[prefix + "accuracy"], rel=1e-6)
            assert scalars[("epoch_loss", line["epoch"])] == pytest.approx(line[prefix + "loss"], rel=1e-6)
    with open(os.path.join(run, "config.json")) as handle:
        record = json.load(handle)
    assert record["preset"] == "sabour2017" and record["overrides"]["epochs"] == 2
    assert os.path.exists(os.path.join(run, "perturbations_0.png"))
    # evaluating alone gives the same figures; a layer-wise run is refused by name
    # (the affine test set is seed 0's, not the training seed's, so evaluating again repeats it)
    again = _evaluated_again(run, result)
    assert result["evaluation"]["seed"] == again["evaluation"]["seed"] == 0
    other = _evaluated_again(run, result, "--seed", "5", run_script=functools.partial(_run_here, monkeypatch, capsys))
    assert other["evaluation"]["seed"] == 5
    _, err = _run_here(monkeypatch, capsys, "evaluate.py", "--run-dir", run, code=2)
    assert "holds a baseline run; this needs a layerwise run" in err
    _check_environment(run, ["train", "evaluate", "train", "evaluate", "evaluate", "evaluate"], ["baseline.py"] * 6)


@pytest.mark.slow
def test_em_baseline_trains_under_xla_and_evaluates_again_from_its_saved_network(tmp_path, mnist_dir, monkeypatch,
                                                                                 capsys):
    """The EM preset through the same script (resuming is the sabour2017 test's: the code is shared)."""
    run = str(tmp_path / "hinton2018-small")
    result = _baseline(mnist_dir, run, "hinton2018-small", "--epochs", "1")
    assert (result["routing_iterations"], result["train"]["epochs_this_call"]) == (3, 1)
    with open(os.path.join(run, "config.json")) as handle:
        assert json.load(handle)["settings"]["jit_compile"] == "auto"      # XLA, as a user's EM run trains
    assert os.path.exists(os.path.join(run, "affine_examples.png"))
    _evaluated_again(run, result, run_script=functools.partial(_run_here, monkeypatch, capsys))
    _check_environment(run, ["train", "evaluate", "evaluate"], ["baseline.py"] * 3)
