"""ClientActor: a Ray actor hosting one client (or ``clients_per_actor`` packed clients), each with its shard,
its state across rounds and its model, on the actor's device; or, as a worker of a pool
(``resources.client_workers``), every client's shard, training the clients it is sent from the states sent."""

from __future__ import annotations

import os
import threading

import ray
import torch

from actors.channel import Endpoint
from fedsweep.algorithms.base import ClientData, ClientMessage
from fedsweep.config import ExperimentConfig
from fedsweep.evaluation import ClientEval
from fedsweep.federation import (
    COMPUTE_THREADS,
    Client,
    ClientSnapshot,
    Payload,
    evaluate_from_snapshots,
    train_clients,
    train_from_snapshots,
)

#: The ClientActor methods a worker pool's ServerActor may call through the actor's socket (actors/channel.py).
CHANNEL_CALLS = frozenset({"train_states", "evaluate_states"})

#: The calls made every round (ServerActor.step, ClientActor.train and evaluate) report no task events to
#: Ray's dashboard and state API (``ray list tasks``, ``ray timeline``): Ray documents these events as a
#: cost on every task; without them a 50 ms round on one core was 3% faster (docs/performance.md).
#: Set-up, reset, checkpoint and restore calls still report theirs.
ROUND_CALL = {"enable_task_events": False}


class StaleClientActor(RuntimeError):
    """The actor does not hold the clients of the experiment a call is for: Ray restarted it (a restarted
    actor comes back empty), or it was reset for another experiment."""


@ray.remote(num_cpus=0)
class ClientActor:
    """Wraps :class:`fedsweep.federation.Client` objects; resources are set by ``.options()`` from the trial's bundle.

    Packed clients train one after the other inside the actor, or as one stacked computation with
    ``resources.vectorize_clients``; parallelism across actors comes from Ray.

    An actor starts empty; :meth:`reset` gives it an experiment's shards. ``experiment`` numbers the
    experiments a (warm, reused) actor has hosted; every call names the one it is for, and an actor
    holding another, or none, raises :class:`StaleClientActor`.
    """

    def __init__(self):
        # One intra-op thread: an actor holds a fraction of a CPU, and many share the node.
        torch.set_num_threads(COMPUTE_THREADS)
        self.clients: dict[int, Client] = {}
        self.experiment = -1  # none
        self.endpoint: Endpoint | None = None
        self.lock = threading.Lock()  # Ray's calls and the socket's share the clients

    def open_channel(self) -> tuple[str, str | bytes, bytes]:
        """(node id, socket address, key) of this actor's socket endpoint, started on the first call: a worker
        pool's ServerActor on the same node sends :data:`CHANNEL_CALLS` there instead of calling through Ray."""
        if self.endpoint is None:
            self.endpoint = Endpoint(self._answer)
        return ray.get_runtime_context().get_node_id(), self.endpoint.address, self.endpoint.authkey

    def _answer(self, method: str, args: tuple):
        if method not in CHANNEL_CALLS:
            raise ValueError(f"{method!r} is not served on the socket; allowed: {sorted(CHANNEL_CALLS)}")
        with self.lock:
            return getattr(self, method)(*args)

    def channel_served(self) -> int:
        """Requests answered through the socket since this process started."""
        return 0 if self.endpoint is None else self.endpoint.served

    def reset(self, shards: dict[int, ClientData], cfg: ExperimentConfig, num_features: int, num_classes: int,
              experiment: int) -> None:
        """Host ``shards`` for experiment ``cfg`` with fresh states (what a new actor would hold)."""
        use_gpu = cfg.resources.client_gpus > 0 and torch.cuda.is_available()
        device = "cuda" if use_gpu else "cpu"
        with self.lock:
            self.clients = {i: Client(i, d, cfg, num_features, num_classes, device) for i, d in shards.items()}
            self.experiment = experiment

    def _check(self, experiment: int) -> None:
        if experiment != self.experiment:
            held = f"experiment {self.experiment}" if self.experiment >= 0 else "nothing (new or restarted)"
            raise StaleClientActor(f"holds {held}, asked for experiment {experiment}")

    @ray.method(**ROUND_CALL)
    def train(self, payload: Payload, rnd: int, client_ids: list[int], experiment: int) -> list[ClientMessage]:
        self._check(experiment)
        return train_clients([self.clients[i] for i in client_ids], payload, rnd)

    @ray.method(**ROUND_CALL)
    def evaluate(self, payload: Payload, rnd: int, experiment: int) -> list[ClientEval]:
        self._check(experiment)
        return [c.evaluate(payload, rnd) for c in self.clients.values()]

    @ray.method(**ROUND_CALL)
    def train_states(self, payload: Payload, rnd: int, snapshots: dict[int, ClientSnapshot],
                     experiment: int) -> tuple[list[ClientMessage], dict[int, ClientSnapshot]]:
        """A worker of a pool (``resources.client_workers``): train these clients from the states sent."""
        self._check(experiment)
        return train_from_snapshots(self.clients, snapshots, payload, rnd)

    @ray.method(**ROUND_CALL)
    def evaluate_states(self, payload: Payload, rnd: int, snapshots: dict[int, ClientSnapshot],
                        experiment: int) -> list[ClientEval]:
        self._check(experiment)
        return evaluate_from_snapshots(self.clients, snapshots, payload, rnd)

    def get_states(self, client_ids: list[int], experiment: int) -> list[Payload | None]:
        self._check(experiment)
        return [self.clients[i].get_state() for i in client_ids]

    def snapshot(self, experiment: int) -> dict[int, ClientSnapshot]:
        self._check(experiment)
        return {i: c.snapshot() for i, c in self.clients.items()}

    def load(self, snapshots: dict[int, ClientSnapshot], setup: tuple | None = None) -> None:
        """Load client states; with ``setup`` (the arguments of :meth:`reset`, the shards as an object
        ref, which Ray does not resolve inside a tuple), reset first."""
        if setup is not None:
            shards, *rest = setup
            self.reset(ray.get(shards), *rest)
        with self.lock:
            for i, snap in snapshots.items():
                self.clients[i].load(snap)

    def info(self) -> list[dict]:
        return hosted_info(self.clients)

    def placement(self) -> dict:
        """This process: its node, pid and the requests its socket answered (``ServerActor.placement``)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(), "socket_requests": self.channel_served()}


def hosted_info(clients: dict[int, Client]) -> list[dict]:
    """Where each client of this process runs: pid, torch device, the GPUs Ray assigned and CUDA_VISIBLE_DEVICES."""
    common = {
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else [],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    return [{"client_id": i, "device": str(c.device), **common} for i, c in clients.items()]
