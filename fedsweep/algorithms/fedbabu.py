"""FedBABU (Oh, Kim, Yun, ICLR 2022): "FedBABU: toward enhanced representation for federated image classification".

The model is split into the body φ (the ``body`` group) and the head h (the classifier, the ``head`` group). The head
is fixed at its random initialization h_0 (the seeded one every client and the server share) and never trained in
federated training. Round t (paper, Algorithm 1): the server sends φ^t; a sampled client i takes τ SGD steps on the
body only,

    φ ← φ − β ∇_φ f_i(φ, h_0; D)

and sends φ_i; the server averages φ^{t+1} = Σ_{i∈S} p_i φ_i (p_i ∝ n_i; the authors' code, github
``jhoon-oh/FedBABU``, ``main_fed.py`` with ``--local_upt_part body --aggr_part body``, averages uniformly:
``aggregation: uniform``). Only φ travels: |φ| floats each way per sampled client. The global model is (φ^t, h_0),
scored as such (the paper's accuracy "before fine-tuning").

Evaluation (the paper's personalization protocol): each client fine-tunes the global model on its own training data and
is scored with the result. The authors' ``analysis.ipynb`` fine-tunes the whole model (body and head, one learning
rate: 1e-3 with momentum 0.9, about 0.01 per step once the momentum builds up) for 5 epochs of minibatches of 50;
here ``personalization_steps`` (5) full-batch steps of size α (``personalization_lr``, 0.01) on the part
``fine_tune_part`` names (``full`` by default; ``head`` and ``body`` are the paper's ablation). The client keeps
nothing between rounds but h_0.

This is FedRep (:mod:`.fedrep`) with ``head_steps: 0`` (heads never leave h_0), scored after fine-tuning.
Reads: β (``local_lr``), τ, r, α (``personalization_lr``) at evaluation; own setting ``fine_tune_part``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, State, register
from fedsweep.algorithms.fedavg import FedAvgParams, fine_tune
from fedsweep.algorithms.fedper import FedPer
from fedsweep.algorithms.fedrep import partial_sgd
from fedsweep.models import ParamLayout
from fedsweep.schema import aliases


class FedBABUParams(FedAvgParams):
    personalization_lr: float = Field(
        0.01, ge=0, validation_alias=aliases("personalization_lr", "alpha", "α"),
        description="α: step size of the evaluation-time fine-tuning (0 = score the global model with its random head).",
    )
    personalization_steps: int = Field(5, ge=0, description="Number of full-batch fine-tuning steps of size α at evaluation.")
    fine_tune_part: Literal["full", "head", "body"] = Field(
        "full", description="What the evaluation-time fine-tuning updates: the whole model (the authors' code), the head or the body.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "FedBABU trains a body below a frozen head: use a model with a hidden layer (mlp, cnn)"
        return None


@register("fedbabu")
class FedBABU(FedPer):
    Params = FedBABUParams
    hp: FedBABUParams
    fedavg_reduction: ClassVar[dict | None] = None  # the head never trains: no setting makes it FedAvg

    def split(self) -> ParamLayout:
        return self.model.layout

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        layout = self.split()
        w = layout.join({"body": payload["body"], "head": state["head"]})
        w, loss = partial_sgd(ctx, w, layout, "body", self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"body": layout.select(w, "body").clone()}, state, {"local_train_loss": loss}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return global_params  # (φ^t, h_0): the server never touches the head

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        hp, layout = self.hp, self.split()
        w = layout.join({"body": payload["body"], "head": state["head"]})
        if hp.fine_tune_part == "full":
            return fine_tune(ctx, w, hp.personalization_lr, hp.personalization_steps)
        if hp.personalization_lr == 0 or hp.personalization_steps == 0:
            return w
        return partial_sgd(ctx, w, layout, hp.fine_tune_part, hp.personalization_lr, hp.personalization_steps, None)[0]
