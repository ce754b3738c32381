"""ServerActor: the :class:`fedsweep.engine.Engine` of one experiment in a Ray actor (bundle 0 of the trial's
placement group), its remote hosts ClientActors (bundles 1…) reached through Ray calls. With a worker pool
(``resources.client_workers``) it also trains a share of each round's clients itself (host 0)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.client import ROUND_CALL, ClientActor, Packed, StaleClientActor, hosted_info
from fedsweep.engine import Engine
from fedsweep.federation import COMPUTE_THREADS, Payload, Setup
from fedsweep.pool import Host, Parts

#: Payloads up to this size ride inside each call, as Ray inlines small arguments (its
#: ``max_direct_call_object_size``, 100 KiB); larger ones are put in the object store once per round.
INLINE_PAYLOAD_BYTES = 100 * 1024


class RayCalls:
    """How calls travel to ClientActors: the round's shared payload put in the object store once (when large),
    and the replies gathered within one timeout, a dead or restarted actor reported as lost."""

    def __init__(self):
        self._shared: tuple[Payload, Any] | None = None

    @staticmethod
    def broadcast(payload: Payload) -> Payload | ray.ObjectRef:
        """What the round's calls carry: a small payload itself (no trip through the object store, which is
        a process of its own: docs/performance.md, section 1), a large one as a single ``ray.put``
        object read by every actor."""
        if sum(v.nbytes for v in payload.values()) <= INLINE_PAYLOAD_BYTES:
            return payload
        return ray.put(payload)

    def pack(self, payloads: dict[int, Payload], client_ids: list[int]) -> Packed:
        """The payloads of ``client_ids`` as one call carries them: one shared payload put at most once per round."""
        first = payloads[client_ids[0]]
        if all(payloads[c] is first for c in client_ids):
            if self._shared is None or self._shared[0] is not first:
                self._shared = (first, self.broadcast(first))
            return ("shared", self._shared[1], client_ids)
        return ("each", {c: payloads[c] for c in client_ids})

    @staticmethod
    def gather(handles: dict[int, ray.ObjectRef], timeout_s: float | None) -> tuple[dict[int, Any], set[int]]:
        """Replies by host of the calls that returned within the timeout, and the hosts that died (or came back
        empty) during theirs; a straggler is neither: its late reply is never read."""
        if not handles:
            return {}, set()
        refs = list(handles.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
        replies, lost = {}, set()
        for h, ref in handles.items():
            if ref not in ready:
                continue
            try:
                replies[h] = ray.get(ref)
            except (ray.exceptions.RayActorError, StaleClientActor):
                lost.add(h)
        return replies, lost


class ActorHost:
    """A :class:`fedsweep.pool.Host` in a ClientActor: its calls are Ray calls, their replies handles."""

    remote = True

    def __init__(self, actor, setup_args: tuple, calls: RayCalls, experiment: int):
        self.actor = actor
        self.setup_args = setup_args  # ClientActor.reset's arguments for this experiment (shards as a ref)
        self.calls = calls
        self.experiment = experiment

    def train(self, parts: Parts, payloads: dict[int, Payload], rnd: int) -> ray.ObjectRef:
        return self.actor.train.remote(parts, self.calls.pack(payloads, list(parts)), rnd, self.experiment)

    def evaluate(self, parts: Parts, payloads: dict[int, Payload], global_params: np.ndarray | None, rnd: int) -> ray.ObjectRef:
        return self.actor.evaluate.remote(parts, self.calls.pack(payloads, list(parts)), global_params, rnd, self.experiment)

    def setup(self) -> ray.ObjectRef:
        return self.actor.setup.remote(self.setup_args)


def start_client_actors(cfg, placement_group: PlacementGroup | None, first_bundle: int = 1) -> list:
    """One empty ClientActor per remote host of the layout, ClientActor a in bundle ``first_bundle + a``.
    Started by the driver at the same time as the ServerActor, so that the processes start (each
    importing torch) side by side rather than one after the other. Empty, a restarted ClientActor is
    never mistaken for one that still holds its clients: its next call raises StaleClientActor."""
    r = cfg.resources
    actors = []
    for a in range(r.num_client_actors(cfg.num_clients)):
        options: dict = {"num_cpus": r.client_cpus, "num_gpus": r.client_gpus, "max_restarts": r.client_max_restarts}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group, placement_group_bundle_index=first_bundle + a
            )
        actors.append(ClientActor.options(**options).remote())
    return actors


class ExperimentServer(Engine):
    """An :class:`Engine` whose remote hosts are ``client_actors`` (started empty by the caller,
    :func:`start_client_actors`); :meth:`reset` makes the same actors run another experiment of equal resources
    (a sweep's next trial) without starting new processes."""

    def __init__(self, cfg, client_actors: list):
        """Sets this process's torch threads to :data:`COMPUTE_THREADS`, on which the numbers depend."""
        torch.set_num_threads(COMPUTE_THREADS)
        self.actors = client_actors
        super().__init__(cfg)

    def remote_hosts(self, cfg, dataset, setup: Setup, holds: list[list[int]]) -> tuple[list[Host], Any]:
        """ClientActor a hosts ``holds[-len(actors) + a]``: every block, or a worker pool's hosts after the first.
        Its shards go to the object store once (a worker pool's: one object of every shard, shared by all)."""
        if not self.actors:
            return [], None
        mine = holds[len(holds) - len(self.actors):]
        if cfg.resources.client_workers:
            refs = [ray.put(dict(enumerate(dataset.clients)))] * len(mine)
        else:
            refs = [ray.put({i: dataset.clients[i] for i in ids}) for ids in mine]
        use_gpu = cfg.resources.client_gpus > 0
        calls = RayCalls()
        experiment = self.experiment
        args = [(ref, setup, cfg.resources.vectorize_clients, use_gpu, experiment) for ref in refs]
        ray.get([a.reset.remote(*arg) for a, arg in zip(self.actors, args)])
        self.hosts_of_actors = mine
        return [ActorHost(a, arg, calls, experiment) for a, arg in zip(self.actors, args)], calls.gather

    def clients_info(self) -> list[dict]:
        """Where the clients run (with a worker pool: every worker's row for every client, this actor's first);
        blocks until every client actor is constructed."""
        own = hosted_info(self.local)
        return own + [i for infos in (ray.get([a.info.remote() for a in self.actors]) if self.actors else []) for i in infos]

    def placement(self) -> list[dict]:
        """Where this experiment runs: a row for this actor and for each ClientActor (its node, process, clients)."""
        here = {"node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None, "pid": os.getpid()}
        rows = [{"process": "server", **here, "clients": sorted(self.local), "channel": None}]
        asked = [actor.placement.remote() for actor in self.actors]
        for a, ref in enumerate(asked):
            try:
                where = ray.get(ref, timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as e:
                where = {"node_id": None, "pid": None, "error": type(e).__name__}
            rows.append({"process": f"client_actor_{a}", **where, "clients": self.hosts_of_actors[a], "channel": "ray"})
        return rows

    @ray.method(**ROUND_CALL)
    def steps(self, first: int, last: int, clock_from: int) -> list[dict[str, float]]:
        return super().steps(first, last, clock_from)


@ray.remote(num_cpus=0)
class ServerActor(ExperimentServer):
    """:class:`ExperimentServer` in a process of its own, in bundle 0 of the experiment's placement group."""
