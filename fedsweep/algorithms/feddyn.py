"""FedDyn (Acar et al., 2021, ICLR, Algorithm 1) and PFLDyn (Acar et al., 2021, ICML, Algorithm 1).

Client i, sampled in round t, from the server model w^t and its own g_i (the gradient state), takes
τ = K steps on the transformed objective plus the dynamic regularizer R_i(w) = −⟨w, g_i⟩ + (λ/2)‖w − w^t‖²:

    w ← w − β (∇f_i(T(w; D); D′) − g_i + λ (w − w^t))
    g_i ← g_i − λ (w_i^{t+1} − w^t)

Server (m = number of clients, P_t the sampled ones):

    g^{t+1} = g^t − (λ/m) Σ_{i∈P_t} (w_i^{t+1} − w^t)
    w^{t+1} = (1/|P_t|) Σ_{i∈P_t} w_i^{t+1} − g^{t+1}/λ

λ is the papers' α. Unsampled clients keep g_i frozen. The model scored (the global model, and the one a client
personalizes at evaluation) is w^{t+1} as the papers write it; the authors' code (alpemreacar/PFL, ``train_dyn_model``'s
callers) sends w^{t+1} but scores the plain mean of the sampled models, which may part our numbers from their tables.
Reads: β (``local_lr``), λ (``regularization``), τ, r, and the transform's η (α).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedsweep.algorithms import transforms
from fedsweep.algorithms.base import Algorithm, ClientContext, ClientMessage, HyperParameters, State, register
from fedsweep.schema import aliases


class FedDynParams(HyperParameters):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    regularization: float = Field(
        0.01, gt=0, validation_alias=aliases("regularization", "lambda", "λ"), description="λ (the paper's α): dynamic-regularizer weight."
    )


@register("feddyn")
class FedDyn(transforms.TransformHooks, Algorithm):
    Params = FedDynParams

    def init_client_state(self, global_params: torch.Tensor) -> State:
        return {"grad_state": torch.zeros_like(global_params)}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        return {"h": torch.zeros_like(global_params)}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        anchor, g_i = payload["params"], state["grad_state"]
        lam = self.hp.regularization
        w, loss = self.local_sgd(
            ctx, anchor, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size, lambda w: -g_i + lam * (w - anchor)
        )
        return {"params": w}, {"grad_state": g_i - lam * (w - anchor)}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        lam = self.hp.regularization
        models = [m.payload["params"] for m in messages]
        h = server_state["h"] - (lam / num_clients) * sum(w - global_params for w in models)
        return sum(models) / len(models) - h / lam, {"h": h}
