"""Keras Models whose `train_step` trains something, and the machinery of runs that survive.

Kept free of TensorFlow at import (the modules below import it), so that
command lines can check the NaN policies' names at once.
"""

# What `NonFiniteGuard` does on a NaN (`poecaps.trainers.resumable.fit_resumable(on_nan=...)`).
NAN_POLICIES = ("stop", "reduce-lr", "off")
# How `GenerativeCapsuleTrainer` weighs each child: alike, or by its length (a capsule's activation).
CHILD_WEIGHTS = ("uniform", "lengths")
