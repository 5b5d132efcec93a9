"""The README's Python quickstart, run as written on the repository's copy of the offline digits."""

import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quickstart():
    with open(os.path.join(ROOT, "README.md")) as handle:
        readme = handle.read()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert len(blocks) == 1, "the README holds one Python block, the quickstart"
    return blocks[0]


@pytest.mark.slow
def test_the_readmes_python_quickstart_runs(tmp_path, mnist_dir, capsys):
    code = _quickstart()
    assert code.count('"runs/quick"') == 1 and code.count('"../shared/data/mnist-5k"') == 1
    # Only where it runs and where the digits are change.
    code = code.replace('"runs/quick"', repr(str(tmp_path / "quick"))).replace(
        '"../shared/data/mnist-5k"', repr(mnist_dir))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102  (the README's own code, as a user runs it)
    grid, figures = namespace["grid"], namespace["figures"]
    assert grid["shape"] == (4, 20, 28, 28, 1)
    with np.load(os.path.join(tmp_path, "quick", "samples.npz")) as samples:
        assert samples["images"].shape == grid["shape"]
    captured = capsys.readouterr()
    printed = captured.out.strip().splitlines()[-1]
    assert printed == f"{figures['result_grid']['classes_covered']} {figures['result_grid']['mean_purity']}"
    # From Python the library's progress, training's and evaluation's alike, goes to stdout (as Keras' epochs);
    # the commands send it to stderr. (The evaluation's went to stderr, the training's to stdout.)
    assert "[decoder] done in " in captured.out and "[evaluate] Bernoulli RBM: " in captured.out
    assert "[evaluate]" not in captured.err
    assert os.path.exists(os.path.join(tmp_path, "quick", "eval.json"))
