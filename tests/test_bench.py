"""The benchmarks under `bench/` still run: at toy sizes each ends on its `RESULT` line.

They are measured by hand, never timed here (no figure is checked but its
form); this only keeps them from rotting as the library changes under them.
"""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOY = {
    "ae_step.py": ["--batch", "8", "--repeats", "1"],
    "capsnet_step.py": ["--batch", "8", "--repeats", "1"],
    "cd_step.py": ["--batch", "8", "--repeats", "1"],
    "em_step.py": ["--batch", "2", "--size", "small", "--repeats", "1"],
    "inference_step.py": ["--batch", "4", "--steps", "20"],
    "learned_step.py": ["--batch", "8", "--repeats", "1"],
}


def test_every_benchmark_is_exercised():
    assert sorted(name for name in os.listdir(os.path.join(ROOT, "bench")) if name.endswith("_step.py")) \
        == sorted(TOY)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(TOY))
def test_benchmark_ends_on_its_result_line(script):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *TOY[script]],
                            check=False, capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    last = result.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"RESULT images_per_s=(\S+) vs_reference=(\S+) matmul_fraction=(\S+)", last)
    assert match, last
    images_per_s, vs_reference, matmul_fraction = map(float, match.groups())
    assert all(math.isfinite(x) and x > 0 for x in (images_per_s, vs_reference, matmul_fraction)), last
