"""What machine and software a run's figures came from, one JSON line per command.

A seeded run repeats bit for bit on one machine, but another CPU's
kernels (oneDNN picks them by instruction set) or another TensorFlow sum
in another order, and a job of many steps carries those differences
forward. `describe()` records what decides that order, so that two runs
that disagree can be told apart: the library versions, the CPU (its
name, vendor, family and model) and the instruction sets its kernels
may use, the CPUs this process may use (`taskset` narrows them), the
thread pools, the devices and the environment variables that switch
kernels or compilers.
"""

import datetime
import os
import platform
import subprocess
import sys

# Instruction sets that change which kernels oneDNN and Eigen run.
_CPU_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16")
# Variables that switch kernels, threads or compilers.
_ENVIRONMENT = ("TF_ENABLE_ONEDNN_OPTS", "TF_XLA_FLAGS", "TF_DETERMINISTIC_OPS", "OMP_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES", "PYTHONHASHSEED")


def cpu(path="/proc/cpuinfo"):
    """`(model name, identity, sorted kernel-relevant flags)` from `path`, or the platform's answer elsewhere.

    The identity, "AuthenticAMD family 26 model 2 stepping 1", tells apart CPUs that a virtual machine
    names alike ("AMD EPYC") and whose flags agree, but whose BLAS picks other kernels; None if unknown.
    """
    model, flags, fields = platform.processor() or platform.machine(), set(), {}
    try:
        with open(path) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "model name" and value:
                    model = value
                elif key in ("vendor_id", "cpu family", "model", "stepping"):
                    fields[key] = value
                elif key == "flags":            # the first processor's block ends here
                    flags = set(value.split())
                    break
    except OSError:
        pass
    identity = None
    if "cpu family" in fields:
        words = {"vendor_id": "", "cpu family": "family ", "model": "model ", "stepping": "stepping "}
        identity = " ".join(words[key] + fields[key] for key in words if key in fields)
    return model, identity, sorted(flags.intersection(_CPU_FLAGS))


def usable_cpus():
    """How many CPUs this process may run on (`taskset` narrows them); all of them where the system cannot tell."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _git_commit(package):
    """The commit of the poecaps checkout `package` lies in (`-dirty` if it has changes), or None.

    None too when `package` was installed into a folder that some other
    repository holds (a virtual environment inside a project's checkout).
    """
    git = lambda *args: subprocess.run(["git", *args], cwd=package, capture_output=True, text=True, timeout=10,
                                       check=True).stdout.strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        if os.path.realpath(os.path.join(top, "poecaps")) != os.path.realpath(package):
            return None
        changed = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "HEAD") + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return None


def describe(action):
    """A JSON-ready record of this process: `action`, when, the command, software, CPU, threads, devices.

    Reads the physical devices only, so it leaves TensorFlow's device configuration open.
    """
    import keras
    import numpy as np
    import tensorflow as tf

    import poecaps

    model, identity, flags = cpu()
    return {
        "action": action,
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
        "poecaps": poecaps.__version__,
        "git_commit": _git_commit(os.path.dirname(os.path.abspath(poecaps.__file__))),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu": model,
        "cpu_id": identity,
        "cpu_flags": flags,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "threads": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                    "inter_op": tf.config.threading.get_inter_op_parallelism_threads()},
        "devices": [device.name for device in tf.config.list_physical_devices()],
        "environment": {name: os.environ[name] for name in _ENVIRONMENT if name in os.environ},
    }
