"""``fedsweep run``'s MLflow run, kept by a child process of its own.

A single run's command spent as long on MLflow as on torch and its rounds: importing MLflow and opening its store
(1.3 s, in a thread whose Python the GIL kept from overlapping torch's import), then at the end the plot and the
teardown of MLflow's modules. The child (``python -m fedsweep.tracking_process``) starts first, before the command
imports torch, and imports MLflow on the other core; it holds the run's :class:`~fedsweep.tracking.RunLogger` — the
one a sweep's trial uses in its own process — and the command sends it one JSON line per call
(:class:`TrackingProcess`): ``start`` (the experiment and the :class:`~fedsweep.tracking.RunRecord`, sent once the
file is valid, so bad input still creates no store and no run), then the rounds, tags, metrics and ``finish``. The
rounds do not wait for the run's creation (they queue behind it); the calls that must be waited for (a flush, the
end) get an answer, and an error of the child's (a write the store refused, a tracking outage past its limit,
:class:`~fedsweep.metric_writer.TrackingOutage`) comes back as one, raised in the command at its next call. The
child imports no torch, pre-imports matplotlib while the rounds run, and ends without its modules' teardown
(``os._exit``, as :func:`fedsweep.cli.entry` ends the command). It ignores Ctrl-C (the terminal sends it to both):
the command ends the run as it does in process; a command killed without ``finish`` leaves the child the end of
its input, and the child ends the run KILLED. Measured: the peer benchmark's 50-round single run 3.79 → 2.38 s
(docs/performance.md, "Thirty-fifth session").
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

from fedsweep.metric_writer import TrackingOutage


class TrackingProcessError(RuntimeError):
    """The child failed a call (its error's type and message), or ended without answering."""


class TrackingProcess:
    """The command's side: :class:`~fedsweep.tracking.RunLogger`'s calls that :func:`fedsweep.experiment.execute` and
    ``fedsweep run`` make, sent to the child (started here)."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[1])  # the child imports this fedsweep, whatever its sys.path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)
        self._read = b""  # what was read of the answers past the last whole line
        self.run_id: str | None = None
        self.logged_through = -1
        self._started = False

    def _send(self, op: str, **fields: Any) -> None:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # a broken pipe; the input closed already
            raise self._ended() from e

    def _ended(self) -> TrackingProcessError:
        code = self.proc.wait()
        return TrackingProcessError(f"the tracking process ended (exit code {code}) before the run did; its error is above")

    def _take(self, until: str | None) -> Any:
        """The child's answers, in order: the run's id kept (:attr:`run_id`), an error raised. Returns the value of
        the first answer that holds ``until``, waiting for it; with ``until`` None, reads what has come (None)."""
        fd = self.proc.stdout.fileno()  # read as bytes: a text buffer would hide a whole answer from select
        while True:
            while b"\n" not in self._read:
                if until is None and not select.select([fd], [], [], 0)[0]:
                    return None
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise self._ended()
                self._read += chunk
            line, self._read = self._read.split(b"\n", 1)
            answer = json.loads(line)
            if "error" in answer:
                kind = TrackingOutage if answer["error"] == TrackingOutage.__name__ else TrackingProcessError
                raise kind(answer["message"] if kind is TrackingOutage else f"{answer['error']}: {answer['message']}")
            self.run_id = answer.get("run_id", self.run_id)
            if until is not None and until in answer:
                return answer[until]

    def start(self, uri: str, experiment: str, record, run_name: str) -> None:
        """Create the run (in experiment ``experiment``, made if missing) from ``record``. The command goes on without
        waiting (its rounds queue behind the run's creation); :attr:`run_id` is set once the child has answered, which
        :meth:`started` waits for."""
        self._send("start", uri=uri, experiment=experiment, record=record.to_json(), run_name=run_name)
        self._started = True

    def started(self) -> str:
        return self.run_id or self._take("run_id")

    def log_round(self, metrics: dict[str, float]) -> None:
        self._send("round", metrics=metrics)
        self.logged_through = int(metrics["round"])
        self._take(None)

    def flush(self) -> bool:
        self._send("flush")
        return self._take("written")

    def stopped_by_scheduler(self) -> bool:  # no scheduler outside a sweep
        return False

    def set_tag(self, key: str, value: str) -> None:
        self._send("tag", key=key, value=value)

    def log_metric(self, key: str, value: float, step: int) -> None:
        self._send("metric", key=key, value=value, step=step)

    def finish(self, client_rows: list[dict] | None, status: str = "FINISHED", outcome: str | None = None,
               placement: list[dict] | None = None) -> None:
        """:meth:`fedsweep.tracking.RunLogger.finish` in the child, waited for; the child then ends."""
        self._send("finish", client_rows=client_rows, status=status, outcome=outcome, placement=placement)
        self._take("finished")
        self.proc.wait()

    def close(self) -> None:
        """The child stopped if no run was started (bad input), else told the input has ended and waited for: it
        ends a run :meth:`finish` did not end as KILLED."""
        if not self._started:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # the child has gone
                pass
        self.proc.wait()  # a started run: ended by finish, or as KILLED by the child


def serve(lines: IO[str], answers: IO[str]) -> None:
    """The child: one :class:`~fedsweep.tracking.RunLogger`, driven by ``lines`` (see :class:`TrackingProcess`)."""
    import mlflow  # noqa: F401 - the reason this process exists: imported while the command imports torch

    from fedsweep.tracking import RunLogger, RunRecord, ensure_experiment

    def answer(**fields: Any) -> None:
        answers.write(json.dumps(fields) + "\n")
        answers.flush()

    logger = None
    for line in lines:
        msg = json.loads(line)
        op = msg.pop("op")
        try:
            if op == "start":
                record = RunRecord(**msg["record"])
                logger = RunLogger(msg["uri"], ensure_experiment(msg["uri"], msg["experiment"]), record, msg["run_name"])
                if record.log_plot:  # while the rounds run: the plot at the end then only draws
                    threading.Thread(target=_import_pyplot, daemon=True).start()
                answer(run_id=logger.run_id)
            elif op == "round":
                logger.log_round(msg["metrics"])
            elif op == "flush":
                answer(written=logger.flush())
            elif op == "tag":
                logger.set_tag(msg["key"], msg["value"])
            elif op == "metric":
                logger.log_metric(msg["key"], msg["value"], msg["step"])
            elif op == "finish":
                ending, logger = logger, None  # once, as in process, whether it succeeds or not
                ending.finish(msg["client_rows"], msg["status"], msg["outcome"], msg["placement"])
                answer(finished=True)
        except Exception as e:  # noqa: BLE001 - sent to the command, which raises it
            answer(error=type(e).__name__, message=str(e))
        if op == "finish":
            return
    if logger is not None:  # the command ended without finishing the run
        logger.finish(None, "KILLED")


def _import_pyplot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command too, which ends the run
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # whatever a library prints goes to stderr, not into the answers
    sys.stdout = sys.stderr
    serve(sys.stdin, answers)
    sys.stderr.flush()
    # the run is written and ended (or the command has gone): no teardown of MLflow's, SQLAlchemy's and matplotlib's
    # modules, which the command would wait for (0.9 s; as fedsweep.cli.entry ends the command itself)
    os._exit(0)
