"""The research scripts (routing table, sparse inference, generative and probabilistic capsules, the toy): flags, bad runs and runs."""

import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESEARCH = ["compare_routing.py", "sparse_inference.py", "generative_capsules.py", "toy_routing.py",
            "probabilistic_capsules.py"]
ON_A_CAPSNET_RUN = ["sparse_inference.py", "generative_capsules.py"]


def _run(script, *args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], check=False,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("script", RESEARCH)
def test_help_lists_at_most_a_dozen_flags(script):
    result = _run(script, "--help")
    assert result.returncode == 0 and "usage:" in result.stdout
    flags = {line.split()[0] for line in result.stdout.splitlines() if line.startswith("  --")} - {"--help"}
    assert "--run-dir" in flags and len(flags) <= 12, flags


def _one_error_line(result):
    assert result.returncode == 2, result.stdout[-1000:] + result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith(("error:", "usage:"))
              or ": error:" in line]
    assert errors, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.mark.parametrize("script", ON_A_CAPSNET_RUN)
def test_a_missing_run_or_one_without_a_capsnet_gets_one_line(script, tmp_path):
    assert "--run-dir" in _one_error_line(_run(script))
    assert "No run directory" in _one_error_line(_run(script, "--run-dir", str(tmp_path / "missing")))
    em_run = tmp_path / "em"                        # a baseline run of matrix capsules: its record, no model
    shutil.copytree(os.path.join(ROOT, "docs", "results", "baselines", "hinton2018_small_mnist5k"), em_run)
    assert "holds no trained CapsNet (model em)" in _one_error_line(_run(script, "--run-dir", str(em_run)))


def test_generative_capsules_and_sparse_inference_check_their_settings():
    for flag in ("--parents", "--parent-dim", "--epochs"):
        stderr = _one_error_line(_run("generative_capsules.py", "--run-dir", "r", flag, "0"))
        assert f"{flag[2:].replace('-', '_')} must be an integer >= 1" in stderr
    for flag, value, message in (("--examples", "0", "examples must be an integer >= 1"),
                                 ("--steps", "x", "steps must be an integer >= 1"),
                                 ("--l1", "-1", "l1 must be a finite number >= 0, or auto"),
                                 ("--set", "shown=0", "shown must be an integer >= 1")):
        assert message in _one_error_line(_run("sparse_inference.py", "--run-dir", "r", flag, value))
    assert "iterations must be an integer >= 1" in _one_error_line(
        _run("generative_capsules.py", "--run-dir", "r", "--set", "iterations=0"))


def test_probabilistic_capsules_checks_its_flags_and_runs(tmp_path):
    script = "probabilistic_capsules.py"
    assert "--data-dir" in _one_error_line(_run(script, "--run-dir", str(tmp_path / "r")))
    for flag in ("--epochs", "--batch-size", "--canvas"):
        assert f"{flag[2:].replace('-', '_')} must be an integer >= 1" in _one_error_line(
            _run(script, "--data-dir", "d", flag, "0"))
    assert "learning_rate must be a finite number > 0" in _one_error_line(
        _run(script, "--data-dir", "d", "--learning-rate", "0"))
    assert "tto_steps must be an integer >= 0" in _one_error_line(_run(script, "--data-dir", "d", "--tto-steps", "-1"))
    # every other setting through --set, read by the same declarations
    assert "specialisation must be a finite number >= 0" in _one_error_line(
        _run(script, "--data-dir", "d", "--set", "specialisation=-1"))
    for name, value in (("between", "-1"), ("within", "nan"), ("between", "inf")):
        assert f"{name}_sparsity must be a finite number >= 0" in _one_error_line(
            _run(script, "--data-dir", "d", "--set", f"{name}_sparsity={value}"))
    assert "Did you mean tto_steps" in _one_error_line(_run(script, "--data-dir", "d", "--set", "tto_step=3"))
    assert "--set takes FIELD=VALUE" in _one_error_line(_run(script, "--data-dir", "d", "--set", "epochs"))
    assert "it takes no epochs" in _one_error_line(_run(script, "--evaluate-only", "--epochs", "3"))
    assert "it takes no specialisation" in _one_error_line(_run(script, "--evaluate-only", "--set", "specialisation=1"))
    assert "No run directory" in _one_error_line(_run(script, "--evaluate-only", "--run-dir", str(tmp_path / "no")))
    baseline = tmp_path / "baseline"                    # another kind of run: named, where it read "no trained"
    shutil.copytree(os.path.join(ROOT, "docs", "results", "baselines", "hinton2018_small_mnist5k"), baseline)
    assert "holds a baseline run, not a probabilistic capsule model" in _one_error_line(
        _run(script, "--evaluate-only", "--run-dir", str(baseline)))
    os.makedirs(tmp_path / "empty")
    assert "no trained probabilistic capsule model" in _one_error_line(
        _run(script, "--evaluate-only", "--run-dir", str(tmp_path / "empty")))
    digits = _tiny_idx(tmp_path / "digits")
    assert "canvas must be at least" in _one_error_line(
        _run(script, "--run-dir", str(tmp_path / "small"), "--data-dir", digits, "--canvas", "20"))


def _tiny_idx(directory, count=16):
    """IDX files of `count` 28x28 digits (a bar at a class-dependent place) for both splits."""
    os.makedirs(directory)
    rng = np.random.default_rng(0)
    labels = (np.arange(count) % 4).astype("uint8")
    images = np.zeros((count, 28, 28), "uint8")
    for i, label in enumerate(labels):
        images[i, 4 + 5 * label:8 + 5 * label, 6:22] = rng.integers(128, 256)
    for prefix in ("train", "t10k"):
        with gzip.open(os.path.join(directory, f"{prefix}-images-idx3-ubyte.gz"), "wb") as handle:
            handle.write((2051).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (count, 28, 28))
                         + images.tobytes())
        with gzip.open(os.path.join(directory, f"{prefix}-labels-idx1-ubyte.gz"), "wb") as handle:
            handle.write((2049).to_bytes(4, "big") + count.to_bytes(4, "big") + labels.tobytes())
    return str(directory)


@pytest.mark.slow
def test_probabilistic_capsules_trains_resumes_and_evaluates(tmp_path, capsys):
    # In one process (the command line's flags and errors are tested above): train one epoch, resume to two.
    import keras

    from poecaps import metrics
    from poecaps.errors import InputError
    from poecaps.experiments import api
    from poecaps.experiments import probabilistic_capsules as study

    digits, run = _tiny_idx(tmp_path / "digits"), str(tmp_path / "run")
    study.train_run(run, epochs=1, batch_size=8, canvas=28, data_dir=digits, jit_compile=False)
    # the Python API resumes to two epochs and evaluates, as the script does
    # (the other training settings, data folder included, are the run's own: config.json's)
    found = api.probabilistic_capsules(run, resume=True, jit_compile=False, epochs=2, tto_steps=2)
    with open(os.path.join(run, "train.json")) as handle:
        train = json.load(handle)
    assert [e["epoch"] for e in train["curve"]] == [1, 2]          # epoch 1 from the first call, 2 from the resumed one
    assert "Already trained" not in capsys.readouterr().out
    with pytest.raises(InputError, match="other between_sparsity"):
        study.train_run(run, epochs=3, batch_size=8, canvas=28, data_dir=digits, resume=True, between_sparsity=1.0)
    assert train["settings"]["epochs"] == 2 and 0 < train["generative_parameters"] < 30000
    assert (train["settings"]["batch_size"], train["settings"]["canvas"]) == (8, 28)
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle) == json.loads(json.dumps(found))
    assert set(found["probe_accuracy"]) == {"t0", "t0_A0", "t0_logits", "t0_logits_A0", "vae"}
    assert set(found["probe_accuracy"]["t0"]) == {"0", "45", "90", "135", "180", "affine", "up_to_45", "up_to_90",
                                                  "up_to_135", "up_to_180"}
    assert found["test_time_optimisation"]["images"] == 16 and found["test_time_optimisation"]["steps"] == 2
    for name in ("templates", "reconstructions", "rotation", "samples", "training_curves"):
        assert os.path.getsize(os.path.join(run, f"{name}.png")) > 0
    assert train["figure"] == os.path.join(run, "training_curves.png")
    with open(os.path.join(run, "environment.jsonl")) as handle:    # the refused resume adds no line
        assert [json.loads(line)["action"] for line in handle] == ["train", "train", "evaluate"]
    # the probe studies' loader: the table's training features, read here without XLA from the encoders
    _, capsules, vae, (x_train, y_train), (x_test, y_test), table_train = study.load_study(run, 0)
    assert x_train.shape == x_test.shape == (16, 28, 28, 1) and len(y_train) == len(y_test) == 16
    parameters = capsules.variational_parameters(x_train)
    t0, a0 = np.asarray(keras.ops.sigmoid(parameters["top_logits"])), np.asarray(parameters["top_pose"])
    # float32 through the encoders' ~20 layers, summed in another order under XLA: 1e-4
    np.testing.assert_allclose(table_train["t0"], t0, atol=1e-4)
    np.testing.assert_allclose(table_train["t0_A0"], np.hstack([t0, a0.reshape(16, -1)]), atol=1e-4)
    # the logits: sigmoid's slope is at most 1/4, so the same error in t0 is up to 4 times larger before it
    logits = np.asarray(parameters["top_logits"])
    np.testing.assert_allclose(table_train["t0_logits"], logits, atol=4e-4)
    np.testing.assert_allclose(table_train["t0_logits_A0"], np.hstack([logits, a0.reshape(16, -1)]), atol=4e-4)
    np.testing.assert_allclose(table_train["t0"], 1 / (1 + np.exp(-table_train["t0_logits"])), atol=1e-6)
    # and, with the table's own features of the upright test digits, give its figure for t0
    t0_test = study._batched(study._features(capsules, vae), x_test)["t0"]
    assert metrics.linear_probe(table_train["t0"], y_train, t0_test, y_test) == found["probe_accuracy"]["t0"]["0"]


@pytest.mark.parametrize("names, message", [
    ("faria2019-em", r"rows must be a non-empty list of the table's presets, or None.*Received: 'faria2019-em'$"),
    ([], r"rows must be a non-empty list.*Received: \[\]$"),
    (["faria2019-em", "nope"], r"^nope is not a preset of the routing network"),
    # named by the argument the Python API and the script call them by; a number or an item that is not a name
    # failed with TypeError ("object of type 'int' has no len()", "sequence item 0: expected str")
    (5, r"^rows must be a non-empty list.*Received: 5$"),
    ([["faria2019-em"]], r"^\['faria2019-em'\] is not a preset of the routing network"),
])
def test_routing_table_refuses_rows_it_would_misread(tmp_path, names, message):
    """Before, an empty list trained every row of the table (as None does), and one name as a string was
    refused as twelve unknown presets, one per character."""
    from poecaps.errors import InputError
    from poecaps.experiments import routing_comparison as table

    with pytest.raises(InputError, match=message):
        table.compare_routing(str(tmp_path / "table"), {}, names)
    assert not (tmp_path / "table").exists()


@pytest.mark.slow
def test_routing_table_reads_evaluates_resumes_or_retrains_each_row(tmp_path, monkeypatch):
    # One row (no routing: the cheapest) on 16 tiny digits, 1 step per epoch; each call finds the run
    # in another state: evaluated, trained only, stopped while training, or trained with other settings.
    from poecaps.experiments import routing_comparison as table

    digits, root = _tiny_idx(tmp_path / "digits"), str(tmp_path / "table")
    run = os.path.join(root, "faria2019-uniform")
    settings = {"dataset": "mnist", "data_dir": digits, "epochs": 2, "jit_compile": "false", "shards": 1}
    evaluation = table.BaselineEvaluationConfig(test_limit=16)
    real_train, real_evaluate = table.train_baseline, table.evaluate_baseline
    calls = []

    def train(config, run_dir, record, resume=False, test_limit=None):
        calls.append(("train", resume, test_limit))      # the evaluation's test images, each epoch's too
        return real_train(config, run_dir, record, resume=resume, test_limit=test_limit)

    def evaluate(run_dir, config):
        calls.append(("evaluate",))
        return real_evaluate(run_dir, config)

    def crash(run_dir, config):
        raise RuntimeError("stopped before the evaluation")

    def state():
        with open(os.path.join(run, "state.json")) as handle:
            return json.load(handle)

    monkeypatch.setattr(table, "train_baseline", train)
    monkeypatch.setattr(table, "evaluate_baseline", crash)
    with pytest.raises(RuntimeError):                    # trained two epochs, stopped before its evaluation
        table.compare_routing(root, settings, ["faria2019-uniform"], evaluation)
    assert calls == [("train", False, 16)] and state()["epochs_this_call"] == 2
    assert not os.path.exists(os.path.join(run, "eval.json"))

    monkeypatch.setattr(table, "evaluate_baseline", evaluate)
    calls.clear()                                        # trained: evaluated, not trained again
    results, printed = table.compare_routing(root, settings, ["faria2019-uniform"], evaluation)
    assert calls == [("evaluate",)] and state()["epochs_this_call"] == 2
    assert "| faria2019-uniform |" in printed and results["faria2019-uniform"]["routing"]["router"] == "uniform"

    calls.clear()                                        # evaluated: read
    again, _ = table.compare_routing(root, settings, ["faria2019-uniform"], evaluation)
    assert calls == [] and again == results

    fewer = table.BaselineEvaluationConfig(test_limit=8)   # evaluated with other evaluation settings: evaluated again
    other, _ = table.compare_routing(root, settings, ["faria2019-uniform"], fewer)
    assert calls == [("evaluate",)] and other["faria2019-uniform"]["test_images"] == 8
    assert results["faria2019-uniform"]["test_images"] == 16
    calls.clear()

    for name in ("state.json", "eval.json"):             # stopped while training, after its checkpoints
        os.remove(os.path.join(run, name))
    table.compare_routing(root, settings, ["faria2019-uniform"], evaluation)
    assert calls == [("train", True, 16), ("evaluate",)]
    assert state()["epochs_this_call"] == 0              # went on from the last checkpoint: nothing left

    calls.clear()                                        # other settings: trained again from the start
    table.compare_routing(root, {**settings, "seed": 1}, ["faria2019-uniform"], evaluation)
    assert calls == [("train", False, 16), ("evaluate",)] and state()["epochs_this_call"] == 2


@pytest.mark.slow
def test_the_generative_layer_and_sparse_inference_run_on_a_trained_capsnet(tmp_path):
    # Both studies end to end on a CapsNet trained without routing, as their scripts' runs are, at toy sizes.
    from poecaps.errors import InputError
    from poecaps.experiments import api, capsnet_inference, generative_capsules
    from poecaps.experiments.baselines import train_baseline
    from poecaps.experiments.configs import BaselineConfig
    from poecaps.experiments.runs import load_images
    from poecaps.experiments.trained import load_capsnet
    from poecaps.models.saving import load_component

    digits, run = _tiny_idx(tmp_path / "digits"), str(tmp_path / "capsnet")
    config = BaselineConfig(dataset="mnist", data_dir=digits, routing_iterations=0, epochs=1, batch_size=8, seed=0)
    train_baseline(config, run)
    _, _, capsnet = load_capsnet(run)
    test, test_labels, _ = load_images(config, "test")

    inference = api.sparse_inference(run, examples=8, steps=5, batch_size=8, shown=2)   # as the script calls it
    assert inference["examples"] == 8 and inference["calibration"]["split"] == "train"
    assert inference["l1"] in capsnet_inference.L1_GRID
    # the feed-forward reading is the network's own
    images, labels = capsnet_inference.even_spread(test, test_labels, 8)
    scores = np.asarray(capsnet(images)["scores"])
    assert inference["feed_forward_accuracy"] == float(np.mean(np.argmax(scores, -1) == labels))
    start = capsnet_inference.batched_infer(capsnet, images, None, 8, steps=1, learning_rate=0.01)
    np.testing.assert_allclose(start["initial_lengths"], scores, atol=1e-5)     # lengths <= 1 in float32
    for name in ("free", "free_l1", "clamped", "clamped_l1"):
        assert 0.0 <= inference[name]["accuracy"] <= 1.0 and np.isfinite(inference[name]["energy_end"])
    for name in ("inference.json", "lengths.png", "energy.png"):
        assert os.path.getsize(os.path.join(run, "inference", name)) > 0

    settings = {"parents": 4, "parent_dim": 4, "batch_size": 8, "iterations": 3, "child_weights": "lengths",
                "heldout": 8, "probe_train": 16}
    first = generative_capsules.train_generative(run, epochs=1, **settings)
    with pytest.raises(InputError, match=r"other parents \(was 4\)"):       # resumed with another layer
        api.generative_capsules(run, resume=True, epochs=2, parents=3)
    with pytest.raises(InputError, match=r"other child_weights \(was 'lengths'\)"):
        api.generative_capsules(run, resume=True, epochs=2, child_weights="uniform")
    found = api.generative_capsules(run, resume=True, epochs=2)          # the other settings: the layer's own
    kept = ("parents", "parent_dim", "batch_size", "iterations", "child_weights")
    assert {k: found[k] for k in kept} == {k: settings[k] for k in kept}
    assert [e["epoch"] for e in found["curve"]] == [0, 1, 2]
    assert found["curve"][:2] == first["curve"]                  # the first call's curve kept, not measured again
    assert set(found["probe_accuracy"]) == {"learned", "random_g"} and os.path.getsize(found["figure"]) > 0
    assert os.path.getsize(found["curves_figure"]) > 0
    # the saved layer, reloaded, infers the recorded coefficient entropy (NumPy's) from the test digits' children,
    # each weighted by its length
    layer = load_component(os.path.join(run, "models", "generative.keras")).layers[-1]
    children = generative_capsules.primary_capsules(capsnet, test)
    coefficients = np.asarray(layer.infer(children, np.linalg.norm(children, axis=-1), iterations=3).coefficients,
                              "float64")
    entropy = -np.sum(coefficients * np.log(coefficients + 1e-30), -1) / np.log(4)
    # float32 EM under XLA in the run, eager here: coefficients to ~1e-6, entropies averaged over all children
    np.testing.assert_allclose(np.mean(entropy), found["coefficient_entropy_over_log_j"], atol=1e-4)
    with open(os.path.join(run, "environment.jsonl")) as handle:
        # the refused resume adds no line
        assert [json.loads(line)["action"] for line in handle] == ["train", "sparse inference"] + [
            "generative layer"] * 2


def test_probe_features_stack_t0_and_the_flattened_poses_and_refuse_poses_of_another_batch():
    """Before, `A0` was reshaped by the length of `t0`, so poses of a batch twice as large ([4, K, 6] for a t0 of
    [2, K]) were taken as [2, 12K] features without a word."""
    from poecaps.errors import InputError
    from poecaps.experiments.probabilistic_capsules import probe_features

    t0, logits = np.array([[0.1, 0.9], [0.5, 0.2]]), np.array([[-2.0, 2.0], [0.0, -1.0]])
    a0 = np.arange(24.0).reshape(2, 2, 6)
    sets = probe_features(t0, a0, logits)
    assert set(sets) == {"t0", "t0_A0", "t0_logits", "t0_logits_A0"}
    np.testing.assert_array_equal(sets["t0_A0"][1], [0.5, 0.2, *range(12, 24)])
    np.testing.assert_array_equal(sets["t0_logits_A0"][0], [-2.0, 2.0, *range(12)])
    np.testing.assert_array_equal(probe_features(t0, a0.reshape(2, 12))["t0_A0"], sets["t0_A0"])  # A0 flattened
    for bad in ({"a0": np.zeros((4, 2, 6))}, {"a0": np.zeros((2, 13))}, {"a0": np.zeros(2)},
                {"t0_logits": logits[:1]}, {"t0": t0[0]}):
        with pytest.raises(InputError, match="probe_features needs t0 \\[B, K\\], A0 \\[B, K, ...\\]"):
            probe_features(**{"t0": t0, "a0": a0, "t0_logits": logits, **bad})
