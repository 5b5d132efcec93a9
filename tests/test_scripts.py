"""The command-line scripts end to end on real digits (small sizes)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script, *args, stderr=False):
    """The script's stdout (and its stderr with `stderr=True`); it must exit 0."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                            check=False, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return (result.stdout, result.stderr) if stderr else result.stdout


@pytest.mark.parametrize("script", ["train_layerwise.py", "sample.py", "evaluate.py", "baseline.py"])
def test_help(script):
    out = _run(script, "--help")
    for flag in ("--seed", "--run-dir", "--resume"):
        assert flag in out
    if script == "train_layerwise.py":
        assert "--dataset" in out and "--data-dir" in out and "--stage" in out


@pytest.mark.parametrize("script", ["train_layerwise.py", "sample.py", "evaluate.py", "baseline.py"])
def test_help_imports_no_tensorflow(script):
    """--help answers at once: the flags come from `poecaps.configs`, TensorFlow loads after parsing."""
    code = ("import runpy, sys\n"
            f"sys.argv = [{script!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({os.path.join(ROOT, 'scripts', script)!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "print('loaded:', sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                            timeout=120)
    assert "--seed" in result.stdout
    assert result.stdout.rstrip().endswith("loaded: []"), result.stdout[-300:]


def test_every_config_flag_has_help():
    from poecaps.cli import field_help
    from poecaps.configs import (
        BaselineConfig,
        BaselineEvaluationConfig,
        EvaluationConfig,
        LayerwiseConfig,
    )

    for config in (LayerwiseConfig, BaselineConfig, EvaluationConfig, BaselineEvaluationConfig):
        missing = [name for name, text in field_help(config).items() if not text]
        assert not missing, f"{config.__name__} fields without a comment: {missing}"


def test_field_help_reads_comments_of_the_class_and_its_bases():
    import dataclasses

    from poecaps.cli import field_help

    @dataclasses.dataclass(frozen=True)
    class Base:
        depth: int = 2           # how deep
        width: int = 3

    @dataclasses.dataclass(frozen=True)
    class Child(Base):
        name: str | None = "a"   # what it is called
        rate: float = dataclasses.field(default=0.5, metadata={"help": "from metadata"})

    assert field_help(Child) == {"depth": "how deep", "width": "", "name": "what it is called",
                                 "rate": "from metadata"}


@pytest.mark.slow
def test_layerwise_pipeline_sample_and_evaluate(tmp_path, mnist_dir, monkeypatch):
    run = str(tmp_path / "run")
    common = ["--dataset", "mnist", "--data-dir", mnist_dir, "--run-dir", run, "--seed", "3",
              "--limit", "256", "--batch-size", "64", "--heldout-size", "64", "--filters", "16",
              "--num-capsules", "4", "--upper-dim", "4", "--ae-epochs", "1",
              "--encoder-epochs", "1", "--decoder-epochs", "1", "--jit-cd", "false",
              "--center-code", "true", "--cd-learning-rate", "0.1"]
    out = _run("train_layerwise.py", *common)
    assert "[decoder] done" in out and "stage_seconds" in out
    for name in ("config.json", "metrics.jsonl", "filters.png", "training_curves.png",
                 "models/autoencoder.npz", "models/encoder.npz", "models/decoder.npz",
                 "models/rbm.npz", "models/code_mean.npy", "models/mean_directions.npy",
                 "models/pose_moments.npy", "models/longest_pose_moments.npy",
                 "models/winning_axes.npy"):
        assert os.path.exists(os.path.join(run, name)), name
    resumed = _run("train_layerwise.py", *common, "--resume", "--encoder-epochs", "2")
    assert resumed.count("already trained") == 4
    with open(os.path.join(run, "state.json")) as handle:
        stages = json.load(handle)["stages"]
    with open(os.path.join(run, "config.json")) as handle:
        assert json.load(handle)["encoder_epochs"] == 2   # the last call's settings
    assert {stage: stages[stage]["config"]["encoder_epochs"] for stage in stages} == {
        "autoencoder": 1, "encoder": 1, "decoder": 1, "rbm": 1}   # each stage's own

    _run("sample.py", "--run-dir", run, "--rows", "3", "--restricted")
    with np.load(os.path.join(run, "samples.npz")) as samples:
        images = samples["images"]
    assert images.shape == (3, 4, 28, 28, 1)
    assert 0.0 <= images.min() and images.max() <= 1.0
    assert os.path.exists(os.path.join(run, "samples.png"))
    _run("sample.py", "--run-dir", run, "--rows", "2", "--fitted")
    with np.load(os.path.join(run, "samples.npz")) as samples:
        assert samples["images"].shape == (2, 4, 28, 28, 1)
    assert os.path.exists(os.path.join(run, "samples_fitted_full.png"))
    _run("sample.py", "--run-dir", run, "--rows", "2", "--fitted", "longest", "--restricted")
    assert os.path.exists(os.path.join(run, "samples_fitted_longest_restricted.png"))
    _run("sample.py", "--run-dir", run, "--rows", "2", "--restricted", "winning")
    assert os.path.exists(os.path.join(run, "samples_winning_side.png"))

    out, err = _run("evaluate.py", "--run-dir", run, "--rows", "5", "--classifier-epochs", "1", "--draws", "3",
                    stderr=True)
    result = json.loads(out)   # stdout is the JSON alone; the progress goes to stderr
    for step in ("reference classifier", "linear probes", "one-capsule decodings", "Bernoulli RBM"):
        assert f"[evaluate] {step}: " in err, err[-2000:]
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle) == result
    for key in ("reconstruction_mse", "probe_accuracy_vectors", "probe_accuracy_lengths",
                "samples_full", "samples_restricted", "samples_fitted_full", "samples_fitted_restricted",
                "samples_fitted_longest_full", "samples_fitted_longest_restricted",
                "samples_winning_side", "samples_fitted_winning_side",
                "samples_fitted_longest_winning_side", "one_capsule_reconstruction_class_accuracy", "longest_capsule_clusters",
                "one_capsule_decoded_clusters"):
        assert key in result["poecaps"]
    assert 0.0 <= result["poecaps"]["samples_full"]["mean_purity"] <= 1.0
    assert 1 <= result["poecaps"]["samples_full"]["classes_covered"] <= 4
    assert sum(result["poecaps"]["longest_capsule_clusters"]["size"]) == result["test_images"]
    assert (result["poecaps"]["one_capsule_decoded_clusters"]["size"]
            == result["poecaps"]["longest_capsule_clusters"]["size"])
    kmeans = result["pixel_kmeans"]
    assert sum(kmeans["clusters"]["size"]) == result["test_images"] and len(kmeans["clusters"]["size"]) == 4
    assert len(kmeans["centroids"]["named"]) == 4
    assert kmeans["centroids"]["classes_covered"] == len(set(kmeans["centroids"]["named"]))
    assert "[evaluate] pixel k-means reference (4 clusters): " in err
    sides = result["poecaps"]["longest_capsule_side_clusters"]
    assert [a + b for a, b in zip(sides["both_sides"]["size"][::2], sides["both_sides"]["size"][1::2])] \
        == result["poecaps"]["longest_capsule_clusters"]["size"]
    assert sides["visited_side"]["size"] == sides["both_sides"]["size"][::2]
    assert (result["poecaps"]["one_capsule_decoded_side_clusters"]["both_sides"]["size"]
            == sides["both_sides"]["size"])
    assert sum(result["poecaps"]["training_images_longest"]) == result["train_images"]
    share = result["poecaps"]["pose_principal_share"]
    assert len(share["per_capsule"]) == 4 and 0.25 - 1e-6 <= share["mean"] <= 1.0 + 1e-6
    assert result["rbm"]["hidden_units"] == 20
    assert os.path.exists(os.path.join(run, "reconstructions.png"))
    _check_sampler_draws(run, result["poecaps"], err)
    _check_class_mean_reference(run, result["class_mean_reference"])


    # --decoder-input longest: the decoder stage trains on each image's code cut
    # to its longest capsule, with the whole image's lower capsules as targets.
    from poecaps import metrics
    from poecaps.configs import LayerwiseConfig
    from poecaps.runs import CapsulePipeline, RunDir, batched
    from trainers import layerwise

    config = LayerwiseConfig(**{**RunDir(run).read_json("config.json"), "decoder_input": "longest"})
    train, _, _ = layerwise.load_images(config, "train")
    test, _, _ = layerwise.load_images(config, "test")
    pipeline = CapsulePipeline.load(os.path.join(run, "models"), config.capsule_dim)
    lower = batched(pipeline.lower_capsules, train)
    seen = {}
    monkeypatch.setattr(layerwise, "_fit", lambda trainer, x, *args, y=None, **kwargs: seen.update(x=x, y=y))
    layerwise.train_stage("decoder", config, RunDir(run), train, test)
    np.testing.assert_allclose(seen["x"], metrics.keep_longest(batched(pipeline.upper_capsules, lower)),
                               rtol=1e-5, atol=1e-6)
    assert np.all(np.count_nonzero(np.linalg.norm(seen["x"], axis=-1), axis=1) == 1)
    np.testing.assert_allclose(seen["y"], lower, rtol=1e-5, atol=1e-6)

    # --decoder-length: the decoder reads (x, |x|)/sqrt(2), and the pipeline
    # appends the length itself when it decodes (samplers, evaluation).
    layerwise.train_stage("decoder", dataclasses.replace(config, decoder_length=True), RunDir(run), train, test)
    cut = metrics.keep_longest(batched(pipeline.upper_capsules, lower))
    appended = np.concatenate([cut, np.linalg.norm(cut, axis=-1, keepdims=True)], -1) / np.sqrt(2.0)
    np.testing.assert_allclose(seen["x"], appended, rtol=1e-5, atol=1e-6)
    reading = CapsulePipeline.load(os.path.join(run, "models"), config.capsule_dim)
    assert reading.decoder_reads_length and not pipeline.decoder_reads_length
    upper = batched(reading.upper_capsules, lower[:8])
    with_lengths = np.concatenate([upper, np.linalg.norm(upper, axis=-1, keepdims=True)], -1) / np.sqrt(2.0)
    np.testing.assert_allclose(batched(reading.decode_upper, upper),
                               batched(reading.decode_lower, batched(reading.decoder, with_lengths)),
                               rtol=1e-5, atol=1e-6)

    # --decoder-rule delta: the same (upper, lower) pairs go to the delta-rule trainer.
    from trainers.cd import ClampedDecoderTrainer

    monkeypatch.setattr(layerwise, "_fit",
                        lambda trainer, x, *args, y=None, **kwargs: seen.update(trainer=trainer, x=x, y=y))
    layerwise.train_stage("decoder", dataclasses.replace(config, decoder_rule="delta"), RunDir(run), train, test)
    assert isinstance(seen["trainer"], ClampedDecoderTrainer) and seen["trainer"].rule == "delta"
    np.testing.assert_allclose(seen["y"], lower, rtol=1e-5, atol=1e-6)

    # The decoder stage refuses a run without the encoder, or without the mean
    # code the encoder's capsules were centred with.
    from poecaps.errors import InputError

    os.rename(os.path.join(run, "models", "code_mean.npy"), str(tmp_path / "code_mean.npy"))
    with pytest.raises(InputError, match="no code_mean.npy"):
        layerwise.train_stage("decoder", config, RunDir(run), train, test)
    bare = RunDir(str(tmp_path / "bare"))
    shutil.copy(os.path.join(run, "models", "autoencoder.npz"), bare.models)
    with pytest.raises(InputError, match="No trained encoder"):
        layerwise.train_stage("decoder", config, bare, train, test)


def _check_sampler_draws(run, figures, err):
    """`--draws 3`: draw k is CapsuleSampler(seed=k), labelled and counted here by hand."""
    import keras

    from poecaps.runs import CapsulePipeline
    from samplers import CapsuleSampler

    pipeline = CapsulePipeline.load(os.path.join(run, "models"), 8)
    classifier = keras.saving.load_model(os.path.join(run, "models", "reference_classifier.keras"))
    for domain, kwargs in (("full", {}), ("restricted", {"restricted": True}),
                           ("winning_side", {"restricted": True, "half": "winning"})):
        draws = figures[f"samples_{domain}_draws"]
        assert draws["sampler_seeds"] == [0, 1, 2]
        assert draws["classes_covered"][0] == figures[f"samples_{domain}"]["classes_covered"]
        assert draws["mean_purity"][0] == figures[f"samples_{domain}"]["mean_purity"]
        for k in range(3):
            images = CapsuleSampler(pipeline, seed=k).sample(5, **kwargs)["images"]
            labels = np.argmax(classifier.predict(images.reshape(-1, 28, 28, 1), verbose=0), -1).reshape(5, -1)
            majority = [np.bincount(column).argmax() for column in labels.T]
            purity = np.mean([np.mean(column == m) for column, m in zip(labels.T, majority)])
            assert draws["classes_covered"][k] == len(set(majority))
            np.testing.assert_allclose(draws["mean_purity"][k], purity, rtol=1e-6)
        assert f"[evaluate] N(0, I), {domain.replace('_', ' ')} domain, 3 draws: classes " in err


def _check_class_mean_reference(run, reference):
    """Each class's mean training image, labelled here by the run's classifier."""
    import keras

    from poecaps.configs import LayerwiseConfig
    from poecaps.runs import RunDir
    from trainers.layerwise import load_images

    train, labels, _ = load_images(LayerwiseConfig(**RunDir(run).read_json("config.json")), "train")
    classifier = keras.saving.load_model(os.path.join(run, "models", "reference_classifier.keras"))
    present = sorted(set(labels.tolist()))
    means = np.stack([train[labels == c].mean(0) for c in present])
    named = np.argmax(classifier.predict(means, verbose=0), -1)
    assert reference["classes"] == present and reference["named"] == named.tolist()
    assert reference["named_as_itself"] == int(np.sum(named == present))
    assert reference["classes_covered"] == len(set(named.tolist()))


def test_resume_refuses_a_different_architecture(tmp_path, mnist_dir):
    run = str(tmp_path / "run")
    os.makedirs(run)
    with open(os.path.join(run, "state.json"), "w") as handle:
        json.dump({"config": {"dataset": "mnist", "num_capsules": 7}, "stages": {}}, handle)
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "train_layerwise.py"), "--dataset", "mnist",
         "--data-dir", mnist_dir, "--run-dir", run, "--resume", "--stage", "encoder"],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.returncode != 0
    assert "num_capsules" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["capsnet", "em"])
def test_baseline_trains_resumes_and_evaluates(tmp_path, mnist_dir, model):
    run = str(tmp_path / model)
    common = ["--model", model, "--dataset", "mnist", "--data-dir", mnist_dir, "--run-dir", run,
              "--seed", "1", "--limit", "64", "--batch-size", "32", "--test-limit", "64"]
    _run("baseline.py", *common, "--epochs", "1")
    out = _run("baseline.py", *common, "--epochs", "2", "--resume")
    result = json.loads(out[out.index("{\n"):])
    with open(os.path.join(run, "eval.json")) as handle:
        assert json.load(handle)["test_accuracy"] == result["test_accuracy"]
    assert result["train"]["epochs_this_call"] == 1          # the first epoch was not redone
    assert set(result["rotation_accuracy"]) == {"0", "45", "90", "135", "180"}
    assert 0.0 <= result["affine_accuracy"] <= 1.0
    assert 0.0 <= result["routing"]["coefficient_entropy_over_log_j"] <= 1.0 + 1e-6
    with open(os.path.join(run, "metrics.jsonl")) as handle:
        assert [json.loads(line)["epoch"] for line in handle] == [0, 1]
    expected = {"capsnet": "perturbations_0.png", "em": "affine_examples.png"}[model]
    assert os.path.exists(os.path.join(run, expected))
