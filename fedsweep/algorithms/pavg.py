"""P-Avg (Acar et al., 2021, Sec. 5): FedAvg trained and evaluated through the Proto transform.

Client: τ steps w ← w − β ∇_w CE(−‖r_w(x) − c_k(w; D)‖², y; D′); server: the FedAvg average;
evaluation: nearest class centroid of the client's training data. Reads: β, τ, r.
"""

from __future__ import annotations

from pydantic import Field

from fedsweep.algorithms import transforms
from fedsweep.algorithms.base import AggregationMixin, ClientContext, LocalSGDOptions, State, register
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.schema import aliases


class PAvgParams(AggregationMixin, LocalSGDOptions):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "P-Avg's proto transform needs a representation: use a model with a hidden layer (mlp), not mlr"
        return None


@register("pavg")
class PAvg(transforms.TransformHooks, FedAvg):
    Params = PAvgParams
    transform = "proto"

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        w, loss = self.local_sgd(ctx, payload["params"], self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"params": w}, state, {"local_train_loss": loss}
