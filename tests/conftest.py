import os

# In os.environ, so the interpreters the tests start (scripts, workers) inherit them too.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras
import numpy as np
import pytest

# A copy of ../shared/data/mnist-5k kept in the repository, so a clone runs its tests anywhere.
MNIST_5K = os.path.join(os.path.dirname(__file__), "data", "mnist-5k")


@pytest.fixture
def rng():
    keras.utils.set_random_seed(0)
    return np.random.default_rng(0)


@pytest.fixture
def mnist_dir():
    path = os.path.abspath(MNIST_5K)
    if not os.path.isdir(path):
        pytest.fail(f"the MNIST-5k test data is missing at {path}")
    return path


@pytest.fixture
def quick_error_exits(monkeypatch):
    """`cli.run_main` collects garbage before it prints an error, to finalise a training loop the error
    interrupted. In a test process holding many TensorFlow graphs a full collection takes a good part of
    a second; sweeps of hundreds of bad inputs, which start no training, skip it."""
    import types

    from poecaps.experiments import cli
    monkeypatch.setattr(cli, "gc", types.SimpleNamespace(collect=lambda: 0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """For `-n logical` (pyproject.toml): the CPUs this process may run on. pytest-xdist counts the
    machine's, so a run pinned to one core (`taskset -c 0`) would start two processes on it.
    `PYTEST_XDIST_AUTO_NUM_WORKERS`, and systems without CPU affinity, keep xdist's own count."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or not hasattr(os, "sched_getaffinity"):
        return None
    return len(os.sched_getaffinity(0))


# What the generated bad-input tests tried, per script, printed at the end of the run. Each test
# records its counts on its report, so that under pytest-xdist the counts reach the process that prints.
_TRIES = {}


@pytest.fixture
def record_tries(request):
    def record(script, what, count):
        request.node.user_properties.append(("tried", [script, what, int(count)]))
    return record


def pytest_runtest_logreport(report):
    if report.when == "teardown":       # the last report of a test carries all it recorded
        for name, value in report.user_properties:
            if name == "tried":
                script, what, count = value
                _TRIES.setdefault(script, {}).setdefault(what, 0)
                _TRIES[script][what] += count


def pytest_terminal_summary(terminalreporter):
    if _TRIES:
        lines = [f"{script}: " + ", ".join(f"{count} {what}" for what, count in tried.items())
                 for script, tried in sorted(_TRIES.items())]
        terminalreporter.write_line("bad inputs tried, per script: " + "; ".join(lines))
