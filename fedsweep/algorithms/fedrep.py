"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021): exploiting shared representations for personalized FL.

The model is split as in FedPer (:mod:`.fedper`): a shared representation φ (the ``body`` group) and a head h_i per
client (the ``head`` group: the classifier, or ``personal_layers``). Round t (paper, Algorithm 1): the server sends
φ^t to the sampled clients; client i first updates its own head with the representation frozen,

    h_i ← h_i − α_h ∇_h f_i(φ^t, h_i; D)            (``head_steps`` = τ_h steps, from last round's h_i)

then the representation with that head frozen,

    φ ← φ − β ∇_φ f_i(φ, h_i; D)                    (τ = ``local_steps`` steps, from φ^t)

keeps h_i and sends φ_i. The server averages, φ^{t+1} = Σ_{i∈S} p_i φ_i (p_i ∝ n_i, or uniform as the paper's 1/rn).
A client is scored with (φ^t, h_i). Only φ travels: |φ| floats each way per sampled client; there is no global model
(a representation without a classifier). Clients not sampled keep h_i.

Steps: in Algorithm 1 the paper's τ counts the head updates and the representation takes one GRD step; the
experiments (authors' code, github ``lgcollins/FedRep``, ``models/Update.py``, ``LocalUpdate.train``) run
``local_ep − local_rep_ep`` head epochs, then ``local_rep_ep`` = 1 representation epoch, with one learning rate for
both. Here ``head_steps`` is the head's count and τ (``local_steps``) the representation's, so that τ counts the
shared part's steps as in FedAvg and FedPer; ``head_lr`` (null = β) is the head's step.

Reductions: with ``head_steps: 0`` a round is the representation's τ steps under the client's fixed head. Its first
step equals FedPer's body step from the same (φ^t, h_i) (FedPer moves (φ, h) jointly, and the gradient in φ at the
starting point is the same), so with τ = 1 the body sent, and the server's average, are FedPer's exactly; for τ > 1
they differ, since FedPer's head has moved. With ``head_steps: 0`` the heads never move from the seeded
initialization: that is FedBABU's training (:mod:`.fedbabu`). With ``personal_layers: []`` and ``head_steps: 0`` it
is FedAvg. Reads: β (``local_lr``), τ, r, and α at evaluation as FedAvg; own settings ``head_steps``, ``head_lr``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, State, grad, register, sgd
from fedsweep.algorithms.fedper import FedPer, FedPerParams
from fedsweep.models import ParamLayout


def partial_sgd(ctx: ClientContext, params: torch.Tensor, layout: ParamLayout, group: str, lr: float, steps: int,
                batch_size: int | None) -> tuple[torch.Tensor, float]:
    """:func:`~.base.sgd` on the ``group`` entries of ``params`` only, the others frozen (their gradient is zeroed):
    ``steps`` steps w_g ← w_g − lr ∇_g f_i(w; D) on fresh batches."""

    def gradient(w: torch.Tensor):
        g, value = grad(ctx.loss, w, ctx.batch(batch_size))
        return layout.merge(torch.zeros_like(g), group, layout.select(g, group)), value

    return sgd(ctx, params, lr, steps, batch_size, gradient=gradient)


class FedRepParams(FedPerParams):
    head_steps: int = Field(10, ge=0, description="τ_h: steps on the client's head (representation frozen) before the "
                            "representation's τ steps; the paper's τ. 0 = the head stays as it is.")
    head_lr: float | None = Field(None, gt=0, description="Step size of the head's steps; null = local_lr (β), as the "
                                  "authors' code.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr" and self.personal_layers is None:
            return "FedRep shares a representation below a personal head: use a model with a hidden layer (mlp, cnn)"
        return None


@register("fedrep")
class FedRep(FedPer):
    Params = FedRepParams
    hp: FedRepParams
    fedavg_reduction: ClassVar[dict] = {"personal_layers": [], "head_steps": 0}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, layout = self.hp, self.split()
        w = layout.join({"body": payload["body"], "head": state["head"]})
        w, _ = partial_sgd(ctx, w, layout, "head", hp.head_lr or hp.local_lr, hp.head_steps, hp.batch_size)
        w, loss = partial_sgd(ctx, w, layout, "body", hp.local_lr, hp.local_steps, hp.batch_size)
        return {"body": layout.select(w, "body").clone()}, {"head": layout.select(w, "head").clone()}, {"local_train_loss": loss}
