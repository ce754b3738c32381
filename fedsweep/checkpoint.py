"""Round checkpoints on disk: arrays in one ``.npz`` (read with ``allow_pickle=False``), everything else in
JSON. Nothing is unpickled, so a checkpoint folder can come from shared storage without running code."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

ARRAYS, META = "arrays.npz", "checkpoint.json"
_SEP = "|"


def save(checkpoint: dict, folder: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write :meth:`fedsweep.federation.Server.checkpoint`'s output (plus JSON-able ``extra``) to ``folder``."""
    folder = Path(folder)
    arrays = {"params": checkpoint["params"]}
    arrays.update({f"server{_SEP}{k}": v for k, v in checkpoint["server_state"].items()})
    times_trained = {}
    for cid, (state, times) in checkpoint["clients"].items():
        times_trained[str(cid)] = times
        for k, v in (state or {}).items():
            arrays[f"client{_SEP}{cid}{_SEP}{k}"] = v
    np.savez(folder / ARRAYS, **arrays)
    meta = {key: checkpoint[key] for key in ("round", "uploads", "downloads")}
    meta["times_trained"] = times_trained
    (folder / META).write_text(json.dumps({**meta, "extra": extra or {}}))


def load(folder: str | Path) -> tuple[dict, dict[str, Any]]:
    """The checkpoint dict and the ``extra`` saved with it."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    server_state: dict[str, np.ndarray] = {}
    clients: dict[int, dict[str, np.ndarray]] = {}
    with np.load(folder / ARRAYS, allow_pickle=False) as z:
        params = z["params"]
        for key in z.files:
            parts = key.split(_SEP)
            if parts[0] == "server":
                server_state[parts[1]] = z[key]
            elif parts[0] == "client":
                clients.setdefault(int(parts[1]), {})[parts[2]] = z[key]
    checkpoint = {
        "round": meta["round"],
        "params": params,
        "server_state": server_state,
        "uploads": meta["uploads"],
        "downloads": meta["downloads"],
        "clients": {int(c): (clients.get(int(c)), n) for c, n in meta["times_trained"].items()},
    }
    return checkpoint, meta["extra"]


def save_latest(checkpoint: dict, trial_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Write ``round_NNNNNN`` under ``trial_dir`` atomically (a hidden folder renamed into place), then
    remove older rounds: whenever the process dies, the newest complete checkpoint is on disk."""
    trial_dir = Path(trial_dir)
    trial_dir.mkdir(parents=True, exist_ok=True)
    final = trial_dir / f"round_{checkpoint['round']:06d}"
    partial = trial_dir / f".{final.name}.{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    save(checkpoint, partial, extra)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for older in trial_dir.glob("round_*"):
        if older.name < final.name:
            shutil.rmtree(older, ignore_errors=True)
    return final


def load_latest(trial_dir: str | Path) -> tuple[dict, dict[str, Any]] | None:
    """The newest checkpoint :func:`save_latest` wrote under ``trial_dir``, or None."""
    rounds = sorted(Path(trial_dir).glob("round_*")) if Path(trial_dir).is_dir() else []
    return load(rounds[-1]) if rounds else None
