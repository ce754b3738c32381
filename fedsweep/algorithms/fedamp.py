"""FedAMP (Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, 2021): attentive message passing between clients' models.

The server keeps every client's latest personalized model w_j (the seeded initialization until j first trains).
Before client i trains in round k it receives its own cloud model (Eq. 6-7), j over the federation's clients: the
clients held out of training (``unseen_fraction``), whose rows stay at the initialization, are no part of it

    u_i = Σ_j ξ_ij w_j,   ξ_ij = α_k A′(‖w_i − w_j‖²) (j ≠ i),   ξ_ii = 1 − Σ_{j≠i} ξ_ij,

with A(x) = 1 − exp(−x/σ), so A′(x) = exp(−x/σ)/σ: models closer to w_i weigh more. Client i then solves
(Eq. 8) min_w F_i(w) + (λ / 2α_k) ‖w − u_i‖² by τ SGD steps

    w ← w − β (∇f_i(w; D) + (λ/α_k)(w − u_i)),

starting from its own w_i (the paper's argmin names no starting point; PFLlib's ``clientAMP.train`` trains the
client's own model, which we follow), keeps w_i ← w and sends it; the server stores it. α_k = α is constant here.
Each client gets its own u_i (P floats down) and sends w_i (P floats up); there is no global model, and a client is
scored with its own w_i. Reads: β (``local_lr``), λ (``coupling``), α (``attention_step``), σ, τ, r. As in the paper
(and PFLlib's ``serveramp``), nothing bounds α Σ_{j≠i} A′(‖w_i − w_j‖²) by 1: with models close together and a large α,
ξ_ii is negative and u_i lies beyond w_i rather than between the models (the paper asks for a small α_k).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, ClientMessage, State, register, sgd
from fedsweep.algorithms.local import Local, LocalParams
from fedsweep.schema import aliases


class FedAMPParams(LocalParams):
    coupling: float = Field(1.0, ge=0, validation_alias=aliases("coupling", "lambda", "λ"), description="λ: pull towards u_i.")
    attention_step: float = Field(
        0.1, gt=0, validation_alias=aliases("attention_step", "alpha", "α", "alpha_k"),
        description="α_k: weight of the other clients' models in u_i (and the proximal term's 1/α_k).",
    )
    sigma: float = Field(1.0, gt=0, validation_alias=aliases("sigma", "σ"), description="σ: scale of A(x) = 1 − exp(−x/σ).")


def attention_weights(models: torch.Tensor, i: int, alpha: float, sigma: float) -> torch.Tensor:
    """ξ_i· (Eq. 7): α A′(‖w_i − w_j‖²) for j ≠ i, and 1 − their sum for j = i."""
    sq = ((models - models[i]) ** 2).sum(dim=1)
    xi = alpha * torch.exp(-sq / sigma) / sigma
    xi[i] = 0.0
    xi[i] = 1.0 - xi.sum()
    return xi


@register("fedamp")
class FedAMP(Local):
    """Each client's own model, as :class:`Local`'s (nothing shared, no global model), pulled towards u_i."""

    Params = FedAMPParams
    hp: FedAMPParams

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"models": global_params.expand(num_clients, -1).clone()}

    def client_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        models = server_state["models"]
        # the federation's rows (the count server_update is given; before the first aggregation every row is the
        # initialization, and which rows enter changes nothing), and client_id's own if it is held out
        rows = models[: int(server_state["members"])] if "members" in server_state else models
        if client_id >= len(rows):
            rows, client_id = torch.cat([rows, models[client_id : client_id + 1]]), len(rows)
        return {"cloud": attention_weights(rows, client_id, self.hp.attention_step, self.hp.sigma) @ rows}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        u, pull = payload["cloud"], self.hp.coupling / self.hp.attention_step
        w, loss = sgd(ctx, state["params"], self.hp.local_lr, self.hp.local_steps, self.hp.batch_size, lambda w: pull * (w - u))
        return {"params": w}, {"params": w}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        models = server_state["models"].clone()
        for m in messages:
            models[m.client_id] = m.payload["params"]
        return global_params, {"models": models, "members": torch.tensor(num_clients)}
