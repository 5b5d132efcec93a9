"""Settings every training run shares: checkpoints, NaN policy, strategy, precision."""

import dataclasses

from poecaps.errors import InputError

# Kept free of TensorFlow so that a script's --help answers at once
# (`poecaps.distribute` and `poecaps.guard` use these names).
STRATEGIES = ("default", "mirrored", "multiworker")
PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16")
POLICIES = ("stop", "reduce-lr", "off")


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """How a run is kept safe and where it runs; none of these changes the model.

    Each field's comment is its command-line help (`poecaps.cli.field_help`).
    """

    save_every: int = 200            # also checkpoint every this many steps (0: epochs only)
    on_nan: str = "stop"             # on a NaN: "stop", "reduce-lr" (halve it, go on) or "off"
    strategy: str = "default"        # "default" (one device), "mirrored" or "multiworker"
    precision: str = "float32"       # "float32", "mixed_float16" or "mixed_bfloat16"

    def __post_init__(self):
        if self.save_every < 0:
            raise InputError(f"save_every must be >= 0. Received: save_every={self.save_every}")
        for name, allowed in (("on_nan", POLICIES), ("strategy", STRATEGIES), ("precision", PRECISIONS)):
            if getattr(self, name) not in allowed:
                raise InputError(f"{name} must be one of {allowed}. Received: {name}={getattr(self, name)!r}")
