"""The benchmarks under `bench/` still run: at toy sizes each ends on its `RESULT` line.

They are measured by hand, never timed here (no figure is checked but its
form); this only keeps them from rotting as the library changes under them.
Their references' checks against poecaps are tested for power: a reference
one routing round off (or, for the autoencoder, poecaps with another leaky
ReLU slope) must fail them.
"""

import importlib
import math
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest

from poecaps.layers import ConvAutoencoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = {
    "ae_step.py": ["--batch", "8", "--repeats", "1"],
    "capsnet_step.py": ["--batch", "8", "--repeats", "1"],
    "cd_step.py": ["--batch", "8", "--repeats", "1"],
    # No sharded variant: its steps are the trainer's, checked against one XLA computation in test_supervised
    "em_step.py": ["--batch", "2", "--size", "small", "--repeats", "1", "--shards", "1"],
    "inference_step.py": ["--batch", "4", "--steps", "20"],
    # One router: the loop is the same for both, and each router's reference is checked against poecaps
    # below (test_reference_checks_pass_the_same_function_and_fail_a_neighbour); the connectionist's XLA
    # compilation alone took 60 % of the run.
    "learned_step.py": ["--batch", "2", "--repeats", "1", "--router", "similarity"],
}


def test_every_benchmark_is_exercised():
    assert sorted(name for name in os.listdir(os.path.join(ROOT, "bench")) if name.endswith("_step.py")) \
        == sorted(TOY)


def test_a_benchmark_runs_as_a_script():
    # The toy runs below call each script's `main` in this process; its own interpreter starts it as users do.
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "cd_step.py"), "--help"], check=False,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.startswith("usage: cd_step.py"), result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TOY))
def test_benchmark_ends_on_its_result_line(script, monkeypatch, capsys):
    # The script's `main` in this process, imported as `python bench/<script>` finds it (as the refusals below
    # are): a new interpreter for each toy run would add TensorFlow's start to it.
    main = _bench_module(script[:-3], monkeypatch).main
    monkeypatch.setattr(sys, "argv", [os.path.join(ROOT, "bench", script), *TOY[script]])
    main()
    stdout = capsys.readouterr().out
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"RESULT images_per_s=(\S+) vs_reference=(\S+) matmul_fraction=(\S+)", last)
    assert match, last
    images_per_s, vs_reference, matmul_fraction = map(float, match.groups())
    assert all(math.isfinite(x) and x > 0 for x in (images_per_s, vs_reference, matmul_fraction)), last
    machine = [line for line in stdout.splitlines() if line.startswith("machine: ")]
    assert len(machine) == 1 and "usable CPUs" in machine[0], stdout[-2000:]   # what the ratio was measured on


@pytest.mark.parametrize("script", sorted(TOY))
def test_benchmark_refuses_a_count_below_one_in_one_line(script, monkeypatch, capsys):
    # Before, `--batch 0` failed deep in the model or the reference with a traceback, and `--repeats 0` only
    # after the whole warm-up, at min() of no timings. argparse ends the run before any work.
    main = _bench_module(script[:-3], monkeypatch).main
    flag = "--steps" if script == "inference_step.py" else "--repeats"
    for bad, shown in ((["--batch", "0"], "0"), ([flag, "0"], "0"), (["--batch", "two"], "'two'")):
        monkeypatch.setattr(sys, "argv", [script, *bad])
        with pytest.raises(SystemExit) as stop:
            main()
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"{script}: error: argument {bad[0]}: expected an integer >= 1, got {shown}")


def _bench_module(name, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    return importlib.import_module(name)


def _disagreements(case, monkeypatch):
    """The check's figure for poecaps' own function, then for a neighbour, and the check's tolerance (the bench's).

    The neighbour: the reference with 2 routing rounds against poecaps' 3;
    for the autoencoder, poecaps with leaky ReLU slope 0.3 against the
    reference's 0.2.
    """
    # Some weights (the routing network's primary capsule convolutions) come from Keras' global random state:
    # fixed here, so that the figures do not depend on which tests ran before in this process.
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    images = rng.uniform(size=(2, 28, 28, 1)).astype("float32")
    labels = rng.integers(0, 10, size=2)
    figures = []
    for rounds in (3, 2):
        if case == "ae":
            bench = _bench_module("ae_step", monkeypatch)
            slope = 0.2 if rounds == 3 else 0.3         # the reference's is Keras' default, 0.2
            figures.append(bench.reference_disagreement(bench.reference_model((28, 28, 1)),
                                                        ConvAutoencoder(negative_slope=slope, seed=0), images, 0))
        elif case == "capsnet":
            bench = _bench_module("capsnet_step", monkeypatch)
            ref = bench.TiledReference(rounds=rounds)
            ref(images, labels)
            figures.append(bench.reference_disagreement(ref, images, labels, seed=0))
        elif case == "em":
            bench = _bench_module("em_step", monkeypatch)
            sizes = (8, 2, 3, 3)
            ref = bench.TiledReference(sizes, iterations=rounds)
            ref(images, labels, margin=0.2)
            figures.append(bench.reference_disagreement(ref, images, labels, sizes, seed=0))
        else:
            bench = _bench_module("learned_step", monkeypatch)
            monkeypatch.setattr(bench, "ITERATIONS", rounds)
            ref = bench.TiledReference(case)
            ref(images, labels)
            figures.append(bench.reference_disagreement(ref, case, images, labels, seed=0))
    return figures, bench.TOLERANCE


@pytest.mark.parametrize("case", ["ae", "capsnet", "em", "similarity", "connectionist"])
def test_reference_checks_pass_the_same_function_and_fail_a_neighbour(case, monkeypatch):
    (same, neighbour), tolerance = _disagreements(case, monkeypatch)
    assert same < tolerance, same
    assert neighbour > 10 * tolerance, neighbour
