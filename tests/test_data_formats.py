"""The real datasets' files checked against their formats before anything trains on them (issue 36): image
shape, pixel type, one label per image, labels within the classes, every class in the training files, and the
official files' sample counts (unless the folder declares itself a subset). The malformed-file corpus
(tests/test_malformed_sweeps.py) shows the same refusals through the three commands."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from fedsweep.data import vision
from tests.test_malformed_sweeps import idx


def test_the_official_counts_pass_and_one_short_file_is_refused_by_name(full_size_image_root, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    x_train, _, x_test, _ = vision.load_uint8("mnist", full_size_image_root)
    assert (x_train.shape, x_test.shape) == ((60_000, 784), (10_000, 784))
    root = tmp_path / "root"
    shutil.copytree(full_size_image_root / "cifar-10-batches-py", root / "cifar-10-batches-py")
    assert len(vision.load_uint8("cifar10", root)[0]) == 50_000
    short = root / "cifar-10-batches-py" / "data_batch_3"
    batch = pickle.loads(short.read_bytes(), encoding="bytes")
    short.write_bytes(pickle.dumps({b"labels": batch[b"labels"][:9_990], b"data": batch[b"data"][:9_990]}, protocol=2))
    with pytest.raises(ValueError, match=r"data.root: .*data_batch_3: 9990 images; the official cifar10 file holds 10000"):
        vision.load_uint8("cifar10", root)
    (root / "cifar-10-batches-py" / vision.SUBSET_MARKER).touch()  # a subset on purpose: said, then accepted
    assert len(vision.load_uint8("cifar10", root)[0]) == 49_990


def _mnist(root, train_labels, test_labels=None):
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for split, y in (("train", train_labels), ("t10k", test_labels if test_labels is not None else train_labels)):
        (raw / f"{split}-images-idx3-ubyte").write_bytes(idx(np.zeros((len(y), 28, 28))))
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(idx(np.asarray(y)))
    (raw / vision.SUBSET_MARKER).touch()


def test_a_class_absent_from_the_training_files_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    _mnist(tmp_path / "ok", np.arange(20) % 10)
    assert len(vision.load_uint8("mnist", tmp_path / "ok")[1]) == 20
    _mnist(tmp_path / "bad", np.arange(20) % 9, np.arange(20) % 10)
    with pytest.raises(ValueError, match=r"the training files hold no image of class\(es\) \[9\]; mnist has 10 classes"):
        vision.load_uint8("mnist", tmp_path / "bad")


@pytest.mark.parametrize("labels, problem", [
    (list(range(99)) + [100], "labels 0..100; cifar100 has classes 0..99"),
    ([0.5] * 100, "labels of shape (100,) and type float64; the cifar100 format holds one integer label per image"),
    (list(range(99)), "99 labels for 100 images; the format holds one label per image"),
])
def test_cifar100_labels_are_checked_against_its_hundred_classes(tmp_path, monkeypatch, labels, problem):
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name in ("train", "test"):
        (folder / name).write_bytes(pickle.dumps({b"fine_labels": labels, b"data": np.zeros((100, 3072), np.uint8)}, protocol=2))
    (folder / vision.SUBSET_MARKER).touch()
    with pytest.raises(ValueError) as err:
        vision.load_uint8("cifar100", tmp_path)
    assert problem in str(err.value) and str(err.value).startswith(f"data.root: {folder / 'train'}")


def test_a_cache_entry_is_keyed_by_the_subset_marker(tmp_path, monkeypatch):
    """Files accepted as a declared subset are decoded again when the marker goes: the counts are then checked."""
    monkeypatch.setenv("FEDSWEEP_CACHE_DIR", str(tmp_path / "cache"))
    _mnist(tmp_path, np.arange(20) % 10)
    vision.load_uint8("mnist", tmp_path)
    (tmp_path / "MNIST" / "raw" / vision.SUBSET_MARKER).unlink()
    with pytest.raises(ValueError, match="20 images; the official mnist file holds 60000"):
        vision.load_uint8("mnist", tmp_path)
