"""A new SQLite MLflow store, started as a copy of an empty one.

MLflow creates a new SQLite store by creating its tables and running every schema migration since its first
version, in each new store: 0.8 s of CPU here, on the critical path of a first ``fedsweep run`` and paid once
by every test's store. fedsweep makes that empty store once per MLflow version in the node's cache
(:func:`fedsweep.node_cache.cache_dir`), with MLflow's own function, and copies it (0.03 s) where a new store is
to be. MLflow then opens it as any store: it finds its tables at its schema's head revision (which it checks) and
creates the Default experiment with this store's own artifact root, as in a store it made itself. Anything
unexpected (no cache, a file system without hard links) leaves the store to MLflow, as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from functools import lru_cache
from pathlib import Path

from fedsweep.node_cache import cache_dir


def seed_new_store(uri: str) -> None:
    """If ``uri`` names a SQLite file that does not exist yet (in an existing folder), create it as a copy of the
    empty store. Never replaces a file: the copy is linked into place, and a store another process created
    meanwhile is kept."""
    if not uri.startswith("sqlite:///") or "?" in uri:
        return
    path = Path(uri[len("sqlite:///") :])
    if path.exists() or not path.parent.is_dir():
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    # on any failure MLflow creates the store itself, as it would without this
    with contextlib.suppress(Exception):
        try:
            shutil.copyfile(empty_store(), tmp)
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


@lru_cache(maxsize=1)
def empty_store() -> Path:
    """The empty store of this MLflow version: its tables at the head revision, no experiment (made once per node,
    written beside and renamed into place, so a reader never sees it half written)."""
    import mlflow
    import sqlalchemy
    from mlflow.store.db.utils import _initialize_tables

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"mlflow-{mlflow.__version__}-empty-store.db"
    if not path.exists():
        tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.unlink(missing_ok=True)
        engine = sqlalchemy.create_engine(f"sqlite:///{tmp}")
        try:
            _initialize_tables(engine)
        finally:
            engine.dispose()
        os.replace(tmp, path)
    return path
