"""ServerActor: builds the federated dataset, gives the ClientActors (one per client, or ``clients_per_actor``
clients each, in the trial's placement group) their shards, and runs rounds: sample ⌈r·n⌉ clients, one broadcast
(inside the calls when small, else one ``ray.put``), aggregate, evaluate on the cadence. With a worker pool
(``resources.client_workers``) it trains a share of each round's clients itself."""

from __future__ import annotations

import os
import time

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.channel import Call, ChannelLost, Link
from actors.client import ROUND_CALL, ClientActor, StaleClientActor, hosted_info
from fedsweep.algorithms.base import ClientMessage
from fedsweep.config import ExperimentConfig
from fedsweep.data import build_federated_dataset
from fedsweep.evaluation import ClientEval
from fedsweep.federation import (
    COMPUTE_THREADS,
    Client,
    ClientSnapshot,
    Payload,
    Server,
    evaluate_from_snapshots,
    train_from_snapshots,
)

#: Payloads up to this size ride inside each call, as Ray inlines small arguments (its
#: ``max_direct_call_object_size``, 100 KiB); larger ones are put in the object store once per round.
INLINE_PAYLOAD_BYTES = 100 * 1024


class RayPool:
    """The client pool of :class:`fedsweep.federation.Server`, backed by ClientActors.

    ``hosts[a]`` lists the client ids actor ``a`` holds. A round makes one call per actor that
    holds a sampled client; replies come back in the order of ``client_ids``, so aggregation
    sums in the same order as in-process (identical numbers, whatever the packing).

    Faults: an actor that dies during a call, or has not answered within ``timeout_s``, is left
    out of that call's replies (its clients are missing from the returned list); Ray restarts a
    dead actor for the next rounds when its ``max_restarts`` allows, and before its next call the
    pool loads its clients' states from the last checkpoint (:meth:`snapshot`; none yet: fresh states).
    """

    def __init__(self, actors: list, hosts: list[list[int]], setups: list[tuple], experiment: int = 0,
                 timeout_s: float | None = None):
        self.actors = actors
        self.hosts = hosts
        self.setups = setups  # per actor: the arguments of ClientActor.reset for this experiment
        self.experiment = experiment
        self.actor_of = {c: a for a, ids in enumerate(hosts) for c in ids}
        self.timeout_s = timeout_s
        self.saved: dict[int, ClientSnapshot] = {}  # the clients at the last checkpoint
        self.lost: set[int] = set()  # actors that died during a call
        self.restored = 0  # clients whose checkpointed state was loaded into a restarted actor

    def _recover(self, actor_ids) -> None:
        """Set restarted actors up for this experiment (Ray rebuilt them from the arguments of the one they
        were created for) and load the last checkpoint's client states; an actor still down stays lost."""
        pending = {a: self.actors[a].load.remote(self._of_actor(a, self.saved), self.setups[a])
                   for a in self.lost.intersection(actor_ids)}
        for a in self._gather(pending):
            self.lost.discard(a)
            self.restored += sum(1 for c in self.hosts[a] if c in self.saved)

    def _of_actor(self, a: int, snapshots: dict[int, ClientSnapshot]) -> dict[int, ClientSnapshot]:
        """The part of ``snapshots`` that belongs to the clients actor ``a`` hosts."""
        return {c: snapshots[c] for c in self.hosts[a] if c in snapshots}

    def _gather(self, calls: dict[int, ray.ObjectRef], timeout_s: float | None = None) -> dict[int, list]:
        """Replies by actor, of the calls that returned within the timeout (``timeout_s``, else the pool's)
        without their actor dying."""
        if not calls:  # e.g. no lost actor to recover: no Ray call on the round's path
            return {}
        refs = list(calls.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s if timeout_s is not None else self.timeout_s)[0])
        replies = {}
        for a, ref in calls.items():
            if ref not in ready:
                continue  # a straggler: its late reply is never read
            try:
                replies[a] = ray.get(ref)
            except (ray.exceptions.RayActorError, StaleClientActor):
                self.lost.add(a)  # its process died during the call, or died and was restarted before it
        return replies

    def _by_actor(self, client_ids: list[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for c in client_ids:
            groups.setdefault(self.actor_of[c], []).append(c)
        return groups

    @staticmethod
    def broadcast(payload: Payload) -> Payload | ray.ObjectRef:
        """What the round's calls carry: a small payload itself (no trip through the object store, which is
        a process of its own: on one core that trip was 7% of a round), a large one as a single ``ray.put``
        object read by every actor."""
        if sum(v.nbytes for v in payload.values()) <= INLINE_PAYLOAD_BYTES:
            return payload
        return ray.put(payload)

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]:
        ref = self.broadcast(payload)
        groups = self._by_actor(client_ids)
        self._recover(groups)
        replies = self._gather({a: self.actors[a].train.remote(ref, rnd, ids, self.experiment) for a, ids in groups.items()})
        by_client = {m.client_id: m for msgs in replies.values() for m in msgs}
        return [by_client[c] for c in client_ids if c in by_client]

    def _gather_asking_twice(self, calls: dict[int, ray.ObjectRef], call) -> dict[int, list]:
        """:meth:`_gather` for calls that change no state (evaluation): an actor that failed its call is set
        up again and asked once more with ``call(a)`` (a restarted actor answers this time); training is
        never repeated within a round."""
        replies = self._gather(calls)
        missing = [a for a in calls if a not in replies]
        self._recover(missing)
        replies.update(self._gather({a: call(a) for a in missing}))
        return replies

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        ref = self.broadcast(payload)
        self._recover(range(len(self.actors)))

        def call(a: int) -> ray.ObjectRef:
            return self.actors[a].evaluate.remote(ref, rnd, self.experiment)

        replies = self._gather_asking_twice({a: call(a) for a in range(len(self.actors))}, call)
        return [e for a in sorted(replies) for e in replies[a]]

    def take_restored(self) -> int:
        """Clients loaded from a checkpoint into restarted actors since the last call."""
        n, self.restored = self.restored, 0
        return n

    def snapshot(self) -> dict[int, ClientSnapshot]:
        """Every client's state, from every actor (a checkpoint must be whole: no timeout, no dropout)."""
        self.saved = {c: snap for part in ray.get([a.snapshot.remote(self.experiment) for a in self.actors]) for c, snap in part.items()}
        return self.saved

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None:
        ray.get([actor.load.remote(self._of_actor(a, snapshots)) for a, actor in enumerate(self.actors)])
        self.saved = dict(snapshots)

    def close(self) -> None:
        """Called when the ServerActor replaces this pool (a warm actor's next experiment)."""

    def channel_of(self, a: int) -> str:
        """How the rounds reach ClientActor ``a``: ``ray`` (actor calls) or ``socket`` (:mod:`actors.channel`)."""
        return "ray"

    def states(self, client_ids: list[int]) -> list:
        groups = self._by_actor(client_ids)
        replies = ray.get([self.actors[a].get_states.remote(ids, self.experiment) for a, ids in groups.items()])
        by_client = {c: st for ids, sts in zip(groups.values(), replies) for c, st in zip(ids, sts)}
        return [by_client[c] for c in client_ids]


class WorkerPool(RayPool):
    """The client pool of a worker pool (``resources.client_workers`` = W): the ServerActor's own clients
    (``local``) and W - 1 ClientActors, each holding every client's shard.

    A round's clients, in id order, are split into W contiguous parts whose sizes differ by at most one;
    the ClientActors get the larger parts (the ServerActor also aggregates), and their calls are sent
    before the ServerActor trains its own part. The client states live here, between rounds and in
    checkpoints, and travel with the calls, so a ClientActor that dies loses none: its clients are
    missing from that round's replies (their states unchanged), and a restarted one is reset to every
    shard before its next call. Replies are returned in client-id order: the same numbers as any packing.

    With ``channel="socket"`` (``resources.pool_channel``) the round's calls to a ClientActor on this node go
    through its socket (:mod:`actors.channel`) instead of Ray; a socket found closed counts as the actor's
    death (Ray restarts it, the pool sets it up and connects again), a reply later than the timeout is dropped.
    """

    def __init__(self, local: dict[int, Client], actors: list, setups: list[tuple], experiment: int = 0,
                 timeout_s: float | None = None, channel: str = "ray"):
        super().__init__(actors, [list(local)] * len(actors), setups, experiment, timeout_s)
        self.local = local
        self.held: dict[int, ClientSnapshot] = {c: (None, 0) for c in local}  # every client's state
        self.channel = channel
        self.links: dict[int, Link | None] = {}  # per ClientActor: its socket, or None for Ray calls
        self._shared: tuple[Payload, Payload | ray.ObjectRef] | None = None  # the last payload, as Ray calls carry it

    def _connect(self, actor_ids) -> None:
        """Give the actors without a link one: their socket when on this node and ``channel`` is socket, else
        None (Ray calls). An actor that dies meanwhile is lost (set up again before its next call)."""
        new = [a for a in actor_ids if a not in self.links and a not in self.lost]
        if not new:  # every round after the first: nothing to ask
            return
        if self.channel != "socket":
            self.links.update(dict.fromkeys(new))
            return
        here = ray.get_runtime_context().get_node_id()
        for a, (node, address, authkey) in self._gather({a: self.actors[a].open_channel.remote() for a in new}).items():
            self.links[a] = Link(address, authkey) if node == here else None

    def _drop_link(self, a: int) -> None:
        link = self.links.pop(a, None)
        if link is not None:
            link.close()

    def _lose(self, a: int) -> None:
        self.lost.add(a)
        self._drop_link(a)

    def _recover(self, actor_ids) -> None:
        actor_ids = list(actor_ids)
        super()._recover(actor_ids)
        self._connect(actor_ids)

    def _call(self, a: int, method: str, payload: Payload, *args) -> Call | ray.ObjectRef:
        """``method(payload, *args)`` on ClientActor ``a``: through its socket if it has one, else a Ray call."""
        link = self.links.get(a)
        if link is not None:
            return link.submit(method, payload, *args)
        return getattr(self.actors[a], method).remote(self._for_ray(payload), *args)

    def _gather(self, calls: dict[int, Call | ray.ObjectRef], timeout_s: float | None = None) -> dict[int, list]:
        """:meth:`RayPool._gather` for calls through sockets or Ray, within one timeout."""
        timeout_s = timeout_s if timeout_s is not None else self.timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        replies, refs = {}, {}
        for a, call in calls.items():
            if not isinstance(call, Call):
                refs[a] = call
                continue
            try:
                replies[a] = call.result(deadline)
            except TimeoutError:
                pass  # a straggler: its late reply is dropped when it comes
            except (ChannelLost, StaleClientActor):
                self._lose(a)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return replies | super()._gather(refs, left)

    def close(self) -> None:
        for a in list(self.links):
            self._drop_link(a)

    def channel_of(self, a: int) -> str:
        return "ray" if self.links.get(a) is None else "socket"

    def _parts(self, client_ids: list[int]) -> tuple[list[list[int]], list[int]]:
        """(the part of each ClientActor, the ServerActor's part)."""
        parts = [[int(c) for c in p] for p in np.array_split(np.asarray(client_ids, dtype=np.int64), len(self.actors) + 1)]
        return parts[:-1], parts[-1]

    def _held(self, client_ids: list[int]) -> dict[int, ClientSnapshot]:
        return {c: self.held[c] for c in client_ids}

    def _for_ray(self, payload: Payload) -> Payload | ray.ObjectRef:
        """What a Ray call to a ClientActor carries: :meth:`RayPool.broadcast`, once per payload, made only
        when some ClientActor is called through Ray (a pool of one, or one whose ClientActors all have
        sockets, puts nothing in the object store; a large model would be put every round, read by no one)."""
        if self._shared is None or self._shared[0] is not payload:
            self._shared = (payload, self.broadcast(payload))
        return self._shared[1]

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]:
        remote, mine = self._parts(client_ids)
        self._recover(range(len(self.actors)))
        calls = {a: self._call(a, "train_states", payload, rnd, self._held(ids), self.experiment)
                 for a, ids in enumerate(remote) if ids}
        messages, states = train_from_snapshots(self.local, self._held(mine), payload, rnd)
        for msgs, sts in self._gather(calls).values():
            messages += msgs
            states.update(sts)
        self.held.update(states)
        by_client = {m.client_id: m for m in messages}
        return [by_client[c] for c in client_ids if c in by_client]

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        remote, mine = self._parts(sorted(self.local))
        self._recover(range(len(self.actors)))

        def call(a: int) -> Call | ray.ObjectRef:
            return self._call(a, "evaluate_states", payload, rnd, self._held(remote[a]), self.experiment)

        calls = {a: call(a) for a, ids in enumerate(remote) if ids}
        evals = evaluate_from_snapshots(self.local, self._held(mine), payload, rnd)
        replies = self._gather_asking_twice(calls, call)
        return evals + [e for a in sorted(replies) for e in replies[a]]

    def snapshot(self) -> dict[int, ClientSnapshot]:
        return dict(self.held)

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None:
        self.held = {c: (None, 0) for c in self.local} | dict(snapshots)

    def states(self, client_ids: list[int]) -> list:
        return [self.held[c][0] for c in client_ids]


def start_client_actors(cfg: ExperimentConfig, placement_group: PlacementGroup | None, first_bundle: int = 1) -> list:
    """One empty ClientActor per ``clients_per_actor`` clients, ClientActor a in bundle ``first_bundle + a``.
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


class ExperimentServer:
    """One experiment's server and its ClientActors; :meth:`reset` makes the same actors run another
    experiment of equal resources (a sweep's next trial) without starting new processes.

    It runs in a :class:`ServerActor`, or, for a layout of one process (a worker pool of one: no ClientActor)
    run on this machine by ``fedsweep run``, in the command's own process: the same code, the same numbers,
    without Ray (:func:`fedsweep.experiment.runs_in_process`)."""

    def __init__(self, cfg: ExperimentConfig, client_actors: list):
        """``client_actors``: started empty by the caller (:func:`start_client_actors`), while this actor
        starts; they host nothing until :meth:`reset` gives them this experiment's shards. Sets this process's
        torch threads to :data:`COMPUTE_THREADS`, on which the numbers depend."""
        torch.set_num_threads(COMPUTE_THREADS)
        r = cfg.resources
        self.hosts = [r.clients_of_actor(a, cfg.num_clients) for a in range(r.num_client_actors(cfg.num_clients))]
        self.actors = client_actors
        self.experiment = -1
        self.pool: RayPool | None = None
        self.reset(cfg)

    def _put_shards(self, dataset) -> list[ray.ObjectRef]:
        """One object per ClientActor: the shards of the clients it hosts (with a worker pool, one object
        of every shard, shared by all)."""
        if not self.hosts:
            return []
        if self.cfg.resources.client_workers:
            return [ray.put(dict(enumerate(dataset.clients)))] * len(self.hosts)
        return [ray.put({i: dataset.clients[i] for i in ids}) for ids in self.hosts]

    def reset(self, cfg: ExperimentConfig) -> None:
        """Run experiment ``cfg`` next: its dataset, a fresh server, and the ClientActors reset to its shards
        and fresh states. ``cfg`` must have the resources and the number of clients of the first experiment."""
        dataset = build_federated_dataset(cfg.data)
        self.cfg = cfg
        self.experiment += 1
        self.diverged = False
        self.server = Server(cfg, dataset.num_features, dataset.num_classes)
        # The arguments of ClientActor.reset per actor (they hold this experiment's shards), kept by the pool
        # for restarted actors.
        setups = [(ref, cfg, dataset.num_features, dataset.num_classes, self.experiment) for ref in self._put_shards(dataset)]
        timeout_s = cfg.resources.round_timeout_s
        if self.pool is not None:
            self.pool.close()
        if cfg.resources.client_workers:
            local = {i: Client(i, d, cfg, dataset.num_features, dataset.num_classes) for i, d in enumerate(dataset.clients)}
            self.pool = WorkerPool(local, self.actors, setups, self.experiment, timeout_s, cfg.resources.pool_channel)
        else:
            self.pool = RayPool(self.actors, self.hosts, setups, self.experiment, timeout_s)
        if self.actors:
            ray.get([a.reset.remote(*setup) for a, setup in zip(self.actors, setups)])

    def clients_info(self) -> list[dict]:
        """Where the clients run (with a worker pool: every worker's row for every client, this actor's first);
        blocks until every client actor is constructed."""
        own = hosted_info(self.pool.local) if isinstance(self.pool, WorkerPool) else []
        return own + [i for infos in (ray.get([a.info.remote() for a in self.actors]) if self.actors else []) for i in infos]

    @ray.method(**ROUND_CALL)
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

    def placement(self) -> list[dict]:
        """Where this experiment runs: a row for this actor and for each ClientActor (its node, process, clients,
        and how the rounds reach it: ``ray`` calls or the ``socket``, with the requests answered through it)."""
        here = {"node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None, "pid": os.getpid()}
        local = sorted(self.pool.local) if isinstance(self.pool, WorkerPool) else []
        rows = [{"process": "server", **here, "clients": local, "channel": None}]
        asked = [actor.placement.remote() for actor in self.actors]
        for a, ref in enumerate(asked):
            try:
                where = ray.get(ref, timeout=60)
            except (ray.exceptions.RayError, TimeoutError) as e:
                where = {"node_id": None, "pid": None, "socket_requests": None, "error": type(e).__name__}
            rows.append({"process": f"client_actor_{a}", **where, "clients": self.hosts[a], "channel": self.pool.channel_of(a)})
        return rows

    def global_params(self):
        return self.server.params.numpy()

    def client_states(self, client_ids: list[int]) -> list:
        return self.pool.states(client_ids)


@ray.remote(num_cpus=0)
class ServerActor(ExperimentServer):
    """:class:`ExperimentServer` in a process of its own, in bundle 0 of the experiment's placement group."""
