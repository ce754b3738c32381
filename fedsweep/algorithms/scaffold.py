"""SCAFFOLD (Karimireddy et al., 2020, Algorithm 1, option II) and PFLScaf (Acar et al., 2021, Algorithm 2).

Client i, from the server model x and control variate c, with its own control variate c_i, takes
τ = K steps on the transformed objective (identity for SCAFFOLD):

    y ← y − β (∇f_i(T(y; D); D′) − c_i + c)                                   (PFL: R_i = ⟨w, −g_i + g⟩)
    c_i⁺ = c_i − c + (x − y) / (K β)
    sends Δy = y − x and Δc = c_i⁺ − c_i (two vectors: two transmissions each way)

Server: x ← x + η_g Σ_{i∈S} p_i Δy_i,  c ← c + (1/N) Σ_{i∈S} Δc_i, with p_i the aggregation weights: by sample
count by default, as for every method here (``aggregation``); both papers' 1/|S| is ``aggregation: uniform`` (the
same on the PFL ACID files, whose devices hold 500 images each).
With c = c_i = 0 (the first round) the client step is FedAvg's. A client's c_i only changes when
it is sampled. Reads: β (``local_lr``), τ, r, η_g (``global_lr``), and the transform's η (α).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms import transforms
from fedsweep.algorithms.base import (
    AggregationMixin,
    Algorithm,
    ClientContext,
    ClientMessage,
    State,
    register,
    weighted_average,
)
from fedsweep.schema import aliases


class ScaffoldParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    global_lr: float = Field(1.0, gt=0, description="η_g: server step size on the averaged update.")


@register("scaffold")
class Scaffold(transforms.TransformHooks, Algorithm):
    Params = ScaffoldParams

    def init_client_state(self, global_params: torch.Tensor) -> State:
        return {"control": torch.zeros_like(global_params)}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"control": torch.zeros_like(global_params)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"params": global_params, "control": server_state["control"]}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        x, c, c_i = payload["params"], payload["control"], state["control"]
        lr, steps = self.hp.local_lr, self.hp.local_steps
        y, loss = self.local_sgd(ctx, x, lr, steps, self.hp.batch_size, lambda _: c - c_i)
        c_new = c_i - c + (x - y) / (steps * lr)
        return {"delta_params": y - x, "delta_control": c_new - c_i}, {"control": c_new}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        dx = weighted_average([m.payload["delta_params"] for m in messages], self.aggregation_weights(messages))
        dc = sum(m.payload["delta_control"] for m in messages) / num_clients
        return global_params + self.hp.global_lr * dx, {"control": server_state["control"] + dc}
