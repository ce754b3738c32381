"""pFedMe (Dinh, Tran, Nguyen, 2020, Algorithm 1): personalized FL with Moreau envelopes.

F_i(w) = min_θ { f_i(θ) + (λ/2)‖θ − w‖² }. Round t: the server sends w_t to every client; client i sets
w_{i,0} = w_t and, for r = 0..R−1 (R = τ), draws a batch D and

    θ ← θ − α (∇f_i(θ; D) + λ (θ − w_{i,r}))      K times (θ starts at w_t, carried over r)
    w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ)

The server samples S clients and sets w_{t+1} = (1 − β) w_t + β Σ_{i∈S} p_i w_{i,R}.
Evaluation: PM scores θ_i from the client's last local round (personalized), GM the global w.
Reads: α (personal learning rate), η (``local_lr``), λ, β (server mixing), τ = R, r = S/N, K.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms.base import (
    AggregationMixin,
    Algorithm,
    Batch,
    ClientContext,
    ClientMessage,
    LossFn,
    RoundPlan,
    State,
    grad,
    loss_value,
    register,
    weighted_average,
)
from fedsweep.schema import aliases


class PFedMeParams(AggregationMixin):
    personalization_lr: float = Field(
        0.01, gt=0, validation_alias=aliases("personalization_lr", "alpha", "α"), description="α: personal learning rate of the inner solver."
    )
    local_lr: float = Field(0.01, gt=0, validation_alias=aliases("local_lr", "eta", "η"), description="η: local learning rate.")
    coupling: float = Field(15.0, gt=0, validation_alias=aliases("coupling", "lambda", "λ"), description="λ: Moreau-envelope regularization.")
    server_mixing: float = Field(2.0, gt=0, validation_alias=aliases("server_mixing", "beta", "β"), description="β: server mixing (β = 1: plain average).")
    inner_steps: int = Field(5, ge=1, description="K: gradient steps of the inner solver.")
    local_steps: int = Field(20, ge=1, validation_alias=aliases("local_steps", "tau", "τ", "R"), description="τ = R: local rounds.")


def prox_solve(loss: LossFn, theta: torch.Tensor, anchor: torch.Tensor, batch: Batch, lr: float, steps: int, lam: float) -> torch.Tensor:
    """K gradient steps on h(θ) = f(θ; D) + (λ/2)‖θ − anchor‖² from ``theta``: approximates the proximal point."""
    for _ in range(steps):
        g, _ = grad(loss, theta, batch)
        theta = theta - lr * (g + lam * (theta - anchor))
    return theta


@register("pfedme")
class PFedMe(Algorithm):
    Params = PFedMeParams
    hp: PFedMeParams

    def can_vectorize(self) -> bool:
        return True

    def plan_round(self, sampled: list[int], num_clients: int) -> RoundPlan:
        """The server broadcasts to every client and every client trains (its θ_i moves); only the sampled
        clients' models are sent back and aggregated."""
        return RoundPlan(list(range(num_clients)), sampled)

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        w = payload["params"].clone()
        theta, total = w.clone(), 0.0
        for _ in range(hp.local_steps):
            batch = ctx.batch(hp.batch_size)
            theta = prox_solve(ctx.loss, theta, w, batch, hp.personalization_lr, hp.inner_steps, hp.coupling)
            w = w - hp.local_lr * hp.coupling * (w - theta)
            total += loss_value(ctx.loss(theta.detach(), batch))
        return {"params": w}, {"personalized": theta}, {"local_train_loss": total / hp.local_steps}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        beta = self.hp.server_mixing
        mean = weighted_average([m.payload["params"] for m in messages], self.aggregation_weights(messages))
        return (1 - beta) * global_params + beta * mean, server_state

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """PM: θ_i of the last local round; before any, the K-step proximal point of the global model."""
        if "personalized" in state:
            return state["personalized"]
        w = payload["params"]
        return prox_solve(ctx.loss, w, w, ctx.train_data(), self.hp.personalization_lr, self.hp.inner_steps, self.hp.coupling)
