"""MNIST, CIFAR-10 and CIFAR-100 from their files on disk, in the layout torchvision's dataset classes
download to (``MNIST/raw/*-idx?-ubyte[.gz]``, ``cifar-10-batches-py/``, ``cifar-100-python/``).

The readers need no torchvision: they parse the IDX format and the CIFAR "python version" batches
directly, the latter with an unpickler that admits only NumPy array reconstruction (the batches are
pickles; a general ``pickle.load`` of a file would run whatever it names). torchvision is used
only to download the files (``download: true``, the ``vision`` extra, a machine with internet).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
from pathlib import Path

import numpy as np

# name -> (subfolder torchvision uses, train files, test files, torchvision class)
LAYOUT = {
    "mnist": (
        "MNIST/raw",
        ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"],
        ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"],
        "MNIST",
    ),
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        "CIFAR10",
    ),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "CIFAR100"),
}

_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (LeCun's MNIST format), plain or gzipped: magic 0x0000, type code, ndim, big-endian sizes."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4]!r})")
    ndim = raw[3]
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    data = np.frombuffer(raw, dtype=dtype, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {data.size} values")
    return data.reshape(dims)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings, numbers and NumPy arrays; refuses every other global."""

    ALLOWED = frozenset({
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 carry bytes
    })

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}: only NumPy arrays are allowed here")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> dict:
    """One CIFAR python-version batch: a dict with ``data`` (N × 3072 uint8, channel-major) and labels."""
    with open(path, "rb") as f:
        batch = _ArrayUnpickler(io.BytesIO(f.read()), encoding="bytes").load()
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()}


def data_root(configured: str | None) -> Path:
    """The config's ``root``, else ``$FEDSWEEP_DATA_DIR``, else ``./data``."""
    return Path(configured or os.environ.get("FEDSWEEP_DATA_DIR") or "data").expanduser().resolve()


def missing_files(name: str, root: Path) -> list[Path]:
    sub, train, test, _ = LAYOUT[name]
    folder = root / sub
    return [folder / f for f in train + test if not (folder / f).exists() and not (folder / f"{f}.gz").exists()]


def download(name: str, root: Path) -> None:
    """Fetch the files with torchvision (needs the ``vision`` extra and internet)."""
    try:
        import torchvision.datasets as tvd
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise FileNotFoundError(
            f"data.download: torchvision is not importable ({e}); install fedsweep[vision] or put the files under {root}"
        ) from None
    cls = getattr(tvd, LAYOUT[name][3])
    for train in (True, False):
        cls(str(root), train=train, download=True)


def load(name: str, root: Path, allow_download: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): images as float32 in [0, 1], flattened channel-major; int64 labels."""
    if missing_files(name, root) and allow_download:
        download(name, root)
    absent = missing_files(name, root)
    if absent:
        raise FileNotFoundError(
            f"data.root: {name} files not found under {root}: expected "
            + ", ".join(str(p.relative_to(root)) for p in absent)
            + " (set data.root or FEDSWEEP_DATA_DIR to the folder that holds them, or data.download: true)"
        )
    sub, train, test, _ = LAYOUT[name]
    folder = root / sub

    def path(f: str) -> Path:
        return folder / f if (folder / f).exists() else folder / f"{f}.gz"

    if name == "mnist":
        parts = [read_idx(path(f)) for f in train + test]
        images = [parts[0], parts[2]]
        labels = [parts[1], parts[3]]
    else:
        key = "labels" if name == "cifar10" else "fine_labels"
        images, labels = [], []
        for files in (train, test):
            batches = [read_cifar_batch(path(f)) for f in files]
            images.append(np.concatenate([np.asarray(b["data"], dtype=np.uint8) for b in batches]))
            labels.append(np.concatenate([np.asarray(b[key]) for b in batches]))
    x_train, x_test = (im.reshape(len(im), -1).astype(np.float32) / 255.0 for im in images)
    y_train, y_test = (np.asarray(y, dtype=np.int64) for y in labels)
    return x_train, y_train, x_test, y_test
