"""FedOpt (Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, ICLR 2021, "Adaptive Federated
Optimization", Algorithm 2): FedAdagrad, FedYogi and FedAdam, one module with ``variant``.

Clients run FedAvg's τ SGD steps from the server model x_t (ClientOpt = SGD with step β) and send their model x_i
(P floats up, P floats down). The server forms the pseudo-gradient Δ_t = Σ_{i∈S} p_i (x_i − x_t) (p_i ∝ n_i, or
uniform with ``aggregation: uniform``; the paper's Δ_t is the plain mean) and takes one adaptive step (Alg. 2):

    m_t = β1 m_{t−1} + (1 − β1) Δ_t
    adagrad: v_t = v_{t−1} + Δ_t²
    yogi:    v_t = v_{t−1} − (1 − β2) Δ_t² sign(v_{t−1} − Δ_t²)
    adam:    v_t = β2 v_{t−1} + (1 − β2) Δ_t²
    x_{t+1} = x_t + η m_t / (√v_t + ε)

elementwise, with no bias correction (Alg. 2 has none). m and v (P floats each) are the server's state; m_{−1} = 0
and v_{−1} = ``initial_accumulator``. Alg. 2 asks v_{−1} ≥ ε² (the paper's τ, called ``epsilon`` here because τ is
the local steps); since √v + ε ≥ ε for any v ≥ 0 the default v_{−1} = 0 is as safe and gives Adam's first step the
closed form x_1 = x_0 + η (1 − β1) Δ / (√(1 − β2) |Δ| + ε). Nothing stays on the client; the global model is x.
Reads: β (``local_lr``), τ, r, and α (``personalization_lr``) at evaluation as FedAvg; its own η (``server_lr``),
β1, β2, ε, v_{−1}.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientMessage, State, register, weighted_average
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.schema import aliases


class FedOptParams(FedAvgParams):
    variant: Literal["adam", "yogi", "adagrad"] = Field("adam", description="The server optimizer (Alg. 2): FedAdam, FedYogi or FedAdagrad.")
    server_lr: float = Field(0.01, gt=0, validation_alias=aliases("server_lr", "eta", "η"), description="η: server step size.")
    beta1: float = Field(0.9, ge=0, lt=1, validation_alias=aliases("beta1", "β1"), description="β1: decay of the first moment m.")
    beta2: float = Field(0.99, ge=0, lt=1, validation_alias=aliases("beta2", "β2"), description="β2: decay of the second moment v (adam, yogi).")
    epsilon: float = Field(
        1e-3, gt=0, validation_alias=aliases("epsilon", "ε", "adaptivity"),
        description="ε (the paper's τ): degree of adaptivity, added to √v in the step's denominator.",
    )
    initial_accumulator: float = Field(0.0, ge=0, description="v_{−1}: the second moment's initial value.")


def second_moment(variant: str, v: torch.Tensor, sq: torch.Tensor, beta2: float) -> torch.Tensor:
    """v_t from v_{t−1} and Δ_t² (Alg. 2, the line of each variant)."""
    if variant == "adagrad":
        return v + sq
    if variant == "yogi":
        return v - (1 - beta2) * sq * torch.sign(v - sq)
    return beta2 * v + (1 - beta2) * sq


@register("fedopt")
class FedOpt(FedAvg):
    Params = FedOptParams
    hp: FedOptParams

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"m": torch.zeros_like(global_params), "v": torch.full_like(global_params, self.hp.initial_accumulator)}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        hp = self.hp
        delta = weighted_average([m.payload["params"] - global_params for m in messages], self.aggregation_weights(messages))
        m = hp.beta1 * server_state["m"] + (1 - hp.beta1) * delta
        v = second_moment(hp.variant, server_state["v"], delta * delta, hp.beta2)
        return global_params + hp.server_lr * m / (v.sqrt() + hp.epsilon), {"m": m, "v": v}
