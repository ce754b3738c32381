"""Ditto (Li, Hu, Beirami, Smith, 2021, Algorithm 1): fair and robust FL through personalization.

A sampled client i runs FedAvg's τ global steps w ← w − β ∇f_i(w; D) from w^t and uploads w, and
updates its own personal model v_i (kept in the client across rounds, initialized to the first w^t it
receives) with ``personal_steps`` steps on the regularized objective

    v_i ← v_i − α (∇f_i(v_i; D) + λ (v_i − w^t))

Evaluation scores v_i. With λ = 0 the personal models are plain local training.
Reads: α (personal step), β (global local step), λ, τ, r.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, register, sgd
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.schema import aliases


class DittoParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: step of the global model's local training.")
    personalization_lr: float = Field(
        0.05, gt=0, validation_alias=aliases("personalization_lr", "alpha", "α"), description="α: step of the personal model."
    )
    coupling: float = Field(0.1, ge=0, validation_alias=aliases("coupling", "lambda", "λ"), description="λ: pull of v_i towards w^t.")
    personal_steps: int | None = Field(None, ge=1, description="Steps on v_i per round; null = local_steps (τ).")


@register("ditto")
class Ditto(FedAvg):
    Params = DittoParams
    hp: DittoParams

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        anchor = payload["params"]
        w, loss = sgd(ctx, anchor, hp.local_lr, hp.local_steps, hp.batch_size)
        v0 = state.get("personal", anchor)
        v, _ = sgd(ctx, v0, hp.personalization_lr, hp.personal_steps or hp.local_steps, hp.batch_size, lambda v: hp.coupling * (v - anchor))
        return {"params": w}, {"personal": v}, {"local_train_loss": loss}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return state.get("personal", payload["params"])
