"""Local: every client trains its own model on its own data, with no communication (the "Local" row of PFL
tables, e.g. pFL-Bench and PFLlib).

Client i starts from the seeded initialization w_0 (the same on every client) and, each round it is sampled,
takes τ SGD steps w_i ← w_i − β ∇f_i(w_i; D). Nothing is sent either way (0 floats); the server has no global
model, so the global metrics are absent; each client is scored with its own w_i. Reads: β (``local_lr``), τ, r.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms.base import Algorithm, ClientContext, ClientMessage, HyperParameters, State, register, sgd
from fedsweep.schema import aliases


class LocalParams(HyperParameters):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")


@register("local")
class Local(Algorithm):
    Params = LocalParams
    hp: LocalParams

    def can_vectorize(self) -> bool:
        return True

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"params": initial_params.clone()}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        w, loss = sgd(ctx, state["params"], self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {}, {"params": w}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        return global_params, server_state

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return state["params"]
