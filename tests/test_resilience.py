"""Runs that survive: atomic checkpoints, kill-and-resume, corrupted checkpoints, the NaN guard."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from keras import ops
from small_trainers import TRAINER_NAMES, each_trainer

from poecaps.capsules import squash
from poecaps.errors import CheckpointError, InputError, NonFiniteError
from poecaps.experts import CapsuleExperts
from poecaps.rbm import BernoulliRBM
from poecaps.routing import DynamicRouting
from poecaps.trainers.cd import CDTrainer, default_optimizer
from poecaps.trainers.checkpoints import CheckpointManager
from poecaps.trainers.guard import NonFiniteGuard
from poecaps.trainers.resumable import EpochBatches, epoch_order, fit_resumable
from poecaps.trainers.schedule import ScaledSchedule, learning_rate_scale

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "resume_run.py")


def _capsule_trainer(seed=0, num_out=3, shards=1):
    keras.utils.set_random_seed(seed)
    model = CapsuleExperts(num_out, 5, routing=DynamicRouting(2, "cosine"),
                           kernel_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=seed))
    model.build((None, 10, 4))
    trainer = CDTrainer(model, seed=seed, shards=shards)
    trainer.compile(optimizer=default_optimizer(0.05, 6, 0.9, 0.9))
    return trainer


def _sharded_capsule_trainer(seed=0):
    return _capsule_trainer(seed, shards=2)


def _rbm_trainer(seed=0):
    keras.utils.set_random_seed(seed)
    model = BernoulliRBM(6, seed=seed)
    model.build((None, 20))
    trainer = CDTrainer(model, steps=2, seed=seed)
    trainer.compile(optimizer=default_optimizer(0.05, 6, 0.9, 0.9))
    return trainer


@pytest.fixture
def capsules(rng):
    return np.asarray(squash(rng.normal(size=(48, 10, 4)))).astype("float32")


@pytest.fixture
def binary(rng):
    return (rng.uniform(size=(48, 20)) < 0.3).astype("float32")


def _weights(trainer):
    return [np.array(w) for w in trainer.energy_model.get_weights()]


def test_epoch_batches_cover_each_epoch_once_in_a_seeded_order():
    x = np.arange(21, dtype="float32")[:, None]
    data = EpochBatches((x,), batch_size=4, seed=3, epoch=2, start=0)
    assert len(data) == 6
    seen = np.concatenate([data[k][:, 0] for k in range(len(data))])
    np.testing.assert_array_equal(np.sort(seen), x[:, 0])
    np.testing.assert_array_equal(np.sort(seen[:4]), np.sort(epoch_order(3, 2, 21)[:4]))
    late = EpochBatches((x,), batch_size=4, seed=3, epoch=2, start=4)
    assert len(late) == 2
    np.testing.assert_array_equal(late[0], data[4])
    assert not np.array_equal(epoch_order(3, 2, 21), epoch_order(3, 3, 21))


_X = np.arange(10, dtype="float32")[:, None]


@pytest.mark.parametrize("make, message", [
    (lambda: EpochBatches((_X, np.arange(12)), 4, 0), "one first dimension"),   # y's last rows dropped silently
    (lambda: EpochBatches((_X, np.arange(6)), 4, 0), "one first dimension"),    # an IndexError at the 2nd batch
    (lambda: EpochBatches(_X, 4, 0), "one first dimension"),                    # each example read as an array
    (lambda: EpochBatches((_X,), 2.5, 0), "batch_size must be an integer >= 1"),
    (lambda: EpochBatches((_X,), 0, 0), "batch_size must be an integer >= 1"),  # ZeroDivisionError
    (lambda: EpochBatches((_X,), 4, 1.5), "seed must be an integer >= 0"),      # read as seed 1's order
    (lambda: epoch_order(1.5, 0, 10), "seed must be an integer >= 0"),
    (lambda: epoch_order(1, -1, 10), "epoch must be an integer >= 0"),
])
def test_epoch_batches_refuse_arrays_and_settings_they_would_misread(make, message):
    with pytest.raises(InputError, match=message):
        make()


@pytest.mark.parametrize("make, data", [(_capsule_trainer, "capsules"), (_sharded_capsule_trainer, "capsules"),
                                        (_rbm_trainer, "binary")])
def test_resuming_mid_epoch_reaches_the_uninterrupted_weights(tmp_path, make, data, request):
    """Stop after 1 epoch plus 4 steps (by dropping later checkpoints), resume, compare."""
    _check_resumed_mid_epoch(make, request.getfixturevalue(data), 3, tmp_path)


def _check_resumed_mid_epoch(make, x, epochs, tmp_path):
    """Train `epochs` epochs with `save_every=2`, and `epochs - 1` whose newest checkpoint (the epoch's end) is
    then dropped, so that a resumed run (of other initial weights and seeds) goes on from within the epoch:
    its weights must equal the uninterrupted run's. Returns the checkpoints the stopped run wrote."""
    whole = make()
    fit_resumable(whole, x, epochs=epochs, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "a"),
                  save_every=2, verbose=0)
    part = make()
    fit_resumable(part, x, epochs=epochs - 1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "b"),
                  save_every=2, verbose=0)
    written = CheckpointManager(str(tmp_path / "b"), keep=3).paths()
    os.remove(written[0])
    resumed = make(seed=5)   # other initial weights and seeds: all must come from the checkpoint
    fit_resumable(resumed, x, epochs=epochs, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "b"),
                  save_every=2, resume=True, verbose=0)
    for a, b in zip(_weights(whole), _weights(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    return [os.path.basename(path) for path in written]


def test_resuming_mid_epoch_under_moving_average_weights_reaches_the_uninterrupted_weights(tmp_path, capsules):
    """With `use_ema=True` Keras overwrites the weights with their moving averages at the end of every `fit`. A
    run resumed mid-epoch fits twice (the interrupted epoch, then the rest), and its second fit went on from the
    averages, so every weight ended off the uninterrupted run's. Now the first fit ends with the trained
    weights, and the run reaches the uninterrupted weights. A finished run resumed (nothing left to train) ends
    with the averages too, as the run did; before, with the last epoch's trained weights from its checkpoint."""
    def make(seed=0):
        trainer = _capsule_trainer(seed)
        trainer.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, use_ema=True, ema_momentum=0.5))
        return trainer

    _check_resumed_mid_epoch(make, capsules, 3, tmp_path)
    finished = make(seed=5)       # the finished run, resumed: nothing to train, and the weights it ended with
    fit_resumable(finished, capsules, epochs=3, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "a"),
                  resume=True, verbose=0)
    uninterrupted = make()
    fit_resumable(uninterrupted, capsules, epochs=3, batch_size=8, seed=0, verbose=0)
    for a, b in zip(_weights(uninterrupted), _weights(finished)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_callback_that_stops_the_interrupted_epoch_stops_the_resumed_run(tmp_path, capsules):
    """A run resumed mid-epoch finishes that epoch in a `fit` of its own. A callback that stops training there
    (as EarlyStopping or TerminateOnNaN do, by `model.stop_training`) stops the run, as it would have stopped
    the uninterrupted run at that epoch's end; before, the next `fit` trained on to the last epoch."""
    class StopAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    fit_resumable(_capsule_trainer(), capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path),
                  save_every=2, verbose=0)
    os.remove(CheckpointManager(str(tmp_path)).paths()[0])       # the newest left: step 4 of epoch 1
    resumed = _capsule_trainer()
    history = fit_resumable(resumed, capsules, epochs=3, batch_size=8, seed=0, checkpoint_dir=str(tmp_path),
                            save_every=2, resume=True, verbose=0, callbacks=[StopAtEpochEnd()])
    assert len(history["p_on"]) == 1
    assert int(ops.convert_to_numpy(resumed.optimizer.iterations)) == 6      # epoch 1's six steps, no more


def test_callbacks_see_a_run_resumed_mid_epoch_as_one_training(tmp_path, capsules):
    """A run resumed mid-epoch fits twice (the interrupted epoch, then the rest), and its callbacks are told of
    one training: begun once, every epoch's end, ended once. So EarlyStopping keeps its count of epochs without
    improvement, and a CSVLogger (append=False) its file, a row for every epoch. Before, each fit began and
    ended them: the second fit reset EarlyStopping and rewrote the log without the interrupted epoch's row. A
    callback that stops the interrupted epoch ends the training once too."""
    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = []

        def on_train_begin(self, logs=None):
            self.calls.append("begin")

        def on_epoch_end(self, epoch, logs=None):
            self.calls.append(epoch)

        def on_train_end(self, logs=None):
            self.calls.append("end")

    class StopAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    def resumed_run(callbacks):
        folder = str(tmp_path / str(len(os.listdir(tmp_path))))
        fit_resumable(_capsule_trainer(), capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=folder,
                      save_every=2, verbose=0)
        os.remove(CheckpointManager(folder).paths()[0])       # the newest left: step 4 of epoch 0 (of 6 steps)
        fit_resumable(_capsule_trainer(), capsules, epochs=3, batch_size=8, seed=0, checkpoint_dir=folder,
                      save_every=2, resume=True, verbose=0, callbacks=callbacks)

    recorder, log = Recorder(), str(tmp_path / "log.csv")
    resumed_run([recorder, keras.callbacks.CSVLogger(log, append=False)])
    assert recorder.calls == ["begin", 0, 1, 2, "end"]
    with open(log) as handle:
        assert [line.split(",")[0] for line in handle.read().splitlines()] == ["epoch", "0", "1", "2"]
    stopped = Recorder()
    resumed_run([stopped, StopAtEpochEnd()])
    assert stopped.calls == ["begin", 0, "end"]
    assert all("on_train_begin" not in vars(c) and "on_train_end" not in vars(c) for c in (recorder, stopped))


def test_save_every_holds_when_keras_calls_back_every_few_steps(tmp_path, capsules):
    """Compiled with `steps_per_execution=3`, Keras calls back after steps 3 and 6 of an epoch of 6 (48
    examples in batches of 8): `save_every=2` writes after step 3 (steps 1-3 reached 2) and at the epoch's end,
    where before only steps that were multiples of 2 were looked at, and the epoch's end alone was written.
    A run resumed from step 3 reaches the uninterrupted weights."""
    def make(seed=0):
        trainer = _capsule_trainer(seed)
        trainer.compile(optimizer=default_optimizer(0.05, 6, 0.9, 0.9), steps_per_execution=3)
        return trainer

    assert _check_resumed_mid_epoch(make, capsules, 2, tmp_path) == ["ckpt-000000006.npz", "ckpt-000000003.npz"]


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_fit_resumable_takes_tensors_and_lists_as_arrays_and_refuses_a_dataset(name, make, x, y):
    """A tensor or a list of examples trains to the very weights the NumPy arrays do (before, indexing a tensor
    with the epoch's order raised a TypeError, and a list failed inside the model); a `tf.data.Dataset`, whose
    order `fit_resumable` cannot set, is refused by type (before: a misleading shape or dtype message, or a
    TypeError)."""
    import tensorflow as tf

    def trained(x, y):
        keras.utils.set_random_seed(0)
        trainer = make()
        # eagerly: what is tested is how the examples reach the steps, not the compiled steps (3 compilations)
        trainer.compile(optimizer=keras.optimizers.SGD(1e-2), run_eagerly=True)
        fit_resumable(trainer, x, y, epochs=2, batch_size=3, seed=0, verbose=0)
        return trainer.get_weights()

    expected = trained(x, y)
    for convert in (tf.constant, list):
        for got, want in zip(trained(convert(x), None if y is None else convert(y)), expected):
            np.testing.assert_array_equal(got, want)
    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-2))
    with pytest.raises(InputError, match="^fit_resumable orders, batches and checkpoints the examples itself, so x "
                                         "must be an array .* Received: _BatchDataset; train on a dataset with the "
                                         "trainer's own fit.$"):
        fit_resumable(trainer, tf.data.Dataset.from_tensor_slices(x).batch(4), y, epochs=1, batch_size=4, seed=0)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_every_trainer_resumed_mid_epoch_from_other_state_reaches_the_uninterrupted_weights(tmp_path, name, make, x,
                                                                                             y):
    """Every variable a trainer's steps read is in its checkpoint: a run resumed within an epoch, whose every
    variable (weights, seed generator states, step counters) was moved first, trains to the uninterrupted run's
    weights. Before, the variational trainer's count of draws was not a Keras variable, so no checkpoint held
    it: a resumed run drew its first steps' noise again."""
    x = np.concatenate([x] * 3)
    y = None if y is None else np.concatenate([y] * 3)

    def trained(directory, epochs, resume=False, move=False):
        keras.utils.set_random_seed(0)
        trainer = make()
        trainer.compile(optimizer=keras.optimizers.Adam(1e-2))
        if move:
            trainer(x)
            for variable in trainer.variables:
                variable.assign(variable + ops.cast(7 if "int" in variable.dtype else 0.5, variable.dtype))
        fit_resumable(trainer, x, y, epochs=epochs, batch_size=4, seed=0, checkpoint_dir=str(tmp_path / directory),
                      save_every=2, resume=resume, verbose=0)
        return trainer

    whole = trained("whole", 3)
    trained("stopped", 2)
    os.remove(CheckpointManager(str(tmp_path / "stopped"), keep=3).paths()[0])   # the end of epoch 2: resume within it
    resumed = trained("stopped", 3, resume=True, move=True)
    for a, b in zip(whole.get_weights(), resumed.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name, make, x, y", each_trainer(), ids=TRAINER_NAMES)
def test_fit_resumable_validates_on_a_dataset_and_checks_validation_arrays_before_training(name, make, x, y):
    """Validation data as Keras takes it: a `tf.data.Dataset` is validated on (before, `fit_resumable` unpacked
    the dataset's batches into `check_inputs`: a misleading message), and arrays that a trainer's steps would
    refuse (sample weights; for a trainer of pairs, no y) are refused before any weight moves (before, at the
    end of the first epoch, or by a TypeError)."""
    import tensorflow as tf

    trainer = make()
    trainer.compile(optimizer=keras.optimizers.SGD(1e-2), run_eagerly=True)     # one epoch: its steps, eagerly
    pairs = x if y is None else (x, y)
    history = fit_resumable(trainer, x, y, epochs=1, batch_size=4, seed=0, verbose=0,
                            validation_data=tf.data.Dataset.from_tensor_slices(pairs).batch(4))
    assert {f"val_{metric.name}" for metric in trainer.metrics} <= set(history)
    before = [w.copy() for w in trainer.get_weights()]
    refused = [((x, y, np.ones(len(x))), "takes no sample_weight or class_weight")]
    if y is not None:
        refused.append((x, r"learns from \(\w+, \w+\) pairs"))
    for validation, message in refused:
        with pytest.raises(InputError, match=message):
            fit_resumable(trainer, x, y, epochs=1, batch_size=4, seed=0, verbose=0, validation_data=validation)
    for a, b in zip(trainer.get_weights(), before):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_holds_optimizer_seed_and_learning_rate_scale(tmp_path, binary):
    trainer = _rbm_trainer()
    fit_resumable(trainer, binary, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path), verbose=0)
    learning_rate_scale(trainer.optimizer).assign(0.25)
    path = CheckpointManager(str(tmp_path)).save(trainer, epoch=1, step=0, global_step=6)
    with np.load(path) as stored:
        header = json.loads(str(stored["header"]))
    names = " ".join(header["names"])
    assert "iteration" in names and "seed_generator_state" in names and "learning_rate_scale" in names
    fresh = _rbm_trainer(seed=9)
    fresh(binary[:1])
    fresh.optimizer.build(fresh.trainable_variables)
    CheckpointManager(str(tmp_path), log=lambda m: None).restore(fresh)
    assert float(ops.convert_to_numpy(learning_rate_scale(fresh.optimizer))) == 0.25
    assert int(ops.convert_to_numpy(fresh.optimizer.iterations)) == 6
    for a, b in zip(_weights(trainer), _weights(fresh)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("damage", ["truncate", "flip_bytes", "empty"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsules, damage):
    trainer = _capsule_trainer()
    fit_resumable(trainer, capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path),
                  save_every=2, verbose=0)
    manager = CheckpointManager(str(tmp_path))
    newest, previous = manager.paths()[:2]
    size = os.path.getsize(newest)
    if damage == "truncate":
        with open(newest, "r+b") as handle:
            handle.truncate(size // 2)
    elif damage == "empty":
        open(newest, "wb").close()
    else:   # same length, a valid archive header, one array's bytes changed
        with open(newest, "r+b") as handle:
            handle.seek(size - 400)
            chunk = bytearray(handle.read(8))
            handle.seek(size - 400)
            handle.write(bytes(b ^ 0xFF for b in chunk))
    messages = []
    fresh = _capsule_trainer(seed=4)
    fresh(capsules[:1])
    fresh.optimizer.build(fresh.trainable_variables)
    header = CheckpointManager(str(tmp_path), log=messages.append).restore(fresh)
    assert header["global_step"] == 4   # the newest (end of epoch 1, step 6) was damaged
    assert any(os.path.basename(newest) in m and "corrupted" in m and os.path.basename(previous) in m
               for m in messages), messages


def test_checkpoint_from_another_configuration_is_refused(tmp_path, capsules):
    trainer = _capsule_trainer()
    fit_resumable(trainer, capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path),
                  checkpoint_config={"num_capsules": 3}, verbose=0)
    with pytest.raises(CheckpointError, match="different configuration.*num_capsules: checkpoint 3, now 4"):
        fit_resumable(_capsule_trainer(num_out=4), capsules, epochs=2, batch_size=8, seed=0,
                      checkpoint_dir=str(tmp_path), checkpoint_config={"num_capsules": 4}, resume=True,
                      verbose=0)
    with pytest.raises(CheckpointError, match="do not match this trainer"):
        fit_resumable(_capsule_trainer(num_out=4), capsules, epochs=2, batch_size=8, seed=0,
                      checkpoint_dir=str(tmp_path), checkpoint_config={"num_capsules": 3}, resume=True,
                      verbose=0)


@pytest.mark.parametrize("change", [{"batch_size": 6}, {"seed": 1}, {"examples": 40}])
def test_resuming_inside_an_epoch_with_another_batch_order_is_refused_before_any_weight_moves(tmp_path, capsules,
                                                                                          change):
    """The rest of an interrupted epoch is the batches after its step in the epoch's order. Before, a run resumed
    with another batch size, seed or number of examples went on over another cut of the data (some examples
    twice, others never) without a word. An epoch's end resumes with any of them (the next epoch is whole)."""
    recorded = {"batch_size": 8, "seed": 0, "examples": 48}
    settings = {**recorded, **change}
    stopped = _capsule_trainer()
    fit_resumable(stopped, capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path), save_every=2,
                  verbose=0)
    written = CheckpointManager(str(tmp_path)).paths()
    os.remove(written[0])                                      # the epoch's end: the newest left is step 4 of 6
    resumed = _capsule_trainer(seed=5)
    before = _weights(resumed)
    (name, value), = change.items()
    message = re.escape(f"ckpt-000000004.npz stopped inside epoch 1 (step 4), whose remaining batches the examples, "
                        f"batch size and seed fix; they changed ({name}: checkpoint {recorded[name]}, now {value})")
    with pytest.raises(CheckpointError, match=message):
        fit_resumable(resumed, capsules[:settings["examples"]], epochs=2, batch_size=settings["batch_size"],
                      seed=settings["seed"], checkpoint_dir=str(tmp_path), save_every=2, resume=True, verbose=0)
    for a, b in zip(before, _weights(resumed)):                # refused before the checkpoint was restored
        np.testing.assert_array_equal(a, b)
    # the same order resumes; and from an epoch's end, another one does too
    fit_resumable(resumed, capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path), save_every=2,
                  resume=True, verbose=0)
    fit_resumable(resumed, capsules[:settings["examples"]], epochs=2, batch_size=settings["batch_size"],
                  seed=settings["seed"], checkpoint_dir=str(tmp_path), resume=True, verbose=0)


def test_no_temporary_file_is_left_and_only_the_newest_are_kept(tmp_path, capsules):
    trainer = _capsule_trainer()
    fit_resumable(trainer, capsules, epochs=2, batch_size=8, seed=0, checkpoint_dir=str(tmp_path),
                  save_every=1, verbose=0)
    files = sorted(os.listdir(tmp_path))
    assert files == ["ckpt-000000010.npz", "ckpt-000000011.npz", "ckpt-000000012.npz"]


def _spawn(run_dir, model, resume, sleep):
    command = [sys.executable, WORKER, str(run_dir), model, "--sleep", str(sleep)]
    return subprocess.Popen(command + (["--resume"] if resume else []), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _newest_step(run_dir):
    names = glob.glob(os.path.join(run_dir, "checkpoints", "ckpt-*.npz"))
    return max((int(os.path.basename(n)[5:14]) for n in names), default=-1)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["rbm", "capsules"])
def test_sigkill_at_random_moments_then_resume_matches_uninterrupted_run(tmp_path, model):
    """48 steps (4 epochs of 12); killed with SIGKILL three times mid-run, resumed each time."""
    reference = tmp_path / "reference"
    reference.mkdir()
    done = _spawn(reference, model, resume=False, sleep=0.0)
    assert done.wait(timeout=300) == 0, done.stdout.read()
    killed = tmp_path / "killed"
    killed.mkdir()
    rng = np.random.default_rng(1)
    kills = []
    for attempt in range(3):
        worker = _spawn(killed, model, resume=attempt > 0, sleep=0.08)
        start = _newest_step(killed)
        deadline = time.time() + 120
        while _newest_step(killed) <= start and time.time() < deadline and worker.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))   # anywhere: mid-step, mid-write, between checkpoints
        assert worker.poll() is None, "the worker finished before it could be killed"
        worker.send_signal(signal.SIGKILL)
        assert worker.wait(timeout=60) == -signal.SIGKILL
        kills.append(_newest_step(killed))
        assert not (killed / "final.npz").exists()
    assert kills == sorted(kills) and kills[-1] < 48, kills   # progress kept, never finished
    last = _spawn(killed, model, resume=True, sleep=0.0)
    output = last.communicate(timeout=300)[0]
    assert last.returncode == 0, output
    assert "Resumed from" in output
    with np.load(reference / "final.npz") as a, np.load(killed / "final.npz") as b:
        for key in a.files:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, atol=1e-7)


class _InjectNaN(keras.callbacks.Callback):
    def __init__(self, *at_batches):
        super().__init__()
        self.at_batches = at_batches

    def on_train_batch_begin(self, batch, logs=None):
        if batch in self.at_batches:
            kernel = self.model.energy_model.kernel
            kernel.assign(ops.where(ops.arange(kernel.shape[0])[:, None, None, None] == 0,
                                    float("nan"), kernel))


class _Snapshot(keras.callbacks.Callback):
    def __init__(self, at_batch):
        super().__init__()
        self.at_batch, self.weights = at_batch, None

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.at_batch:
            self.weights = [np.array(w) for w in self.model.energy_model.get_weights()]


def test_nan_guard_restores_the_last_good_state_and_stops(tmp_path, capsules):
    trainer = _capsule_trainer()
    before = _Snapshot(2)
    log = tmp_path / "faults.jsonl"
    with pytest.raises(NonFiniteError, match=r"epoch 1, batch 4.*restored.*on_nan=reduce-lr"):
        fit_resumable(trainer, capsules, epochs=2, batch_size=8, seed=0, fault_log=str(log),
                      callbacks=[before, _InjectNaN(3)], verbose=0)
    for a, b in zip(before.weights, _weights(trainer)):
        np.testing.assert_array_equal(a, b)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(events) == 1 and events[0]["action"] == "stop" and events[0]["batch"] == 3
    assert any("kernel" in name for name in events[0]["non_finite"])


def test_nan_guard_halves_the_learning_rate_and_continues(tmp_path, capsules):
    trainer = _capsule_trainer()
    log = tmp_path / "faults.jsonl"
    history = fit_resumable(trainer, capsules, epochs=2, batch_size=8, seed=0, on_nan="reduce-lr",
                            fault_log=str(log), callbacks=[_InjectNaN(3)], verbose=0)
    assert all(np.isfinite(w).all() for w in _weights(trainer))
    assert len(history["reconstruction_error"]) == 2 and np.isfinite(history["reconstruction_error"]).all()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["action"] for e in events] == ["reduce-lr", "reduce-lr"]   # batch 3 of each epoch
    assert float(ops.convert_to_numpy(learning_rate_scale(trainer.optimizer))) == 0.25


def test_nan_guard_writes_its_log_into_a_folder_it_makes_and_refuses_a_folder_as_the_log(tmp_path, capsules):
    """Before, a log in a missing folder ended the run at the first event with FileNotFoundError, after the guard
    had restored the state and halved the rate to go on; a folder as the log failed there with IsADirectoryError."""
    trainer = _capsule_trainer()
    log = tmp_path / "not" / "yet" / "faults.jsonl"
    fit_resumable(trainer, capsules, epochs=1, batch_size=8, seed=0, on_nan="reduce-lr", fault_log=str(log),
                  callbacks=[_InjectNaN(3)], verbose=0)
    assert [json.loads(line)["action"] for line in log.read_text().splitlines()] == ["reduce-lr"]
    with pytest.raises(InputError, match=r"^log_path must be a file for the NaN events, not a folder"):
        NonFiniteGuard("stop", str(tmp_path))


def test_nan_guard_compounds_the_reductions_and_stops_at_its_limit(tmp_path, capsules):
    """Failures at batches 1, 2, 3 in a row: the rate in effect halves each time (0.5, 0.25,
    0.125), though the state restored each time is the one from before batch 1."""
    trainer = _capsule_trainer()
    log = tmp_path / "faults.jsonl"
    fit_resumable(trainer, capsules, epochs=1, batch_size=8, seed=0, on_nan="reduce-lr",
                  fault_log=str(log), callbacks=[_InjectNaN(1, 2, 3)], verbose=0)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [e["learning_rate_scale"] for e in events] == [0.5, 0.25, 0.125]
    assert [e["reductions"] for e in events] == [1, 2, 3]
    assert float(ops.convert_to_numpy(learning_rate_scale(trainer.optimizer))) == 0.125
    # with a limit of two halvings the third failure stops the run, saying so
    guard = NonFiniteGuard("reduce-lr", max_reductions=2, log=lambda *a: None)
    with pytest.raises(NonFiniteError, match="after 2 halvings"):
        fit_resumable(_capsule_trainer(), capsules, epochs=1, batch_size=8, seed=0, on_nan="off",
                      callbacks=[guard, _InjectNaN(1, 2, 3)], verbose=0)


def test_checkpoint_config_is_checked_and_kept_as_its_header_gives_it_back(tmp_path, capsules):
    """Before, a NumPy number or NaN in the config failed at the first save, after an epoch of training (or NaN
    never equalled itself on resuming), and a tuple was refused on resuming, as the list its checkpoint read back
    ('a: checkpoint [1, 2], now (1, 2)')."""
    for config, message in [({"J": np.int64(20)}, "Object of type int64 is not JSON serializable"),
                            ({"rate": float("nan")}, "Out of range float values are not JSON compliant"),
                            ([("J", 20)], "config must be a dict of JSON-able settings. Received: list")]:
        with pytest.raises(InputError, match=message):
            CheckpointManager(str(tmp_path / "refused"), config=config)
    trainer = _capsule_trainer()
    fit_resumable(trainer, capsules, epochs=1, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "run"),
                  checkpoint_config={"sizes": (3, 5)}, verbose=0)
    fit_resumable(trainer, capsules, epochs=2, batch_size=8, seed=0, checkpoint_dir=str(tmp_path / "run"),
                  checkpoint_config={"sizes": (3, 5)}, resume=True, verbose=0)
    assert CheckpointManager(str(tmp_path / "run")).paths()[0].endswith("ckpt-000000012.npz")


def test_scaled_schedule_round_trips_and_scales():
    schedule = ScaledSchedule(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5), scale=0.5)
    np.testing.assert_allclose(float(schedule(10)), 0.025, rtol=1e-6)
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(schedule))
    np.testing.assert_allclose(float(again(10)), 0.025, rtol=1e-6)


@pytest.mark.parametrize("where", ["log", "terminal", "notebook"])
def test_progress_is_a_bar_at_a_terminal_or_notebook_and_a_line_per_epoch_in_a_log(monkeypatch, capsys, where):
    """`verbose="auto"`: Keras redraws its bar every step, which a log file would keep frame by frame."""
    x = np.asarray(squash(np.random.default_rng(2).normal(size=(32, 6, 3)))).astype("float32")
    keras.utils.set_random_seed(0)
    layer = CapsuleExperts(2, 4)
    layer.build((None, 6, 3))
    trainer = CDTrainer(layer)
    trainer.compile(optimizer=default_optimizer(0.05, 4))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: where == "terminal", raising=False)
    monkeypatch.delenv("PYCHARM_HOSTED", raising=False)
    if where == "notebook":
        monkeypatch.setitem(sys.modules, "ipykernel", type(sys)("ipykernel"))
    else:
        monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    fit_resumable(trainer, x, epochs=2, batch_size=8, seed=0)
    out = capsys.readouterr().out
    assert out.count("Epoch 2/2") == 1
    if where != "log":
        assert out.count("\r") >= 4 or out.count("\b") >= 4, out       # redrawn at least once a step
    else:
        assert "\r" not in out and "\b" not in out and out.count("4/4 - ") == 2, out   # one line per epoch


@pytest.mark.parametrize("keep", [1, 2.5, "3", True])
def test_checkpoint_manager_keeps_an_integer_of_at_least_two(tmp_path, keep):
    """Before, 2.5 was taken (and failed later as a slice index), "3" raised TypeError from `<`, True passed."""
    with pytest.raises(InputError, match=rf"^keep must be an integer >= 2\. Received: keep={keep!r}$"):
        CheckpointManager(str(tmp_path / "ckpt"), keep=keep)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("max_reductions", [-1, 2.5, "3", True])
def test_the_guard_takes_a_count_of_reductions(max_reductions):
    """Before, any value was taken: -1 stopped at the first event, 2.5 allowed three halvings, "3" raised TypeError
    at the first event."""
    with pytest.raises(InputError, match=rf"^max_reductions must be an integer >= 0\. Received: "
                                         rf"max_reductions={re.escape(repr(max_reductions))}$"):
        NonFiniteGuard("reduce-lr", max_reductions=max_reductions)
    assert NonFiniteGuard("reduce-lr", max_reductions=np.int64(0)).max_reductions == 0
