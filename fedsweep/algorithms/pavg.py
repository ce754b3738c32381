"""P-Avg (Acar et al., 2021, Sec. 5): FedAvg trained and evaluated through the Proto transform.

Client: τ steps w ← w − β ∇_w CE(−‖r_w(x) − c_k(w; D)‖², y; D′); server: the FedAvg average;
evaluation: nearest class centroid of the client's training data. Reads: β, τ, r.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsweep.algorithms import transforms
from fedsweep.algorithms.base import AggregationMixin, ClientContext, State
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.schema import aliases


class PAvgParams(AggregationMixin):
    name: Literal["pavg"] = "pavg"
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "P-Avg's proto transform needs a representation: use a model with a hidden layer (mlp), not mlr"
        return None


class PAvg(FedAvg):
    name = "pavg"
    Params = PAvgParams

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        w, total = payload["params"].clone(), 0.0
        for _ in range(self.hp.local_steps):
            g, loss = transforms.transformed_gradient(ctx, "proto", w, 0.0, self.hp.batch_size)
            w = w - self.hp.local_lr * g
            total += loss
        return {"params": w}, state, {"local_train_loss": total / self.hp.local_steps}

    def personalize(self, ctx: ClientContext, payload: State, state: State):
        return payload["params"]

    def predictor(self, ctx: ClientContext, personalized):
        return transforms.predictor(ctx, "proto", personalized)
