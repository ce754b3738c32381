"""FedDeper (Zhou et al., "FedDeper: Federated learning with depersonalization", arXiv 2210.03444), as the
seed describes it.

RECONSTRUCTED from the paper's description (introduction, Fig. 1); the paper's Section III equations
were not available. What follows implements the reading of the seed's own statements (S1-S7, quoted in
issue 20 from seed 003 and the abstract), each line marked with the statements it rests on.

Client i keeps a personalized component y_i across rounds ("historical info", S5), zero before its
first round. In round k a sampled client

    (c) initialization:    v ← x^k (the broadcast global model); y_i from its history            [S5]
    for t = 1..τ, alternating SGD on fresh minibatches D, D′ (one per half-step)                 [S6, S1]
    (a) optimization:      y_i ← y_i − α (∇f_i(v + y_i; D) + λ y_i)                             [S2]
    (b) depersonalization: v ← v − β ∇f_i(v + y_i; D′)                                          [S1, S3]

The original local model is w = v + y_i, so the globalized model v = w − y_i is "the original local
model minus the personalized one" (S3). The client uploads v in place of w (S4, S7); the server averages
the uploads as FedAvg does (``aggregation``). The personalized model scored at evaluation is x + y_i, the
current global model plus the client's own component. λ ≥ 0 decays y_i towards zero (the shared
vocabulary's tie to the shared model; default 0). With α = 0 the step (a) is skipped (no batch drawn),
y_i stays zero and the client runs FedAvg's τ steps of β: FedAvg exactly. A client not sampled keeps y_i.
Reads: α, β, λ, τ, r.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, grad, register
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.schema import aliases

RECONSTRUCTED = (
    "reconstructed from the paper's description (introduction, Fig. 1); "
    "the paper's Section III equations were not available"
)


class FedDeperParams(AggregationMixin):
    personalization_lr: float = Field(
        0.01, ge=0, validation_alias=aliases("personalization_lr", "alpha", "α"),
        description="α: step of the personalized component y_i (0 = FedAvg).",
    )
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: step of the globalized model v.")
    coupling: float = Field(0.0, ge=0, validation_alias=aliases("coupling", "lambda", "λ"), description="λ: decay of y_i towards zero (0 = none).")


@register("feddeper")
class FedDeper(FedAvg):
    Params = FedDeperParams
    hp: FedDeperParams
    provenance = RECONSTRUCTED

    def init_client_state(self, global_params: torch.Tensor) -> State:
        return {"personal": torch.zeros_like(global_params)}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        v, y = payload["params"].clone(), state["personal"].clone()
        total = 0.0
        for _ in range(hp.local_steps):
            if hp.personalization_lr:
                g, _ = grad(ctx.loss, v + y, ctx.batch(hp.batch_size))
                y = y - hp.personalization_lr * (g + hp.coupling * y)
            g, value = grad(ctx.loss, v + y, ctx.batch(hp.batch_size))
            v = v - hp.local_lr * g
            total += value
        return {"params": v}, {"personal": y}, {"local_train_loss": total / hp.local_steps}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return payload["params"] + state["personal"]
