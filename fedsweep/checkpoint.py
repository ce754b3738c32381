"""Round checkpoints in a sweep's storage (a local or shared folder, or an object store: :mod:`fedsweep.storage`):
arrays in one ``.npz`` (read with ``allow_pickle=False``), everything else in JSON. Nothing is unpickled, so a
checkpoint can come from shared storage without running code."""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

import numpy as np

from fedsweep.storage import Storage

ARRAYS, META = "arrays.npz", "checkpoint.json"
_SEP = "|"


def save(checkpoint: dict, storage: Storage, folder: str, extra: dict[str, Any] | None = None) -> None:
    """Write :meth:`fedsweep.federation.Server.checkpoint`'s output (plus JSON-able ``extra``) to ``folder`` of
    ``storage``: the arrays first, the JSON last, so that a folder with its JSON is complete."""
    write(storage, folder, *encode(checkpoint, extra))


def write(storage: Storage, folder: str, arrays: bytes, meta: bytes) -> None:
    """:func:`encode`'s bytes to ``folder``, the arrays first."""
    storage.write_bytes(posixpath.join(folder, ARRAYS), arrays)
    storage.write_bytes(posixpath.join(folder, META), meta)


def encode(checkpoint: dict, extra: dict[str, Any] | None = None) -> tuple[bytes, bytes]:
    """The checkpoint as the bytes of its two files (arrays, JSON): a copy of it, whatever changes after."""
    arrays = {"params": checkpoint["params"]}
    arrays.update({f"server{_SEP}{k}": v for k, v in checkpoint["server_state"].items()})
    times_trained = {}
    for cid, (state, times) in checkpoint["clients"].items():
        times_trained[str(cid)] = times
        for k, v in (state or {}).items():
            arrays[f"client{_SEP}{cid}{_SEP}{k}"] = v
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    meta = {key: checkpoint[key] for key in ("round", "floats_up", "floats_down")}
    if "wall_time_s" in checkpoint:  # the run's seconds of rounds so far (execute adds it): a resumed clock goes on
        meta["wall_time_s"] = float(checkpoint["wall_time_s"])
    meta["times_trained"] = times_trained
    # a state with no arrays ({}: FedAvg's) is a state, not None (not yet trained)
    meta["stateful"] = sorted(int(c) for c, (state, _) in checkpoint["clients"].items() if state is not None)
    return buffer.getvalue(), json.dumps({**meta, "extra": extra or {}}).encode()


def load(storage: Storage, folder: str) -> tuple[dict, dict[str, Any]]:
    """The checkpoint dict and the ``extra`` saved with it."""
    meta = json.loads(storage.read_bytes(posixpath.join(folder, META)))
    server_state: dict[str, np.ndarray] = {}
    clients: dict[int, dict[str, np.ndarray]] = {}
    with np.load(io.BytesIO(storage.read_bytes(posixpath.join(folder, ARRAYS))), allow_pickle=False) as z:
        params = z["params"]
        for key in z.files:
            parts = key.split(_SEP)
            if parts[0] == "server":
                server_state[parts[1]] = z[key]
            elif parts[0] == "client":
                clients.setdefault(int(parts[1]), {})[parts[2]] = z[key]
    stateful = set(meta.get("stateful", ()))
    checkpoint = {
        "round": meta["round"],
        "params": params,
        "server_state": server_state,
        "floats_up": meta["floats_up"],
        "floats_down": meta["floats_down"],
        "clients": {int(c): (clients.get(int(c), {} if int(c) in stateful else None), n) for c, n in meta["times_trained"].items()},
    }
    if "wall_time_s" in meta:  # (checkpoints before 2026-11-27 have none: the resumed clock starts at 0)
        checkpoint["wall_time_s"] = meta["wall_time_s"]
    return checkpoint, meta["extra"]


def save_latest(checkpoint: dict, storage: Storage, trial_dir: str, extra: dict[str, Any] | None = None) -> str:
    """Write ``round_NNNNNN`` under ``trial_dir``, then remove older rounds: whenever the process dies, the
    newest complete checkpoint (one with its JSON) is in the storage."""
    return write_latest(storage, trial_dir, checkpoint["round"], *encode(checkpoint, extra))


def write_latest(storage: Storage, trial_dir: str, rnd: int, arrays: bytes, meta: bytes) -> str:
    """:func:`save_latest` of a checkpoint of round ``rnd`` :func:`encode` made."""
    final = posixpath.join(trial_dir, f"round_{rnd:06d}")
    write(storage, final, arrays, meta)
    for older in storage.folders(trial_dir, "round_"):
        if older < posixpath.basename(final):
            storage.remove_folder(posixpath.join(trial_dir, older))
    return final


def load_latest(storage: Storage, trial_dir: str) -> tuple[dict, dict[str, Any]] | None:
    """The newest complete checkpoint :func:`save_latest` wrote under ``trial_dir``, or None."""
    for name in reversed(storage.folders(trial_dir, "round_")):
        if storage.is_file(posixpath.join(trial_dir, name, META)):
            return load(storage, posixpath.join(trial_dir, name))
    return None
