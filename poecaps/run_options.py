"""Settings every training run shares: checkpoints, NaN policy, strategy, precision."""

import dataclasses

from poecaps.distribute import PRECISIONS, STRATEGIES
from poecaps.errors import InputError
from poecaps.guard import POLICIES


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run is kept safe and where it runs; none of these changes the model.

    Fields:
        save_every: checkpoint every this many steps as well as every epoch (0: epochs only).
        on_nan: on a non-finite loss or weight, "stop" (after restoring the last
            good state), "reduce-lr" (restore, halve the learning rate, go on) or "off".
        strategy: "default" (one device), "mirrored" (all local GPUs or CPUs) or
            "multiworker" (`TF_CONFIG`).
        precision: "float32", "mixed_float16" or "mixed_bfloat16" (routing and
            energies stay float32).
    """

    save_every: int = 200
    on_nan: str = "stop"
    strategy: str = "default"
    precision: str = "float32"

    def __post_init__(self):
        if self.save_every < 0:
            raise InputError(f"save_every must be >= 0. Received: save_every={self.save_every}")
        for name, allowed in (("on_nan", POLICIES), ("strategy", STRATEGIES), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise InputError(f"{name} must be one of {allowed}. Received: {name}={getattr(self, name)!r}")
