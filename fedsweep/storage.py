"""Where a sweep keeps what outlives its processes: Tune's experiment folders, fedsweep's round checkpoints and
the state ``--resume`` starts from (``sweep.storage_path``).

On a cluster every node must see it: a shared filesystem mounted at the same path on every node, or an object
store URI (``s3://bucket/prefix``, ``gs://…``), read and written through ``pyarrow.fs`` as Ray Tune does. An
S3-compatible server other than AWS is named in the URI's query, as pyarrow reads it:
``s3://bucket/prefix?endpoint_override=http://127.0.0.1:9000``; credentials come from each node's environment.

A :class:`Storage` pickles as its location, so each process that unpickles it (a Tune trial on another node)
opens the filesystem itself, with its own credentials.
"""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pyarrow.fs as pafs


class Storage:
    """A folder (``root``) in a pyarrow filesystem (``fs``), from a local path or a URI."""

    def __init__(self, location: str):
        self.location = location
        self.is_uri = "://" in location
        if self.is_uri:
            self.fs, root = pafs.FileSystem.from_uri(location)
        else:
            self.fs, root = pafs.LocalFileSystem(), str(Path(location).resolve())
        self.root = root.rstrip("/")

    def __reduce__(self):  # a local folder as its absolute path: the unpickling process may have another cwd
        return Storage, (self.location if self.is_uri else self.root,)

    def __repr__(self) -> str:
        return f"Storage({self.location!r})"

    def path(self, *parts: str) -> str:
        """``root/part/…`` in the filesystem's own notation (no scheme, no query)."""
        return posixpath.join(self.root, *parts)

    def tune_location(self) -> tuple[str, pafs.FileSystem | None]:
        """(``storage_path``, ``storage_filesystem``) for Ray Tune: a local folder as before, a URI as its
        filesystem (so that a query such as ``endpoint_override`` reaches every read and write)."""
        return (self.root, self.fs) if self.is_uri else (self.root, None)

    def ensure(self) -> None:
        """Create the root folder; an OSError (no such bucket, no credentials, no server) says why not."""
        self.fs.create_dir(self.root, recursive=True)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``path`` whole or not at all. An object store's object appears complete when its upload ends, so
        it is written in place; on a local disk it goes to a hidden neighbour first and is renamed into place (on
        an object store that detour would be a second copy and a delete per write)."""
        folder, name = posixpath.split(path)
        self.fs.create_dir(folder, recursive=True)
        target = path if self.is_uri else posixpath.join(folder, f".{name}.{os.getpid()}.partial")
        with self.fs.open_output_stream(target) as out:
            out.write(data)
        if target != path:
            self.fs.move(target, path)

    def read_bytes(self, path: str) -> bytes:
        with self.fs.open_input_stream(path) as f:
            return f.read()

    def is_file(self, path: str) -> bool:
        return self.fs.get_file_info(path).type == pafs.FileType.File

    def file_mtime(self, path: str) -> float | None:
        """When file ``path`` was last written, or None when it is not a file (one filesystem call)."""
        info = self.fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            return None
        return info.mtime.timestamp() if info.mtime is not None else 0.0

    def folders(self, path: str, prefix: str = "") -> list[str]:
        """The names of the folders directly under ``path`` that start with ``prefix``, sorted."""
        infos = self.fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))  # none yet: []
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith(prefix))

    def remove_folder(self, path: str) -> None:
        try:
            self.fs.delete_dir(path)
        except FileNotFoundError:
            pass

    def others_could_write(self, folder: str) -> list[str]:
        """In a local ``folder`` that ``--resume`` restores from: the folder itself and each file directly in it
        (Tune's ``tuner.pkl`` and ``experiment_state-*.json``, which Ray unpickles with no restriction) that another
        user could have written, owned by another user or writable by its group or by anyone, each as "path (why)".
        [] for an object store, whose permissions are its own (the README says ``--resume`` trusts it)."""
        if self.is_uri:
            return []
        me, out = os.getuid(), []
        for path in [Path(folder), *sorted(p for p in Path(folder).iterdir() if p.is_file())]:
            st = path.lstat()
            if st.st_uid != me:
                out.append(f"{path} (owned by user {st.st_uid})")
            elif st.st_mode & 0o022:
                who = " and ".join(w for w, bit in (("its group", 0o020), ("anyone", 0o002)) if st.st_mode & bit)
                out.append(f"{path} (writable by {who}: mode {st.st_mode & 0o777:o})")
        return out
