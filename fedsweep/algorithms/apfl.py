"""APFL (Deng, Kamani, Mahdavi, 2020, "Adaptive Personalized Federated Learning", arXiv:2003.13461), Algorithm 1.

Client i keeps a personal model v_i and a mixing weight α_i ∈ [0, 1]; its personalized model is the mixture

    v̄_i = α_i v_i + (1 − α_i) w.

A sampled client receives the global w and, for t = 1..τ, on one fresh minibatch D per step, updates all three from
their values at t − 1 (Alg. 1, local updates; ∇_v f_i(v̄) = α_i ∇f_i(v̄) and ∂f_i(v̄)/∂α_i = ⟨v_i − w, ∇f_i(v̄)⟩):

    w   ← w − β ∇f_i(w; D)
    v_i ← v_i − β α_i ∇f_i(v̄_i; D)
    α_i ← clip(α_i − η_α ⟨v_i − w, ∇f_i(v̄_i; D)⟩, 0, 1)                  (the adaptive-α step; η_α = 0 keeps α_i fixed)

and sends w (P floats up, P down). The server averages the w's as FedAvg (p_i ∝ n_i or uniform). v_i and α_i stay
on the client; a client not sampled keeps them. A client is scored with v̄_i = α_i v_i + (1 − α_i) w, w the current
global model. There is a global model, w.

Ambiguity: the authors' code (github MLOPTPSU/FedTorch, ``fedtorch/comms/trainings/federated/apfl.py``,
``train_and_validate_federated_apfl``, with ``comms/utils/flow_utils.py``, ``alpha_update``) moves α only on the first
step of each round, adds a 0.02·α penalty to its gradient and steps w before v. We follow the paper's Algorithm 1: α
moves every step by the plain gradient above, with its own step size (the paper's single η_t when ``mixing_lr`` is
null), and v̄ mixes the pre-step w. Like the code, we clip α to [0, 1].

With α = 0 and η_α = 0, v̄ = w and v never moves: the global model is FedAvg's exactly (``fedavg_reduction``).
Reads: β (``local_lr``), α (``mixing``: α_i's initial value, the step from w towards the client's own model), τ, r;
its own setting η_α (``mixing_lr``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, grad, register
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.schema import aliases


class APFLParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: step of w and of v_i.")
    mixing: float = Field(
        0.25, ge=0, le=1, validation_alias=aliases("mixing", "alpha", "α"),
        description="α: initial α_i, the weight of the personal model in v̄_i = α_i v_i + (1 − α_i) w (0 = the global model).",
    )
    mixing_lr: float | None = Field(
        None, ge=0, validation_alias=aliases("mixing_lr", "eta_alpha", "η_α"),
        description="η_α: step size of α_i's gradient step; null = local_lr (the paper's single η); 0 = α_i fixed.",
    )


@register("apfl")
class APFL(FedAvg):
    """FedAvg's global model and server, with each client's v_i and α_i trained beside it."""

    Params = APFLParams
    hp: APFLParams
    fedavg_reduction: ClassVar[dict] = {"mixing": 0.0, "mixing_lr": 0.0}

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"personal": initial_params.clone(), "mixing": torch.tensor(self.hp.mixing, dtype=initial_params.dtype,
                                                                          device=initial_params.device)}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        eta = hp.local_lr if hp.mixing_lr is None else hp.mixing_lr
        w, v, a = payload["params"].detach().clone(), state["personal"], state["mixing"]
        total = 0.0
        for _ in range(hp.local_steps):
            batch = ctx.batch(hp.batch_size)
            g_w, value = grad(ctx.loss, w, batch)
            col = a[..., None]  # α_i against the last (parameter) dimension, for one client or stacked rows
            g_bar, _ = grad(ctx.loss, col * v + (1 - col) * w, batch)
            a_next = (a - eta * ((v - w) * g_bar).sum(-1)).clamp(0.0, 1.0)
            w, v, a = w - hp.local_lr * g_w, v - hp.local_lr * col * g_bar, a_next
            total += value
        return {"params": w}, {"personal": v, "mixing": a}, {"local_train_loss": total / hp.local_steps}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        a = state["mixing"][..., None]
        return a * state["personal"] + (1 - a) * payload["params"]
