"""IFCA (Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020): the Iterative Federated Clustering Algorithm, Algorithm 1
with its model-averaging option (Option II).

The server keeps k cluster models θ_1..θ_k and sends all of them to every sampled client (k·P floats down). Client
i estimates its cluster identity by the loss of each model on its whole training set,

    ĵ = argmin_j F_i(θ_j)                                      (Alg. 1, cluster estimation; ties: the lowest j)

trains θ_ĵ for τ SGD steps θ ← θ − β ∇f_i(θ; D) (FedAvg's local update) and sends the trained model with its
cluster index (P + 1 floats up). The server averages each cluster over the clients that chose it,

    θ_j ← Σ_{i∈S_j} p_i θ_i,   p_i ∝ n_i (``aggregation: weighted``) or uniform  (Option II; θ_j unchanged if S_j = ∅)

Nothing stays on the client. A client is scored with the cluster model it would choose now (the same argmin on its
training data), fine-tuned by α as FedAvg's evaluation (``personalization_lr``, 0 = none).

Initialization. The paper starts the k models at random; here they come deterministically from the seeded
initial vector θ_0: θ_1 = θ_0 and θ_j (j ≥ 2) is θ_0 with the entries of every parameter tensor permuted by a
``torch.Generator`` seeded with j. A permutation of i.i.d. initial values is a draw from the same initialization
distribution, so each cluster starts as a differently initialized network of the same scale.

Global model: with k = 1 IFCA is FedAvg (``fedavg_reduction``), and θ_1 is scored as the global model. With k > 1
no model is meant for every client, so there is none (scoring cluster 1 on clients of other clusters would measure
nothing); the server's vector is still θ_1. Reads: β (``local_lr``), τ, r, α at evaluation, and k (``clusters``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, ClientMessage, Context, State, register, sgd, weighted_average
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams, fine_tune
from fedsweep.schema import aliases


class IFCAParams(FedAvgParams):
    personalization_lr: float = Field(
        0.0, ge=0, validation_alias=aliases("personalization_lr", "alpha", "α"),
        description="α: step size of the evaluation-time fine-tuning of the client's chosen cluster model (0 = none).",
    )
    clusters: int = Field(2, ge=1, validation_alias=aliases("clusters", "k"), description="k: number of cluster models (1 = FedAvg).")


@contextmanager
def statistics_kept(model) -> Iterator[None]:
    """Calls in the block use the model's normalization statistics without updating them (evaluating losses
    in the middle of local training: selection of a cluster, of other clients' models)."""
    training = getattr(model, "training", False)
    if model is not None:
        model.training = False
    try:
        yield
    finally:
        if model is not None:
            model.training = training


def losses(ctx: Context, models: torch.Tensor, batch) -> torch.Tensor:
    """(F_i(θ_j))_j on ``batch`` for the rows θ_j of ``models`` [..., k, P]: shape [..., k] (stacked clients: [C, k])."""
    with torch.no_grad(), statistics_kept(ctx.model):
        return torch.stack([ctx.loss(models[..., j, :], batch) for j in range(models.shape[-2])], dim=-1)


def permuted_init(initial: torch.Tensor, j: int, layout=None) -> torch.Tensor:
    """θ_0 with the entries of each parameter tensor (of the whole vector without a layout) permuted, seeded by j."""
    gen = torch.Generator().manual_seed(j)
    out = initial.clone()
    parts = list(layout.slices.values()) if layout is not None else [slice(0, initial.numel())]
    for s in parts:
        n = s.stop - s.start
        out[s] = initial[s][torch.randperm(n, generator=gen).to(initial.device)]
    return out


@register("ifca")
class IFCA(FedAvg):
    Params = IFCAParams
    hp: IFCAParams
    fedavg_reduction: ClassVar[dict] = {"clusters": 1}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        layout = self.model.layout if self.model is not None else None
        inits = [global_params.clone()] + [permuted_init(global_params, j, layout) for j in range(1, self.hp.clusters)]
        return {"models": torch.stack(inits)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"models": server_state["models"]}

    def choose(self, ctx: Context, models: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ĵ, θ_ĵ): the index of the lowest training loss and its model (rows for stacked clients)."""
        j = losses(ctx, models, ctx.train_data()).argmin(dim=-1)
        return j, torch.take_along_dim(models, j[..., None, None], dim=-2).squeeze(-2)

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        j, w0 = self.choose(ctx, payload["models"])
        w, loss = sgd(ctx, w0, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"params": w, "cluster": j}, state, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        models = server_state["models"].clone()
        for j in range(models.shape[0]):
            chosen = [m for m in messages if int(m.payload["cluster"]) == j]
            if chosen:
                models[j] = weighted_average([m.payload["params"] for m in chosen], self.aggregation_weights(chosen))
        return models[0].clone(), {"models": models}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return global_params if self.hp.clusters == 1 else None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        _, w = self.choose(ctx, payload["models"])
        return fine_tune(ctx, w, self.hp.personalization_lr, self.hp.personalization_steps)
