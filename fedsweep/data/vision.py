"""MNIST, Fashion-MNIST, CIFAR-10 and CIFAR-100 from their files on disk, in the layout torchvision's
dataset classes download to (``MNIST/raw/*-idx?-ubyte[.gz]``, ``FashionMNIST/raw/``,
``cifar-10-batches-py/``, ``cifar-100-python/``); Fashion-MNIST also from Debian's
``dataset-fashion-mnist`` package (:data:`SYSTEM_FOLDERS`).

The readers need no torchvision: they parse the IDX format and the CIFAR "python version" batches
directly, the latter with an unpickler that admits only NumPy array reconstruction (the batches are
pickles; a general ``pickle.load`` of a file would run whatever it names). torchvision is used
only to download the files (``download: true``, the ``vision`` extra, a machine with internet).

Once per node: the first process that reads a dataset writes its decoded uint8 arrays to a node-local
cache (:func:`cache_dir`) as ``.npy`` files, atomically; every later process on the node (each
ServerActor, the driver's checks) maps those files read-only instead of decompressing and unpickling
again, so the pages are shared and only the shards a process uses are converted to float.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedsweep import safe_pickle
from fedsweep.node_cache import cache_dir

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
    "fashion_mnist": (
        "FashionMNIST/raw",
        ["train-images-idx3-ubyte", "train-labels-idx1-ubyte"],
        ["t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"],
        "FashionMNIST",
    ),
}
IDX_DATASETS = ("mnist", "fashion_mnist")

#: Where a system package puts a dataset's files, looked at when the data root does not hold them
#: (Debian: ``apt-get install dataset-fashion-mnist``).
SYSTEM_FOLDERS = {"fashion_mnist": [Path("/usr/share/datasets/fashion-mnist")]}

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


#: what a CIFAR batch may name besides arrays: how protocol-2 pickles written by Python 3 carry bytes
_CIFAR_BATCH = safe_pickle.NUMPY_ARRAYS | {("_codecs", "encode")}


def read_cifar_batch(path: Path) -> dict:
    """One CIFAR python-version batch: a dict with ``data`` (N × 3072 uint8, channel-major) and labels."""
    with open(path, "rb") as f:
        batch = safe_pickle.load(f.read(), _CIFAR_BATCH, "only NumPy arrays are allowed here", encoding="bytes")
    batch = {k.decode() if isinstance(k, bytes) else k: v for k, v in batch.items()} if isinstance(batch, dict) else {}
    if "data" not in batch or not {"labels", "fine_labels"} & set(batch):
        raise ValueError(f"{path}: not a CIFAR batch (a dict with data and labels)")
    return batch


def data_root(configured: str | None) -> Path:
    """The config's ``root``, else ``$FEDSWEEP_DATA_DIR``, else ``./data``."""
    return Path(configured or os.environ.get("FEDSWEEP_DATA_DIR") or "data").expanduser().resolve()


def _file(folder: Path, name: str) -> Path:
    """A dataset file as it lies in ``folder``: plain, else gzipped (which may not exist either)."""
    return folder / name if (folder / name).exists() else folder / f"{name}.gz"


def _missing_in(name: str, folder: Path) -> list[Path]:
    _, train, test, _ = LAYOUT[name]
    return [folder / f for f in train + test if not _file(folder, f).exists()]


def dataset_folder(name: str, root: Path) -> Path:
    """The folder holding the files: ``root``'s torchvision layout, else a system package's folder that has
    them all, else ``root``'s layout (which then lacks files)."""
    own = root / LAYOUT[name][0]
    if not _missing_in(name, own):
        return own
    return next((f for f in SYSTEM_FOLDERS.get(name, []) if not _missing_in(name, f)), own)


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


#: What each format holds, checked file by file before anything is trained on (:func:`_checked`): the shape
#: of one image (IDX: rows × columns; CIFAR: 3 × 32 × 32 channel-major bytes), the number of classes, and the
#: samples of each official file (MNIST and Fashion-MNIST: 60,000 train, 10,000 test; CIFAR-10: 10,000 a
#: batch; CIFAR-100: 50,000 and 10,000). :mod:`fedsweep.data` derives from it what validation knows before the
#: files are read: the input size, the classes and ``POOL_SIZES`` (the sum of the counts).
FORMATS = {
    "mnist": ((28, 28), 10, {"train-images-idx3-ubyte": 60_000, "t10k-images-idx3-ubyte": 10_000}),
    "fashion_mnist": ((28, 28), 10, {"train-images-idx3-ubyte": 60_000, "t10k-images-idx3-ubyte": 10_000}),
    "cifar10": ((3, 32, 32), 10, {**{f"data_batch_{i}": 10_000 for i in range(1, 6)}, "test_batch": 10_000}),
    "cifar100": ((3, 32, 32), 100, {"train": 50_000, "test": 10_000}),
}


#: A file of this name in a dataset's folder declares its files a subset of the official ones, or stand-ins
#: for them (tests, ``benchmarks/cifar_gpu.py``'s CI size): every check but the official counts applies.
SUBSET_MARKER = "FEDSWEEP_SUBSET"


def _checked(name: str, path: Path, images: Any, labels: Any, label_path: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One file's (or IDX pair's) images and labels, if they are what the format says: uint8 images of the
    format's shape, as many labels as images, integer labels of the format's classes, the official file's
    count (unless the folder holds :data:`SUBSET_MARKER`). Raises a ValueError naming the file (``label_path``:
    the labels' own, IDX), what it holds and what the format needs."""
    shape, classes, counts = FORMATS[name]
    where = f"data.root: {path}"
    if not isinstance(images, np.ndarray) or images.dtype != np.uint8:
        got = images.dtype if isinstance(images, np.ndarray) else type(images).__name__
        raise ValueError(f"{where}: images of type {got}; the {name} format holds uint8 pixels")
    per_image = images.shape[1:] if name in IDX_DATASETS else (int(np.prod(images.shape[1:])) if images.ndim > 1 else 1,)
    expected = shape if name in IDX_DATASETS else (int(np.prod(shape)),)
    if images.ndim < 2 or tuple(per_image) != expected:
        raise ValueError(f"{where}: images of shape {tuple(images.shape[1:]) or '()'} each; the {name} format holds "
                         f"{' × '.join(map(str, shape))} ({'rows × columns' if name in IDX_DATASETS else 'channels × rows × columns'})")
    labels, at = np.asarray(labels), f"data.root: {label_path or path}"
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"{at}: labels of shape {labels.shape} and type {labels.dtype}; the {name} format holds "
                         "one integer label per image")
    if len(labels) != len(images):
        raise ValueError(f"{at}: {len(labels)} labels for {len(images)} images; the format holds one label per image")
    if len(labels) and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"{at}: labels {int(labels.min())}..{int(labels.max())}; {name} has classes 0..{classes - 1}")
    official = counts.get(path.name.removesuffix(".gz"))
    if official is not None and len(images) != official and not (path.parent / SUBSET_MARKER).exists():
        raise ValueError(f"{where}: {len(images)} images; the official {name} file holds {official} (a partial or "
                         "different download: fetch the files again, or data.download: true; files that are a subset "
                         f"on purpose: put a file named {SUBSET_MARKER} beside them)")
    return images, labels


def _decode(name: str, folder: Path) -> dict[str, np.ndarray]:
    """Decompress or unpickle the files, each checked against its format (:func:`_checked`): images as uint8
    (N × features, channel-major), int64 labels; every class present in the training pool."""
    _, train, test, _ = LAYOUT[name]
    images, labels = [], []
    if name in IDX_DATASETS:
        for image_file, label_file in (train, test):
            path, label_path = _file(folder, image_file), _file(folder, label_file)
            x, y = _checked(name, path, _read(read_idx, path), _read(read_idx, label_path), label_path)
            images.append(x)
            labels.append(y)
    else:
        key = "labels" if name == "cifar10" else "fine_labels"
        for files in (train, test):
            checked = [_checked(name, _file(folder, f), b["data"], b.get(key))
                       for f in files for b in [_read(read_cifar_batch, _file(folder, f))]]
            images.append(np.concatenate([x for x, _ in checked]))
            labels.append(np.concatenate([y for _, y in checked]))
    x_train, x_test = (np.ascontiguousarray(im.reshape(len(im), -1), dtype=np.uint8) for im in images)
    y_train, y_test = (np.asarray(y, dtype=np.int64) for y in labels)
    missing = sorted(set(range(FORMATS[name][1])) - set(np.unique(y_train).tolist()))
    if missing:
        raise ValueError(f"data.root: {folder}: the training files hold no image of class(es) {missing[:10]}; "
                         f"{name} has {FORMATS[name][1]} classes, each in its training files")
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def _read(reader: Callable[[Path], Any], path: Path) -> Any:
    """``reader(path)``, with a damaged or unreadable file reported as a ValueError naming it."""
    try:
        return reader(path)
    except (OSError, EOFError, zlib.error, pickle.UnpicklingError, ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ValueError(f"data.root: {path} cannot be read (damaged, or not this dataset's file): {e}") from None


def _source_key(name: str, folder: Path) -> str:
    """Identity of the source files (path, size, modification time): a changed file gets a new cache entry."""
    _, train, test, _ = LAYOUT[name]
    h = hashlib.sha1(f"{name}|checked".encode())  # entries written before the format checks are decoded again
    for f in train + test:
        p = _file(folder, f)
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    h.update(str((folder / SUBSET_MARKER).exists()).encode())  # a marker added or removed: checked again
    return h.hexdigest()[:16]


def load_uint8(name: str, root: Path, allow_download: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test) with uint8 images, decoded once per node: read-only memory maps of
    the node's cache when it has them, else decoded from the files and written there for the next process
    (a process that cannot write the cache keeps its decoded arrays and says nothing)."""
    folder = dataset_folder(name, root)
    if _missing_in(name, folder) and allow_download:
        download(name, root)
        folder = dataset_folder(name, root)
    absent = _missing_in(name, folder)
    if absent:
        raise FileNotFoundError(
            f"data.root: {name} files not found under {root}: expected "
            + ", ".join(str(p.relative_to(root)) for p in absent)
            + " (set data.root or FEDSWEEP_DATA_DIR to the folder that holds them, or data.download: true"
            + "".join(f"; or install the files at {f}" for f in SYSTEM_FOLDERS.get(name, []))
            + ")"
        )
    entry = cache_dir() / f"{name}-{_source_key(name, folder)}"
    keys = ("x_train", "y_train", "x_test", "y_test")
    if all((entry / f"{k}.npy").exists() for k in keys):
        try:
            return tuple(np.load(entry / f"{k}.npy", mmap_mode="r") for k in keys)  # type: ignore[return-value]
        except (OSError, ValueError):
            pass  # a damaged entry: decode again and replace it
    arrays = _decode(name, folder)
    try:
        entry.mkdir(parents=True, exist_ok=True)
        for k in keys:
            # write beside, then rename: a process reading the entry never sees a half-written file
            with tempfile.NamedTemporaryFile(dir=entry, suffix=".tmp", delete=False) as f:
                np.save(f, arrays[k])
            os.replace(f.name, entry / f"{k}.npy")
    except OSError:
        pass
    return tuple(arrays[k] for k in keys)  # type: ignore[return-value]


def to_float(images: np.ndarray) -> np.ndarray:
    """uint8 images as float32 in [0, 1]: x / 255 in float32, divided in place (the same values as
    ``np.asarray(images, np.float32) / 255.0``, each of the 256 checked in ``tests/test_vision.py``, in a sixth of
    the time: MNIST's 70,000 images are converted at every dataset build)."""
    out = np.array(images, dtype=np.float32)
    out /= np.float32(255.0)
    return out


#: Added to every pixel's standard deviation by :func:`standardize` (0..255 units), as pFedMe's generator does.
STANDARDIZE_EPSILON = 0.001


def pixel_statistics(*pools: np.ndarray, chunk: int = 10_000) -> tuple[np.ndarray, np.ndarray]:
    """Per-pixel mean and (population) standard deviation of uint8 images over all ``pools`` together,
    in 0..255 units; accumulated in float64, a chunk of images at a time."""
    total = sum(len(p) for p in pools)
    s = np.zeros(pools[0].shape[1], np.float64)
    s2 = np.zeros_like(s)
    for p in pools:
        for start in range(0, len(p), chunk):
            block = np.asarray(p[start:start + chunk], dtype=np.float64)
            s += block.sum(0)
            s2 += np.square(block).sum(0)
    mean = s / total
    return mean, np.sqrt(np.maximum(s2 / total - mean**2, 0.0))


def standardize(images: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """uint8 images as float32 (x − μ)/(σ + 0.001), per pixel (pFedMe's ``generate_niid_20users.py``)."""
    return ((np.asarray(images, dtype=np.float64) - mean) / (std + STANDARDIZE_EPSILON)).astype(np.float32)


def load(name: str, root: Path, allow_download: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): images as float32 in [0, 1], flattened channel-major; int64 labels."""
    x_train, y_train, x_test, y_test = load_uint8(name, root, allow_download)
    return to_float(x_train), np.asarray(y_train), to_float(x_test), np.asarray(y_test)
