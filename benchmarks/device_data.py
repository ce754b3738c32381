"""CIFAR-10's files packed small enough to travel to a lent GPU machine in parts, and unpacked there byte for byte.

The `device` tool carries at most 64 MiB a call and the machine cannot download; CIFAR-10's python files are
178 MB (xz alone: 75%). Each file's pixel array is stored as the residuals of a lossless image predictor —
LOCO-I's median edge detector per channel (JPEG-LS), then the red and blue residuals minus the green one — and
xz; everything around the pixels (the pickle's other bytes) as they are. About 55% of the original, in
``--parts`` parts of about equal size, each with a manifest of the files' SHA-256:

    python benchmarks/device_data.py pack ../shared/data/cifar-10-batches-py DIR --parts 2   # DIR/part_0, DIR/part_1
    python benchmarks/device_data.py unpack DIR/part_1 OUT/cifar-10-batches-py                # each part, any order
    python benchmarks/device_data.py stand-in OUT [--per-class 1000]   # random images in CIFAR-10's files (timings)

``unpack`` rebuilds the part's files, checks each against its SHA-256 (a mismatch stops with an error) and prints
which of the folder's files are there, so a later call can tell that every part arrived.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import pickle
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsweep.data.vision import read_cifar_batch  # after the path: the restricted unpickler

FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "lc": 0, "lp": 0, "pb": 0}]
SHAPE = (3, 32, 32)  # CIFAR's rows: 3072 bytes, the red, green and blue 32×32 planes


def _prediction(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """LOCO-I's median edge detector from the left (a), upper (b) and upper-left (c) neighbours."""
    hi, lo = np.maximum(a, b), np.minimum(a, b)
    return np.where(c >= hi, lo, np.where(c <= lo, hi, a + b - c))


def _neighbours(img: np.ndarray, i: int | slice = slice(None), j: int | slice = slice(None)):
    """(left, upper, upper-left) of every pixel, 0 outside the image; the first column's left is its upper."""
    a, b, c = (np.zeros_like(img) for _ in range(3))
    a[..., :, 1:] = img[..., :, :-1]
    b[..., 1:, :] = img[..., :-1, :]
    c[..., 1:, 1:] = img[..., :-1, :-1]
    a[..., 1:, 0] = b[..., 1:, 0]
    c[..., 1:, 0] = b[..., 1:, 0]
    return a, b, c


def encode(pixels: np.ndarray) -> bytes:
    """uint8 rows of CIFAR images → compressed residuals."""
    img = pixels.reshape(-1, *SHAPE).astype(np.int16)
    r = img - _prediction(*_neighbours(img))
    r[:, 0] -= r[:, 1]
    r[:, 2] -= r[:, 1]
    return lzma.compress((r % 256).astype(np.uint8).transpose(1, 0, 2, 3).tobytes(), format=lzma.FORMAT_XZ, filters=FILTERS)


def decode(blob: bytes, n: int) -> np.ndarray:
    """The inverse of :func:`encode`: ``n`` uint8 rows of 3072."""
    r = np.frombuffer(lzma.decompress(blob), np.uint8).reshape(3, n, 32, 32).transpose(1, 0, 2, 3).astype(np.int16)
    r[:, 0] += r[:, 1]
    r[:, 2] += r[:, 1]
    img = np.zeros((n, *SHAPE), np.int16)
    for i in range(32):  # pixel by pixel, every image and channel at once: each needs its decoded neighbours
        for j in range(32):
            up = img[..., i - 1, j] if i else np.zeros((n, 3), np.int16)
            left = img[..., i, j - 1] if j else up
            upleft = img[..., i - 1, j - 1] if i and j else (up if i else np.zeros((n, 3), np.int16))
            img[..., i, j] = (r[..., i, j] + _prediction(left, up, upleft)) % 256
    return img.astype(np.uint8).reshape(n, -1)


def pack(src: Path, dst: Path, parts: int) -> None:
    entries = []
    for path in sorted(p for p in src.iterdir() if p.is_file()):
        raw = path.read_bytes()
        entry = {"name": path.name, "sha256": hashlib.sha256(raw).hexdigest(), "size": len(raw)}
        data = read_cifar_batch(path)["data"] if path.name.startswith(("data_batch", "test_batch")) else None
        pixels = data.tobytes() if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.shape[1:] == (3072,) else b""
        at = raw.find(pixels[:65536]) if pixels else -1
        if at >= 0 and raw[at : at + len(pixels)] == pixels:  # CIFAR's own files (Python 2 pickles): one run of bytes
            entry.update(rows=len(data), at=at, blob=encode(data), around=lzma.compress(raw[:at] + raw[at + len(pixels):]))
        else:  # any other file, or pixels the pickle stores otherwise (Python 3's protocol 2 escapes bytes): as it is
            entry.update(around=lzma.compress(raw))
        entries.append(entry)
        print(f"{path.name}: {len(raw):,} bytes -> {len(entry.get('blob', b'')) + len(entry['around']):,}", flush=True)
    loads = [0] * parts
    for k in range(parts):
        (dst / f"part_{k}").mkdir(parents=True, exist_ok=True)
    for e in sorted(entries, key=lambda e: -len(e.get("blob", b""))):  # the largest first, each to the lightest part
        k = loads.index(min(loads))
        loads[k] += len(e.get("blob", b"")) + len(e["around"])
        folder = dst / f"part_{k}"
        (folder / f"{e['name']}.around.xz").write_bytes(e.pop("around"))
        if "blob" in e:
            (folder / f"{e['name']}.pixels.xz").write_bytes(e.pop("blob"))
        manifest = folder / "manifest.json"
        listed = json.loads(manifest.read_text()) if manifest.exists() else []
        manifest.write_text(json.dumps([*listed, e], indent=1))
    print("parts:", ", ".join(f"part_{k} {v / 2**20:.1f} MiB" for k, v in enumerate(loads)))


def unpack(part: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for e in json.loads((part / "manifest.json").read_text()):
        around = lzma.decompress((part / f"{e['name']}.around.xz").read_bytes())
        if "rows" in e:
            pixels = decode((part / f"{e['name']}.pixels.xz").read_bytes(), e["rows"]).tobytes()
            raw = around[: e["at"]] + pixels + around[e["at"]:]
        else:
            raw = around
        if len(raw) != e["size"] or hashlib.sha256(raw).hexdigest() != e["sha256"]:
            raise SystemExit(f"{e['name']}: rebuilt file differs from the original (SHA-256)")
        (out / e["name"]).write_bytes(raw)
        print(f"{e['name']}: {len(raw):,} bytes, SHA-256 checked", flush=True)
    print("present:", " ".join(sorted(p.name for p in out.iterdir())))


def stand_in_cifar10(root: Path, per_class: int = 1000) -> None:
    """CIFAR-10's six files in its format, ``per_class`` random images of each class in each (1000: its sizes)."""
    rng = np.random.default_rng(0)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        labels = [c for c in range(10) for _ in range(per_class)]
        batch = {b"labels": labels, b"data": rng.integers(0, 256, (len(labels), 3072), dtype=np.uint8)}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    if per_class != 1000:  # not the official files' 10,000 a file: say so (fedsweep.data.vision.SUBSET_MARKER)
        (folder / "FEDSWEEP_SUBSET").touch()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("pack")
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--parts", type=int, default=2)
    u = sub.add_parser("unpack")
    u.add_argument("part", type=Path)
    u.add_argument("out", type=Path)
    s = sub.add_parser("stand-in")
    s.add_argument("root", type=Path)
    s.add_argument("--per-class", type=int, default=1000)
    args = ap.parse_args(argv)
    if args.step == "pack":
        pack(args.src, args.dst, args.parts)
    elif args.step == "unpack":
        unpack(args.part, args.out)
    else:
        stand_in_cifar10(args.root, args.per_class)


if __name__ == "__main__":
    sys.exit(main())
