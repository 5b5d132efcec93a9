"""Package-level settings that take effect on import."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Allocator statistics exist only for BFC allocators: TensorFlow's default CPU
# allocator raises "Allocator stats not available".
PROBE = """
import tensorflow as tf
import poecaps
x = tf.ones((256, 256)) * 2.0
try:
    info = tf.config.experimental.get_memory_info("CPU:0")
    print("BFC", info["peak"] >= 256 * 256 * 4)
except ValueError:
    print("DEFAULT")
"""


def _allocator(env_value):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPU_ALLOCATOR_USE_BFC"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    if env_value is not None:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = env_value
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, check=False,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()[-2:] if "BFC" in result.stdout else result.stdout.split()[-1:]


def test_importing_poecaps_selects_the_bfc_cpu_allocator_even_after_tensorflow():
    assert _allocator(None) == ["BFC", "True"]


def test_an_explicit_allocator_choice_is_kept():
    assert _allocator("false") == ["DEFAULT"]
