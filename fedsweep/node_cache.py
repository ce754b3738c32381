"""The node's cache folder: decoded image datasets (:mod:`fedsweep.data.vision`) and the empty MLflow store
(:mod:`fedsweep.sqlite_store`). A module of its own, importing nothing heavy: ``fedsweep run``'s tracking process
opens its store without importing torch (which :mod:`fedsweep.data` imports)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$FEDSWEEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedsweep``, else ``~/.cache/fedsweep``: local to the node."""
    configured = os.environ.get("FEDSWEEP_CACHE_DIR")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fedsweep"
