"""ClientActor: a Ray actor holding some clients' shards (one block of ``clients_per_actor``, or, as a worker of a
pool, every shard), their models on the actor's device, and the states of the clients it trained last (resident
between rounds). It is a remote host of :class:`fedsweep.pool.ClientPool`: the pool sends a client's state with a
call only when this actor does not hold the current one."""

from __future__ import annotations

import os

import ray
import torch

from fedsweep.client_data import ClientData
from fedsweep.federation import COMPUTE_THREADS, Client, Payload, Setup
from fedsweep.pool import Parts, run_evaluate, run_train

#: The calls made every round (ClientActor.train and evaluate, ServerActor.steps) report no task events to
#: Ray's dashboard and state API (``ray list tasks``, ``ray timeline``): Ray documents these events as a
#: cost on every task; docs/performance.md, section 1, measures rounds without them.
#: Set-up, reset, checkpoint and restore calls still report theirs.
ROUND_CALL = {"enable_task_events": False}


class StaleClientActor(RuntimeError):
    """The actor does not hold the clients of the experiment a call is for: Ray restarted it (a restarted
    actor comes back empty), or it was reset for another experiment."""


#: A round's payloads as a call carries them: ("shared", one payload for every client, client ids) — the
#: payload itself or one object-store object — or ("each", {client: payload}) when clients get their own.
Packed = tuple


def unpack(packed: Packed) -> dict[int, Payload]:
    if packed[0] == "shared":
        _, payload, ids = packed
        if isinstance(payload, ray.ObjectRef):  # Ray does not resolve a ref inside an argument's tuple
            payload = ray.get(payload)
        return dict.fromkeys(ids, payload)
    return packed[1]


@ray.remote(num_cpus=0)
class ClientActor:
    """Wraps :class:`fedsweep.federation.Client` objects; resources are set by ``.options()`` from the trial's bundle.

    An actor starts empty; :meth:`reset` gives it an experiment's shards. ``experiment`` numbers the
    experiments a (warm, reused) actor has hosted; every call names the one it is for, and an actor
    holding another, or none, raises :class:`StaleClientActor`.
    """

    def __init__(self):
        # One intra-op thread: an actor holds a fraction of a CPU, and many share the node.
        torch.set_num_threads(COMPUTE_THREADS)
        self.clients: dict[int, Client] = {}
        self.experiment = -1  # none
        self.stacked = False

    def reset(self, shards: dict[int, ClientData], setup: Setup, stacked: bool, use_gpu: bool, experiment: int) -> None:
        """Host ``shards`` for an experiment with fresh states (what a new actor would hold)."""
        device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
        self.clients = {i: Client(i, d, setup, device) for i, d in shards.items()}
        self.stacked = stacked
        self.experiment = experiment

    def _check(self, experiment: int) -> None:
        if experiment != self.experiment:
            held = f"experiment {self.experiment}" if self.experiment >= 0 else "nothing (new or restarted)"
            raise StaleClientActor(f"holds {held}, asked for experiment {experiment}")

    @ray.method(**ROUND_CALL)
    def train(self, parts: Parts, packed: Packed, rnd: int, experiment: int):
        self._check(experiment)
        return run_train(self.clients, parts, unpack(packed), rnd, self.stacked)

    @ray.method(**ROUND_CALL)
    def evaluate(self, parts: Parts, packed: Packed, global_params, rnd: int, experiment: int):
        self._check(experiment)
        return run_evaluate(self.clients, parts, unpack(packed), global_params, rnd)

    @ray.method(max_task_retries=-1)
    def setup(self, args: tuple) -> None:
        """:meth:`reset` with the shards given as an object ref (which Ray does not resolve inside a tuple):
        how the pool sets a restarted actor up again. Retried by Ray until the actor is back: sent while it is
        still restarting (seconds: a new process imports torch), a call with no retries fails at once with
        ``ActorUnavailableError``, and the round's evaluation would miss its clients (seen in CI). Once the
        actor's restarts are spent it fails with ``ActorDiedError`` and the pool keeps the host lost."""
        shards, *rest = args
        self.reset(ray.get(shards), *rest)

    def info(self) -> list[dict]:
        return hosted_info(self.clients)

    def placement(self) -> dict:
        """This process: its node and pid (``ServerActor.placement``)."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def hosted_info(clients: dict[int, Client]) -> list[dict]:
    """Where each client of this process runs: pid, torch device, the GPUs Ray assigned and CUDA_VISIBLE_DEVICES."""
    common = {
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else [],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    return [{"client_id": i, "device": str(c.device), **common} for i, c in clients.items()]
