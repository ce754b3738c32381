"""MOON (Li, He, Song, CVPR 2021, "Model-Contrastive Federated Learning", Algorithm 1).

Client i receives w^t and takes τ SGD steps from it on the local objective (Eq. 5) of Algorithm 1 (PartyLocalTraining)

    ℓ = ℓ_sup(w; x, y) + μ ℓ_con,                                                  (Eq. 4)
    ℓ_con = −log [ exp(sim(z, z_glob)/T) / (exp(sim(z, z_glob)/T) + exp(sim(z, z_prev)/T)) ],

averaged over the minibatch, with z = R_w(x) the representation of the model being trained, z_glob = R_{w^t}(x) of the
received global model and z_prev = R_{w_i^{t−1}}(x) of the client's own model at the end of its previous round
(kept in its state; the seeded initialization before its first round, when z_glob = z_prev and ℓ_con is the constant
log 2, as the authors' code has no negative then), sim the cosine similarity and T the temperature. The paper's R is
its projection head's output, the input of the output layer; here R is :meth:`FlatModel.features`, the input of the
model's last layer (the last hidden layer of an MLP or CNN), so a model needs a hidden layer (mlr is refused).
z_glob and z_prev are constants (no gradient), computed in evaluation mode as the authors' ``global_net.eval()``
(QinbinLi/MOON, main.py ``train_net_fedcon``), where ℓ_con is ``CrossEntropyLoss`` of the logits
[sim(z, z_glob), sim(z, z_prev)]/T with label 0 (one previous model, ``model_buffer_size = 1``). With batch
normalization both use the statistics the client received, and the pass that computes z folds no second copy of the
batch's statistics into the client's. The local optimizer is plain SGD, as in every fedsweep method (the authors'
runs use momentum 0.9 and weight decay).

It sends w_i (P floats up, P down); the server averages as FedAvg (p_i ∝ n_i). The previous model stays on the
client. The global model is w; a client is scored with it (α fine-tuning optional, as FedAvg). μ = 0 is FedAvg.
Reads: β (``local_lr``), τ, r, λ = μ (``contrastive_strength``), α at evaluation; its own T (``temperature``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, State, loss_value, register, sgd
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.models import FlatModel
from fedsweep.schema import aliases


class MOONParams(FedAvgParams):
    contrastive_strength: float = Field(
        1.0, ge=0, validation_alias=aliases("contrastive_strength", "mu", "μ", "lambda", "λ"),
        description="λ = μ: weight of the model-contrastive loss (0 = FedAvg).",
    )
    temperature: float = Field(0.5, gt=0, validation_alias=aliases("temperature", "T"), description="T: temperature of ℓ_con.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "MOON contrasts representations (the input of the last layer): use a model with a hidden layer (mlp, cnn), not mlr"
        return None


@contextmanager
def statistics(model: FlatModel, stats: torch.Tensor | None, training: bool) -> Iterator[None]:
    """Calls of ``model`` in the block normalize with ``stats`` (and fold batch statistics into them when
    ``training``); the model's own statistics and mode are restored after."""
    own, was = model.stats, model.training
    model.stats, model.training = stats, training
    try:
        yield
    finally:
        model.stats, model.training = own, was


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """ℓ_con, averaged over the batch."""
    logits = torch.stack([F.cosine_similarity(z, z_glob, dim=-1), F.cosine_similarity(z, z_prev, dim=-1)], dim=-1) / temperature
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


@register("moon")
class MOON(FedAvg):
    Params = MOONParams
    hp: MOONParams
    fedavg_reduction: ClassVar[dict] = {"contrastive_strength": 0.0}

    def can_vectorize(self) -> bool:
        return False

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"previous": initial_params.clone()}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, model = self.hp, ctx.model
        anchor, previous = payload["params"], state["previous"]
        received = None if model.stats is None else model.stats.clone()

        def gradient(w: torch.Tensor) -> tuple[torch.Tensor, float]:
            batch = ctx.batch(hp.batch_size)
            w = w.detach().requires_grad_(True)
            sup = ctx.loss(w, batch)
            total = sup
            if hp.contrastive_strength > 0:
                x = batch[0]
                with statistics(model, received, False), torch.no_grad():
                    z_glob, z_prev = model.features(anchor, x), model.features(previous, x)
                # the supervised pass already folded this batch's statistics in: this one folds them into a copy
                with statistics(model, None if model.stats is None else model.stats.clone(), model.training):
                    z = model.features(w, x)
                total = sup + hp.contrastive_strength * contrastive_loss(z, z_glob, z_prev, hp.temperature)
            (g,) = torch.autograd.grad(total, w)
            return g, loss_value(sup)

        w, loss = sgd(ctx, anchor, hp.local_lr, hp.local_steps, hp.batch_size, gradient=gradient)
        return {"params": w}, {"previous": w.clone()}, {"local_train_loss": loss}
