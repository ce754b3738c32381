"""Where the clients live: one pool design for every layout, in this process or across Ray actors.

A :class:`ClientPool` spreads a round's clients over its *hosts*. A host holds some clients' shards and, between
calls, the states of the clients it trained last (resident state). Two layouts (:func:`host_clients`):

- *blocks* (``resources.clients_per_actor`` = k, no ``client_workers``): host a holds clients [a·k, (a+1)·k), each
  client always runs there;
- *replicas* (``resources.client_workers`` = W): W hosts each hold every shard, and a round's clients are split into
  W contiguous parts (sizes within one of each other), so that every host has work whatever the sampling.

How calls travel is the host's business: :class:`LocalHost` runs its clients in this process (the server's own
part of a worker pool, and every host of an in-process run); ``actors.server.ActorHost`` sends them to a ClientActor
through Ray calls. The pool sends every remote host its call before running the local ones, then gathers.

**One fault model: no client state is ever lost or rolled back.** The pool keeps every client's latest state
(each training reply carries the trained clients' new states) and knows which host holds it (``fresh``). A call
carries a client's state only when its host does not hold the current one (another host trained it last, or the
host was restarted); a host that dies or does not answer within the round's timeout is missing from that call's
replies (its clients dropped for the round, their states unchanged) and gets the states it needs sent with its
next call; one that died is also set up again before that call (a straggler is not: it is alive, only late). Checkpoints are read from the pool's copy, with no call at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from fedsweep.algorithms.base import ClientMessage
from fedsweep.evaluation import ClientEval
from fedsweep.federation import Client, ClientSnapshot, Payload, train_group

#: What a call gives a host for each of its clients: the state to load first, or None to use the one it holds.
Parts = dict[int, ClientSnapshot | None]


#: How long a call waits for a lost host to be set up again (a restarted actor: a new process that imports torch,
#: seconds; on a node that must be replaced, longer). Past it the host stays lost for the call, its clients
#: dropped, and its next call asks again.
RESTART_WAIT_S = 120.0


class HostLost(RuntimeError):
    """A host died during a call, or came back empty (restarted): its clients' resident states are gone."""


def host_clients(num_clients: int, clients_per_host: int, replicas: int) -> tuple[list[list[int]], bool]:
    """(the clients each host holds, whether every host holds every client). ``replicas`` > 0: that many hosts
    of every client; else blocks of ``clients_per_host``."""
    everyone = list(range(num_clients))
    if replicas:
        return [everyone] * replicas, True
    return [everyone[a : a + clients_per_host] for a in range(0, num_clients, clients_per_host)], False


def run_train(clients: dict[int, Client], parts: Parts, payloads: dict[int, Payload], rnd: int,
              stacked: bool) -> tuple[list[ClientMessage], dict[int, ClientSnapshot]]:
    """What a host does for a training call: load the states sent, train, return the messages and new states."""
    chosen = [clients[c] for c in parts]
    for c in chosen:
        if parts[c.client_id] is not None:
            c.load(parts[c.client_id])
    messages = train_group(chosen, payloads, rnd, stacked)
    return messages, {c.client_id: c.snapshot() for c in chosen}


def run_evaluate(clients: dict[int, Client], parts: Parts, payloads: dict[int, Payload], global_params: np.ndarray | None,
                 rnd: int) -> list[ClientEval]:
    """What a host does for an evaluation call (states are not changed by it)."""
    out = []
    for c, snap in parts.items():
        if snap is not None:
            clients[c].load(snap)
        out.append(clients[c].evaluate(payloads[c], global_params, rnd))
    return out


class Host(Protocol):
    """One place clients run. ``remote`` hosts return handles that the pool's ``gather`` resolves."""

    remote: bool

    def train(self, parts: Parts, payloads: dict[int, Payload], rnd: int) -> Any: ...

    def evaluate(self, parts: Parts, payloads: dict[int, Payload], global_params: np.ndarray | None, rnd: int) -> Any: ...

    def setup(self) -> Any:
        """Make a (restarted) host hold its shards again, with fresh clients; a handle for remote hosts."""
        ...


class LocalHost:
    """Clients in this process. Several local hosts may share the same :class:`Client` objects: the pool's
    ``fresh`` map tells each call whether a client's state must be loaded first."""

    remote = False

    def __init__(self, clients: dict[int, Client], stacked: bool):
        self.clients = clients
        self.stacked = stacked

    def train(self, parts: Parts, payloads: dict[int, Payload], rnd: int):
        return run_train(self.clients, parts, payloads, rnd, self.stacked)

    def evaluate(self, parts: Parts, payloads: dict[int, Payload], global_params: np.ndarray | None, rnd: int):
        return run_evaluate(self.clients, parts, payloads, global_params, rnd)

    def setup(self) -> None:
        return None


#: Resolves remote hosts' handles: (replies by host, hosts lost) of those that answered within the timeout.
Gather = Callable[[dict[int, Any], float | None], tuple[dict[int, Any], set[int]]]


def _no_remote(handles: dict[int, Any], timeout_s: float | None) -> tuple[dict[int, Any], set[int]]:
    if handles:
        raise RuntimeError("a remote host needs a gather function")
    return {}, set()


class ClientPool:
    """The clients of one experiment, on ``hosts`` (``holds[h]``: the clients host h holds; ``replicated``: every
    host holds every client). See the module's docstring for the assignment and the fault model."""

    def __init__(self, hosts: list[Host], holds: list[list[int]], replicated: bool, num_clients: int,
                 gather: Gather | None = None, timeout_s: float | None = None):
        self.hosts = hosts
        self.replicated = replicated
        self.owner = {c: h for h, ids in enumerate(holds) for c in ids} if not replicated else {}
        self.gather = gather or _no_remote
        self.timeout_s = timeout_s
        self.held: dict[int, ClientSnapshot] = {c: (None, 0) for c in range(num_clients)}
        self.fresh: dict[int, int] = {}  # client → the host holding its current state (after it trained there)
        self.lost: set[int] = set()
        self.orphaned: set[int] = set()  # clients whose current state was resident on a host that died
        self.restored = 0

    @classmethod
    def of_clients(cls, clients: list[Client], stacked: bool = False) -> ClientPool:
        """Every client in one :class:`LocalHost` of this process (the math's tests, the peer benchmarks), in the
        states they hold."""
        pool = cls([LocalHost({c.client_id: c for c in clients}, stacked)], [[c.client_id for c in clients]], False, len(clients))
        pool.held = {c.client_id: c.snapshot() for c in clients}
        pool.fresh = dict.fromkeys(pool.held, 0)
        return pool

    def assign(self, client_ids: list[int]) -> dict[int, list[int]]:
        """Host → its clients of ``client_ids`` (in id order): the owner of each (blocks), or contiguous parts whose
        sizes differ by at most one, the larger to the remote hosts (the server also aggregates)."""
        if not self.replicated:
            out: dict[int, list[int]] = {}
            for c in client_ids:
                out.setdefault(self.owner[c], []).append(c)
            return out
        order = sorted(range(len(self.hosts)), key=lambda h: not self.hosts[h].remote)
        parts = np.array_split(np.asarray(client_ids, dtype=np.int64), len(self.hosts))
        return {h: [int(c) for c in p] for h, p in zip(order, parts) if len(p)}

    def _parts(self, h: int, client_ids: list[int]) -> Parts:
        return {c: None if self.fresh.get(c) == h else self.held[c] for c in client_ids}

    def _sent_again(self, assigned: dict[int, list[int]]) -> None:
        """Count the orphaned clients whose state this call sends again (``clients_restored``)."""
        again = self.orphaned.intersection(c for h, ids in assigned.items() if h not in self.lost for c in ids)
        self.restored += len(again)
        self.orphaned -= again

    def _recover(self, hosts) -> None:
        """Set lost (always remote) hosts up again; one still down stays lost (its clients dropped from the call)."""
        pending = self.lost.intersection(hosts)
        if pending:
            replies, _ = self.gather({h: self.hosts[h].setup() for h in pending}, RESTART_WAIT_S)
            self.lost -= set(replies)

    def _forget(self, h: int) -> set[int]:
        """No client's current state is on host ``h`` any more; returns the clients whose state was."""
        gone = {c for c, g in self.fresh.items() if g == h}
        self.fresh = {c: g for c, g in self.fresh.items() if g != h}
        return gone

    def _lose(self, h: int) -> None:
        self.lost.add(h)
        self.orphaned |= self._forget(h)

    def _call(self, method: str, assigned: dict[int, list[int]], *args) -> dict[int, Any]:
        self._recover(assigned)
        self._sent_again(assigned)
        live = {h: ids for h, ids in assigned.items() if h not in self.lost}
        handles = {h: getattr(self.hosts[h], method)(self._parts(h, ids), *args) for h, ids in live.items() if self.hosts[h].remote}
        replies = {h: getattr(self.hosts[h], method)(self._parts(h, ids), *args) for h, ids in live.items() if not self.hosts[h].remote}
        got, lost = self.gather(handles, self.timeout_s)
        for h in lost:
            self._lose(h)
        for h in set(handles) - set(got) - lost:  # a straggler may still run this call: its states are not current
            self._forget(h)
        return replies | got

    def train(self, payloads: dict[int, Payload], rnd: int) -> list[ClientMessage]:
        assigned = self.assign(sorted(payloads))
        replies = self._call("train", assigned, payloads, rnd)
        messages = []
        for h, (msgs, states) in replies.items():
            messages += msgs
            self.held.update(states)
            self.fresh.update(dict.fromkeys(states, h))
        by_client = {m.client_id: m for m in messages}
        return [by_client[c] for c in sorted(payloads) if c in by_client]

    def evaluate(self, payloads: dict[int, Payload], global_params: np.ndarray | None, rnd: int) -> list[ClientEval]:
        """Every client scored; a host that fails is set up again and asked once more (evaluation changes no
        state; training is never repeated within a round)."""
        assigned = self.assign(sorted(payloads))
        replies = self._call("evaluate", assigned, payloads, global_params, rnd)
        missing = {h: ids for h, ids in assigned.items() if h not in replies}
        if missing:
            replies |= self._call("evaluate", missing, payloads, global_params, rnd)
        return sorted((e for evals in replies.values() for e in evals), key=lambda e: e.client_id)

    def take_restored(self) -> int:
        """Clients whose state was lost with their host and sent again from the pool's copy, since the last call."""
        n, self.restored = self.restored, 0
        return n

    def snapshot(self) -> dict[int, ClientSnapshot]:
        return dict(self.held)

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None:
        self.held = self.held | dict(snapshots)
        self.fresh, self.orphaned = {}, set()

    def states(self, client_ids: list[int]) -> list:
        return [self.held[c][0] for c in client_ids]
