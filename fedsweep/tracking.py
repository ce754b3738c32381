"""MLflow logging: one run per experiment (a trial), nested under a sweep's parent run.

Runs are written with :class:`mlflow.MlflowClient` and explicit run ids, never the
fluent "active run" (a stray ``MLFLOW_RUN_ID`` would otherwise re-parent them).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsweep.conv_kernels import CONV_VAR
from fedsweep.dotted import format_value
from fedsweep.metric_writer import MetricWriter

if TYPE_CHECKING:
    from fedsweep.config import ExperimentConfig

TAG_PREFIX = "fedsweep."
PARENT_TAG = "mlflow.parentRunId"
#: The tag of a run whose evaluation lets the scored model see test data; its value names that evaluation.
LEAK_TAG = f"{TAG_PREFIX}evaluation"
#: ``fedsweep.outcome`` of a run that a scheduler stopped before its last round (FINISHED, never a best setting).
STOPPED_EARLY = "stopped_early"
#: The tag of such a run, set by the scheduler when it decides (:class:`fedsweep.stopping.MarkingASHA`): the round.
STOPPED_AFTER = f"{TAG_PREFIX}stopped_after_round"
#: Metrics held before a write even without an evaluation round (a long evaluation interval).
_FLUSH_AT = 900
#: Seconds since the last hand-over before an evaluation round hands its rounds to the writer: faster intervals go
#: several to one write (a 200-round MNIST trial's 21 writes to SQLite took 0.33 s of its CPU; docs/performance.md,
#: "Fifty-second session"), and MLflow shows a run's rounds at most about this much later.
LINGER_S = 0.5
# Keys of a round's metrics that are not logged as MLflow metrics.
_NOT_METRICS = {"round", "diverged"}


#: The tag naming the platform a run's arithmetic ran on, and the one naming fedsweep's code (see :func:`run_platform`).
PLATFORM_TAG = f"{TAG_PREFIX}platform"
CODE_TAG = f"{TAG_PREFIX}code"


#: Environment variables that change which kernels MKL and oneDNN run, and so a run's numbers (on one Intel CPU,
#: MKL_CBWR and ONEDNN_MAX_CPU_ISA each moved FedAvg's accuracy on the MNIST pathological small-CNN cell by up to 0.4
#: points, and MKL_ENABLE_INSTRUCTIONS=AVX2 as MKL_CBWR=AVX2 did: docs/reproduction.md; DNNL_MAX_CPU_ISA is oneDNN's
#: older name for ONEDNN_MAX_CPU_ISA), and fedsweep's own FEDSWEEP_CONV, whether oneDNN computes convolutions at all
#: (:mod:`fedsweep.conv_kernels`).
LIBRARY_DISPATCH = ("MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", CONV_VAR)
#: Every variable that chooses a run's CPU kernels: PyTorch's own (``ATEN_CPU_CAPABILITY``, whose values PyTorch
#: takes in lower case only, ignoring any other), MKL's and oneDNN's, and fedsweep's FEDSWEEP_CONV.
KERNEL_VARS = ("ATEN_CPU_CAPABILITY", *LIBRARY_DISPATCH)
ATEN_CAPABILITIES = ("default", "avx2", "avx512", "zvector", "vsx", "sve256")
#: A platform's ``, VAR=value`` parts for the variables of :data:`LIBRARY_DISPATCH` (a value may hold commas).
_TOLD = re.compile(rf", ({'|'.join(LIBRARY_DISPATCH)})=(.*?)(?=, (?:{'|'.join(LIBRARY_DISPATCH)})=|$)")


def names_kernels(platform: str, kernels: dict[str, str]) -> bool:
    """Whether a run's platform (:func:`run_platform`) says it ran with ``kernels`` (variable -> value, of
    :data:`KERNEL_VARS`) and no other: PyTorch's as the capability its kernels dispatched to, MKL's and oneDNN's as
    they were set, none of those set that ``kernels`` leaves out (each of them changes the numbers)."""
    told = dict(_TOLD.findall(platform))
    aten = kernels.get("ATEN_CPU_CAPABILITY")
    return (aten is None or f"({aten.upper()})" in platform) and told == {k: v for k, v in kernels.items() if k in LIBRARY_DISPATCH}


def kernel_settings(kernels: dict[str, str]) -> str:
    """``kernels`` as a command's prefix: ``ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE``."""
    return " ".join(f"{var}={value}" for var, value in kernels.items())


@functools.cache
def run_platform() -> str:
    """What a run's numbers depend on besides its config and seed: torch's build and the vector instructions its CPU
    kernels dispatch to (``ATEN_CPU_CAPABILITY``), the CPU's model, the GPU's when one is visible, and the settings
    by which MKL (matrix products) and oneDNN (convolutions) are told to pick their own kernels, which they choose by
    the CPU and not by ``ATEN_CPU_CAPABILITY``, and whether oneDNN computes convolutions at all (``FEDSWEEP_CONV``,
    applied wherever a CNN is built): :data:`LIBRARY_DISPATCH`, each named only when set. The same config and
    seed give the same numbers bit for bit on one platform; on another the float sums round differently in their
    last digits (``ATEN_CPU_CAPABILITY=default`` against ``avx2`` moves FedAvg's global loss in the 8th digit within
    20 rounds), which over hundreds of rounds can flip a prediction; an Intel and an AMD CPU differ so even with
    AVX2 kernels on both (docs/reproduction.md, "Same kernels, other CPU"). Read in the process that logs the
    run: on one node, where its clients trained."""
    import platform as host

    import torch

    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        cpuinfo = ""
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
               host.processor() or "unknown CPU")
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    told = "".join(f", {var}={os.environ[var]}" for var in LIBRARY_DISPATCH if os.environ.get(var))
    return (f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {cpu} ({host.machine()}){gpu}, "
            f"Python {host.python_version()}{told}")


@functools.cache
def code_version() -> str:
    """fedsweep's commit when it runs from a git checkout (``+changes`` when files of the package differ from it),
    else its version. Read once per process, when this module is imported (below): the checkout the process's
    modules came from, though it moves on during a long sweep (a trial process reused by Tune after a ``git pull``
    once tagged its runs with the new commit while it ran the code loaded before, 2026-11-27)."""
    import subprocess

    import fedsweep

    root = Path(fedsweep.__file__).resolve().parent.parent
    if (root / ".git").exists():
        git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30, check=False)
        try:
            head = git("rev-parse", "--short=12", "HEAD")
            if head.returncode == 0:
                changed = git("status", "--porcelain", "--untracked-files=no", "--", "fedsweep").stdout.strip()
                return head.stdout.strip() + ("+changes" if changed else "")
        except (OSError, subprocess.SubprocessError):  # no git command, or it hangs: the version says less, not nothing
            pass
    return fedsweep.__version__


code_version()


def client(uri: str):
    from mlflow import MlflowClient

    from fedsweep.sqlite_store import seed_new_store

    seed_new_store(uri)  # a new SQLite store: a copy of an empty one, not MLflow's migrations run again
    return MlflowClient(tracking_uri=uri)


def end_run(uri: str, run_id: str, status: str) -> None:
    """Ends a command's own MLflow run (a sweep's parent, a benchmark's) with ``status``, from the command's
    ``finally``. Where an error is already on its way out, a store that cannot take the status (gone, unreachable)
    is said on stderr and the first error goes on: the user sees why the command stopped, not that its run could
    not be ended."""
    pending = sys.exc_info()[1]
    try:
        client(uri).set_terminated(run_id, status)
    except Exception as error:
        if pending is None:
            raise
        print(f"[fedsweep] MLflow run {run_id} not ended ({status}): {type(error).__name__}: {error}", file=sys.stderr)


def set_shared_tag(mlflow, run_id: str, key: str, value: str) -> None:
    """``mlflow.set_tag`` for a tag another process may write at the same moment (a stopped trial's ``outcome``:
    its thread and the sweep's driver, :mod:`fedsweep.stopping`). MLflow's SQL store reads, then inserts a tag it
    did not find, so two first writers collide on the table's UNIQUE key and one gets an error (CI of 2026-11-27;
    two threads writing a new tag at once: 54 collisions in 100). The tag exists after a collision: the loser
    writes again only if it holds another value (an update, which cannot collide)."""
    try:
        mlflow.set_tag(run_id, key, value)
    except Exception:  # noqa: BLE001 - a collision (its type is the store's: SQL, REST); the tag is read back
        if mlflow.get_run(run_id).data.tags.get(key) != value:
            mlflow.set_tag(run_id, key, value)


def warm_up(uri: str) -> threading.Thread:
    """Import MLflow and open its store for ``uri`` in a thread of this process, creating no experiment and no run
    (a new SQLite store gets its tables): the store is kept per URI, so the run's own calls find it open. Started
    before Ray (``connect_ray``) and joined before the first write, it overlaps the two start-ups (docs/performance.md,
    section 8, ``benchmarks/startup.py``). A store that cannot be opened is reported by the first real call,
    as without it."""

    def open_store() -> None:
        with contextlib.suppress(Exception):
            client(uri).search_experiments(max_results=1)

    thread = threading.Thread(target=open_store, name="mlflow-warm-up", daemon=True)
    thread.start()
    return thread


EXPERIMENT_KIND = "mlflow.experimentKind"


def ensure_experiment(uri: str, name: str) -> str:
    """The id of experiment ``name``, created if missing (local stores keep artifacts in ./mlartifacts)."""
    c = client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    artifact_location = None
    if uri.startswith(("sqlite:", "file:")):
        artifact_location = (Path.cwd() / "mlartifacts").resolve().as_uri()
    try:
        # the kind tag tells the MLflow UI (3.x) these are model-training runs, not GenAI traces
        return c.create_experiment(name, artifact_location=artifact_location, tags={EXPERIMENT_KIND: "custom_model_development"})
    except Exception:  # created concurrently by another process
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _batched(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


#: The shared vocabulary's symbols (ALGORITHMS.md) of hyperparameters, by name or alias; for trial names,
#: legends and axis labels.
SYMBOLS = {"local_lr": "β", "beta": "β", "personalization_lr": "α", "alpha": "α", "coupling": "λ", "lambda": "λ",
           "local_steps": "τ", "tau": "τ", "participation_rate": "r"}


def in_vocabulary(label: str) -> str:
    """A setting label (``local_lr=0.1, alpha=0.2``) in the shared symbols (``β=0.1, α=0.2``)."""
    parts = [p.split("=", 1) for p in label.split(", ") if "=" in p]
    return ", ".join(f"{SYMBOLS.get(k, k)}={v}" for k, v in parts) or label


def trial_title(cfg: ExperimentConfig, overrides: dict[str, Any]) -> str:
    """What a trial is, for people: ``fedavg β=0.05, α=0 seed=1``."""
    setting = setting_label(overrides)
    words = [cfg.algorithm.name, in_vocabulary(setting) if setting != "default" else None, f"seed={cfg.seed}"]
    return " ".join(w for w in words if w)


def setting_label(overrides: dict[str, Any]) -> str:
    """The grid values that define a setting (seed and algorithm name left out)."""
    parts = [
        f"{k.removeprefix('algorithm.')}={format_value(v)}" for k, v in overrides.items() if k not in ("seed", "algorithm.name")
    ]
    return ", ".join(parts) or "default"


@dataclass(frozen=True)
class RunRecord:
    """What a run is created with, in plain values: the process that writes it need not hold the config (nor import
    torch, as :mod:`fedsweep.tracking_process` does not). ``title`` names the accuracy plot."""

    tags: dict[str, str]
    params: dict[str, str]
    title: str
    outage_limit_s: float
    log_client_table: bool
    log_plot: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_record(cfg: ExperimentConfig, overrides: dict[str, Any] | None = None, tags: dict[str, str] | None = None,
               parent_run_id: str | None = None) -> RunRecord:
    """The tags and params of ``cfg``'s run (the platform read in this process: the one whose arithmetic it logs)."""
    from fedsweep.algorithms import ALGORITHMS

    all_tags = {
        f"{TAG_PREFIX}algorithm": cfg.algorithm.name,
        f"{TAG_PREFIX}setting": cfg.setting_key(),
        f"{TAG_PREFIX}setting_label": setting_label(overrides or {}),
        f"{TAG_PREFIX}seed": str(cfg.seed),
        PLATFORM_TAG: run_platform(),
        CODE_TAG: code_version(),
        **({LEAK_TAG: f"{cfg.algorithm.evaluation} (leaks test data)"} if cfg.algorithm.leaks_test_data else {}),
        **({f"{TAG_PREFIX}provenance": provenance} if (provenance := ALGORITHMS[cfg.algorithm.name].provenance) else {}),
        **(tags or {}),
        **({PARENT_TAG: parent_run_id} if parent_run_id else {}),
    }
    params = {k: json.dumps(v) if isinstance(v, (list, dict)) else str(v) for k, v in cfg.flat_params().items()}
    t = cfg.tracking
    return RunRecord(all_tags, params, cfg.name, t.outage_limit_s, t.log_client_table, t.log_plot)


class RunLogger:
    """Logs one experiment: params, per-round metrics with ``step=round``, a per-client table and a plot."""

    def __init__(
        self,
        uri: str,
        experiment_id: str,
        cfg: ExperimentConfig | RunRecord,
        run_name: str,
        parent_run_id: str | None = None,
        overrides: dict[str, Any] | None = None,
        tags: dict[str, str] | None = None,
        run_id: str | None = None,
    ):
        """``cfg``: the experiment, or its :class:`RunRecord` already made (which holds the overrides, tags and
        parent: then give none of them)."""
        from mlflow.entities import Param

        if isinstance(cfg, RunRecord):
            assert parent_run_id is None and overrides is None and tags is None, "a RunRecord holds them already"
            self.record = cfg
        else:
            self.record = run_record(cfg, overrides, tags, parent_run_id)
        self.client = client(uri)
        self.logged_through = -1  # the last round whose metrics this run holds (written, or held until the next flush)
        self.pending: list[list] = []  # the rounds since the last flush, each a list of metrics
        self._pending_count = 0
        self._handed_at = -math.inf  # time.monotonic() of the last hand-over: the first evaluation round goes at once
        self.history: list[dict[str, float]] = []
        if run_id is not None:  # a trial resumed from a checkpoint goes on logging into its own run
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            self._reload_history()
            self.writer = MetricWriter(uri, run_id, self.record.outage_limit_s)
            return
        self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=self.record.tags).info.run_id
        for chunk in _batched([Param(k, v) for k, v in self.record.params.items()], 100):
            self.client.log_batch(self.run_id, params=chunk)
        self.writer = MetricWriter(uri, self.run_id, self.record.outage_limit_s)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_metric(self, key: str, value: float, step: int) -> None:
        self.client.log_metric(self.run_id, key, value, step=step)

    def _reload_history(self) -> None:
        """The rounds an earlier attempt logged: ``logged_through`` and the evaluations the plot needs."""
        steps = [m.step for m in self.client.get_metric_history(self.run_id, "uploads")]
        self.logged_through = max(steps, default=-1)
        by_round: dict[int, dict[str, float]] = {}
        for key in PLOTTED:
            for m in self.client.get_metric_history(self.run_id, key):
                by_round.setdefault(m.step, {"round": float(m.step)})[key] = m.value
        self.history = [by_round[r] for r in sorted(by_round)]

    def log_round(self, metrics: dict[str, float]) -> None:
        """A round's metrics, held until an evaluation round (or a checkpoint, :meth:`after_written`) at least
        :data:`LINGER_S` after the last hand-over, which hands them all to the writer in one call (one store round
        trip for one or several evaluation intervals instead of one per round; docs/performance.md, section 5) and
        goes on training while the writer's thread writes them; :meth:`flush` hands them sooner and waits until
        they are written (a scheduler's report), :meth:`finish` at the end and on failure.
        Raises :class:`~fedsweep.metric_writer.TrackingOutage` once the server has not taken metrics for
        ``tracking.outage_limit_s``."""
        from mlflow.entities import Metric

        step = int(metrics["round"])
        ts = int(time.time() * 1000)  # kept through every retry: a repeated write is stored once
        self.pending.append([
            Metric(k, float(v), ts, step)
            for k, v in metrics.items()
            if k not in _NOT_METRICS and v is not None and not (isinstance(v, float) and math.isnan(v))
        ])
        self._pending_count += len(self.pending[-1])
        self.logged_through = step
        evaluated = "personalized_accuracy_mean" in metrics
        if evaluated:
            self.history.append(metrics)
        if self._pending_count >= _FLUSH_AT or (evaluated and time.monotonic() - self._handed_at >= LINGER_S):
            self._hand_over()
        self.writer.check()

    def _hand_over(self) -> None:
        self.writer.put(self.pending)
        self.pending, self._pending_count, self._handed_at = [], 0, time.monotonic()

    def after_written(self, action) -> None:
        """``action()`` once MLflow holds every round logged so far (:meth:`~fedsweep.metric_writer.MetricWriter.after_written`),
        the trial going on meanwhile: the rounds held here are handed over now when the last hand-over was
        :data:`LINGER_S` ago, else with the next one (rounds that fast: a newer checkpoint may replace this one
        there, under a second of training later). Left always for the next evaluation's hand-over, a checkpoint
        between evaluations waited for it and was replaced there: checkpoints at evaluations only."""
        if time.monotonic() - self._handed_at >= LINGER_S:
            self._hand_over()
        self.writer.after_written(action, later=self._pending_count)

    def flush(self) -> bool:
        """Hand the rounds held by :meth:`log_round` to the writer and wait while it writes them: True once the
        run holds every round logged so far; False, without waiting, while the server does not answer (an
        outage: the writer holds them and writes them when it answers again)."""
        self._hand_over()
        return self.writer.wait(until_written=False)

    def stopped_by_scheduler(self) -> bool:
        """Whether a scheduler tagged this run stopped before its last round (False while the server does not answer:
        the sweep's driver marks it at the sweep's end, :func:`fedsweep.stopping.mark_stopped_early`). Not asked
        during an outage the writer has seen: MLflow's client would retry the read for minutes."""
        if self.writer.outage_since is not None or self.writer.gave_up:
            return False
        try:
            return STOPPED_AFTER in self.client.get_run(self.run_id).data.tags
        except Exception:  # noqa: BLE001 - an outage: the driver's mark stays
            return False

    def finish(self, client_rows: list[dict] | None, status: str = "FINISHED", outcome: str | None = None,
               placement: list[dict] | None = None) -> None:
        """The rounds still held, written (waiting up to ``tracking.outage_limit_s`` for a server that does not
        answer), artifacts (per-client table, accuracy-vs-round plot, ``placement.json``: where the processes ran,
        ``ServerActor.placement``, with the number of nodes as the tag ``fedsweep.nodes``), then the run's
        terminal status. When the writer gave up (the error being raised is its
        :class:`~fedsweep.metric_writer.TrackingOutage`, or the server's refusal of the metrics), or gives up here,
        nothing more is sent: the run stays RUNNING, for the retry that goes on from its checkpoint (or deletes it,
        :func:`fedsweep.sweep._earlier_attempts`)."""
        try:
            if self.writer.gave_up:
                return
            self._hand_over()
            self.writer.wait()
        finally:
            self.writer.close()
        try:
            if placement:
                self.client.log_dict(self.run_id, placement, "placement.json")
                if nodes := {row["node_id"] for row in placement if row["node_id"]}:  # none: run in the command's process
                    self.client.set_tag(self.run_id, f"{TAG_PREFIX}nodes", str(len(nodes)))
            if client_rows and self.record.log_client_table:
                import pandas as pd

                self.client.log_table(self.run_id, pd.DataFrame(client_rows), "clients/final_round.json")
            if self.history and self.record.log_plot:
                fig = accuracy_plot(self.history, self.record.title)
                self.client.log_figure(self.run_id, fig, "plots/accuracy_vs_round.png")
                pyplot().close(fig)
        finally:
            set_shared_tag(self.client, self.run_id, f"{TAG_PREFIX}outcome", outcome or status.lower())
            self.client.set_terminated(self.run_id, status)


#: The evaluation metrics :func:`accuracy_plot` draws.
PLOTTED = ("personalized_accuracy_worst", "personalized_accuracy_best", "personalized_accuracy_mean",
           "personalized_accuracy_p10", "global_accuracy")


def pyplot():
    """matplotlib's pyplot on its Agg backend, which draws to files only: trials, workers and CI have no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def accuracy_plot(history: list[dict[str, float]], title: str):
    plt = pyplot()
    rounds = [h["round"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 4))
    if all("personalized_accuracy_worst" in h and "personalized_accuracy_best" in h for h in history):
        ax.fill_between(
            rounds,
            [h["personalized_accuracy_worst"] for h in history],
            [h["personalized_accuracy_best"] for h in history],
            alpha=0.15,
            label="personalized, worst-best client",
        )
    for key, label in (
        ("personalized_accuracy_mean", "personalized, mean over clients"),
        ("personalized_accuracy_p10", "personalized, 10th percentile"),
        ("global_accuracy", "global model"),
    ):
        if all(key in h for h in history):  # e.g. no global model: no global line
            ax.plot(rounds, [h[key] for h in history], marker="o", markersize=3, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
