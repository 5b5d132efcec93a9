import gzip
import os
import re
import struct

import numpy as np
import pytest

from poecaps import data
from poecaps.errors import InputError


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as handle:
        handle.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("t10k", 4)):
        _write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 5, 5)))
        _write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 3)
    return tmp_path


def test_load_from_idx_directory(idx_dir):
    ds = data.load("mnist", "train", data_dir=str(idx_dir))
    images, labels = zip(*ds.as_numpy_iterator())
    images = np.stack(images)
    assert images.shape == (6, 5, 5, 1) and images.dtype == np.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    np.testing.assert_array_equal(labels, [0, 1, 2, 0, 1, 2])
    assert np.asarray(labels).dtype == np.int64


def test_load_from_environment_variable(idx_dir, monkeypatch):
    monkeypatch.setenv("POECAPS_DATA", str(idx_dir))
    images, _, source = data.load_arrays("fashion_mnist", "test", source="idx")
    assert images.shape == (4, 5, 5, 1) and source.startswith("idx:")


def test_real_mnist_5k(mnist_dir):
    images, labels, _ = data.load_arrays("mnist", "train", data_dir=mnist_dir)
    assert images.shape == (4000, 28, 28, 1)
    assert np.bincount(labels).tolist() == [400] * 10


def test_truncated_idx_file_is_a_clear_error(idx_dir):
    path = idx_dir / "train-images-idx3-ubyte.gz"
    with gzip.open(path) as handle:
        raw = handle.read()
    with gzip.open(path, "wb") as handle:
        handle.write(raw[:-7])
    with pytest.raises(data.DataError, match="truncated or corrupted"):
        data.load_arrays("mnist", "train", data_dir=str(idx_dir), source="idx")


def test_an_idx_header_whose_sizes_overflow_int64_is_a_clear_error(tmp_path):
    """Before, NumPy's product of the sizes 65536**4 wrapped to 0, so a header with no data passed the size check
    and failed in `reshape` with NumPy's error."""
    path = tmp_path / "big-idx"
    path.write_bytes(bytes([0, 0, 0x08, 4]) + struct.pack(">IIII", *[65536] * 4))
    with pytest.raises(data.DataError, match=f"holds 20 bytes, its header promises {65536**4 + 20} "):
        data.read_idx(str(path))


@pytest.mark.parametrize("images, labels", [
    (np.arange(6) % 3, np.arange(6) % 3),                  # images without pixels: before, loaded as [6]
    (np.zeros((6, 5, 5)), np.zeros((6, 2))),               # labels with a second axis: before, loaded as [6, 2]
])
def test_idx_files_of_the_wrong_rank_are_a_clear_error(idx_dir, images, labels):
    _write_idx(idx_dir / "train-images-idx3-ubyte.gz", images)
    _write_idx(idx_dir / "train-labels-idx1-ubyte.gz", labels)
    with pytest.raises(data.DataError, match=(r"train-images-idx3-ubyte must hold images \[N, H, W\] or "
                                              r"\[N, H, W, C\] and train-labels-idx1-ubyte labels \[N\]\. "
                                              rf"Received: shapes {re.escape(str(images.shape))} and "
                                              rf"{re.escape(str(labels.shape))}")):
        data.load_arrays("mnist", "train", data_dir=str(idx_dir), source="idx")


def test_idx_labels_beyond_the_ten_classes_or_no_examples_are_a_clear_error(idx_dir):
    """Before, a label of 200 (a corrupted or foreign labels file) loaded as a class of its own, and the
    evaluation's reference classifier grew 201 outputs; an empty split loaded as zero examples."""
    _write_idx(idx_dir / "train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 200, 1, 2]))
    with pytest.raises(data.DataError, match=r"train-labels-idx1-ubyte must hold labels 0 to 9\. Received: labels "
                                             r"up to 200 \(a corrupted or foreign file\)$"):
        data.load_arrays("mnist", "train", data_dir=str(idx_dir), source="idx")
    _write_idx(idx_dir / "t10k-images-idx3-ubyte.gz", np.zeros((0, 5, 5)))
    _write_idx(idx_dir / "t10k-labels-idx1-ubyte.gz", np.zeros(0))
    with pytest.raises(data.DataError, match=r"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte hold no examples$"):
        data.load_arrays("mnist", "test", data_dir=str(idx_dir), source="idx")


def test_corrupted_gzip_is_a_clear_error(idx_dir):
    (idx_dir / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(data.DataError, match="not a readable"):
        data.load_arrays("mnist", "train", data_dir=str(idx_dir), source="idx")


def test_missing_dataset_lists_every_source_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("POECAPS_DATA", str(tmp_path / "empty"))        # a standing default: the others follow it
    monkeypatch.setattr(data, "SYSTEM_DIRS", {"mnist": [str(tmp_path / "nowhere")],
                                              "fashion_mnist": []})
    monkeypatch.setattr(data, "_network_answers", lambda *a, **k: False)
    monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "tfds"))
    with pytest.raises(data.DataError) as error:
        data.load_arrays("mnist", "train")
    message = str(error.value)
    for expected in (f"idx {tmp_path / 'empty'}: missing", f"system {tmp_path / 'nowhere'}: missing", "tfds mnist",
                     "To get it"):
        assert expected in message


def test_a_folder_given_by_name_is_the_only_source(idx_dir, tmp_path, monkeypatch):
    # Another copy sits where the system sources are looked for; a named folder that lacks the files (or a
    # split) is still an error, never a silent switch to that copy.
    monkeypatch.setattr(data, "SYSTEM_DIRS", {"mnist": [], "fashion_mnist": [str(idx_dir)]})
    monkeypatch.setattr(data, "_from_tfds", lambda *a: pytest.fail("TFDS looked at for a named folder"))
    monkeypatch.delenv("POECAPS_DATA", raising=False)
    only_train = tmp_path / "only_train"
    only_train.mkdir()
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"):
        (only_train / name).write_bytes((idx_dir / name).read_bytes())
    assert data.load_arrays("fashion_mnist", "train", data_dir=str(only_train))[2] == f"idx:{only_train}"
    with pytest.raises(data.DataError, match="from the folder given: missing .*t10k-images-idx3-ubyte"):
        data.load_arrays("fashion_mnist", "test", data_dir=str(only_train))
    with pytest.raises(data.DataError, match="from the folder given: missing"):
        data.load_arrays("fashion_mnist", "train", data_dir=str(tmp_path / "typo"))
    (only_train / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(data.DataError, match="not a readable"):
        data.load_arrays("fashion_mnist", "train", data_dir=str(only_train))
    # without a folder the system copy is found, as before
    assert data.load_arrays("fashion_mnist", "test")[2] == f"system:{idx_dir}"


def test_tfds_is_used_when_prepared(tmp_path, monkeypatch):
    """The TFDS path: a prepared (fake) builder is read without any download."""
    import tensorflow as tf

    class Builder:
        def is_prepared(self):
            return True

        def as_dataset(self, split, as_supervised):
            assert as_supervised and split == "test"
            return tf.data.Dataset.from_tensor_slices(
                (np.zeros((3, 4, 4, 1), np.uint8), np.array([1, 2, 3])))

    import tensorflow_datasets as tfds

    monkeypatch.setattr(tfds, "builder", lambda name, data_dir=None: Builder())
    images, labels, source = data.load_arrays("mnist", "test", source="tfds")
    assert source == "tfds" and images.shape == (3, 4, 4, 1) and labels.tolist() == [1, 2, 3]


@pytest.mark.parametrize("kwargs, message", [
    ({"name": "cifar", "split": "train"}, "name='cifar'"),
    ({"name": "mnist", "split": "valid"}, "split='valid'"),
    ({"name": "mnist", "split": "train", "source": "ftp"}, "source='ftp'"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(data.DataError, match=message):
        data.load_arrays(**kwargs)


def test_system_location_is_used_when_present(idx_dir, monkeypatch):
    monkeypatch.setattr(data, "SYSTEM_DIRS", {"mnist": [], "fashion_mnist": [str(idx_dir)]})
    _, _, source = data.load_arrays("fashion_mnist", "train")
    assert source == f"system:{os.fspath(idx_dir)}"


def test_to_float_scales_uint8_images_and_refuses_others():
    """Float images were divided by 255 again without a word (an image in [0, 1] became one in [0, 0.004])."""
    from poecaps.data import to_float

    np.testing.assert_array_equal(to_float(np.array([[0, 51, 255]], np.uint8)), np.float32([[0.0, 0.2, 1.0]]))
    for images in (np.float32([[0.0, 0.5, 1.0]]), np.array([[0, 255]], np.int64), [[0, 255]]):
        with pytest.raises(InputError, match="to_float takes uint8 images"):
            to_float(images)
