"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez, ICLR 2021, "Personalized Federated Learning with First Order Model
Optimization").

The server keeps every client's latest uploaded model θ_j and an affinity matrix P ∈ R^{n×n} (P_ij: how useful client
j's model has been to client i). Round t, each sampled client i downloads M models {θ_n} of other clients and, on a
held-out split V_i of its own training data, weighs each by its first-order benefit per unit of distance (Sec. 3):

    w_n = max(0, (L_i(θ_i) − L_i(θ_n)) / ‖θ_n − θ_i‖),   w_n ← w_n / Σ_m w_m
    θ_i ← θ_i + Σ_n w_n (θ_n − θ_i)                       (no update when every w_n is 0)

then trains θ_i for τ SGD steps θ ← θ − β ∇f_i(θ; D) on the rest of its training data, keeps it and uploads it.
Each client also reports its signed, normalized benefits d_n / |Σ_m d_m| (d_n the ratio above before max(0, ·)),
which the server adds to P_in: the affinity update of the authors' code (github NVlabs/FedFomo, ``federation.py``,
``Federation.update_client_weights``).

Choice of the M models (the paper's ε-greedy sampling; authors' ``client.py``, ``Client.get_federating_clients``,
``e_greedy``): among the other clients that have uploaded a model, ordered by P_i· (ties broken at random), each of
the min(M, #candidates) picks takes, with probability ε_t = max(ε − t·decay, 0), the next client of a random
ordering instead of the next best one, skipping clients already picked. Round 1 has no uploaded model, so every
client trains alone (the authors' first round is local training too). The server's randomness is a
``torch.Generator`` seeded by (t, i), t the number of aggregations so far (``round`` in the server state), so
the server can redo client i's choice when its reply arrives, and a resumed run draws the same.

Held-out split (the authors' ``Client.init_data``: ``train_split``): a fixed permutation (seed 0) of the client's
training set; its first ⌈f·n⌉ samples (f = ``holdout_fraction``, at least 1, leaving at least 1) are V_i, the rest
train. The sweep's validation data is never used. Losses on V_i are evaluated without updating normalization
statistics. ‖·‖ is the L2 norm (the paper's; ``distance: l1`` is the authors' code default).

Floats per sampled client and round: M·P down (M ≤ ``models_per_round``), P + M up. No global model; a client is
scored with its own θ_i, which stays on the client (a copy on the server): an evaluation sends no models.
Reads: β (``local_lr``), τ, r; its own settings M (``models_per_round``), ε (``epsilon``), ``epsilon_decay``, f (``holdout_fraction``), ``distance``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from fedsweep.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ClientMessage,
    HyperParameters,
    State,
    grad,
    register,
    sgd,
)
from fedsweep.algorithms.ifca import statistics_kept
from fedsweep.schema import aliases


class FedFomoParams(HyperParameters):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    models_per_round: int = Field(5, ge=1, validation_alias=aliases("models_per_round", "M"), description="M: other clients' models each client downloads.")
    epsilon: float = Field(0.3, ge=0, le=1, validation_alias=aliases("epsilon", "ε"), description="ε: chance that a pick is random instead of by affinity.")
    epsilon_decay: float = Field(0.05, ge=0, description="Decrease of ε per round: ε_t = max(ε − t·decay, 0).")
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="f: share of the client's training data held out to weigh the downloaded models.")
    distance: Literal["l2", "l1"] = Field("l2", description="Norm of θ_n − θ_i: l2 (the paper) or l1 (the authors' code default).")


def split(n: int, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out, training) indices of a training set of n samples: a fixed permutation (seed 0), cut at ⌈f·n⌉."""
    if n < 2:
        every = torch.arange(n)
        return every, every
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    k = min(max(1, math.ceil(round(fraction * n, 9))), n - 1)  # round() first: 0.3 × 10 is 3, not 4
    return perm[:k], perm[k:]


def draw(data: Batch, batch_size: int | None, gen: torch.Generator) -> Batch:
    x, y = data
    n = int(y.shape[0])
    if batch_size is None or batch_size >= n:
        return x, y
    idx = torch.randperm(n, generator=gen)[:batch_size].to(x.device)
    return x[idx], y[idx]


@register("fedfomo")
class FedFomo(Algorithm):
    Params = FedFomoParams
    hp: FedFomoParams

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"params": initial_params.clone()}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"models": global_params.expand(num_clients, -1).clone(), "uploaded": torch.zeros(num_clients),
                "affinity": torch.zeros(num_clients, num_clients), "round": torch.tensor(0)}

    def choose(self, client_id: int, server_state: State) -> list[int]:
        """The clients whose models client ``client_id`` downloads this round, in pick order (ε-greedy on P)."""
        n = server_state["uploaded"].numel()
        candidates = [j for j in range(n) if j != client_id and server_state["uploaded"][j] > 0]
        if not candidates:
            return []
        t = int(server_state["round"])
        gen = torch.Generator().manual_seed(t * n + client_id)
        epsilon = max(self.hp.epsilon - t * self.hp.epsilon_decay, 0.0)
        shuffled = torch.randperm(len(candidates), generator=gen)
        affinity = server_state["affinity"][client_id, candidates][shuffled]
        best = [candidates[k] for k in shuffled[torch.sort(-affinity, stable=True).indices]]
        random = [candidates[k] for k in torch.randperm(len(candidates), generator=gen)]
        chosen: list[int] = []
        for _ in range(min(self.hp.models_per_round, len(candidates))):
            source = random if float(torch.rand((), generator=gen)) < epsilon else best
            while source[0] in chosen:
                source.pop(0)
            chosen.append(source.pop(0))
        return chosen

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {}

    def client_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        return {"models": server_state["models"][torch.tensor(self.choose(client_id, server_state), dtype=torch.long)]}

    def eval_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        return {}  # a client is scored with its own θ_i: the n·M models a training payload would copy go nowhere

    def weigh(self, ctx: ClientContext, theta: torch.Tensor, models: torch.Tensor, held_out: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_n normalized, d_n / |Σ d|): the update weights and the affinity report of the downloaded models."""
        with torch.no_grad(), statistics_kept(ctx.model):
            own = ctx.loss(theta, held_out)
            others = torch.stack([ctx.loss(m, held_out) for m in models])
        dist = torch.linalg.vector_norm(models - theta, ord=2 if self.hp.distance == "l2" else 1, dim=-1)
        d = torch.where(dist > 0, (own - others) / dist.clamp(min=torch.finfo(dist.dtype).tiny), torch.zeros_like(dist))
        w = d.clamp(min=0)
        w = w / w.sum() if w.sum() > 0 else w
        return w, d / d.sum().abs().clamp(min=1e-9)

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        x, y = ctx.train_data()
        held, fit = split(int(y.shape[0]), self.hp.holdout_fraction)
        theta, models = state["params"], payload["models"]
        report = models.new_zeros(0)
        if models.shape[0]:
            w, report = self.weigh(ctx, theta, models, (x[held.to(x.device)], y[held.to(y.device)]))
            theta = theta + (w[:, None] * (models - theta)).sum(0)
        data = (x[fit.to(x.device)], y[fit.to(y.device)])
        new, loss = sgd(ctx, theta, self.hp.local_lr, self.hp.local_steps, None,
                        gradient=lambda v: grad(ctx.loss, v, draw(data, self.hp.batch_size, ctx.generator)))
        return {"params": new, "affinity": report}, {"params": new}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        models, uploaded = server_state["models"].clone(), server_state["uploaded"].clone()
        affinity = server_state["affinity"].clone()
        for m in messages:
            chosen = self.choose(m.client_id, server_state)  # as when its payload was made: the state is unchanged
            affinity[m.client_id, torch.tensor(chosen, dtype=torch.long)] += m.payload["affinity"].to(affinity.dtype)
            models[m.client_id] = m.payload["params"]
            uploaded[m.client_id] = 1.0
        return global_params, {"models": models, "uploaded": uploaded, "affinity": affinity, "round": server_state["round"] + 1}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return state["params"]
