"""A run's metrics on their way to MLflow: written by a thread of their own, held while the tracking server does
not take them, written when it takes them again; the trial fails once that has lasted ``tracking.outage_limit_s``.

Exactly once: a metric keeps the timestamp it was taken with, and MLflow's SQL stores key a metric by (key,
timestamp, step, value): a write repeated after an attempt that reached the store but whose answer was lost
stores nothing twice. Rounds are written in order and a round in one call (up to :data:`BATCH` metrics), so the
rounds a run holds are always its first ones: what :class:`fedsweep.tracking.RunLogger` reads back on resume.

Bounded: past :data:`MAX_HELD` metrics in memory, further rounds go to a file (one JSON line a round) in the
temporary folder, read back in order once the ones in memory are written, and removed when written.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

#: Metrics held in memory (about 200 bytes each); the rounds beyond go to a file until the held ones are written.
MAX_HELD = 100_000
#: MLflow's limit of metrics in one ``log_batch`` call.
BATCH = 1000
#: Seconds one write may take. A write is not retried inside MLflow's client (whose retries, with their backoff,
#: block one call for minutes): the writer retries, and knows since when.
REQUEST_TIMEOUT_S = 30.0
#: First and longest pause between attempts while the server does not answer.
PAUSES_S = (0.5, 5.0)


class TrackingOutage(RuntimeError):
    """The tracking server did not take a run's metrics for longer than ``tracking.outage_limit_s``."""


def _permanent(error: BaseException) -> bool:
    """An answer that a retry cannot change (a client error: the run deleted, a value refused), not an outage."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return 400 <= status < 500 and status not in (408, 429)
    return False


def _sender(uri: str, run_id: str, timeout_s: float):
    """``send(metrics)``: one ``log_batch`` of ``run_id``. To a tracking server (REST) a single request of at most
    ``timeout_s``, MLflow's own retries off; to a database or file store MLflow's client call."""
    from mlflow import MlflowClient

    mlflow = MlflowClient(tracking_uri=uri)
    creds = getattr(getattr(getattr(mlflow, "_tracking_client", None), "store", None), "get_host_creds", None)
    if creds is None:
        return lambda metrics: mlflow.log_batch(run_id, metrics=metrics)
    from mlflow.protos.service_pb2 import LogBatch
    from mlflow.utils.proto_json_utils import message_to_json
    from mlflow.utils.rest_utils import http_request_safe

    def send(metrics: list) -> None:
        body = json.loads(message_to_json(LogBatch(run_id=run_id, metrics=[m.to_proto() for m in metrics])))
        http_request_safe(creds(), "/api/2.0/mlflow/runs/log-batch", "POST", max_retries=0, backoff_factor=0,
                          timeout=timeout_s, json=body)

    return send


class MetricWriter:
    """Writes the rounds :meth:`put` hands over (each a list of ``mlflow.entities.Metric``), in order, from a thread.

    While the server does not take them they are held (:attr:`held` metrics) and :attr:`outage_since` says since
    when; :meth:`check` (called by the trial at each round) raises :class:`TrackingOutage` once that has lasted
    ``limit_s``, and a refusal that no retry changes (:func:`_permanent`) at once. :meth:`close` stops the thread;
    what it still holds is then the caller's (a trial that fails reruns those rounds from its last checkpoint)."""

    def __init__(self, uri: str, run_id: str, limit_s: float, max_held: int | None = None,
                 timeout_s: float = REQUEST_TIMEOUT_S, spill_dir: str | None = None):
        self.uri, self.run_id, self.limit_s = uri, run_id, limit_s
        self.max_held = MAX_HELD if max_held is None else max_held
        self.timeout_s = timeout_s  # not cut to the limit: a slow answer from a busy server is no outage
        self.spill_dir = spill_dir
        self._send = _sender(uri, run_id, self.timeout_s)
        self._memory: deque[list] = deque()  # rounds, oldest first; older than every round in the file
        self._in_memory = 0
        self.spill_file: Path | None = None  # rounds put while the memory was full (or the file not yet empty)
        self._spilled = 0  # metrics in the file not yet written
        self._read_at = 0  # offset of the file's first round not yet written
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.outage_since: float | None = None  # time.monotonic() of the first failed attempt since the last write
        self.last_error: BaseException | None = None
        self.refused: BaseException | None = None  # a permanent refusal: the thread has stopped
        self.gave_up = False  # check() or wait() has raised: this writer is done
        self.written = 0
        self._action: tuple[int, Callable[[], None]] | None = None  # (metrics to write first, what to run then)
        self.action_error: BaseException | None = None

    @property
    def held(self) -> int:
        return self._in_memory + self._spilled

    def put(self, rounds: list[list]) -> None:
        """Hand rounds over, oldest first."""
        with self._cond:
            for metrics in filter(None, rounds):
                if self._spilled or self._in_memory + len(metrics) > self.max_held:
                    self._to_file(metrics)
                else:
                    self._memory.append(metrics)
                    self._in_memory += len(metrics)
            if self.held:
                self._start()
            self._cond.notify_all()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mlflow-metrics-{self.run_id[:8]}", daemon=True)
            self._thread.start()

    def after_written(self, action: Callable[[], None], later: int = 0) -> None:
        """Run ``action`` in the writer's thread once every metric put so far, and the ``later`` ones the caller
        puts next, is written: a checkpoint saved when MLflow holds every round before it, without the trial
        waiting for the writes. It replaces an earlier action not yet run (a newer checkpoint supersedes an older
        one); one due when the writer is closed runs before its thread stops (:meth:`close` waits for it up to one request's
        time and 5 s), one whose metrics are not all written is dropped. An error of it is raised by the next :meth:`check`."""
        with self._cond:
            self._action = (self.written + self.held + later, action)
            self._start()
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the server's permanent refusal, or :class:`TrackingOutage` past the limit; else nothing."""
        with self._cond:
            self._raise_if_done()

    def wait(self, until_written: bool = True) -> bool:
        """Until every held metric is written: True. ``until_written``: however long the server takes, up to the
        limit (:meth:`check` raises); else False as soon as an outage is on or one request's time has passed."""
        deadline = time.monotonic() + self.timeout_s + 1
        with self._cond:
            while self.held:
                self._raise_if_done()
                if not until_written and (self.outage_since is not None or time.monotonic() > deadline):
                    return False
                self._cond.wait(0.5)
            return True

    def close(self) -> None:
        """Stop the thread (a write under way ends within one request's time); remove the file of held rounds."""
        with self._cond:
            self._stop.set()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 5)
        with self._cond:
            if self.spill_file is not None:
                self.spill_file.unlink(missing_ok=True)
                self.spill_file, self._spilled, self._read_at = None, 0, 0

    def held_metrics(self) -> list:
        """Every held metric, oldest first (reads the file)."""
        with self._cond:
            return [m for r in self._memory for m in r] + [m for r in self._file_rounds(self._read_at, None)[0] for m in r]

    # ---------------------------------------------------------------- internals, under self._cond

    def _raise_if_done(self) -> None:
        if self.action_error is not None:  # the action's own failure (a checkpoint not saved), raised once: the
            error, self.action_error = self.action_error, None  # writer goes on, and the run can still end FAILED
            raise error
        if self.refused is not None:
            self.gave_up = True
            raise self.refused
        if self.outage_since is not None and (lasted := time.monotonic() - self.outage_since) > self.limit_s:
            self.gave_up = True
            steps = [r[0].step for r in self._memory] or [r[0].step for r in self._file_rounds(self._read_at, 1)[0]]
            raise TrackingOutage(
                f"tracking.outage_limit_s={self.limit_s:g}: the MLflow tracking server at {self.uri} has not taken "
                f"run {self.run_id}'s metrics for {lasted:.0f} s (last error: {_short(self.last_error)}); "
                f"{self.held} metrics from round {steps[0] if steps else '?'} on are held, not written. The trial "
                "fails; a retry goes on from its last checkpoint (every round before it is in MLflow) and logs the "
                "rounds after it again")

    def _to_file(self, metrics: list) -> None:
        if self.spill_file is None:
            fd, name = tempfile.mkstemp(prefix=f"fedsweep-held-{self.run_id}-", suffix=".jsonl", dir=self.spill_dir)
            os.close(fd)
            self.spill_file = Path(name)
        with open(self.spill_file, "a") as f:
            f.write(json.dumps([[m.key, m.value, m.timestamp, m.step] for m in metrics]) + "\n")
        self._spilled += len(metrics)

    def _file_rounds(self, start: int, limit: int | None) -> tuple[list[list], int]:
        """Rounds of the file from offset ``start`` (at most ``limit`` metrics, at least one round; None: all),
        and the offset after them."""
        from mlflow.entities import Metric

        rounds: list[list] = []
        if self.spill_file is None or not self._spilled:
            return rounds, start
        count = 0
        with open(self.spill_file, "rb") as f:
            f.seek(start)
            for line in f:
                metrics = [Metric(k, v, ts, step) for k, v, ts, step in json.loads(line)]
                if rounds and limit is not None and count + len(metrics) > limit:
                    break
                rounds.append(metrics)
                count += len(metrics)
                start += len(line)
        return rounds, start

    def _next_batch(self) -> tuple[list, tuple]:
        """The oldest held rounds, up to :data:`BATCH` metrics (one round at least), and where they came from."""
        if self._memory:
            batch: list = []
            taken = 0
            for metrics in self._memory:
                if batch and len(batch) + len(metrics) > BATCH:
                    break
                batch += metrics
                taken += 1
            return batch, ("memory", taken)
        rounds, end = self._file_rounds(self._read_at, BATCH)
        return [m for r in rounds for m in r], ("file", end)

    def _done(self, batch: list, where: tuple) -> None:
        if where[0] == "memory":
            for _ in range(where[1]):
                self._in_memory -= len(self._memory.popleft())
        else:
            self._spilled -= len(batch)
            self._read_at = where[1]
            if not self._spilled and self.spill_file is not None:
                self.spill_file.unlink(missing_ok=True)
                self.spill_file, self._read_at = None, 0
        self.written += len(batch)

    def _due(self) -> Callable[[], None] | None:
        """The action whose metrics are all written, taken; else None."""
        if self._action is None or self.written < self._action[0]:
            return None
        action, self._action = self._action[1], None
        return action

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - outside the writes' own handling (the held rounds' file, stderr): the thread
            with self._cond:  # is gone, so what it holds is never written; check() and wait() raise it
                self.refused = RuntimeError(f"the metric writer of run {self.run_id} stopped: {e!r}")
                self._cond.notify_all()

    def _loop(self) -> None:
        pause = PAUSES_S[0]
        while True:
            with self._cond:
                while not self._stop.is_set() and not self.held and (self._action is None or self.written < self._action[0]):
                    self._cond.wait()
                action = self._due()  # a due action runs even when the writer is closing (a trial's last checkpoint)
                if self._stop.is_set() and action is None:
                    return
            if action is not None:
                try:
                    action()
                except Exception as e:  # noqa: BLE001 - raised in the trial's thread by check()
                    with self._cond:
                        self.action_error = e
                        self._cond.notify_all()
                continue
            with self._cond:
                if not self.held:
                    continue
                batch, where = self._next_batch()
            started = time.monotonic()
            try:
                for i in range(0, len(batch), BATCH):  # one call but for a round of more than BATCH metrics
                    self._send(batch[i : i + BATCH])
            except Exception as e:  # noqa: BLE001 - every failure is either permanent or an outage
                with self._cond:
                    self.last_error = e
                    if _permanent(e):
                        self.refused = e
                        self._cond.notify_all()
                        return
                    if self.outage_since is None:
                        self.outage_since = started
                        print(f"fedsweep: MLflow at {self.uri} did not take run {self.run_id}'s metrics "
                              f"({_short(e)}); holding them while training goes on, for up to "
                              f"tracking.outage_limit_s={self.limit_s:g} s", file=sys.stderr, flush=True)
                    self._cond.notify_all()
                self._stop.wait(pause)
                pause = min(2 * pause, PAUSES_S[1])
                continue
            with self._cond:
                self._done(batch, where)
                if self.outage_since is not None:
                    print(f"fedsweep: MLflow at {self.uri} takes run {self.run_id}'s metrics again after "
                          f"{time.monotonic() - self.outage_since:.0f} s; {self.held} still to write",
                          file=sys.stderr, flush=True)
                self.outage_since, self.last_error, pause = None, None, PAUSES_S[0]
                self._cond.notify_all()


def _short(error: BaseException | None) -> str:
    text = f"{type(error).__name__}: {error}" if error is not None else "none"
    return text if len(text) <= 300 else text[:297] + "..."
