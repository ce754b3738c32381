"""The small interface every algorithm implements, in plain PyTorch (no Ray).

An algorithm works on flat parameter vectors; :attr:`fedsweep.models.FlatModel.layout` names their parts
(``body``, ``head``, ``norm``). A round is:

1. the server samples ⌈r·n⌉ clients and :meth:`Algorithm.plan_round` says which of all clients train and
   whose messages are aggregated (by default: the sampled ones, both);
2. each training client receives the shared :meth:`Algorithm.server_payload` (e.g. the global vector w)
   merged with its own :meth:`Algorithm.client_payload` (empty by default), runs
   :meth:`Algorithm.client_update` with its persistent state and returns a message;
3. the server runs :meth:`Algorithm.server_update` on the aggregated clients' messages and its own state;
4. on the evaluation cadence every client scores :meth:`Algorithm.personalize` (of the shared payload merged with
   its own :meth:`Algorithm.eval_payload`) on its own test data, and the global model
   (:meth:`Algorithm.global_model`; None for methods without one) where there is one.

Transmissions are the floats of the payloads and messages themselves. An algorithm is registered once, by
:func:`register`. The pools in :mod:`fedsweep.federation` and :mod:`actors` only move these tensors around.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import Field

from fedsweep.client_data import ClientData
from fedsweep.models import FlatModel
from fedsweep.schema import StrictModel, aliases

State = dict[str, torch.Tensor]
Batch = tuple[torch.Tensor, torch.Tensor]
#: f(w; D): a scalar loss of the flat parameters on a batch. Algorithms' math takes one of these, so
#: it can be checked on closed-form objectives (quadratics) as well as on a model's cross-entropy.
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]


class HyperParameters(StrictModel):
    """Fields every algorithm reads: who takes part in a round and how much local work is done.

    Greek aliases follow ``ALGORITHMS.md``: ``tau``/``τ`` for ``local_steps``,
    ``r`` for ``participation_rate``.
    """

    name: str = Field("", description="The algorithm's registered name (set by the registry).")
    participation_rate: float | None = Field(
        None,
        gt=0,
        le=1,
        validation_alias=aliases("participation_rate", "r"),
        description="r: fraction of clients sampled per round; ceil(r*n) clients. "
        "Give this or clients_per_round (default r = 1).",
    )
    clients_per_round: int | None = Field(
        None, ge=1, description="Number of clients sampled per round (alternative to participation_rate)."
    )
    local_steps: int = Field(
        10, ge=1, validation_alias=aliases("local_steps", "tau", "τ"), description="τ: local steps per round."
    )
    batch_size: int | None = Field(
        20, ge=1, description="Minibatch size of a local step; null = the client's whole training set."
    )

    def model_problem(self, model_name: str) -> str | None:
        """Why this algorithm cannot train a model of this kind, if it cannot."""
        return None

    @property
    def leaks_test_data(self) -> bool:
        """Whether the evaluation lets the scored model see the client's test data (never by default)."""
        return False

    def sampled_count(self, num_clients: int) -> int:
        """Clients per round: ``clients_per_round`` or ceil(r * n), at least one."""
        if self.clients_per_round is not None:
            return self.clients_per_round
        rate = 1.0 if self.participation_rate is None else self.participation_rate
        # round() first so that 0.3 * 10 = 3.0000000000000004 gives 3, not 4.
        return max(1, math.ceil(round(rate * num_clients, 9)))


class AggregationMixin(HyperParameters):
    """For algorithms whose server averages client models (FedDyn's plain mean has no such choice)."""

    aggregation: Literal["weighted", "uniform"] = Field(
        "weighted",
        description="Server average of client models: 'weighted' by training-sample count, or 'uniform'.",
    )


class Context(Protocol):
    """What a client step may use, for one client (:class:`ClientContext`) or several stacked as rows
    (:class:`~fedsweep.algorithms.stacked.StackedContext`): the same calls on a vector or on a matrix."""

    model: FlatModel

    def loss(self, params: torch.Tensor, batch: Batch) -> torch.Tensor: ...

    def grad(self, params: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, float | torch.Tensor]: ...

    def batch(self, batch_size: int | None) -> Batch: ...

    def train_data(self) -> Batch: ...


@dataclass
class ClientContext:
    """What a client step may use: its model, its data, and a seeded generator for batches. ``held_out``: the client
    is one of the run's unseen clients (``unseen_fraction``), never trained, only scored: a method whose paper gives a
    new client its own step (FedEM's mixture weights) takes it in :meth:`Algorithm.personalize`."""

    model: FlatModel
    data: ClientData
    generator: torch.Generator
    held_out: bool = False

    def loss(self, params: torch.Tensor, batch: Batch) -> torch.Tensor:
        """f_i(w; D): mean cross-entropy of the model with parameters ``params`` on ``batch``."""
        x, y = batch
        return torch.nn.functional.cross_entropy(self.model(params, x), y)

    def grad(self, params: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, float]:
        """∇f_i(w; D) and f_i(w; D) (:func:`grad` of :meth:`loss`)."""
        return grad(self.loss, params, batch)

    def train_data(self) -> Batch:
        return self.data.x_train, self.data.y_train

    def batch(self, batch_size: int | None) -> Batch:
        """A fresh training minibatch drawn without replacement (the whole set if ``batch_size`` is None)."""
        return self._draw(self.data.x_train, self.data.y_train, batch_size)

    def test_batch(self, batch_size: int | None) -> Batch:
        """A minibatch of the client's *test* data. Only an evaluation protocol that is marked as leaking
        test data may call this (``evaluation: adapt_on_test_batch`` or ``test_data_step``)."""
        return self._draw(self.data.x_test, self.data.y_test, batch_size)

    def _draw(self, x: torch.Tensor, y: torch.Tensor, batch_size: int | None) -> Batch:
        n = int(y.shape[0])
        if batch_size is None or batch_size >= n:
            return x, y
        idx = torch.randperm(n, generator=self.generator)[:batch_size].to(x.device)
        return x.index_select(0, idx), y.index_select(0, idx)  # x[idx]'s rows, with less of its overhead


@dataclass
class ClientMessage:
    """What one client sends back in a round: ``payload`` is what travels (counted in floats)."""

    client_id: int
    num_samples: int
    payload: State
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundPlan:
    """Who takes part in a round: the clients in ``train`` receive their payloads and run their update; the
    messages of those in ``aggregate`` (a subset of ``train``) reach the server's update and are uploaded."""

    train: list[int]
    aggregate: list[int]


def floats(state: State) -> int:
    """The number of values in a payload: what sending it costs."""
    return sum(int(v.numel()) for v in state.values())


def loss_value(value: torch.Tensor) -> float | torch.Tensor:
    """A loss as a statistic: a number, or a vector of them for stacked clients (:mod:`.stacked`)."""
    return float(value.detach()) if value.ndim == 0 else value.detach()


def grad(loss: LossFn, params: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, float | torch.Tensor]:
    """∇f(w; D) and f(w; D), with no graph kept.

    For stacked clients the loss is a vector (f_c(w_c))_c over the rows of ``params``: the gradient
    of its sum is each client's own gradient in its row.
    """
    w = params.detach().requires_grad_(True)
    value = loss(w, batch)
    (g,) = torch.autograd.grad(value.sum(), w)
    return g, loss_value(value)


def hessian_vector(loss: LossFn, w: torch.Tensor, batch: Batch, v: torch.Tensor) -> torch.Tensor:
    """∇²f(w; D) v by differentiating ⟨∇f(w; D), v⟩ once more (stacked clients: the loss is their sum, so the
    Hessian is block-diagonal and each client's product its own)."""
    w = w.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(loss(w, batch).sum(), w, create_graph=True)
    (hv,) = torch.autograd.grad((g * v.detach()).sum(), w)
    return hv


def sgd(
    ctx: ClientContext,
    params: torch.Tensor,
    lr: float,
    steps: int,
    batch_size: int | None,
    correction: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gradient: Callable[[torch.Tensor], tuple[torch.Tensor, float]] | None = None,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> tuple[torch.Tensor, float]:
    """``steps`` SGD steps w ← w − lr (∇f_i(w; D) + c(w)) on fresh batches; returns (w, mean loss of f_i).

    ``correction`` c(w) is the gradient of whatever an algorithm adds to the local objective
    (a proximal term, control variates, a dynamic regularizer). ``gradient`` replaces the data term
    ∇f_i(w; D) (the PFL transforms use ∇f_i(T(w; D); D′)). ``clip_norm``: the step's gradient scaled down to
    that norm when longer (each client's row when stacked; ``torch.nn.utils.clip_grad_norm_``'s rule), then
    ``weight_decay`` λ_wd w added, in that order, as ``clip_grad_norm_`` before ``torch.optim.SGD`` does.
    """
    if gradient is None:
        gradient = lambda v: ctx.grad(v, ctx.batch(batch_size))
    w = params.detach().clone()
    total = 0.0
    for _ in range(steps):
        g, value = gradient(w)
        if correction is not None:
            g = g + correction(w)
        if clip_norm is not None:
            g = g * (clip_norm / (g.norm(dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)
        if weight_decay:
            g = g + weight_decay * w
        w -= lr * g
        total += value
    return w, total / max(steps, 1)


class LocalSGDOptions(HyperParameters):
    """Two options of the local SGD step (:func:`sgd`) that the PFL authors' code uses (``torch.optim.SGD``'s weight
    decay, ``clip_grad_norm_``); off by default, as the papers' update rules write the step."""

    weight_decay: float = Field(0.0, ge=0, description="λ_wd: w·λ_wd added to each local step's gradient (after clipping).")
    clip_norm: float | None = Field(None, gt=0, description="Each local step's gradient scaled down to this norm when "
                                    "longer (null: not clipped).")


def weighted_average(vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ_i p_i v_i with p_i = weights_i / Σ weights, summed in the given (client-id) order."""
    total = float(sum(weights))
    out = torch.zeros_like(vectors[0])
    for v, w in zip(vectors, weights):
        out += (w / total) * v
    return out


#: Every algorithm, by name, filled by :func:`register` as the modules of :mod:`fedsweep.algorithms` load.
REGISTRY: dict[str, type[Algorithm]] = {}


def register(name: str) -> Callable[[type[Algorithm]], type[Algorithm]]:
    """Class decorator: the algorithm's one name. It sets ``cls.name``, makes ``cls.Params`` a subclass whose
    ``name`` field is the literal ``name`` (the tag of the config's union of algorithms) and adds the class to
    :data:`REGISTRY`, from which the config, the CLI and the conformance suite read every algorithm. The subclass
    takes the base's place in its module (so that it pickles by name, into Ray's processes, and a module that
    imports the base later gets it)."""
    import sys

    from pydantic import create_model

    def add(cls: type[Algorithm]) -> type[Algorithm]:
        if name in REGISTRY:
            raise ValueError(f"algorithm {name!r} registered twice ({REGISTRY[name].__name__}, {cls.__name__})")
        base = cls.Params
        cls.name = name
        cls.Params = create_model(base.__name__, __base__=base, __module__=base.__module__,
                                  name=(Literal[name], Field(name, description="The algorithm.")))
        if getattr(sys.modules[base.__module__], base.__name__, None) is base:
            setattr(sys.modules[base.__module__], base.__name__, cls.Params)
        REGISTRY[name] = cls
        return cls

    return add


class Algorithm(ABC):
    """One federated algorithm: ``Params`` and the two steps; the other hooks have defaults (FedAvg's)."""

    name: ClassVar[str]
    Params: ClassVar[type[HyperParameters]]
    #: Hyperparameters under which the method's global model is exactly FedAvg's (same ``local_lr``, τ, r,
    #: batches), e.g. FedProx with μ = 0; None when it has no such reduction. The conformance suite checks it.
    fedavg_reduction: ClassVar[dict[str, Any] | None] = None

    #: Where the update rules come from when not from the paper's own equations (shown by `fedsweep
    #: algorithms`, tagged ``fedsweep.provenance`` on every MLflow run); None = the paper's equations.
    provenance: str | None = None

    def __init__(self, params: HyperParameters, model: FlatModel | None = None):
        """``model``: the architecture the method runs on (its :attr:`~FlatModel.layout` names the parts a
        layer-aware method treats apart); None for the math alone (quadratic tests)."""
        self.hp = params
        self.model = model

    def can_vectorize(self) -> bool:
        """Whether :meth:`client_update` runs unchanged on a :class:`~.stacked.StackedContext` (several
        clients' rows at once): true when the step is elementwise in w apart from the loss."""
        return False

    def plan_round(self, sampled: list[int], num_clients: int) -> RoundPlan:
        """Which clients train and whose messages are aggregated, given the round's sampled clients."""
        return RoundPlan(sampled, sampled)

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        """Persistent client state before the client first trains (``initial_params``: the model's seeded
        initialization, the same on every client and on the server)."""
        return {}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        """What every training client receives (sent once per client; one object-store put per round)."""
        return {"params": global_params}

    def client_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        """What client ``client_id`` alone receives besides :meth:`server_payload` (its own model, FedAMP)."""
        return {}

    def eval_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        """What client ``client_id`` alone receives to be scored (:meth:`personalize`'s payload, besides
        :meth:`server_payload`): its training part by default; a method whose :meth:`personalize` reads no part of
        it sends less (FedFomo: nothing, where training sends M other clients' models)."""
        return self.client_payload(client_id, global_params, server_state)

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        """The model scored as the global one; None for a method without one (its global metrics are absent)."""
        return global_params

    @abstractmethod
    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        """Local training from the received payload; returns (message payload, new client state, stats)."""

    @abstractmethod
    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        """Aggregation of the planned clients' messages; returns (new global params, new server state)."""

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """The model a client is scored with; identity (the global model) by default."""
        return payload["params"]

    def predictor(self, ctx: ClientContext, personalized: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """x ↦ class scores of the personalized model (Proto replaces the classifier by centroids)."""
        return lambda x: ctx.model(personalized, x)

    def aggregation_weights(self, messages: list[ClientMessage]) -> list[float]:
        if self.hp.aggregation == "uniform":
            return [1.0] * len(messages)
        return [float(m.num_samples) for m in messages]

    def describe(self) -> dict[str, Any]:
        return self.hp.model_dump()
