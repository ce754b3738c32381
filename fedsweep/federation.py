"""Client, server and the round, in plain Python and PyTorch (no Ray, no deployment settings).

A :class:`Client` holds one shard, its model and its algorithm state; a :class:`Server` holds the global vector,
the server state, the sampling and the transmission counts, and runs rounds against a client pool
(:class:`fedsweep.pool.ClientPool`), wherever the pool keeps the clients.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedsweep.algorithms import build_algorithm
from fedsweep.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientMessage,
    HyperParameters,
    State,
    floats,
    weighted_average,
)
from fedsweep.algorithms.stacked import StackedContext, row, stack_states, stat_of
from fedsweep.client_data import ClientData
from fedsweep.evaluation import ClientEval, score, summarize
from fedsweep.models import FlatModel, ModelConfig, build_model

Payload = dict[str, np.ndarray]
#: A client in a checkpoint: (its algorithm state or None before it first trained, times trained).
ClientSnapshot = tuple[Payload | None, int]

#: The key under which normalization statistics (:attr:`FlatModel.stats`) travel in a payload or a message, and
#: are kept in a client's state. They travel with the global model, averaged by the server as FedAvg averages a
#: model (weighted by samples), exactly when the method has one; a method without a global model (FedBN, FedPer,
#: Local) leaves each client its own. The algorithms never see the key.
STATS = "norm_stats"

# Streams of randomness, kept apart so that e.g. evaluation never shifts training batches.
_TRAIN, _EVAL, _SAMPLE = 1, 2, 3


#: torch intra-op threads of every actor and of an in-process run. A reduction split across threads sums
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
    # Arrays from the object store are read-only; copy into tensors this process owns.
    return {k: torch.tensor(v, device=device) for k, v in payload.items()}


#: Device types on which :meth:`Setup.flat_model` shares one module among a process's clients (its docstring says
#: why the CPU alone; ``benchmarks/pfl_cifar.py --shared-module`` adds ``cuda`` for the A/B).
SHARED_MODULE_DEVICES = {"cpu"}
#: :meth:`Setup.flat_model`'s shared modules, per (architecture, input size, classes, device), in this process.
_MODULES: dict[tuple[str, int, int, str], torch.nn.Module] = {}


@dataclass(frozen=True)
class Setup:
    """What a client or the server needs to know of an experiment: the model, the algorithm and the seed."""

    model: ModelConfig
    algorithm: HyperParameters
    seed: int
    num_features: int
    num_classes: int
    trained: int  # clients 0..trained−1 train, the others are held out (unseen_fraction; ExperimentConfig.trained_count)
    train_loss: bool = True  # score the global model on the training part at evaluations (tracking.log_train_loss)

    @classmethod
    def of(cls, cfg: Any, num_features: int, num_classes: int) -> Setup:
        """From an :class:`~fedsweep.config.ExperimentConfig` and its dataset's shape."""
        return cls(cfg.model, cfg.algorithm, cfg.seed, num_features, num_classes, cfg.trained_count(),
                   cfg.tracking.log_train_loss)

    def flat_model(self, device: torch.device | str = "cpu") -> FlatModel:
        """A :class:`FlatModel` of the architecture on ``device``. On the CPU its module (the layers it calls with a
        vector's views) is built once per process and architecture, and shared: a FlatModel keeps nothing in it
        between calls (parameters come from the vector, statistics and mode are the FlatModel's own), and a module
        per client held parameters it never used (300 clients of the PFL CNN: 1.29 -> 0.36 GiB, the same numbers).
        On a GPU each FlatModel gets its own: shared there, the stacked rounds of pfl-research's CIFAR-10 setting
        ran 1.6x slower on an H200 (0.43-0.52 s against 0.27-0.28 s, alternating on one machine; cause not found),
        though sharing saved 6.2 GB of the card there (docs/performance.md, "pfl-research's CIFAR-10 setting")."""
        device = torch.device(device)
        if device.type not in SHARED_MODULE_DEVICES:
            return FlatModel(build_model(self.model, self.num_features, self.num_classes)).to(device)
        key = (self.model.model_dump_json(), self.num_features, self.num_classes, str(device))
        if key not in _MODULES:
            _MODULES[key] = build_model(self.model, self.num_features, self.num_classes).to(device)
        return FlatModel(_MODULES[key])

    def algorithm_on(self, model: FlatModel) -> Algorithm:
        return build_algorithm(self.algorithm, model)


def _same_model(algorithm: Algorithm, personalized, w: torch.Tensor) -> bool:
    """Whether a client's personalized model is the global model ``w``: scored by the model itself (the base
    :meth:`~fedsweep.algorithms.base.Algorithm.predictor`) with a vector equal to ``w`` bit for bit (FedAvg and
    every method that does not personalize), so that its scores are the global scores (the same computation on the
    same statistics: the client's, or those received, for both)."""
    return (type(algorithm).predictor is Algorithm.predictor and isinstance(personalized, torch.Tensor)
            and personalized.shape == w.shape and personalized.dtype == w.dtype and torch.equal(personalized, w))


class Client:
    """One client: its shard, its model architecture and its persistent algorithm state."""

    def __init__(self, client_id: int, data: ClientData, setup: Setup, device: str = "cpu"):
        self.client_id = client_id
        self.seed = setup.seed
        self.device = torch.device(device)
        self.data = data.to(self.device)
        self.model = setup.flat_model(self.device)
        self.algorithm = setup.algorithm_on(self.model)
        self.train_loss = setup.train_loss
        self.state: State | None = None
        self.times_trained = 0
        self.held_out = client_id >= setup.trained

    def context(self, rnd: int, stream: int = _TRAIN) -> ClientContext:
        gen = torch.Generator().manual_seed(stream_seed(self.seed, self.client_id, rnd, stream))
        return ClientContext(self.model, self.data, gen, self.held_out)

    def current_state(self) -> State:
        """The algorithm state; before the first training, the algorithm's initial one (from the seeded
        initialization every client and the server share)."""
        if self.state is None:
            self.state = self.algorithm.init_client_state(self.model.initial_vector(self.seed, self.device))
        return self.state

    def _received(self, payload: Payload) -> tuple[State, torch.Tensor | None]:
        """The payload as tensors without the statistics, and the statistics received (None: keep one's own)."""
        p = to_tensors(payload, self.device)
        return p, p.pop(STATS, None)

    def train(self, payload: Payload, rnd: int) -> ClientMessage:
        p, received = self._received(payload)
        if received is not None:
            self.model.stats = received
        with self.model.train_mode():
            message, self.state, stats = self.algorithm.client_update(self.context(rnd), p, self.current_state())
        self.times_trained += 1
        if received is not None:
            message = {**message, STATS: self.model.stats.clone()}
        return ClientMessage(self.client_id, self.data.num_train, to_numpy(message), stats)

    def evaluate(self, payload: Payload, global_params: np.ndarray | None, rnd: int) -> ClientEval:
        """Scores of the personalized model and, when there is one, of the global model ``global_params`` (with
        the statistics received, if any; the client's own are left as they were)."""
        p, received = self._received(payload)
        own = self.model.stats
        if received is not None:
            self.model.stats = received
        try:
            return self._evaluate(p, global_params, rnd)
        finally:
            self.model.stats = own

    def _evaluate(self, p: State, global_params: np.ndarray | None, rnd: int) -> ClientEval:
        ctx = self.context(rnd, _EVAL)
        d = self.data
        personalized = self.algorithm.personalize(ctx, p, self.current_state())
        personal_model = self.algorithm.predictor(ctx, personalized)
        pc, pl = score(personal_model, d.x_test, d.y_test)
        gc = gl = tl = None
        same = False  # the personalized model is the global one: its scores are the global scores, not computed twice
        if global_params is not None:
            w = torch.tensor(global_params, device=self.device)
            global_model = lambda x: self.model(w, x)
            same = _same_model(self.algorithm, personalized, w)
            gc, gl = (pc, pl) if same else score(global_model, d.x_test, d.y_test)
            if self.train_loss:
                _, tl = score(global_model, d.x_train, d.y_train)
        out = ClientEval(self.client_id, d.num_train, d.num_test, pc, pl, gc, gl, tl, self.times_trained)
        if d.num_val:
            out.num_val = d.num_val
            out.personalized_val_correct, out.personalized_val_loss_sum = score(personal_model, d.x_val, d.y_val)
            if global_params is None:
                out.global_val_correct = out.global_val_loss_sum = None
            elif same:
                out.global_val_correct, out.global_val_loss_sum = out.personalized_val_correct, out.personalized_val_loss_sum
            else:
                out.global_val_correct, out.global_val_loss_sum = score(global_model, d.x_val, d.y_val)
        return out

    def snapshot(self) -> ClientSnapshot:
        """What a checkpoint keeps of this client: its algorithm state (with its own normalization statistics,
        if its model has any) and how often it trained."""
        if self.state is None:
            return None, self.times_trained
        own = {} if self.model.stats is None else {STATS: self.model.stats.clone()}  # a copy: training updates them in place
        return to_numpy(self.state | own), self.times_trained

    def load(self, snapshot: ClientSnapshot) -> None:
        state, self.times_trained = snapshot
        self.state = None if state is None else to_tensors(state, self.device)
        stats = None if self.state is None else self.state.pop(STATS, None)
        if self.model.stats is not None:
            self.model.stats = self.model.initial_stats().to(self.device) if stats is None else stats


def train_group(clients: list[Client], payloads: dict[int, Payload], rnd: int, stacked: bool) -> list[ClientMessage]:
    """Local training of clients hosted together: one after the other, or (``stacked``, where the algorithm
    declares it can) as one stacked computation (:mod:`fedsweep.algorithms.stacked`). A round whose clients'
    states differ in shape (e.g. Ditto before some clients have a personal model) falls back to one by one."""
    if stacked and len(clients) > 1 and clients[0].algorithm.can_vectorize() and clients[0].model.stats is None:
        messages = _train_stacked(clients, payloads, rnd)
        if messages is not None:
            return messages
    return [c.train(payloads[c.client_id], rnd) for c in clients]


def _train_stacked(clients: list[Client], payloads: dict[int, Payload], rnd: int) -> list[ClientMessage] | None:
    first = clients[0]
    states = stack_states([c.current_state() for c in clients])
    if states is None:
        return None
    # np.stack: a payload that came through Ray's object store is a read-only view, which torch.from_numpy warns of
    rows = {k: torch.from_numpy(np.stack([payloads[c.client_id][k] for c in clients])).to(first.device)
            for k in payloads[first.client_id]}
    ctx = StackedContext([c.context(rnd) for c in clients])
    message, new_states, stats = first.algorithm.client_update(ctx, rows, states)
    out = []
    for i, c in enumerate(clients):
        c.state = row(new_states, i)
        c.times_trained += 1
        out.append(ClientMessage(c.client_id, c.data.num_train, to_numpy(row(message, i)), {k: stat_of(v, i) for k, v in stats.items()}))
    return out


class Pool(Protocol):
    """Where the clients live (:class:`fedsweep.pool.ClientPool`): what the server asks of it."""

    def train(self, payloads: dict[int, Payload], rnd: int) -> list[ClientMessage]: ...

    def evaluate(self, payloads: dict[int, Payload], global_params: np.ndarray | None, rnd: int) -> list[ClientEval]: ...

    def snapshot(self) -> dict[int, ClientSnapshot]: ...

    def load(self, snapshots: dict[int, ClientSnapshot]) -> None: ...

    def take_restored(self) -> int: ...


class Server:
    """Global model, server state, client sampling, aggregation and transmission counts (floats sent each
    way, from the payloads and messages themselves); runs rounds against a :class:`Pool`."""

    def __init__(self, setup: Setup, num_clients: int, eval_rounds: set[int]):
        self.seed = setup.seed
        self.num_clients = num_clients
        #: Clients 0..trained−1 train; the others (``Setup.trained``) are never sampled, only scored (``unseen_*``).
        self.trained = setup.trained
        model = setup.flat_model()
        self.algorithm = setup.algorithm_on(model)
        self.model_floats = model.numel
        self.params = model.initial_vector(setup.seed)
        self.state = self.algorithm.init_server_state(self.params, num_clients)
        #: The global normalization statistics (see :data:`STATS`); None when they do not travel.
        self.stats = model.stats if self.algorithm.global_model(self.params, self.state) is not None else None
        self.eval_rounds = eval_rounds
        self.floats_up = 0
        self.floats_down = 0
        self.last_evals: list[ClientEval] = []

    @classmethod
    def of(cls, cfg: Any, num_features: int, num_classes: int) -> Server:
        """The server of :class:`~fedsweep.config.ExperimentConfig` ``cfg``."""
        return cls(Setup.of(cfg, num_features, num_classes), cfg.num_clients, cfg.eval_rounds())

    def checkpoint(self, pool: Pool, rnd: int) -> dict:
        """Everything round ``rnd + 1`` depends on: global vector, server state, counters, every client's
        state. Randomness needs no saving: every draw is seeded by (seed, client, round, stream)."""
        return {
            "round": rnd,
            "params": self.params.numpy().copy(),
            # the global statistics are kept as part of the server's state
            "server_state": to_numpy(self.state | ({} if self.stats is None else {STATS: self.stats.clone()})),
            "floats_up": self.floats_up,
            "floats_down": self.floats_down,
            "clients": pool.snapshot(),
        }

    def restore(self, pool: Pool, checkpoint: dict) -> int:
        """Load :meth:`checkpoint`'s output; returns the round to run next."""
        self.params = torch.tensor(checkpoint["params"])
        self.state = {k: torch.tensor(v) for k, v in checkpoint["server_state"].items()}
        stats = self.state.pop(STATS, None)
        self.stats = stats if self.stats is not None else None
        self.floats_up, self.floats_down = int(checkpoint["floats_up"]), int(checkpoint["floats_down"])
        pool.load(checkpoint["clients"])
        return int(checkpoint["round"]) + 1

    def sample(self, rnd: int) -> list[int]:
        """⌈r·n⌉ (or ``clients_per_round``) distinct clients, uniformly, from a per-round seeded RNG; n counts the
        clients that train (all of them unless some are held out as unseen)."""
        k = self.algorithm.hp.sampled_count(self.trained)
        rng = np.random.default_rng(stream_seed(self.seed, rnd, _SAMPLE))
        return sorted(int(i) for i in rng.choice(self.trained, size=k, replace=False))

    def payloads(self, client_ids: list[int], scoring: bool = False) -> dict[int, Payload]:
        """Each client's payload: the shared part (one array object for all) merged with its own part (the one it
        is scored with when ``scoring``)."""
        shared = to_numpy(self.algorithm.server_payload(self.params, self.state)
                          | ({} if self.stats is None else {STATS: self.stats}))
        part = self.algorithm.eval_payload if scoring else self.algorithm.client_payload
        own = {c: part(c, self.params, self.state) for c in client_ids}
        return {c: shared | to_numpy(own[c]) if own[c] else shared for c in client_ids}

    def global_model(self) -> np.ndarray | None:
        w = self.algorithm.global_model(self.params, self.state)
        return None if w is None else w.numpy()

    def train_round(self, pool: Pool, rnd: int) -> dict[str, float]:
        """One round: sample, plan, send, local training, aggregation. Messages are used in client-id order.

        A pool may return fewer replies than clients asked (a client lost or too slow): the round
        aggregates the planned clients that answered, counts the rest in ``clients_dropped``, and
        leaves the global model as it was when none answered.
        """
        sampled = self.sample(rnd)
        plan = self.algorithm.plan_round(sampled, self.trained)
        payloads = self.payloads(plan.train)
        replies = sorted(pool.train(payloads, rnd), key=lambda m: m.client_id)
        chosen = set(plan.aggregate)
        messages = [m for m in replies if m.client_id in chosen]
        for m in messages:
            m.payload = {k: torch.from_numpy(np.array(v)) for k, v in m.payload.items()}
        self.floats_down += sum(sum(int(v.size) for v in p.values()) for p in payloads.values())
        self.floats_up += sum(floats(m.payload) for m in messages)
        stats = [m.payload.pop(STATS) for m in messages if STATS in m.payload]
        if messages:
            self.params, self.state = self.algorithm.server_update(self.params, messages, self.state, self.trained)
        if stats:
            self.stats = weighted_average(stats, [float(m.num_samples) for m in messages])
        losses = [m.stats["local_train_loss"] for m in replies if "local_train_loss" in m.stats]
        return {
            "clients_sampled": float(len(sampled)),
            "clients_answered": float(len(messages)),
            "clients_dropped": float(len(plan.train) - len(replies)),
            "local_train_loss": float(np.mean(losses)) if losses else math.nan,
        }

    def evaluate(self, pool: Pool, rnd: int) -> dict[str, float]:
        """Summary over the clients that answered; ``clients_evaluated`` says how many did."""
        payloads = self.payloads(list(range(self.num_clients)), scoring=True)
        evals = sorted(pool.evaluate(payloads, self.global_model(), rnd), key=lambda e: e.client_id)
        if evals:
            self.last_evals = evals
        trained = [e for e in evals if e.client_id < self.trained]
        unseen = [e for e in evals if e.client_id >= self.trained]
        return {**(summarize(trained) if trained else {}), "clients_evaluated": float(len(evals)),
                **({f"unseen_{k}": v for k, v in summarize(unseen).items()} if unseen else {})}

    def transmissions(self) -> dict[str, float]:
        """Floats sent each way, and in models (floats / model size, the papers' unit): ``uploads``,
        ``downloads``, ``transmissions`` (both ways)."""
        up, down = self.floats_up / self.model_floats, self.floats_down / self.model_floats
        return {"floats_up": float(self.floats_up), "floats_down": float(self.floats_down),
                "uploads": up, "downloads": down, "transmissions": up + down}

    def step(self, pool: Pool, rnd: int) -> dict[str, float]:
        """Round ``rnd`` (0 = evaluation of the initial model only) and, on the cadence, evaluation.

        A round that leaves the global model non-finite is flagged ``diverged`` and evaluated, so that
        its metrics are complete; the caller stops there. So is an evaluation that finds a trained client's model
        non-finite (its loss NaN; an infinite loss is also a finite Proto model's score of a class its client
        lacks, so it is not taken for one): a method whose models live on the clients (Local, FedAMP, FedFomo,
        pFedHN's targets, FedPer's heads) can diverge there with a finite global vector, and a NaN model's argmax
        would otherwise be scored as a prediction of class 0.
        """
        metrics: dict[str, float] = {"round": float(rnd)}
        if rnd > 0:
            metrics.update(self.train_round(pool, rnd))
        diverged = not bool(torch.isfinite(self.params).all())
        if rnd in self.eval_rounds or diverged:
            metrics.update(self.evaluate(pool, rnd))
            # NaN, not inf: a Proto model's class absent from a client's support scores −inf, a finite model's inf loss
            diverged = diverged or math.isnan(metrics.get("personalized_loss_mean", 0.0))
        if rnd > 0:
            metrics["clients_restored"] = float(pool.take_restored())
        metrics.update(self.transmissions())
        if diverged:
            metrics["diverged"] = 1.0
        return metrics
