"""FedRoD (Chen & Chao, ICLR 2022): "On bridging generic and personalized federated learning for image classification".

The model is a body z = r_θ(x) (the ``body`` group) and a *generic* head g(z; ψ) (the classifier, the ``head``
group); each client also keeps a *personal* head p(z; φ_i), a linear layer of the classifier's shape. Round t: the
server sends (θ^t, ψ^t); a sampled client i takes τ steps on fresh minibatches D, each with two gradients at the same
point,

    (θ, ψ) ← (θ, ψ) − β ∇ L^BSM_i(θ, ψ; D),   L^BSM_i = −log [ n_{i,y}^γ e^{g_y(z)} / Σ_c n_{i,c}^γ e^{g_c(z)} ]
    φ_i    ← φ_i − β_p ∇_φ CE( sg[g(z; ψ)] + p(sg[z]; φ_i), y; D)

(n_{i,c}: client i's training samples of class c; sg: stop-gradient), keeps φ_i and sends (θ, ψ). The server averages
(θ^{t+1}, ψ^{t+1}) = Σ_{i∈S} p_i (θ_i, ψ_i) (p_i ∝ n_i, or uniform). The generic model (θ^t, ψ^t) is the global
model; client i is scored with the personalized predictor x ↦ g(z; ψ^t) + p(z; φ_i), z = r_{θ^t}(x). Floats: the
whole model, P each way per sampled client; φ_i never travels.

The generic objective is the balanced risk with the balanced softmax (BSM) loss of Ren et al. (2020), robust to
each client's class imbalance: γ (``bsm_gamma``) = 1 is the BSM, γ = 0 plain cross-entropy, with which the generic
model is FedAvg's (the declared reduction). The personal head is the paper's "Fed-RoD (linear)" adaptive module,
learned by the client's empirical risk on top of the generic predictor (its logits added to the generic ones),
updating neither the body nor the generic head. (No equation numbers: the paper's full text was not available when
this module was written; the rules are its method as its abstract and the implementations below describe it.)

Provenance: the authors released no code (github ``hongyouc/Fed-RoD`` holds only a README). Where the paper leaves
details open this follows the common reading of it, checked against PFLlib (``system/flcore/clients/clientrod.py``,
``clientROD.train``): the two updates on the same minibatch from the same point, the personal head on detached
features with the detached generic logits added, one learning rate (here ``head_lr``, null = β), the personal head
initialized as the generic one (the seeded initial classifier). Reads: β (``local_lr``), τ, r; own settings
``head_lr``, ``bsm_gamma``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, loss_value, register
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.stacked import PAD
from fedsweep.models import FlatModel
from fedsweep.schema import aliases

PROVENANCE = ("FedRoD: the authors released no code; the personal head's update (detached features, detached generic logits "
              "added, same minibatch and point as the generic step, initialized as the generic head) follows the paper's "
              "description as PFLlib's clientrod.py reads it")


class FedRoDParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"),
                            description="β: local learning rate of the body and generic head.")
    head_lr: float | None = Field(None, gt=0, description="Step size of the personal head; null = local_lr (β).")
    bsm_gamma: float = Field(1.0, ge=0, description="γ: exponent of the class counts in the balanced softmax, "
                             "logits + γ log n_c (1 = BSM, the paper's; 0 = cross-entropy, FedAvg's generic model).")


def _per_row(fn, *args):
    """``fn`` on one client's tensors, or on each row of stacked clients' (:mod:`.stacked`)."""
    return fn(*args) if args[0].ndim == 1 else torch.func.vmap(fn)(*args)


def head_logits(model: FlatModel, head: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The classifier with parameters ``head`` (its ``head`` group: weight, then bias) applied to features ``z``."""
    weight, bias = model.layout.groups["head"]
    n, k = model.layout.size("head") - model.num_classes, model.num_classes
    assert weight.endswith("weight") and bias.endswith("bias")
    return _per_row(lambda h, zz: F.linear(zz, h[:n].view(k, n // k), h[n:]), head, z)


def mean_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy per client (stacked rows: over each row's labels, padding ignored)."""
    if y.ndim == 1:
        return F.cross_entropy(logits, y)
    per = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="none").view(y.shape)
    return per.sum(-1) / (y != PAD).sum(-1).clamp(min=1)


def log_prior(y: torch.Tensor, num_classes: int, gamma: float) -> torch.Tensor:
    """γ log n_c from the labels ``y`` (a client's, or stacked clients' rows): −inf for a class absent (γ > 0)."""
    counts = (F.one_hot(y.clamp(min=0), num_classes) * (y != PAD).unsqueeze(-1)).sum(-2).to(torch.get_default_dtype())
    return counts.pow(gamma).log()


@register("fedrod")
class FedRoD(FedAvg):
    Params = FedRoDParams
    hp: FedRoDParams
    fedavg_reduction: ClassVar[dict] = {"bsm_gamma": 0.0}
    provenance = PROVENANCE

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"personal_head": self.model.layout.select(initial_params, "head").clone()}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, model = self.hp, ctx.model
        layout = model.layout
        prior = log_prior(ctx.train_data()[1], model.num_classes, hp.bsm_gamma)
        w, ph = payload["params"], state["personal_head"]
        total = 0.0
        for _ in range(hp.local_steps):
            x, y = ctx.batch(hp.batch_size)
            w, ph = w.detach().requires_grad_(True), ph.detach().requires_grad_(True)
            z = _per_row(model.features, w, x)
            generic = head_logits(model, layout.select(w, "head"), z)
            bsm = mean_ce(generic + prior.unsqueeze(-2), y)  # (θ, ψ) only
            personal = mean_ce(generic.detach() + head_logits(model, ph, z.detach()), y)  # φ only
            gw, gp = torch.autograd.grad((bsm + personal).sum(), (w, ph))
            w, ph = w.detach() - hp.local_lr * gw, ph.detach() - (hp.head_lr or hp.local_lr) * gp
            total += loss_value(bsm)
        return {"params": w}, {"personal_head": ph}, {"local_train_loss": total / hp.local_steps}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """(θ^t, ψ^t, φ_i) as one vector; :meth:`predictor` reads it."""
        return torch.cat([payload["params"], state["personal_head"]])

    def predictor(self, ctx: ClientContext, personalized: torch.Tensor):
        model = ctx.model
        w, ph = personalized[: model.numel], personalized[model.numel :]

        def scores(x: torch.Tensor) -> torch.Tensor:
            z = model.features(w, x)
            return head_logits(model, model.layout.select(w, "head"), z) + head_logits(model, ph, z)

        return scores
