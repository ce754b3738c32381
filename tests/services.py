"""Servers the store tests start for real: a throw-away PostgreSQL cluster (Debian's server) and the MLflow tracking
server of `infra/mlflow_server.sh` in front of it, which a test may stop and start again on the same port and store
(tests/test_tracking_outage.py). The fixtures that start them, ``postgres`` and ``mlflow_server``, are in conftest.py."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_job_submit import free_port


def _pg_bin() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        pytest.fail("the store test needs Debian's PostgreSQL server: apt-get install postgresql")
    return Path(found[-1]).parent


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """A throw-away PostgreSQL cluster on a free loopback port (trust auth, socket in its own folder) with a database
    ``mlflow``, as its URI; as root it runs as the `postgres` user, since the server refuses to run as root."""
    bin_dir, port = _pg_bin(), free_port()
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    folder = Path(tempfile.mkdtemp(prefix="fedsweep-pg-"))
    folder.chmod(0o755)
    if as_user:
        shutil.chown(folder, "postgres", "postgres")
    data = folder / "data"
    subprocess.run([*as_user, str(bin_dir / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres"],
                   check=True, capture_output=True)
    log_file = folder.parent / f"{folder.name}.log"
    with open(log_file, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([*as_user, str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
                                 "-k", str(folder)], stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    try:
        deadline = time.time() + 60
        while subprocess.run([str(bin_dir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)], capture_output=True,
                             check=False).returncode:
            if proc.poll() is not None or time.time() > deadline:
                pytest.fail(f"postgres did not start: {log_file.read_text()[-2000:]}")
            time.sleep(0.5)
        subprocess.run([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow"], check=True)
        yield f"postgresql://postgres@127.0.0.1:{port}/mlflow"
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # PostgreSQL's fast shutdown: the data is thrown away
        proc.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)
        log_file.unlink(missing_ok=True)  # beside the folder, so that a failed start can still be read


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log=lambda: "") -> None:
    """Until the MLflow server at ``url`` answers ``/health``; the test fails if ``proc`` exits or time runs out."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited: {log()}")
        time.sleep(0.5)
    pytest.fail(f"mlflow server did not answer /health within {timeout_s:.0f} s")


class MlflowServer:
    """`infra/mlflow_server.sh` on a free loopback port with ``backend_store_uri`` behind it; :meth:`stop` and
    :meth:`start` again keep the port, the store and the artifact folder."""

    def __init__(self, backend_store_uri: str, folder: Path, workers: int | None = None):
        self.backend_store_uri, self.folder, self.workers = backend_store_uri, folder, workers  # None: the script's default
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_file = folder / "server.log"

    def start(self, timeout_s: float = 120) -> None:
        """Start it and wait until it answers ``/health``."""
        env = {**os.environ, "MLFLOW_PORT": str(self.port), "MLFLOW_SERVER_DIR": str(self.folder / "srv"),
               "BACKEND_STORE_URI": self.backend_store_uri}
        if self.workers is not None:
            env["MLFLOW_WORKERS"] = str(self.workers)
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        with open(self.log_file, "a") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(["bash", str(ROOT / "infra" / "mlflow_server.sh")], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_healthy(self.url, self.proc, timeout_s, lambda: self.log_file.read_text()[-3000:])

    def stop(self) -> None:
        """Stop its process group (SIGTERM, then SIGKILL after 30 s): nothing listens on the port afterwards."""
        if self.proc is None:
            return
        group = self.proc.pid
        os.killpg(group, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.proc.wait(timeout=30)
        deadline = time.time() + 30
        while _alive(group) and time.time() < deadline:  # its workers too, which may hold the listening socket
            time.sleep(0.2)
        if _alive(group):
            os.killpg(group, signal.SIGKILL)
        self.proc = None


def _alive(group: int) -> bool:
    """Whether a process of process group ``group`` is still running (zombies, never reaped in some containers, left out)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False
