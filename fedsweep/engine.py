"""One experiment's server and client pool, driven round by round: the code every execution path runs.

:class:`Engine` builds the dataset, the :class:`~fedsweep.federation.Server` and the
:class:`~fedsweep.pool.ClientPool` of the layout in ``cfg.resources``, and answers the calls a driver makes
(:meth:`Engine.steps`, checkpoints, the client table). In this process every host is a
:class:`~fedsweep.pool.LocalHost` (:func:`run_local`, and ``fedsweep run`` of a one-process layout); the Ray
path (``actors.server.ServerActor``) is this class with ClientActors as the remote hosts.
"""

from __future__ import annotations

import os
import time
from typing import Any

from fedsweep.federation import COMPUTE_THREADS, Client, Server, Setup, compute_threads
from fedsweep.pool import ClientPool, Gather, Host, LocalHost, host_clients


class Engine:
    """An experiment's server and pool. Subclasses make remote hosts (:meth:`remote_hosts`); here there are none,
    and every host of the layout is a :class:`LocalHost` over one set of :class:`Client` objects."""

    def __init__(self, cfg: Any, device: str = "cpu"):
        self.experiment = -1
        self.pool: ClientPool | None = None
        self.device = device  # where this process's clients keep their data and models (the server stays on the CPU)
        self.reset(cfg)

    def layout(self, cfg: Any) -> tuple[list[list[int]], bool]:
        """(clients held by each host, replicated): a worker pool's W hosts of every client, else blocks of
        ``clients_per_actor``; host 0 of a worker pool is this process."""
        r = cfg.resources
        return host_clients(cfg.num_clients, r.clients_per_actor, r.client_workers)

    def remote_hosts(self, cfg: Any, dataset: Any, setup: Setup, holds: list[list[int]]) -> tuple[list[Host], Gather | None]:
        """The hosts that run outside this process, for ``holds[1:]`` of a worker pool or every block, and the
        function that gathers their replies; here none (every host local)."""
        return [], None

    def reset(self, cfg: Any) -> None:
        """Run experiment ``cfg`` next: its dataset (the one this command's checks built, if they did), a fresh
        server and fresh client states."""
        from fedsweep.data import built_or_build

        dataset = built_or_build(cfg.run_data())
        self.cfg = cfg
        self.experiment += 1
        self.diverged = False
        setup = Setup.of(cfg, dataset.num_features, dataset.num_classes)
        self.server = Server(setup, cfg.num_clients, cfg.eval_rounds())
        holds, replicated = self.layout(cfg)
        remote, gather = self.remote_hosts(cfg, dataset, setup, holds)
        here = holds[: len(holds) - len(remote)]  # the hosts of this process
        self.local = {c: Client(c, dataset.clients[c], setup, self.device) for c in sorted({c for ids in here for c in ids})}
        local: list[Host] = [LocalHost({c: self.local[c] for c in ids}, cfg.resources.vectorize_clients) for ids in here]
        self.pool = ClientPool(local + remote, holds, replicated, cfg.num_clients, gather, cfg.resources.round_timeout_s)

    def steps(self, first: int, last: int, clock_from: int) -> list[dict[str, float]]:
        """Rounds ``first`` to ``last`` in one call, stopping after a round that diverged; [] once one has (the
        driver may have sent this call before reading that round). ``wall_time_s``: seconds since round
        ``clock_from`` (the run's first training round) began here; 0 before it."""
        out = []
        for rnd in range(first, last + 1):
            if self.diverged:
                break
            if rnd == clock_from:
                self.clock = time.perf_counter()
            metrics = self.server.step(self.pool, rnd)
            metrics["wall_time_s"] = time.perf_counter() - self.clock if rnd >= clock_from else 0.0
            self.diverged = bool(metrics.get("diverged"))
            out.append(metrics)
        return out

    def checkpoint(self, rnd: int) -> dict:
        return self.server.checkpoint(self.pool, rnd)

    def restore(self, checkpoint: dict) -> int:
        return self.server.restore(self.pool, checkpoint)

    def client_table(self) -> list[dict]:
        return [e.row() for e in self.server.last_evals]

    def global_params(self):
        return self.server.params.numpy()

    def client_states(self, client_ids: list[int]) -> list:
        return self.pool.states(client_ids)

    def clients_info(self) -> list[dict]:
        """Where the clients run: this process's rows (pid, device)."""
        return [{"client_id": i, "device": str(c.device), "pid": os.getpid(), "gpu_ids": [],
                 "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")} for i, c in self.local.items()]

    def placement(self) -> list[dict]:
        return [{"process": "server", "node_id": None, "pid": os.getpid(), "clients": sorted(self.local), "channel": None}]


def local_federation(cfg: Any) -> tuple[Server, ClientPool]:
    """Experiment ``cfg``'s server and its pool in this process (every host of its layout local), fresh states."""
    engine = Engine(cfg)
    return engine.server, engine.pool


def run_local(cfg: Any, device: str = "cpu") -> tuple[list[dict[str, float]], Server]:
    """The whole experiment in this process, no Ray: the same :class:`Engine` the actors run, every host local,
    its clients on ``device`` (``"cuda"``: this process's GPU, as a GPU ClientActor's clients)."""
    with compute_threads():  # as in the actors
        engine = Engine(cfg, device)
        history = [m for rnd in range(cfg.rounds + 1) for m in engine.steps(rnd, rnd, 1)]
        for m in history:
            m.pop("wall_time_s")
        return history, engine.server


__all__ = ["COMPUTE_THREADS", "Engine", "local_federation", "run_local"]
