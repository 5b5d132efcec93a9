"""Guarding training against NaN and infinity.

A non-finite loss, metric or weight after a step means the step must not
count: `NonFiniteGuard` puts back the last good state (weights, optimizer
state, random state) and then stops with a clear message or, with
`policy="reduce-lr"`, halves the learning rate and goes on. Either way the
event is printed and appended to a JSON-lines log.
"""

import json
import os
import time

import keras
import numpy as np
from keras import ops

from poecaps.errors import InputError, NonFiniteError
from poecaps.trainers import NAN_POLICIES
from poecaps.trainers.checkpoints import trainer_state
from poecaps.trainers.schedule import lowerable_rate
from poecaps.validation import check_choice, check_integer


def _all_finite(variables):
    # Checked where the variables live, without a copy to NumPy.
    return all(bool(ops.all(ops.isfinite(v))) for v in variables
               if np.issubdtype(np.dtype(v.dtype), np.floating))


class NonFiniteGuard(keras.callbacks.Callback):
    """Keeps the last good state in memory and restores it when a step goes non-finite.

    After every training batch it checks the batch's logged loss and metrics
    and every trainable weight. If all are finite it snapshots the trainer's
    whole state (`poecaps.trainers.checkpoints.trainer_state`); if not, it
    restores the snapshot, resets the running metrics and then, by `policy`:
    `"stop"` raises `NonFiniteError`; `"reduce-lr"` halves the learning rate
    in effect when the step failed (so successive events compound: 0.5,
    0.25, 0.125, ... of the scheduled rate) and continues, up to
    `max_reductions` times, then stops. Put it first in the callback list,
    so that later callbacks never see a bad state.

    Args:
        policy: "stop" or "reduce-lr".
        log_path: JSON-lines file that receives one record per event (its
            folder made at the first), or None; not a folder.
        max_reductions: how many halvings "reduce-lr" may make in one run.
    """

    def __init__(self, policy="stop", log_path=None, max_reductions=10, log=print):
        super().__init__()
        check_choice(policy, "policy", NAN_POLICIES[:2])
        self.policy = policy
        if log_path is not None and os.path.isdir(log_path):
            raise InputError(f"log_path must be a file for the NaN events, not a folder. Received: {log_path}")
        self.log_path = log_path
        self.max_reductions = check_integer(max_reductions, "max_reductions", minimum=0)
        self.log = log
        self.reductions = 0
        self.events = []
        self._snapshot = None
        self._epoch = 0

    def _take_snapshot(self):
        # Read tensors keep their values when the variables change afterwards (no NumPy round trip).
        self._snapshot = [ops.copy(v.value) for v in trainer_state(self.model)]

    def on_train_begin(self, logs=None):
        self._take_snapshot()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        bad = sorted(k for k, v in (logs or {}).items()
                     if isinstance(v, (int, float, np.floating, np.ndarray)) and not np.all(np.isfinite(v)))
        if not bad and _all_finite(self.model.trainable_variables):
            self._take_snapshot()
            return
        bad += [v.path for v in self.model.trainable_variables
                if not np.isfinite(ops.convert_to_numpy(v)).all()]
        event = {"time": time.time(), "epoch": self._epoch, "batch": int(batch), "non_finite": bad,
                 "action": "stop"}
        reduce = self.policy == "reduce-lr" and self.reductions < self.max_reductions
        # The snapshot holds the learning-rate scale of its own time; the reduction halves the
        # scale in effect now, so successive events compound.
        rate = lowerable_rate(self.model.optimizer) if reduce else None
        in_effect = float(ops.convert_to_numpy(rate)) if reduce else None
        for variable, value in zip(trainer_state(self.model), self._snapshot):
            variable.assign(value)
        for metric in self.model.metrics:
            metric.reset_state()
        if reduce:
            self.reductions += 1
            now = 0.5 * in_effect
            rate.assign(now)
            event.update(action="reduce-lr", learning_rate_scale=now, reductions=self.reductions)
            self._take_snapshot()
        self.events.append(event)
        if self.log_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
            with open(self.log_path, "a") as handle:
                handle.write(json.dumps(event) + "\n")
        where = f"epoch {self._epoch + 1}, batch {batch + 1}"
        if event["action"] == "stop":
            if self.policy == "reduce-lr":
                more, advice = f" after {self.reductions} halvings of the learning rate", "the data"
            else:
                more, advice = "", "the data, or set on_nan=reduce-lr to halve the learning rate and go on"
            raise NonFiniteError(
                f"Non-finite values ({', '.join(bad)}) at {where}{more}; the last good state was "
                f"restored and training stopped. Lower the learning rate or check {advice}.")
        self.log(f"WARNING: non-finite values ({', '.join(bad)}) at {where}; restored the last good "
                 f"state and halved the learning rate (now {now:g} of the schedule's, "
                 f"halving {self.reductions} of {self.max_reductions}).")
