"""The research scripts (routing table, sparse inference, generative capsules, the toy): flags and bad runs."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESEARCH = ["compare_routing.py", "sparse_inference.py", "generative_capsules.py", "toy_routing.py"]
ON_A_CAPSNET_RUN = ["sparse_inference.py", "generative_capsules.py"]


def _run(script, *args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], check=False,
                          capture_output=True, text=True, env=env, timeout=600)


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


def test_generative_capsules_checks_its_sizes():
    for flag in ("--parents", "--parent-dim", "--epochs"):
        stderr = _one_error_line(_run("generative_capsules.py", "--run-dir", "r", flag, "0"))
        assert f"{flag} must be >= 1" in stderr
