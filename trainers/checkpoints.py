"""Atomic, verified checkpoints of a trainer's whole state.

A checkpoint is one `.npz` file holding every variable of the trainer (weights,
non-trainable state such as persistent chains, and the `SeedGenerator` states
that make its random draws), every optimizer variable (step counter, momenta),
the learning-rate scale of `poecaps.trainers.schedule`, and a JSON header: where training
stood (`epoch`, `step` within it, `global_step`), the run's configuration, each
variable's name and shape, and a SHA-256 digest of all arrays. It is written to
a temporary file, flushed to disk and renamed, so a run killed at any moment
leaves either the old or the new file, never half of one. Loading verifies the
digest; a corrupted or truncated newest checkpoint is reported and the one
before it is used.
"""

import glob
import hashlib
import json
import os
import re

import numpy as np

from poecaps.errors import CheckpointError, InputError
from poecaps.trainers.schedule import learning_rate_scale
from poecaps.validation import check_integer

_PATTERN = re.compile(r"ckpt-(\d{9})\.npz$")


def trainer_state(trainer):
    """The variables a checkpoint holds, in a fixed order: trainer, optimizer, LR scale."""
    variables = list(trainer.variables)
    if getattr(trainer, "optimizer", None) is not None:
        variables += list(trainer.optimizer.variables)
        scale = learning_rate_scale(trainer.optimizer)
        if scale is not None:
            variables.append(scale)
    return variables


def _name(variable):
    return getattr(variable, "path", None) or variable.name


def _digest(arrays):
    sha = hashlib.sha256()
    for array in arrays:
        sha.update(str(array.dtype).encode())
        sha.update(str(array.shape).encode())
        sha.update(np.ascontiguousarray(array).tobytes())
    return sha.hexdigest()


def _value(variable):
    value = variable.numpy() if hasattr(variable, "numpy") else np.asarray(variable)
    return np.asarray(value)


def _as_json(config):
    """`config` (a dict, or None: {}) as JSON gives it back, the form a checkpoint's header stores and a resumed
    run compares with: tuples become lists. Another type, or values JSON cannot write exactly (NumPy numbers,
    NaN, objects), are an `InputError` here, before any training (they failed at the first save, and a tuple
    never equalled the list its checkpoint read back)."""
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise InputError(f"config must be a dict of JSON-able settings. Received: {type(config).__name__}")
    try:
        return json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise InputError(f"config must hold JSON-able settings (every checkpoint's header keeps them): {error}") from None


class CheckpointManager:
    """Writes and restores checkpoints of a trainer in `directory`, keeping the newest `keep`.

    Args:
        directory: folder of the checkpoints (created if missing).
        keep: how many checkpoints to keep (>= 2, so that a corrupted newest
            one leaves a good one behind).
        config: JSON-able dict of the settings that fix the trainer's shape;
            restoring a checkpoint written with other settings is refused.

    Example:
        manager = CheckpointManager("runs/x/checkpoints/encoder", config={"J": 20})
        manager.save(trainer, epoch=0, step=50, global_step=50)
        position = manager.restore(trainer)   # {"epoch": 0, "step": 50, ...} or None
    """

    def __init__(self, directory, keep=3, config=None, log=print):
        self.directory = directory
        self.keep = check_integer(keep, "keep", minimum=2)
        self.config = _as_json(config)
        self.log = log
        os.makedirs(directory, exist_ok=True)

    def paths(self):
        """Checkpoint files, newest first."""
        found = [p for p in glob.glob(os.path.join(self.directory, "ckpt-*.npz")) if _PATTERN.search(p)]
        return sorted(found, key=lambda p: int(_PATTERN.search(p).group(1)), reverse=True)

    def save(self, trainer, epoch, step, global_step, extra=None):
        """Write the trainer's state at (`epoch`, `step` within it, `global_step`) atomically."""
        variables = trainer_state(trainer)
        arrays = [_value(v) for v in variables]
        header = {"epoch": int(epoch), "step": int(step), "global_step": int(global_step),
                  "config": self.config, "names": [_name(v) for v in variables],
                  "shapes": [list(a.shape) for a in arrays], "digest": _digest(arrays),
                  "extra": extra or {}}
        path = os.path.join(self.directory, f"ckpt-{int(global_step):09d}.npz")
        tmp = path + ".tmp"
        with open(tmp, "wb") as handle:
            np.savez(handle, header=np.array(json.dumps(header)),
                     **{f"v{k:04d}": a for k, a in enumerate(arrays)})
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        for old in self.paths()[self.keep:]:
            os.remove(old)
        for stale in glob.glob(os.path.join(self.directory, "ckpt-*.tmp")):   # left by a killed run
            os.remove(stale)
        return path

    def _read(self, path):
        """(header, arrays) of a checkpoint file; raises CheckpointError if it is damaged."""
        try:
            with np.load(path) as stored:
                header = json.loads(str(stored["header"]))
                arrays = [stored[f"v{k:04d}"] for k in range(len(header["names"]))]
        except Exception as error:  # noqa: BLE001  (zip, pickle and JSON errors all mean damaged)
            raise CheckpointError(f"{path} is truncated or corrupted ({type(error).__name__}: "
                                  f"{error})") from None
        if _digest(arrays) != header.get("digest"):
            raise CheckpointError(f"{path} is corrupted (its arrays do not match their digest)")
        return header, arrays

    def _check_compatible(self, path, header, variables, arrays):
        changed = {k: (header["config"].get(k), v) for k, v in self.config.items()
                   if header["config"].get(k) != v}
        if changed:
            detail = ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in changed.items())
            raise CheckpointError(f"{path} was written by a different configuration ({detail}). "
                                  "Resume with the same settings or start a new run directory.")
        values = [_value(v) for v in variables]
        shapes = [list(value.shape) for value in values]
        if len(shapes) != len(header["shapes"]) or shapes != header["shapes"]:
            raise CheckpointError(
                f"{path} holds {len(header['shapes'])} variables that do not match this trainer's "
                f"{len(shapes)} (a different model or configuration). Resume with the same "
                "settings or start a new run directory.")
        changed = sorted({(str(array.dtype), str(value.dtype)) for array, value in zip(arrays, values)
                          if array.dtype != value.dtype})
        if changed:   # `assign` would cast them: a float64 run would go on in float32, or the other way round
            detail = ", ".join(f"{was} where this trainer's are {now}" for was, now in changed)
            raise CheckpointError(
                f"{path} holds variables of other dtypes ({detail}). Resume under the dtype policy it was trained "
                "with (keras.config.set_floatx and set_dtype_policy) or start a new run directory.")

    def restore(self, trainer, check=None):
        """Load the newest good checkpoint into `trainer`; returns its header, or None if none exist.

        Damaged checkpoints are skipped with a message naming them; a
        checkpoint from another configuration, or whose variables differ from
        the trainer's in number, shape or dtype, raises `CheckpointError`, as
        may `check(path, header)`, called before any variable is assigned.
        """
        variables = trainer_state(trainer)
        paths = self.paths()
        if not paths:
            self.log(f"No checkpoint in {self.directory}; training starts from the beginning.")
        for k, path in enumerate(paths):
            try:
                header, arrays = self._read(path)
            except CheckpointError as error:
                following = paths[k + 1] if k + 1 < len(paths) else None
                self.log(f"WARNING: {error}; "
                         + (f"using the previous checkpoint {following}" if following
                            else "no earlier checkpoint is left, starting from scratch"))
                continue
            self._check_compatible(path, header, variables, arrays)
            if check is not None:
                check(path, header)
            for variable, array in zip(variables, arrays):
                variable.assign(array)
            self.log(f"Resumed from {path} (epoch {header['epoch'] + 1}, step {header['step']}, "
                     f"global step {header['global_step']})")
            return header
        return None

    def clear(self):
        for path in glob.glob(os.path.join(self.directory, "ckpt-*")):
            os.remove(path)
