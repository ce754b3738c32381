"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan, AAAI 2023, "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning"), Algorithm 1; the ALA module is its lines 6-16.

A sampled client i receives the global model Θ and, before training, initializes its local model from its old one
θ_i and Θ by element-wise weights W_i ∈ [0, 1] on the higher layers (the last p layers; the lower layers take Θ):

    θ̂_i = θ_i + (Θ − θ_i) ⊙ [1, …, 1; W_i^p]                                        (adaptive local aggregation)

W_i^p is learned on a random fraction s of the client's training data D^s (a contiguous slice at a random offset,
read in order in batches), one gradient step per batch, each followed by clipping to [0, 1]:

    W_i^p ← clip(W_i^p − η ∇_{θ̂_i^p} CE(θ̂_i; D^s) ⊙ (Θ^p − θ_i^p), 0, 1)

(the chain rule through θ̂_i^p = θ_i^p + (Θ^p − θ_i^p) ⊙ W_i^p). W_i starts at ones and is kept by the client across
rounds. The first time ALA runs on a client it repeats epochs over D^s until the standard deviation of the last
``ala_window`` epochs' losses (each epoch's last batch) falls below ``ala_threshold`` (we also stop after
``ala_max_epochs``); afterwards one epoch per round. While θ_i = Θ (the first round) ALA is skipped: θ̂_i = Θ.
The client then runs FedAvg's τ SGD steps θ_i ← θ_i − β ∇f_i(θ_i; D) from θ̂_i, keeps θ_i and sends it; the server
averages as FedAvg, Θ ← Σ_i p_i θ_i. Floats: P down, P up per sampled client; W_i and θ_i stay local. The global
model is Θ.

Evaluation (``evaluation: ala``, the default): the client is scored with the model ALA would initialize now,
ALA(θ_i, Θ) with its current W_i (nothing kept), as the authors' server evaluates every client right after
``send_models`` ran ALA on it; ``evaluation: local`` scores θ_i as last trained.

Details from the authors' code (github TsingZ0/FedALA, ``system/utils/ALA.py``, ``ALA.adaptive_local_aggregation``):
W initialized to ones, clipping to [0, 1], the weight step ``weight - eta * (param_t.grad * (param_g - param))``, the
random contiguous slice of ``rand_percent`` of the data, "deactivate ALA at the 1st communication iteration",
training to convergence only in the start phase (``threshold`` 0.1 and ``num_pre_loss`` 10 as in the code;
its README reports 0.01 in the paper), ALA's forward passes on a copy of the model (batch-norm statistics untouched).
Differences: the code's ``layer_idx`` counts parameter tensors (its default 2 = the last linear layer's weight and bias),
``ala_layers`` counts layers (default 1: the same); the code tests θ_i = Θ on the first tensor's sum, we on the whole
vector; the code runs ALA on every client every round (``serverALA.send_models``), we on the sampled clients
(the paper's Algorithm 1) and at evaluation; the code has no cap on the start phase.

With η = 0, W_i stays at ones, θ̂_i = Θ and FedALA is FedAvg. Reads: β (``local_lr``), τ, r; its own η (``ala_lr``),
s (``ala_fraction``), p (``ala_layers``).
"""

from __future__ import annotations

import statistics
from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, register, sgd
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.models import ParamLayout
from fedsweep.schema import aliases


class FedALAParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    ala_lr: float = Field(1.0, ge=0, validation_alias=aliases("ala_lr", "eta", "η"),
                          description="η: step size of the aggregation weights W (0 = W stays 1: FedAvg).")
    ala_fraction: float = Field(0.8, gt=0, le=1, validation_alias=aliases("ala_fraction", "s"),
                                description="s: fraction of the client's training data W is learned on (the code's rand_percent/100).")
    ala_layers: int | None = Field(1, ge=1, validation_alias=aliases("ala_layers", "p"),
                                   description="p: number of last layers aggregated by W (the lower ones take the global model); null = all.")
    ala_threshold: float = Field(0.1, gt=0, description="Start phase: stop when the std of the last ala_window epoch losses is below this.")
    ala_window: int = Field(10, ge=1, description="Start phase: number of recent epoch losses whose std is tested (num_pre_loss).")
    ala_max_epochs: int = Field(100, ge=1, description="Start phase: at most this many epochs over the fraction s.")
    evaluation: Literal["ala", "local"] = Field(
        "ala", description="'ala': score ALA(θ_i, Θ) with the current global model (the authors' evaluation); "
        "'local': score θ_i as last trained.",
    )


def layers(layout: ParamLayout) -> list[list[str]]:
    """The model's layers in order, each the names of its parameters (a bare linear model is one layer)."""
    out: dict[str, list[str]] = {}
    for name in layout.names:
        out.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name)
    return list(out.values())


def adaptive_local_aggregation(
    ctx: ClientContext, local: torch.Tensor, global_: torch.Tensor, state: State, layout: ParamLayout, hp: FedALAParams
) -> tuple[torch.Tensor, State]:
    """θ̂_i and the client's new ALA state (``weights`` W over the ``head`` group = the higher layers, and
    ``start_phase``), from its old model ``local``, the received ``global_`` and its state."""
    if hp.ala_lr == 0 or torch.equal(local, global_):
        return global_.clone(), {"weights": state["weights"], "start_phase": state["start_phase"]}
    lower, theta = layout.select(global_, "body"), layout.select(local, "head")
    diff = layout.select(global_, "head") - theta
    x, y = ctx.train_data()
    n = int(y.shape[0])
    m = max(1, int(hp.ala_fraction * n))
    start = int(torch.randint(0, n - m + 1, (1,), generator=ctx.generator))
    xs, ys = x[start : start + m], y[start : start + m]
    b = m if hp.batch_size is None else hp.batch_size
    batches = [(xs[i : i + b], ys[i : i + b]) for i in range(0, m, b)]
    start_phase = bool(state["start_phase"] > 0)
    weights, losses = state["weights"].clone(), []
    stats = getattr(ctx.model, "stats", None)
    saved = None if stats is None else stats.clone()  # ALA trains on a copy of the model: statistics unchanged
    try:
        for _ in range(hp.ala_max_epochs if start_phase else 1):
            for batch in batches:
                higher = (theta + diff * weights).detach().requires_grad_(True)
                value = ctx.loss(layout.join({"body": lower, "head": higher}), batch)
                (g,) = torch.autograd.grad(value, higher)
                weights = (weights - hp.ala_lr * g * diff).clamp(0.0, 1.0)
            losses.append(float(value.detach()))
            if start_phase and len(losses) > hp.ala_window and statistics.pstdev(losses[-hp.ala_window :]) < hp.ala_threshold:
                break
    finally:
        if saved is not None:
            ctx.model.stats.copy_(saved)
    init = layout.join({"body": lower, "head": theta + diff * weights})
    return init, {"weights": weights, "start_phase": torch.zeros_like(state["start_phase"])}


@register("fedala")
class FedALA(FedAvg):
    """FedAvg's server and global model; each client's own model θ_i, initialized each round by ALA."""

    Params = FedALAParams
    hp: FedALAParams
    fedavg_reduction: ClassVar[dict] = {"ala_lr": 0.0}

    def can_vectorize(self) -> bool:
        return False  # the weight learning's epochs and stopping rule are per client

    def split(self) -> ParamLayout:
        """The layout with ``head`` = the higher layers (the last p) and ``body`` = the lower ones."""
        layout = self.model.layout
        groups = layers(layout)
        p = len(groups) if self.hp.ala_layers is None else min(self.hp.ala_layers, len(groups))
        return layout.regroup(head=[n for g in groups[len(groups) - p :] for n in g])

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"params": initial_params.clone(), "weights": torch.ones_like(self.split().select(initial_params, "head")),
                "start_phase": initial_params.new_ones(())}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        init, ala = adaptive_local_aggregation(ctx, state["params"], payload["params"], state, self.split(), self.hp)
        w, loss = sgd(ctx, init, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"params": w}, {"params": w, **ala}, {"local_train_loss": loss}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        if self.hp.evaluation == "local":
            return state["params"]
        init, _ = adaptive_local_aggregation(ctx, state["params"], payload["params"], state, self.split(), self.hp)
        return init
