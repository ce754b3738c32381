"""``fedsweep run``'s MLflow run, kept by a child process of its own.

A single run's command spent as long on MLflow as on torch and its rounds: importing MLflow and opening its store
(1.3 s, in a thread whose Python the GIL kept from overlapping torch's import), then at the end the plot and the
teardown of MLflow's modules. The child (:func:`main`, started from fedsweep's own folder) starts first, before the
command imports torch, and imports MLflow on the other core; it holds the run's
:class:`~fedsweep.tracking.RunLogger` — the one a sweep's trial uses in its own process — and the command sends it
one JSON line per call
(:class:`TrackingProcess`): ``start`` (the experiment and the :class:`~fedsweep.tracking.RunRecord`, sent once the
file is valid, so bad input still creates no store and no run), then the rounds, tags, metrics and ``finish``. The
rounds do not wait for the run's creation (they queue behind it); the calls that must be waited for (a flush, the
end) get an answer, and an error of the child's (a write the store refused, a tracking outage past its limit,
:class:`~fedsweep.metric_writer.TrackingOutage`) comes back as one, raised in the command once, at its next call
(the run is then ended as the command ends it; a failed start leaves no run and later calls answered). The
child imports no torch, pre-imports matplotlib while the rounds run, and ends without its modules' teardown
(``os._exit``, as :func:`fedsweep.cli.entry` ends the command). It ignores Ctrl-C, SIGTERM and a hang-up (a
terminal sends them to both): on Ctrl-C the command ends the run as it does in process (FAILED); a command killed
without ``finish`` leaves the child the end of its input, and the child ends the run KILLED. Measured: the peer
benchmark's 50-round single run 3.79 → 2.38 s in the same hour, 2.43 s after a review's fixes
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


#: The calls the command waits for, by the key of their answer; every other call is answered only if it fails.
WAITED = {"start": "run_id", "flush": "written", "finish": "finished"}
#: The child's start: its own path first where this fedsweep is (not the working directory, which ``-m`` would put
#: first: a folder there named like a module would be imported instead), then :func:`main`.
_CHILD = ("import sys; root = sys.argv[1]; sys.path[0:1] = [] if root in sys.path[1:] else [root]; "
          "from fedsweep.tracking_process import main; main()")


class TrackingProcess:
    """The command's side: :class:`~fedsweep.tracking.RunLogger`'s calls that :func:`fedsweep.experiment.execute` and
    ``fedsweep run`` make, sent to the child (started here). The child's first error is raised once, at the call
    that waits for it or at the next call; the run then ends as the command ends it (``finish``), later errors unraised."""

    def __init__(self):
        root = str(Path(__file__).resolve().parents[1])  # where this fedsweep is: the child imports the same
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._read = b""  # what was read of the answers past the last whole line
        self.run_id: str | None = None
        self.logged_through = -1
        self.failed: BaseException | None = None  # the child's first error, raised once
        self._owed = dict.fromkeys(WAITED, 0)  # answers to skip: those of calls that raised an error instead
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

    def _lines(self, wait: bool):
        """The child's answers as they come: all that have come, then (``wait``) the next ones as they arrive."""
        fd = self.proc.stdout.fileno()  # read as bytes: a text buffer would hide a whole answer from select
        while True:
            while b"\n" not in self._read:
                if not wait and not select.select([fd], [], [], 0)[0]:
                    return
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise self._ended()
                self._read += chunk
            line, self._read = self._read.split(b"\n", 1)
            yield json.loads(line)

    def _take(self, op: str | None) -> Any:
        """Read the child's answers: the run's id kept (:attr:`run_id`), its first error raised. Returns the answer
        to waited call ``op`` (:data:`WAITED`), waiting for it; with ``op`` None, reads what has come (None)."""
        for answer in self._lines(wait=op is not None):
            self.run_id = answer.get("run_id", self.run_id)
            of = answer.get("op") if "error" in answer else next((o for o, key in WAITED.items() if key in answer), None)
            if of in WAITED and self._owed[of]:  # the answer to a call that raised an earlier error instead
                self._owed[of] -= 1
                continue
            if "error" in answer and self.failed is None:
                kind = TrackingOutage if answer["error"] == TrackingOutage.__name__ else TrackingProcessError
                self.failed = kind(answer["message"] if kind is TrackingOutage else f"{answer['error']}: {answer['message']}")
                if op is not None and of != op:  # raised by this call: its own answer, still to come, is skipped
                    self._owed[op] += 1
                raise self.failed
            if op is not None and of == op:  # its answer (None for an error after the first: not raised again)
                return answer.get(WAITED[op])
        return None

    def start(self, uri: str, experiment: str, record, run_name: str) -> None:
        """Create the run (in experiment ``experiment``, made if missing) from ``record``. The command goes on without
        waiting (its rounds queue behind the run's creation); :attr:`run_id` is set once the child has answered, which
        :meth:`started` waits for."""
        self._send("start", uri=uri, experiment=experiment, record=record.to_json(), run_name=run_name)
        self._started = True

    def started(self) -> str | None:
        """The run's id, waited for (None after an error already raised)."""
        return self.run_id or (None if self.failed else self._take("start"))

    def _tell(self, op: str, **fields: Any) -> None:
        """A call not waited for; the answers come meanwhile are read (an error raised)."""
        self._send(op, **fields)
        self._take(None)

    def log_round(self, metrics: dict[str, float]) -> None:
        self._tell("round", metrics=metrics)
        self.logged_through = int(metrics["round"])

    def flush(self) -> bool:
        self._send("flush")
        return bool(self._take("flush"))

    def stopped_by_scheduler(self) -> bool:  # no scheduler outside a sweep
        return False

    def set_tag(self, key: str, value: str) -> None:
        self._tell("tag", key=key, value=value)

    def log_metric(self, key: str, value: float, step: int) -> None:
        self._tell("metric", key=key, value=value, step=step)

    def finish(self, client_rows: list[dict] | None, status: str = "FINISHED", outcome: str | None = None,
               placement: list[dict] | None = None) -> None:
        """:meth:`fedsweep.tracking.RunLogger.finish` in the child, waited for; the child then ends."""
        self._send("finish", client_rows=client_rows, status=status, outcome=outcome, placement=placement)
        self._take("finish")
        self.proc.wait()

    def close(self) -> None:
        """The child stopped if no run was started (bad input), else told the input has ended, its answers read to
        their end (none left to block it), and waited for: it ends a run :meth:`finish` did not end as KILLED."""
        if not self._started:
            self.proc.kill()
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:  # the child has gone
                pass
        fd = self.proc.stdout.fileno()
        while os.read(fd, 65536):
            pass
        self.proc.wait()


def serve(lines: IO[str], answers: IO[str]) -> None:
    """The child: one :class:`~fedsweep.tracking.RunLogger`, driven by ``lines`` (see :class:`TrackingProcess`).
    A failed start leaves no run: later calls are answered as done. An answer that cannot be written (the command
    has gone) is dropped; the input's end then ends a run not finished as KILLED."""
    import mlflow  # noqa: F401 - the reason this process exists: imported while the command imports torch

    from fedsweep.tracking import RunLogger, RunRecord, ensure_experiment, pyplot

    gone = False

    def answer(**fields: Any) -> None:
        nonlocal gone
        if not gone:
            try:
                answers.write(json.dumps(fields) + "\n")
                answers.flush()
            except OSError:
                gone = True

    logger = None
    try:
        for line in lines:
            msg = json.loads(line)
            op = msg.pop("op")
            try:
                if op == "start":
                    record = RunRecord(**msg["record"])
                    logger = RunLogger(msg["uri"], ensure_experiment(msg["uri"], msg["experiment"]), record, msg["run_name"])
                    if record.log_plot:  # while the rounds run: the plot at the end then only draws
                        threading.Thread(target=pyplot, daemon=True).start()
                    answer(run_id=logger.run_id)
                elif logger is None:  # no run (its start failed, or it was finished)
                    if op in WAITED:
                        answer(**{WAITED[op]: op == "finish"})
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
                answer(error=type(e).__name__, message=str(e), op=op)
            if op == "finish":
                return
    finally:
        if logger is not None:  # the command ended without finishing the run
            logger.finish(None, "KILLED")


def main() -> None:
    """The child's process: its answers on a copy of stdout (what a library prints goes to stderr), no signal of the
    terminal's (Ctrl-C, a hang-up, a SIGTERM to the command's group: it ends when its input does, after the
    command), no teardown of its modules at the end."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    serve(sys.stdin, answers)
    sys.stderr.flush()
    # the run is written and ended (or the command has gone): no teardown of MLflow's, SQLAlchemy's and matplotlib's
    # modules, which the command would wait for (0.9 s; as fedsweep.cli.entry ends the command itself)
    os._exit(0)
