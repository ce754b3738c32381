"""Client, server and the round loop, in plain Python and PyTorch.

The Ray actors in :mod:`actors` wrap a :class:`Client` and a :class:`Server`;
:class:`LocalPool` runs the same clients in this process, which is what the
tests of the math and the in-process benchmarks use.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import numpy as np
import torch

from fedsweep.algorithms import build_algorithm
from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, State
from fedsweep.algorithms.stacked import StackedContext, row, stack_states, stat_of
from fedsweep.config import ExperimentConfig
from fedsweep.evaluation import ClientEval, score, summarize
from fedsweep.models import FlatModel, build_model

Payload = dict[str, np.ndarray]
#: A client in a checkpoint: (its algorithm state or None before it first trained, times trained).
ClientSnapshot = tuple[Payload | None, int]

# Streams of randomness, kept apart so that e.g. evaluation never shifts training batches.
_TRAIN, _EVAL, _SAMPLE = 1, 2, 3


#: torch intra-op threads of every actor and of :func:`run_local`. A reduction split across threads sums
#: in another order, so the numbers depend on this count (e.g. a personalized loss in its 8th digit):
#: fixing it makes the in-process reference and the actors agree exactly on any machine.
COMPUTE_THREADS = 1


@contextmanager
def compute_threads() -> Iterator[None]:
    """Run the enclosed torch code with :data:`COMPUTE_THREADS` intra-op threads, then restore the count."""
    before = torch.get_num_threads()
    torch.set_num_threads(COMPUTE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def stream_seed(*parts: int) -> int:
    """A 63-bit seed derived from (experiment seed, client, round, stream); independent of scheduling."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def to_numpy(state: State) -> Payload:
    return {k: v.detach().cpu().numpy() for k, v in state.items()}


def to_tensors(payload: Payload, device: torch.device) -> State:
    # Arrays from the object store are read-only; copy into tensors this actor owns.
    return {k: torch.tensor(v, device=device) for k, v in payload.items()}


class Client:
    """One client: its shard, its model architecture and its persistent algorithm state."""

    def __init__(self, client_id: int, data: ClientData, cfg: ExperimentConfig, num_features: int, num_classes: int, device: str = "cpu"):
        self.client_id = client_id
        self.cfg = cfg
        self.device = torch.device(device)
        self.data = data.to(self.device)
        self.model = FlatModel(build_model(cfg.model, num_features, num_classes)).to(self.device)
        self.algorithm = build_algorithm(cfg.algorithm)
        self.state: State | None = None
        self.times_trained = 0

    def _context(self, rnd: int, stream: int) -> ClientContext:
        gen = torch.Generator().manual_seed(stream_seed(self.cfg.seed, self.client_id, rnd, stream))
        return ClientContext(self.model, self.data, gen)

    def _state(self, params: torch.Tensor) -> State:
        return self.state if self.state is not None else self.algorithm.init_client_state(params)

    def train(self, payload: Payload, rnd: int) -> ClientMessage:
        p = to_tensors(payload, self.device)
        message, self.state, stats = self.algorithm.client_update(self._context(rnd, _TRAIN), p, self._state(p["params"]))
        self.times_trained += 1
        return ClientMessage(self.client_id, self.data.num_train, to_numpy(message), stats)

    def evaluate(self, payload: Payload, rnd: int) -> ClientEval:
        p = to_tensors(payload, self.device)
        ctx = self._context(rnd, _EVAL)
        personal = self.algorithm.personalize(ctx, p, self._state(p["params"]))
        d = self.data
        personal_model = self.algorithm.predictor(ctx, personal)
        pc, pl = score(personal_model, d.x_test, d.y_test)
        global_model = lambda x: self.model(p["params"], x)
        gc, gl = score(global_model, d.x_test, d.y_test)
        _, tl = score(global_model, d.x_train, d.y_train)
        out = ClientEval(self.client_id, d.num_train, d.num_test, pc, pl, gc, gl, tl, self.times_trained)
        if d.num_val:
            out.num_val = d.num_val
            out.personalized_val_correct, out.personalized_val_loss_sum = score(personal_model, d.x_val, d.y_val)
            out.global_val_correct, out.global_val_loss_sum = score(global_model, d.x_val, d.y_val)
        return out

    def get_state(self) -> Payload | None:
        return None if self.state is None else to_numpy(self.state)

    def snapshot(self) -> ClientSnapshot:
        """What a checkpoint keeps of this client: its algorithm state and how often it trained."""
        return self.get_state(), self.times_trained

    def load(self, snapshot: ClientSnapshot) -> None:
        state, self.times_trained = snapshot
        self.state = None if state is None else to_tensors(state, self.device)


def train_clients(clients: list[Client], payload: Payload, rnd: int) -> list[ClientMessage]:
    """Local training of clients hosted together: one after the other, or, with
    ``resources.vectorize_clients``, as one stacked computation (:mod:`fedsweep.algorithms.stacked`).
    A round whose clients' states differ in shape (e.g. Ditto before some clients have a personal
    model) falls back to one by one."""
    if len(clients) > 1 and clients[0].cfg.resources.vectorize_clients:
        messages = _train_stacked(clients, payload, rnd)
        if messages is not None:
            return messages
    return [c.train(payload, rnd) for c in clients]


def _train_stacked(clients: list[Client], payload: Payload, rnd: int) -> list[ClientMessage] | None:
    first = clients[0]
    p = to_tensors(payload, first.device)
    states = stack_states([c._state(p["params"]) for c in clients])
    if states is None:
        return None
    rows = {k: v.expand(len(clients), *v.shape).clone() for k, v in p.items()}
    ctx = StackedContext([c._context(rnd, _TRAIN) for c in clients])
    message, new_states, stats = first.algorithm.client_update(ctx, rows, states)
    out = []
    for i, c in enumerate(clients):
        c.state = row(new_states, i)
        c.times_trained += 1
        out.append(ClientMessage(c.client_id, c.data.num_train, to_numpy(row(message, i)), {k: stat_of(v, i) for k, v in stats.items()}))
    return out


def train_from_snapshots(clients: dict[int, Client], snapshots: dict[int, ClientSnapshot], payload: Payload,
                         rnd: int) -> tuple[list[ClientMessage], dict[int, ClientSnapshot]]:
    """A worker of a pool (``resources.client_workers``): train the clients named in ``snapshots`` from the
    states given there, as :func:`train_clients`; returns the messages and the clients' new states."""
    chosen = [clients[c] for c in snapshots]
    for c in chosen:
        c.load(snapshots[c.client_id])
    messages = train_clients(chosen, payload, rnd)
    return messages, {c.client_id: c.snapshot() for c in chosen}


def evaluate_from_snapshots(clients: dict[int, Client], snapshots: dict[int, ClientSnapshot], payload: Payload,
                            rnd: int) -> list[ClientEval]:
    """A worker of a pool: evaluate the clients named in ``snapshots`` in the states given there."""
    out = []
    for c, snap in snapshots.items():
        clients[c].load(snap)
        out.append(clients[c].evaluate(payload, rnd))
    return out


class ClientPool(Protocol):
    """Where the clients live: in this process (:class:`LocalPool`) or in Ray actors."""

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]: ...

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]: ...

    def snapshot(self) -> dict[int, ClientSnapshot]: ...

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None: ...

    def take_restored(self) -> int:
        """Clients whose state was reloaded from a checkpoint after their host restarted, since the last call."""
        ...


class LocalPool:
    """The clients in this process, grouped as the Ray path packs them into actors
    (``resources.clients_per_actor``), so that vectorized training stacks the same clients together."""

    def __init__(self, clients: list[Client]):
        self.clients = clients

    def train(self, client_ids: list[int], payload: Payload, rnd: int) -> list[ClientMessage]:
        groups: dict[int, list[Client]] = {}
        for i in client_ids:
            groups.setdefault(i // self.clients[i].cfg.resources.clients_per_actor, []).append(self.clients[i])
        return [m for group in groups.values() for m in train_clients(group, payload, rnd)]

    def evaluate(self, payload: Payload, rnd: int) -> list[ClientEval]:
        return [c.evaluate(payload, rnd) for c in self.clients]

    def snapshot(self) -> dict[int, ClientSnapshot]:
        return {c.client_id: c.snapshot() for c in self.clients}

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None:
        for i, snap in snapshots.items():
            self.clients[i].load(snap)

    def take_restored(self) -> int:
        return 0  # in-process clients never restart


class Server:
    """Global model, server state, client sampling and aggregation; runs rounds against a :class:`ClientPool`."""

    def __init__(self, cfg: ExperimentConfig, num_features: int, num_classes: int):
        self.cfg = cfg
        self.algorithm = build_algorithm(cfg.algorithm)
        self.params = FlatModel(build_model(cfg.model, num_features, num_classes)).initial_vector(cfg.seed)
        self.state = self.algorithm.init_server_state(self.params)
        self.eval_rounds = cfg.eval_rounds()
        self.uploads = 0
        self.downloads = 0
        self.last_evals: list[ClientEval] = []

    def checkpoint(self, pool: ClientPool, rnd: int) -> dict:
        """Everything round ``rnd + 1`` depends on: global vector, server state, counters, every client's
        state. Randomness needs no saving: every draw is seeded by (seed, client, round, stream)."""
        return {
            "round": rnd,
            "params": self.params.numpy().copy(),
            "server_state": to_numpy(self.state),
            "uploads": self.uploads,
            "downloads": self.downloads,
            "clients": pool.snapshot(),
        }

    def restore(self, pool: ClientPool, checkpoint: dict) -> int:
        """Load :meth:`checkpoint`'s output; returns the round to run next."""
        self.params = torch.tensor(checkpoint["params"])
        self.state = {k: torch.tensor(v) for k, v in checkpoint["server_state"].items()}
        self.uploads, self.downloads = int(checkpoint["uploads"]), int(checkpoint["downloads"])
        pool.load(checkpoint["clients"])
        return int(checkpoint["round"]) + 1

    def sample(self, rnd: int) -> list[int]:
        """⌈r·n⌉ (or ``clients_per_round``) distinct clients, uniformly, from a per-round seeded RNG."""
        n = self.cfg.num_clients
        k = self.cfg.algorithm.sampled_count(n)
        rng = np.random.default_rng(stream_seed(self.cfg.seed, rnd, _SAMPLE))
        return sorted(int(i) for i in rng.choice(n, size=k, replace=False))

    def payload(self) -> Payload:
        return to_numpy(self.algorithm.server_payload(self.params, self.state))

    def train_round(self, pool: ClientPool, rnd: int) -> dict[str, float]:
        """One round: sample, broadcast, local training, aggregation. Messages are used in client-id order.

        A pool may return fewer replies than clients asked (a client lost or too slow): the round
        aggregates the sampled clients that answered, counts the rest in ``clients_dropped``, and
        leaves the global model as it was when none answered.
        """
        sampled = self.sample(rnd)
        trained = list(range(self.cfg.num_clients)) if self.algorithm.trains_all_clients else sampled
        replies = sorted(pool.train(trained, self.payload(), rnd), key=lambda m: m.client_id)
        chosen = set(sampled)
        messages = [m for m in replies if m.client_id in chosen]
        for m in messages:
            m.payload = {k: torch.from_numpy(np.array(v)) for k, v in m.payload.items()}
        if messages:
            self.params, self.state = self.algorithm.server_update(self.params, messages, self.state, self.cfg.num_clients)
        per_message = self.algorithm.transmissions_per_message
        self.downloads += per_message * len(trained)
        self.uploads += per_message * len(messages)
        losses = [m.stats["local_train_loss"] for m in replies if "local_train_loss" in m.stats]
        return {
            "clients_sampled": float(len(sampled)),
            "clients_answered": float(len(messages)),
            "clients_dropped": float(len(trained) - len(replies)),
            "local_train_loss": float(np.mean(losses)) if losses else math.nan,
        }

    def evaluate(self, pool: ClientPool, rnd: int) -> dict[str, float]:
        """Summary over the clients that answered; ``clients_evaluated`` says how many did."""
        evals = sorted(pool.evaluate(self.payload(), rnd), key=lambda e: e.client_id)
        if evals:
            self.last_evals = evals
        return {**(summarize(evals) if evals else {}), "clients_evaluated": float(len(evals))}

    def step(self, pool: ClientPool, rnd: int) -> dict[str, float]:
        """Round ``rnd`` (0 = evaluation of the initial model only) and, on the cadence, evaluation.

        A round that leaves the global model non-finite is flagged ``diverged`` and evaluated, so that
        its metrics are complete; the caller stops there.
        """
        metrics: dict[str, float] = {"round": float(rnd)}
        if rnd > 0:
            metrics.update(self.train_round(pool, rnd))
        diverged = not bool(torch.isfinite(self.params).all())
        if rnd in self.eval_rounds or diverged:
            metrics.update(self.evaluate(pool, rnd))
        if rnd > 0:
            metrics["clients_restored"] = float(pool.take_restored())
        metrics.update(uploads=float(self.uploads), downloads=float(self.downloads), transmissions=float(self.uploads + self.downloads))
        if diverged:
            metrics["diverged"] = 1.0
        return metrics


def local_federation(cfg: ExperimentConfig) -> tuple[Server, LocalPool]:
    """Experiment ``cfg``'s server and all its clients in this process: its dataset, fresh states."""
    from fedsweep.data import build_federated_dataset

    ds = build_federated_dataset(cfg.data)
    server = Server(cfg, ds.num_features, ds.num_classes)
    return server, LocalPool([Client(i, d, cfg, ds.num_features, ds.num_classes) for i, d in enumerate(ds.clients)])


def run_local(cfg: ExperimentConfig) -> tuple[list[dict[str, float]], Server]:
    """The whole experiment in this process, no Ray: the reference the actor path is checked against."""
    with compute_threads():  # as in the actors
        server, pool = local_federation(cfg)
        return [server.step(pool, rnd) for rnd in range(cfg.rounds + 1)], server
