"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, 2019): base layers shared, personalization layers local.

The model's parameters are split by :class:`~fedsweep.models.ParamLayout` into the shared *base* b (the
``body`` group) and the *personalization layers* h_i (the ``head`` group: the classifier by default, any
layers by name with ``personal_layers``). Round t: the server sends b_t; a sampled client i runs FedAvg's τ SGD
steps on the whole model (b, h_i) from (b_t, h_i) (paper, Algorithm 1: "the entire network is trained"),

    (b, h) ← (b, h) − β ∇f_i((b, h); D)

keeps h_i ← h and sends only b. The server averages the bases, b_{t+1} = Σ_{i∈S} p_i b_i (p_i ∝ n_i or uniform).
A client is scored with (b_t, h_i). Only the base travels: |b| floats each way per sampled client.

With ``personal_layers: []`` nothing is personal and FedPer is FedAvg. There is no global model (a base with no
classifier) unless the head is empty. Reads: β (``local_lr``), τ, r, and α at evaluation as FedAvg.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, ClientMessage, State, register, sgd, weighted_average
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams, fine_tune
from fedsweep.models import ParamLayout


class FedPerParams(FedAvgParams):
    personal_layers: list[str] | None = Field(
        None,
        description="Layers kept on each client (names of the model's modules, e.g. ['2'] for an MLP's last layer); "
        "null = the model's head (its last layer); [] = none (FedAvg).",
    )


@register("fedper")
class FedPer(FedAvg):
    Params = FedPerParams
    hp: FedPerParams
    fedavg_reduction: ClassVar[dict] = {"personal_layers": []}

    def split(self) -> ParamLayout:
        """The model's layout with ``head`` = the personal layers and ``body`` = the shared ones."""
        layout = self.model.layout
        return layout if self.hp.personal_layers is None else layout.regroup(head=self.hp.personal_layers)

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"head": self.split().select(initial_params, "head").clone()}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"body": self.split().select(global_params, "body")}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        layout = self.split()
        w0 = layout.join({"body": payload["body"], "head": state["head"]})
        w, loss = sgd(ctx, w0, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"body": layout.select(w, "body").clone()}, {"head": layout.select(w, "head").clone()}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        body = weighted_average([m.payload["body"] for m in messages], self.aggregation_weights(messages))
        return self.split().merge(global_params, "body", body), server_state

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return global_params if self.split().size("head") == 0 else None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        w = self.split().join({"body": payload["body"], "head": state["head"]})
        return fine_tune(ctx, w, self.hp.personalization_lr, self.hp.personalization_steps)
