"""FedProx (Li et al., 2020, "Federated optimization in heterogeneous networks", Algorithm 2).

Client i approximately minimizes h_i(w; w_t) = f_i(w) + (μ/2)‖w − w_t‖² with τ SGD steps:

    w ← w − β (∇f_i(w; D) + μ (w − w_t))

Server: the FedAvg average. μ = 0 is FedAvg exactly.
Reads: β (``local_lr``), λ = μ (``proximal_strength``), τ, r; α at evaluation.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fedsweep.algorithms.base import ClientContext, State, register, sgd
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.schema import aliases


class FedProxParams(FedAvgParams):
    proximal_strength: float = Field(
        0.01, ge=0, validation_alias=aliases("proximal_strength", "mu", "μ", "lambda", "λ"), description="λ = μ: weight of the proximal term."
    )


@register("fedprox")
class FedProx(FedAvg):
    Params = FedProxParams
    hp: FedProxParams
    fedavg_reduction: ClassVar[dict] = {"proximal_strength": 0.0}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        anchor, mu = payload["params"], self.hp.proximal_strength
        w, loss = sgd(ctx, anchor, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size, lambda w: mu * (w - anchor))
        return {"params": w}, state, {"local_train_loss": loss}
