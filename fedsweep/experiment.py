"""Running one experiment: on Ray (connect, reserve a placement group, drive the ServerActor round by round) or in
this process (:class:`InProcessRunner`), both through :func:`execute`."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Container, Iterator
from contextlib import ExitStack
from typing import TYPE_CHECKING

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsweep.checks import check_fits, local_cpus, raise_problems
from fedsweep.config import ExperimentConfig, ResourcesConfig
from fedsweep.tracking import STOPPED_EARLY, TAG_PREFIX, RunLogger

if TYPE_CHECKING:
    from fedsweep.tracking_process import TrackingProcess


def connect_ray(resources: ResourcesConfig) -> None:
    """Join ``ray_address`` / ``$RAY_ADDRESS``, else start a local instance sized by ``cluster_cpus``/``cluster_gpus``."""
    if ray.is_initialized():
        return
    address = resources.address()
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    kwargs: dict = {"num_cpus": int(resources.cluster_cpus or local_cpus())}
    if resources.cluster_gpus is not None:
        kwargs["num_gpus"] = int(resources.cluster_gpus)
    start_local_ray(**kwargs)


def start_local_ray(**kwargs) -> None:
    """``ray.init(**kwargs)`` of a local instance without a dashboard, its dashboard agent on a free port.

    A local instance's agent binds its HTTP server to port 52365 unless told otherwise, and ``ray.init`` cannot tell
    it (``ray start --dashboard-agent-listen-port`` can); when another instance on the machine holds the port (a
    second sweep, the suite's workers side by side), the agent retries it for 3.3 s before giving up, and the raylet
    waits for the agent: ``ray.init`` took 9.2 s instead of 4.9 s beside another instance (docs/performance.md,
    "Thirty-sixth session"). Port 0 is Ray's own "any free port", which the agent reports to the node.

    Nor the autoscaler's monitor (``no_monitor``): a process that imports Ray's autoscaler to scale a cluster
    of one fixed node, and at ``ray.shutdown`` outlives SIGTERM's one-second grace: 1.0 of the 1.36 s a local
    instance took to stop (0.1-0.4 s without it; docs/performance.md, "Fifty-first session").

    Nor, with ``log_to_driver=False``, the log monitor: a process that lists the logs folder and reads every worker's
    log to publish its lines to drivers, which this one does not ask for (docs/performance.md, "Seventieth
    session").

    Nor, without a dashboard, Ray's API server: ``start_head_processes`` starts it whatever ``include_dashboard``
    says, and without the dashboard it loads one module, the usage-stats reporter (``services.start_api_server``:
    ``--modules-to-load=UsageStatsHead``), no job or state API; ``ray.init`` waits for it to publish its address
    (docs/performance.md, "Seventy-fifth session")."""
    from ray._private import parameter
    from ray._private.node import Node

    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":  # tests/test_actors.py: the agents take jobs then
        print("fedsweep: RAY_AUTH_MODE=disabled: this Ray instance's agents listen on the machine's network address and "
              "run a job anyone there submits (Ray binds them so; its token authentication is what refuses them)",
              file=sys.stderr)
    ray_params, api_server = parameter.RayParams, Node.start_api_server
    quiet = {"include_log_monitor": False} if kwargs.get("log_to_driver") is False else {}
    parameter.RayParams = functools.partial(ray_params, dashboard_agent_listen_port=0, no_monitor=True, **quiet)
    kwargs = {"include_dashboard": False, **kwargs}
    if kwargs["include_dashboard"] is False:
        Node.start_api_server = lambda self, **_: None
    try:
        ray.init(**kwargs)
    finally:
        parameter.RayParams, Node.start_api_server = ray_params, api_server


def check_cluster(configs: list[ExperimentConfig], where: str) -> None:
    """After connecting and before any MLflow run: every trial's placement group must fit the cluster, by the
    check made before connecting (:func:`fedsweep.checks.check_fits`), with the cluster's live nodes."""
    total = ray.cluster_resources()
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    raise_problems([p for cfg in configs for p in check_fits(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), None, where, nodes)])


# Inside a Tune trial: the ServerActor (and its ClientActors) the last trial of this process finished
# with, kept for the next trial of the same placement group and resources. Tune's ``reuse_actors`` runs
# that trial in this same process; the actors die with it when Tune stops it.
_warm: dict = {}


def _warm_key(cfg: ExperimentConfig, pg: PlacementGroup) -> tuple:
    return pg.id.hex(), cfg.num_clients, cfg.resources.model_dump_json()


class ExperimentRunner:
    """Starts the ServerActor (which starts the ClientActors) inside a placement group and steps it.

    Outside Tune the runner creates the group itself: bundle 0 holds the ServerActor,
    bundle 1 + a ClientActor a (hosting ``clients_per_actor`` clients). Inside a Tune trial
    the group is the trial's own (``tune.with_resources``), and bundle 0 is shared by the
    trial driver and the ServerActor, which then asks for no CPU of its own; there the actors
    are kept warm after a trial that ended without error and reset for the process's next trial
    of equal resources (:meth:`actors.server.ServerActor.reset`), instead of starting new processes.
    """

    #: Whether :meth:`rounds` may send the next call before reading the last (calls to an actor, not in this process).
    pipelines = True

    def __init__(self, cfg: ExperimentConfig, trial_placement_group: PlacementGroup | None = None, start_timeout_s: float = 300):
        self.cfg = cfg
        self.start_timeout_s = start_timeout_s
        self.own_pg = trial_placement_group is None
        self.pg = trial_placement_group
        self.server = None
        self.client_actors: list = []  # started and owned by this driver; the ServerActor drives them
        self.reused = False  # True when a warm ServerActor of an earlier trial runs this one
        self.clients_info: list[dict] = []

    def start(self) -> None:
        """Start the actors (or take the warm ones of this trial process's last trial); nothing once started."""
        cfg = self.cfg
        if self.server is not None:
            return
        if self.own_pg:
            self.pg = placement_group(cfg.resources.bundles(cfg.num_clients), strategy=cfg.resources.placement_strategy.upper())
            try:
                ray.get(self.pg.ready(), timeout=self.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(self.pg)
                raise RuntimeError(
                    f"resources: the placement group {cfg.resources.bundles(cfg.num_clients)[:2]}... for "
                    f"{cfg.num_clients} clients was not granted within {self.start_timeout_s:.0f}s; "
                    f"the cluster has {ray.available_resources()} available"
                ) from None
        if not self.own_pg and _warm.get("key") == _warm_key(cfg, self.pg):
            self.server, self.client_actors = _warm.pop("server"), _warm.pop("client_actors")
            try:
                self._ask("reset", cfg, timeout=self.start_timeout_s)
                self.reused = True
            except ray.exceptions.RayError:  # it or a ClientActor died since: start anew
                self._kill()
        if self.server is None:
            self._start_server()
        self.clients_info = self._ask("clients_info", timeout=self.start_timeout_s)

    def _start_server(self) -> None:
        cfg = self.cfg
        server_cpus = cfg.resources.server_cpus_total() if self.own_pg else 0
        from actors.server import ServerActor, start_client_actors

        self.client_actors = start_client_actors(cfg, self.pg)  # the driver owns them: kept until stop()
        self.server = ServerActor.options(
            num_cpus=server_cpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=0),
        ).remote(cfg, self.client_actors)

    def _call(self, method: str, *args):
        """Call ``method`` of the server; what :meth:`_reply` reads its reply from."""
        return getattr(self.server, method).remote(*args)

    def _reply(self, pending, timeout: float | None = None):
        return ray.get(pending, timeout=timeout)

    def _ask(self, method: str, *args, timeout: float | None = None):
        """``method(*args)`` on the server, its reply awaited."""
        return self._reply(self._call(method, *args), timeout)

    def rounds(self, start: int = 0, pipelined: bool = False, sync_after: Container[int] = ()) -> Iterator[dict[str, float]]:
        """Rounds ``start`` (0: initial evaluation) to ``rounds``; each item carries ``wall_time_s``, the server's
        seconds since the first training round of this run began.

        ``pipelined``: the server runs the rounds up to the next evaluation in one call (or to a round in
        ``sync_after``, where the caller acts on the actors, e.g. a checkpoint), and the next such call is sent
        before this one's metrics are read, so the ServerActor neither answers a call per round nor waits for the
        driver (its MLflow writes at evaluations); the first training round is a call of its own, so that a user
        sees it (``time_to_first_round_s``) when it ends. A caller that inspects the actors between any two
        rounds leaves it off: one call per round.
        """
        clock_from = max(start, 1)
        spans = round_spans(start, self.cfg.rounds, self.cfg.eval_rounds() | set(sync_after) if pipelined else None)
        sent = None  # the call of the next span, when already sent
        for i, (a, b) in enumerate(spans):
            pending = sent if sent is not None else self._call("steps", a, b, clock_from)
            sent = None
            if pipelined and self.pipelines and i + 1 < len(spans) and b not in sync_after:
                sent = self._call("steps", *spans[i + 1], clock_from)  # returns [] if round b diverged
            for metrics in self._reply(pending):
                yield metrics
                if metrics.get("diverged"):
                    return

    def checkpoint(self, rnd: int) -> dict:
        return self._ask("checkpoint", rnd)

    def restore(self, checkpoint: dict) -> int:
        """Load a checkpoint into the started actors; returns the round to run next."""
        return self._ask("restore", checkpoint)

    def client_table(self) -> list[dict]:
        return self._ask("client_table")

    def placement(self) -> list[dict]:
        return self._ask("placement")

    def _kill(self) -> None:
        for actor in [self.server, *self.client_actors]:
            if actor is not None:
                ray.kill(actor)
        self.server, self.client_actors = None, []

    def stop(self, keep_warm: bool = False) -> None:
        """Stop the actors; ``keep_warm`` (a trial that ended without error) keeps them for the next trial."""
        if keep_warm and not self.own_pg and self.server is not None:
            _warm.update(key=_warm_key(self.cfg, self.pg), server=self.server, client_actors=self.client_actors)
            self.server, self.client_actors = None, []
            return
        self._kill()
        if self.own_pg and self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def round_spans(start: int, last: int, ends: set[int] | None) -> list[tuple[int, int]]:
    """Rounds ``start`` to ``last`` as the (first, last) of each call: one round per call when ``ends`` is None,
    else calls that end at each round of ``ends``, at the first training round (``max(start, 1)``) and at ``last``."""
    if ends is None:
        return [(r, r) for r in range(start, last + 1)]
    cut = sorted(e for e in ends | {max(start, 1), last} if start <= e <= last)
    return list(zip([start, *(e + 1 for e in cut)], cut))


def one_process(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg``'s layout is one process: a worker pool of one (no ClientActor) and no GPU, the layout chosen
    for a stacked model (:func:`fedsweep.layout.auto_layout`). Such a run has nothing for Ray to place: ``fedsweep
    run`` runs it in the command's process (:func:`runs_in_process`), a sweep's trial in the trial's process."""
    r = cfg.resources
    return r.num_client_actors(cfg.num_clients) == 0 and not r.client_gpus and not r.cluster_gpus


def runs_in_process(cfg: ExperimentConfig) -> bool:
    """Whether ``fedsweep run`` runs ``cfg`` in the command's own process, not on Ray: a layout of one process
    (:func:`one_process`) with no cluster to join (``ray_address``, ``$RAY_ADDRESS``). Ray's start and stop
    dominated such a command (docs/performance.md, section 8)."""
    return not cfg.resources.address() and one_process(cfg)


class InProcessRunner(ExperimentRunner):
    """:class:`actors.server.ExperimentServer` (the ServerActor's class) in this process (:func:`one_process`):
    the same calls, answered at once; this process's torch thread count is :data:`fedsweep.federation.COMPUTE_THREADS`
    from :meth:`start` to :meth:`stop` (:func:`fedsweep.federation.compute_threads`), as in an actor. In a Tune
    trial this process holds bundle 0 of the trial's placement group, the bundle a ServerActor would have shared
    with it; there is no process to start or keep warm (a trial process's start-up was two processes' before)."""

    pipelines = False

    def __init__(self, cfg: ExperimentConfig):
        super().__init__(cfg)
        self.threads = ExitStack()  # undone at stop

    def start(self) -> None:
        from actors.server import ExperimentServer
        from fedsweep.federation import compute_threads

        if self.server is None:
            self.threads.enter_context(compute_threads())
            self.server = ExperimentServer(self.cfg, [])
            self.clients_info = self.server.clients_info()

    def _call(self, method: str, *args):
        return getattr(self.server, method)(*args)

    def _reply(self, pending, timeout: float | None = None):
        return pending

    def stop(self, keep_warm: bool = False) -> None:
        self.server = None
        self.threads.close()


def execute(
    cfg: ExperimentConfig,
    logger: RunLogger | TrackingProcess | None,
    on_round: Callable[[dict[str, float]], None] = lambda m: None,
    trial_placement_group: PlacementGroup | None = None,
    checkpoint_every: int = 0,
    on_checkpoint: Callable[[dict[str, float], dict], None] | None = None,
    resume: dict | None = None,
    runner: ExperimentRunner | None = None,
) -> list[dict[str, float]]:
    """Run ``cfg`` to the end: every round is logged to MLflow (``logger``: in this process, or by ``fedsweep run``'s
    child), every round is passed to ``on_round``.

    Every ``checkpoint_every`` rounds (after logging) ``on_checkpoint(metrics, checkpoint)`` is called
    instead of ``on_round``; ``resume`` (such a checkpoint) restarts after its round, and rounds the
    logger already holds are not logged twice; a checkpoint carries the run's ``wall_time_s`` so far, and a
    resumed run's rounds count on from it (not counting the rounds after the checkpoint that ran again).
    The MLflow run ends FINISHED, or FAILED with outcome
    ``diverged`` (non-finite global model) or ``error``; the exception is re-raised. ``runner``: the one to
    use (e.g. an :class:`InProcessRunner`, possibly started already); else, in a Tune trial
    (``trial_placement_group``) with a layout of one process, an :class:`InProcessRunner`, and otherwise a new
    :class:`ExperimentRunner`.
    """
    if runner is None:
        in_trial = trial_placement_group is not None
        runner = InProcessRunner(cfg) if in_trial and one_process(cfg) else ExperimentRunner(cfg, trial_placement_group)
    history: list[dict[str, float]] = []
    finished = ended_cleanly = False
    try:
        runner.start()
        if logger and runner.reused:
            logger.set_tag(f"{TAG_PREFIX}warm_actors", "true")  # no process start: timings differ
        if logger and isinstance(runner, InProcessRunner):
            logger.set_tag(f"{TAG_PREFIX}in_process", "true")  # no actor process: timings differ
        start = runner.restore(resume) if resume is not None else 0
        # the server's clock starts at the first round it runs; a resumed run's goes on from its checkpoint's
        elapsed = float(resume.get("wall_time_s", 0.0)) if resume is not None else 0.0
        checkpoint_rounds = range(checkpoint_every, cfg.rounds, checkpoint_every) if on_checkpoint and checkpoint_every else ()
        for metrics in runner.rounds(start, pipelined=True, sync_after=checkpoint_rounds):
            if elapsed and "wall_time_s" in metrics:
                metrics["wall_time_s"] += elapsed
            history.append(metrics)
            rnd = int(metrics["round"])
            if logger and rnd > logger.logged_through:
                logger.log_round(metrics)
            # a run resumed from a checkpoint finds every round before it in MLflow: ``on_checkpoint`` saves it
            # once the logger's rounds are written (while the tracking server does not answer, later or never:
            # a retry then reruns those rounds from an earlier one)
            if rnd in checkpoint_rounds and not metrics.get("diverged"):
                on_checkpoint(metrics, runner.checkpoint(rnd) | {"wall_time_s": metrics.get("wall_time_s", 0.0)})
            else:
                on_round(metrics)
        diverged = bool(history and history[-1].get("diverged"))
        if logger:
            rows, placement = runner.client_table(), runner.placement()  # a failure here ends the run FAILED below
            finished = True
            logger.finish(rows, "FAILED" if diverged else "FINISHED", "diverged" if diverged else None, placement)
        ended_cleanly = True
        return history
    except SystemExit:
        # Tune stopped the trial: its training thread exits at the report after the decision. A scheduler
        # also stops a trial that reported its last round: that run is complete. One stopped before its last
        # round was either stopped by the scheduler, which tagged its run when it decided (FINISHED,
        # stopped_early), or interrupted (Ctrl-C: KILLED, and --resume reruns it); fedsweep.stopping.
        if logger and not finished:
            complete = bool(history) and int(history[-1]["round"]) >= cfg.rounds
            diverged = bool(history and history[-1].get("diverged"))
            stopped = not (complete or diverged) and logger.stopped_by_scheduler()
            try:
                clients = runner.client_table() if complete else None
            except Exception:  # noqa: BLE001 - the trial's actors may already be going; the run ends regardless
                clients = None
            logger.finish(clients, "FAILED" if diverged else ("FINISHED" if complete or stopped else "KILLED"),
                          "diverged" if diverged else (STOPPED_EARLY if stopped else None))
        raise
    except BaseException:
        if logger and not finished:
            logger.finish(None, "FAILED", "error")
        raise
    finally:
        # actors of a trial that lost or restored clients are not kept: Ray counts client_max_restarts over an
        # actor's life, so the next trial would start a restarted one with less than its own allowance
        faults = any(m.get("clients_restored") or m.get("clients_dropped") for m in history)
        runner.stop(keep_warm=ended_cleanly and not faults)
