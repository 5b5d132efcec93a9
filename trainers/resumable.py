"""`fit()` that survives being killed: deterministic batches, step checkpoints, NaN guard.

Epoch e visits the training arrays in the order
`numpy.random.default_rng([seed, e]).permutation(N)`, a pure function of the
seed and the epoch, so a resumed run sees the very batches it would have
seen. Checkpoints (`poecaps.trainers.checkpoints`) are written every `save_every`
steps and at the end of every epoch; `resume=True` restores the newest good
one, finishes its epoch from the next step and goes on. Together with the
trainer's own `SeedGenerator` states, which the checkpoint holds, a run
killed at any moment and resumed ends with the weights an uninterrupted run
reaches (up to float tolerance).
"""

import contextlib
import os
import sys

import keras
import numpy as np
from keras import ops

from poecaps.errors import CheckpointError, InputError
from poecaps.trainers import NAN_POLICIES
from poecaps.trainers.base import Trainer
from poecaps.trainers.batch import check_batch
from poecaps.trainers.checkpoints import CheckpointManager
from poecaps.trainers.guard import NonFiniteGuard
from poecaps.validation import (
    check_choice,
    check_integer,
    check_integers,
    check_seed,
    check_verbose,
)


def epoch_order(seed, epoch, size):
    """The order in which epoch `epoch` visits `size` examples: a seed and an epoch (integers >= 0) and a size
    (an integer >= 0), else an `InputError`, where `int` would truncate a seed of 1.5 to another run's order."""
    seed, epoch = check_seed(seed), check_integer(epoch, "epoch", minimum=0)
    return np.random.default_rng([seed, epoch]).permutation(check_integer(size, "size", minimum=0))


class EpochBatches(keras.utils.PyDataset):
    """Batches of `arrays` in the order of `epoch_order`, from step `start` of epoch `epoch`.

    One Keras epoch serves the steps `start, ..., ceil(N / batch_size) - 1`
    of the current epoch. `fit()` must get `shuffle=False` and the
    `EpochBatches.Sync` callback, which moves the dataset to each epoch as it
    begins (Keras also reads a batch or two before training to build, so the
    dataset cannot count epochs itself).

    Args:
        arrays: a tuple or list of one array (x) or two (x, y) with the same
            first dimension, at least one example.
        batch_size: examples per batch, an integer >= 1 (the last batch of an
            epoch may be smaller).
        seed: seed of the orders, an integer >= 0.
        epoch: the epoch to start in (>= 0).
        start: the step of `epoch` to start at.

    Anything else is an `InputError`: a bare array would be read as one
    array per example, a y longer than x would lose its last rows without a
    word, and a float seed would be truncated.
    """

    def __init__(self, arrays, batch_size, seed, epoch=0, start=0):
        super().__init__()
        if (not isinstance(arrays, (tuple, list)) or len(arrays) not in (1, 2)
                or any(np.ndim(a) == 0 for a in arrays) or len({len(a) for a in arrays}) != 1):
            shapes = [np.shape(a) for a in arrays] if isinstance(arrays, (tuple, list)) else type(arrays).__name__
            raise InputError(f"arrays must be (x,) or (x, y) with one first dimension. Received: {shapes}")
        self.arrays = tuple(arrays)
        self.batch_size = check_integer(batch_size, "batch_size")
        self.seed = check_seed(seed)
        self.size = len(arrays[0])
        self.steps_per_epoch = -(-self.size // self.batch_size)
        if not 0 <= start < self.steps_per_epoch:
            raise InputError(f"start must be in [0, {self.steps_per_epoch}). Received: start={start}")
        self.epoch = epoch
        self.start = start
        self._order = epoch_order(seed, epoch, self.size)

    def __len__(self):
        return self.steps_per_epoch - self.start

    def __getitem__(self, index):
        step = self.start + index
        rows = np.sort(self._order[step * self.batch_size:(step + 1) * self.batch_size])
        batch = tuple(a[rows] for a in self.arrays)
        return batch[0] if len(batch) == 1 else batch

    def set_epoch(self, epoch):
        if epoch != self.epoch:
            self.epoch, self.start = epoch, 0
            self._order = epoch_order(self.seed, epoch, self.size)

    class Sync(keras.callbacks.Callback):
        def __init__(self, data):
            super().__init__()
            self.data = data

        def on_epoch_begin(self, epoch, logs=None):
            self.data.set_epoch(epoch)


class StepCheckpoint(keras.callbacks.Callback):
    """Writes a checkpoint every `every` steps (0: never) and at the end of every epoch.

    Keras calls back after each `steps_per_execution` steps (`compile`), with
    the index of the last one; a checkpoint is written after every call whose
    steps reached a multiple of `every`, so with `steps_per_execution > every`
    at every call. `extra` (JSON-able) goes into every checkpoint's header.
    """

    def __init__(self, manager, steps_per_epoch, every=0, start_step=0, extra=None):
        super().__init__()
        self.manager = manager
        self.extra = extra
        self.steps_per_epoch = steps_per_epoch
        self.every = every
        self.start_step = start_step
        self.epoch = 0
        self.done = 0       # the global step reached at the last call

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.done = epoch * self.steps_per_epoch + self.start_step

    def on_train_batch_end(self, batch, logs=None):
        step = self.start_step + batch + 1
        global_step = self.epoch * self.steps_per_epoch + step
        crossed = self.every and global_step // self.every > self.done // self.every
        self.done = global_step
        if crossed and step < self.steps_per_epoch:
            self.manager.save(self.model, self.epoch, step, global_step, self.extra)

    def on_epoch_end(self, epoch, logs=None):
        self.start_step = 0
        self.manager.save(self.model, epoch + 1, 0, (epoch + 1) * self.steps_per_epoch, self.extra)


class KeepTrainedWeights(keras.callbacks.Callback):
    """Ends a `fit` with the trainable weights its last epoch trained, for a `fit` that training goes on after.

    At the end of `fit` Keras calls `optimizer.finalize_variable_values`,
    which under `use_ema=True` overwrites the weights with their moving
    averages: right for the end of training, wrong before more of it.
    """

    def on_epoch_end(self, epoch, logs=None):
        self.trained = [ops.copy(v.value) for v in self.model.trainable_weights]

    def on_train_end(self, logs=None):
        for variable, value in zip(self.model.trainable_weights, getattr(self, "trained", ())):
            variable.assign(value)


def as_examples(values, name):
    """`values` (a NumPy array, a tensor, or a list of equal-shaped examples) as a NumPy array, or None.

    `fit_resumable` orders, batches and checkpoints the examples itself, so a
    `tf.data.Dataset`, a `PyDataset` or a generator, whose order it cannot
    set, is an `InputError` naming the type.
    """
    if values is None or isinstance(values, np.ndarray):
        return values
    if isinstance(values, (list, tuple)):
        try:
            return np.asarray(values)
        except ValueError as error:
            raise InputError(f"{name} must hold equal-shaped examples. Received: a {type(values).__name__} "
                             f"({error})") from None
    if hasattr(values, "shape") and hasattr(values, "dtype"):
        return np.asarray(keras.ops.convert_to_numpy(values))
    raise InputError(f"fit_resumable orders, batches and checkpoints the examples itself, so {name} must be an "
                     f"array (NumPy, a tensor or a list). Received: {type(values).__name__}; train on a dataset "
                     "with the trainer's own fit.")


def _validation_arrays(validation_data):
    """`(x, y, sample weights)` of `validation_data` given as arrays (absent ones None), or None for none or
    a dataset (which Keras reads itself)."""
    if isinstance(validation_data, (tuple, list)):
        return (*validation_data, None, None)[:3]
    if hasattr(validation_data, "shape"):
        return validation_data, None, None
    return None


@contextlib.contextmanager
def _silenced(callbacks, hook):
    """`callbacks` whose `hook` (a method's name, "on_train_end" say) does nothing inside the block."""
    own = [callback.__dict__.get(hook) for callback in callbacks]    # a hook set on the object itself, if any
    for callback in callbacks:
        setattr(callback, hook, lambda logs=None: None)
    try:
        yield
    finally:
        for callback, method in zip(callbacks, own):
            if method is None:
                delattr(callback, hook)
            else:
                setattr(callback, hook, method)


def _check_same_order(path, header, order):
    """Refuse to resume inside an epoch with batches in another order than the checkpoint's (`CheckpointError`).

    The rest of an interrupted epoch is the batches after the checkpoint's step in the epoch's order, which the
    number of examples, the batch size and the seed fix: with any of them changed, the epoch would go on over
    another cut of the data, some examples twice and others never. A checkpoint at an epoch's end, or one that
    recorded no order (written before it was recorded), resumes as it is.
    """
    recorded = header.get("extra", {}).get("batch_order")
    if header["step"] == 0 or recorded is None or recorded == order:
        return
    changed = ", ".join(f"{k}: checkpoint {recorded.get(k)!r}, now {v!r}" for k, v in order.items()
                        if recorded.get(k) != v)
    raise CheckpointError(f"{path} stopped inside epoch {header['epoch'] + 1} "
                          f"(step {header['step']}), whose remaining batches the examples, batch size and seed fix; "
                          f"they changed ({changed}). Resume with the same data, batch_size and seed, or start over "
                          "(resume=False).")


def _merge(history, more):
    for key, values in more.history.items():
        history.setdefault(key, []).extend(values)


def fit_resumable(trainer, x, y=None, *, epochs, batch_size, seed, checkpoint_dir=None,
                  checkpoint_config=None, resume=False, save_every=0, on_nan="stop",
                  fault_log=None, callbacks=(), validation_data=None, verbose="auto"):
    """Train `trainer` (a compiled `keras.Model`) with checkpoints, resume and the NaN guard.

    Args:
        trainer: a compiled trainer (any poecaps trainer).
        x, y: training arrays (y may be None): NumPy arrays, tensors or lists of examples (`as_examples`).
        epochs: total epochs of the run (a resumed run counts the ones already done).
        batch_size: global batch size (split over replicas under a strategy).
        seed: seed of the batch orders.
        checkpoint_dir: folder of the checkpoints, or None for none.
        checkpoint_config: settings a resumed run must share (see `CheckpointManager`).
        resume: go on from the newest good checkpoint (else start over and clear them); from one inside an
            epoch only with the same number of examples, batch_size and seed (`CheckpointError` otherwise).
        save_every: also checkpoint every this many steps (0: only at epoch ends).
        on_nan: "stop", "reduce-lr" or "off" (see `NonFiniteGuard`).
        fault_log: JSON-lines file for NaN events.
        callbacks: further Keras callbacks (run after the guard, before the checkpoint). A run resumed
            mid-epoch fits twice (the interrupted epoch, then the rest); they see one training, begun and
            ended once (EarlyStopping keeps its patience, CSVLogger its file).
        validation_data: passed to `fit`: `(x, y)`, `(x,)`, x alone or a dataset, as Keras takes it; arrays
            are checked by the trainer's `check_inputs` before training.
        verbose: passed to `fit`; "auto" is a progress bar at a terminal or
            in a notebook and one line per epoch elsewhere (Keras draws its
            bar into a log file frame by frame, a line of text each step).

    Returns:
        The merged history dict (`{metric: [per-epoch values]}`) of this call.
    """
    check_choice(on_nan, "on_nan", NAN_POLICIES)
    if check_verbose(verbose, allow_auto=True) == "auto":
        live = getattr(sys.stdout, "isatty", lambda: False)() or "ipykernel" in sys.modules
        verbose = 1 if live or "PYCHARM_HOSTED" in os.environ else 2
    epochs, batch_size = check_integers(epochs=epochs, batch_size=batch_size)
    seed = check_seed(seed)
    save_every = check_integer(save_every, "save_every", minimum=0)
    x, y = as_examples(x, "x"), as_examples(y, "y")
    arrays = (x,) if y is None else (x, y)
    if y is not None and len(y) != len(x):
        raise InputError(f"x and y must have as many examples. Received: {len(x)} and {len(y)}")
    validation = _validation_arrays(validation_data)
    if isinstance(trainer, Trainer):      # what its steps would refuse once traced, before any weight moves
        check_batch(trainer, y)
        if validation is not None:
            check_batch(trainer, *validation[1:])
    if hasattr(trainer, "check_inputs"):
        trainer.check_inputs(x, y)
        if validation is not None:
            trainer.check_inputs(*validation[:2])
    if len(x) == 0:
        raise InputError("The training data is empty. Received: x with 0 examples")
    with trainer.distribute_strategy.scope():
        if not trainer.built:
            trainer(x[:1])
        if not trainer.optimizer.built:
            trainer.optimizer.build(trainer.trainable_variables)
    steps_per_epoch = -(-len(x) // batch_size)
    # what fixes the order of the batches: a run resumed inside an epoch goes on with the batches after `step`
    order = {"examples": len(x), "batch_size": batch_size, "seed": seed}
    epoch, start = 0, 0
    manager = None
    if checkpoint_dir is not None:
        manager = CheckpointManager(checkpoint_dir, config=checkpoint_config)
        if resume:
            header = manager.restore(trainer, check=lambda path, header: _check_same_order(path, header, order))
            if header is not None:
                epoch, start = header["epoch"], header["step"]
        else:
            manager.clear()
    history = {}
    if epoch >= epochs:
        print(f"Already trained for {epoch} of {epochs} epochs.")
        # The checkpoint holds the weights the last epoch trained; end as that run's fit ended (under
        # use_ema=True, with the moving averages).
        trainer.optimizer.finalize_variable_values(trainer.trainable_weights)
        return history
    guard = [] if on_nan == "off" else [NonFiniteGuard(on_nan, fault_log)]
    checkpoint = [] if manager is None else [StepCheckpoint(manager, steps_per_epoch, save_every, start,
                                                            {"batch_order": order})]
    all_callbacks = guard + list(callbacks) + checkpoint
    def run(data, last_epoch, more=()):
        _merge(history, trainer.fit(data, initial_epoch=data.epoch, epochs=last_epoch, shuffle=False,
                                    validation_data=validation_data, verbose=verbose,
                                    callbacks=[EpochBatches.Sync(data), *all_callbacks, *more]))

    user = list(callbacks)
    if start:   # finish the interrupted epoch first: Keras epochs all have one length
        going_on = epoch + 1 < epochs
        with _silenced(user, "on_train_end") if going_on else contextlib.nullcontext():
            run(EpochBatches(arrays, batch_size, seed, epoch, start), epoch + 1,
                [KeepTrainedWeights()] if going_on else [])
        epoch += 1
        if trainer.stop_training:   # a callback stopped training (EarlyStopping, TerminateOnNaN): stay stopped
            trainer.optimizer.finalize_variable_values(trainer.trainable_weights)
            if going_on:            # the training ends here, for the callbacks too
                for callback in user:
                    callback.on_train_end({key: values[-1] for key, values in history.items()})
            return history
        if going_on:
            with _silenced(user, "on_train_begin"):
                run(EpochBatches(arrays, batch_size, seed, epoch, 0), epochs)
        return history
    run(EpochBatches(arrays, batch_size, seed, epoch, 0), epochs)
    return history
