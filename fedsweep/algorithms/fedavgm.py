"""FedAvgM (Hsu, Qi, Brown, 2019, "Measuring the effects of non-identical data distribution for federated visual
classification", Sec. 3 "FedAvg with server momentum").

Clients run FedAvg's τ SGD steps from w_t and send their model w_i (P floats up, P floats down). The paper's server,
with Δw = Σ_{i∈S} p_i (w_t − w_i) (the FedAvg step taken as a gradient; p_i ∝ n_i, or uniform), keeps a velocity

    v ← μ v + Δw,    w_{t+1} = w_t − v.

Here the pseudo-gradient points the other way, Δ = Σ p_i (w_i − w_t) = −Δw, and a server step size η is added (the
paper's is 1; Reddi et al. 2021 and TFF's FedAvgM expose it): u ← μ u + Δ, w_{t+1} = w_t + η u, which is the paper's
rule with u = −v when η = 1. The velocity (P floats) is the server's state; nothing stays on the client; the global
model is w. With μ = 0 and η = 1 it is FedAvg (w_t + Σ p_i (w_i − w_t) = Σ p_i w_i). The paper's effective step is
β/(1 − μ) (β the client's); lower β or η as μ grows.
Reads: β (``local_lr``), τ, r, α at evaluation as FedAvg; its own μ (``server_momentum``) and η (``server_lr``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientMessage, State, register, weighted_average
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.schema import aliases


class FedAvgMParams(FedAvgParams):
    server_momentum: float = Field(
        0.9, ge=0, lt=1, validation_alias=aliases("server_momentum", "momentum"), description="μ (the paper's β): server momentum."
    )
    server_lr: float = Field(1.0, gt=0, validation_alias=aliases("server_lr", "eta", "η"), description="η: server step size (1 in the paper).")


@register("fedavgm")
class FedAvgM(FedAvg):
    Params = FedAvgMParams
    hp: FedAvgMParams
    fedavg_reduction: ClassVar[dict] = {"server_momentum": 0.0, "server_lr": 1.0}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"velocity": torch.zeros_like(global_params)}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        delta = weighted_average([m.payload["params"] - global_params for m in messages], self.aggregation_weights(messages))
        velocity = self.hp.server_momentum * server_state["velocity"] + delta
        return global_params + self.hp.server_lr * velocity, {"velocity": velocity}
