"""Datasets as tf.data pipelines: IDX directories, system packages, TFDS.

`load(name, split)` returns a `tf.data.Dataset` of `(image float32 [H, W, C]
in [0, 1], label int64)`. Sources are tried in order unless `source` names
one: (1) an IDX directory given as `data_dir` or by `POECAPS_DATA`; (2)
well-known system locations (Debian's `dataset-fashion-mnist`); (3)
TensorFlow Datasets, using prepared data and downloading only when the
network answers (offline, `tfds.load` would retry for minutes).

A `data_dir` passed as an argument is the only source looked at: a folder
asked for by name that lacks the files is an error, never a silent switch to
another copy of the dataset. `POECAPS_DATA` is a standing default, and the
other sources follow it.
"""

import gzip
import math
import os
import socket
import struct
import zlib

import numpy as np

from poecaps.errors import InputError

DATASETS = ("mnist", "fashion_mnist")
SPLITS = ("train", "test")
SOURCES = ("idx", "system", "tfds")
CLASSES = 10        # of each dataset: digits, and Fashion-MNIST's ten kinds of garment
SYSTEM_DIRS = {
    "fashion_mnist": ["/usr/share/datasets/fashion-mnist"],
    "mnist": ["/usr/share/datasets/mnist"],
}
_IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_HOW_TO_GET = {
    "fashion_mnist": "`apt-get install -y dataset-fashion-mnist`, or go online for TFDS",
    "mnist": "set data_dir (--data-dir on the command line) to a folder of the IDX files "
             "(e.g. ../shared/data/mnist-5k), "
             "or go online for TFDS",
}


class DataError(InputError):
    """A dataset could not be found or read."""


def _open(path):
    for candidate in (path + ".gz", path):
        if os.path.exists(candidate):
            return gzip.open(candidate, "rb") if candidate.endswith(".gz") else open(candidate, "rb")
    return None


def read_idx(path):
    """Read one IDX file (optionally gzipped) into a NumPy array, checking its header."""
    handle = _open(path)
    if handle is None:
        raise FileNotFoundError(path)
    try:
        with handle:
            raw = handle.read()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a readable (gzipped) IDX file: {error}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path}: not an unsigned-byte IDX file (bad magic number)")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(">" + "I" * ndim, raw[4:4 + 4 * ndim])
    expected = math.prod(shape) + 4 + 4 * ndim          # Python ints: NumPy's prod wraps past 2**63
    if len(raw) != expected:
        raise DataError(f"{path}: IDX file holds {len(raw)} bytes, its header promises {expected} "
                        "(truncated or corrupted)")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _from_idx_dir(directory, split):
    images_name, labels_name = _IDX_FILES[split]
    images = read_idx(os.path.join(directory, images_name))
    labels = read_idx(os.path.join(directory, labels_name))
    if images.ndim not in (3, 4) or labels.ndim != 1:
        raise DataError(f"{directory}: {images_name} must hold images [N, H, W] or [N, H, W, C] and {labels_name} "
                        f"labels [N]. Received: shapes {images.shape} and {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{directory}: {len(images)} images but {len(labels)} labels")
    if len(labels) == 0:
        raise DataError(f"{directory}: {images_name} and {labels_name} hold no examples")
    if labels.max() >= CLASSES:
        raise DataError(f"{directory}: {labels_name} must hold labels 0 to {CLASSES - 1}. Received: labels up to "
                        f"{labels.max()} (a corrupted or foreign file)")
    if images.ndim == 3:
        images = images[..., None]
    return images, labels


def _network_answers(host="storage.googleapis.com", port=443, timeout=2.0):
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _from_tfds(name, split, data_dir):
    import tensorflow_datasets as tfds

    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
        if not _network_answers():
            raise DataError("TFDS has no prepared copy and the network does not answer")
        builder.download_and_prepare()
    ds = builder.as_dataset(split=split, as_supervised=True)
    images, labels = zip(*ds.as_numpy_iterator())
    return np.stack(images), np.asarray(labels)


def load_arrays(name, split, data_dir=None, source=None):
    """Like `load`, as NumPy arrays `(uint8 [N, H, W, C], int64 [N])`, plus the source used."""
    if name not in DATASETS:
        raise DataError(f"Unknown dataset; expected one of {DATASETS}. Received: name={name!r}")
    if split not in SPLITS:
        raise DataError(f"Unknown split; expected one of {SPLITS}. Received: split={split!r}")
    if source is not None and source not in SOURCES:
        raise DataError(f"Unknown source; expected one of {SOURCES}. Received: source={source!r}")
    if data_dir and source in (None, "idx"):        # a folder asked for by name is the only place looked
        try:
            images, labels = _from_idx_dir(data_dir, split)
        except FileNotFoundError as error:
            raise DataError(f"Could not load {name!r} split {split!r} from the folder given: missing {error}. "
                            f"Give a folder of the IDX files ({', '.join(_IDX_FILES[split])}, gzipped or "
                            f"not), or no folder for the other sources.") from None
        return images, labels.astype(np.int64), f"idx:{data_dir}"
    data_dir = data_dir or os.environ.get("POECAPS_DATA")
    attempts = []
    candidates = []
    if source in (None, "idx") and data_dir:
        candidates.append(("idx", data_dir))
    if source in (None, "system"):
        candidates += [("system", d) for d in SYSTEM_DIRS[name]]
    for kind, directory in candidates:
        try:
            images, labels = _from_idx_dir(directory, split)
            return images, labels.astype(np.int64), f"{kind}:{directory}"
        except FileNotFoundError as error:
            attempts.append(f"{kind} {directory}: missing {error}")
        except DataError as error:
            if source is not None:
                raise
            attempts.append(f"{kind} {directory}: {error}")
    if source in (None, "tfds"):
        try:
            images, labels = _from_tfds(name, split, data_dir if source == "tfds" else None)
            return images, labels.astype(np.int64), "tfds"
        except Exception as error:  # noqa: BLE001  (TFDS raises many types; all mean "not here")
            attempts.append(f"tfds {name}: {type(error).__name__}: {error}")
    if source == "idx" and not data_dir:
        attempts.append("idx: no data_dir given and POECAPS_DATA is unset")
    raise DataError(
        f"Could not load {name!r} split {split!r}. Tried:\n  - " + "\n  - ".join(attempts)
        + f"\nTo get it: {_HOW_TO_GET[name]}.")


def load(name, split, data_dir=None, source=None):
    """Load a dataset as `tf.data.Dataset` of `(float32 [H, W, C] in [0, 1], int64 label)`."""
    import tensorflow as tf

    images, labels, _ = load_arrays(name, split, data_dir, source)
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    return ds.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y),
                  num_parallel_calls=tf.data.AUTOTUNE)


def to_float(images):
    """uint8 images to float32 in [0, 1]: `images / 255`.

    Anything but a uint8 array is an `InputError`: float images (already in [0, 1], say) would be divided by
    255 again without a word.
    """
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        received = images.dtype if isinstance(images, np.ndarray) else type(images).__name__
        raise InputError(f"to_float takes uint8 images (0 to 255), as the loaders return them. Received: {received}")
    return images.astype(np.float32) / 255.0
