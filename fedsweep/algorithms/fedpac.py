"""FedPAC (Xu, Tong, Huang, ICLR 2023, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration"), Algorithm 1.

Why FedPAC rather than GPFL (Zhang et al., ICCV 2023): FedPAC works on the model as it is, split into a shared
feature extractor (``body``) and a personal linear classifier (``head``), with class prototypes (shared with
:mod:`.fedproto`) and per-client payloads; GPFL adds modules that are not in the model (a conditional valve and a
global category embedding, trained and aggregated beside it), which our fixed architectures cannot hold faithfully.

Round t. The server sends sampled client i the global extractor φ, the global class centroids c_j (with counts)
and its own classifier h_i. The client, with r_φ(x) its representation and π_{i,k} = n_{i,k}/n_i its label shares:

1. from (φ, h_i), before training, computes its statistics for classifier collaboration: μ_{i,k} the mean of r_φ
   over class k, H_i = (π_{i,k} μ_{i,k})_k ∈ R^{C×d} and the variance term
   V_i = (Σ_k π_{i,k} E_k‖r_φ(x)‖² − π_{i,k}² ‖μ_{i,k}‖²) / n_i;
2. trains the classifier alone, ``head_steps`` SGD steps of size ``head_lr`` on CE (the extractor frozen);
3. trains the extractor alone, τ steps of size β on CE + λ · (1/(|D| d)) Σ_{(x,y)∈D} ‖r_φ(x) − c_y‖² (feature
   alignment; c_y the global centroid, or the client's own pre-training centroid of a class without a global one;
   no alignment before the first aggregation);
4. sends φ_i, h_i, its class centroids from the trained extractor with their counts, V_i and H_i.

The server averages the extractors, φ ← Σ_i p_i φ_i (p_i ∝ n_i or uniform), the centroids per class weighted by
counts, and for each sampled client i solves the classifier-collaboration problem over the round's clients
(the bias-variance estimate of the combined classifier's error)

    α_i = argmin_{α ∈ Δ} αᵀ (diag(V) + G_i) α,   (G_i)_{jl} = Σ_k ⟨H_{i,k} − H_{j,k}, H_{i,k} − H_{l,k}⟩,

zeroes the weights below 10⁻³, renormalizes, and sets client i's classifier to h_i ← Σ_j α_ij h_j, which it keeps
(on the server) and sends at i's next round. A client is scored with (φ, h_i). Floats per sampled client: down
P + C·d + C (model, centroids, counts), up P + 2·C·d + C + 1 (model, centroids, counts, H_i, V_i). Nothing stays on
the client between rounds but its data (its classifier is kept, and combined, by the server); no global model.

From the authors' code (github JianXu95/FedPAC, ``methods/fedpac.py``, ``LocalUpdate_FedPAC.local_training`` and
``statistics_extraction``; ``tools.py``, ``get_head_agg_weight``, ``protos_aggregation``, ``agg_classifier_weighted_p``):
the variance term's exact form and its division by n_i, the pairwise matrix with its diagonal, the 10⁻³ cut-off,
one epoch of classifier training at lr 0.1 (``head_steps: null`` = ⌈n_i/B⌉ steps, one epoch's worth) before the
extractor's, the ``nn.MSELoss`` normalisation of the alignment term and its fallback to the pre-training local
centroids. Differences: plain SGD (the code: momentum 0.5, weight decay 5·10⁻⁴); the quadratic program is solved by
SciPy's SLSQP in float64 (the code: cvxpy, after dropping eigenvalues below 0.01 when the matrix is not numerically
PSD; ours is PSD by construction); the centroids of a round are rebuilt from its uploads.

Reads: β (``local_lr``, the extractor's step), λ (``coupling``), τ, r; its own ``head_lr``, ``head_steps``,
``collaboration`` (false: each client keeps its own trained classifier, the code's ``agg_g = 0``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from pydantic import Field

from fedsweep.algorithms.base import (
    AggregationMixin,
    Algorithm,
    ClientContext,
    ClientMessage,
    State,
    register,
    sgd,
    weighted_average,
)
from fedsweep.algorithms.fedproto import (
    aggregate_prototypes,
    alignment,
    class_prototypes,
    features_of,
    head_shape,
    regularized_gradient,
)
from fedsweep.schema import aliases

#: Collaboration weights below this are set to zero (the authors' ``eps``).
CUTOFF = 1e-3


class FedPACParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: step of the feature extractor.")
    head_lr: float = Field(0.1, gt=0, description="Step of the classifier's own training (the code's lr_g = 0.1).")
    head_steps: int | None = Field(None, ge=0, description="Classifier steps before the extractor's; null = ⌈n_i/B⌉ (one epoch).")
    coupling: float = Field(1.0, ge=0, validation_alias=aliases("coupling", "lambda", "λ", "lam"),
                            description="λ: weight of the feature alignment to the global class centroids.")
    collaboration: bool = Field(True, description="Combine the classifiers by the server's quadratic program (false: keep one's own).")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "FedPAC splits a feature extractor from the classifier: use a model with a hidden layer (mlp or cnn), not mlr"
        return None


def feature_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(V_i, H_i): the variance term and the label-share-weighted class means of a client's representations."""
    means, counts = class_prototypes(features, labels, num_classes)
    n = float(labels.shape[0])
    share = counts / n
    mean_sq = features.new_zeros(num_classes).index_add(0, labels, features.pow(2).sum(1)) / counts.clamp(min=1)
    v = (share * mean_sq - share.pow(2) * means.pow(2).sum(1)).sum() / n
    return v.reshape(1), share.unsqueeze(1) * means


def simplex_qp(p: np.ndarray) -> np.ndarray:
    """argmin_{α ≥ 0, Σα = 1} αᵀPα for a PSD matrix P (float64, SLSQP from the uniform point)."""
    m = p.shape[0]
    scale = float(np.abs(p).max())
    if m == 1 or scale == 0:
        return np.full(m, 1.0 / m)
    q = p / scale
    from scipy.optimize import minimize  # here: scipy.optimize adds 0.4 s to every process that imports the algorithms

    res = minimize(lambda a: a @ q @ a, np.full(m, 1.0 / m), jac=lambda a: 2 * q @ a, method="SLSQP",
                   bounds=[(0.0, 1.0)] * m, constraints=[{"type": "eq", "fun": lambda a: a.sum() - 1.0, "jac": lambda a: np.ones(m)}],
                   options={"ftol": 1e-12, "maxiter": 1000})
    return np.clip(res.x, 0.0, None)


def collaboration_weights(variances: torch.Tensor, means: torch.Tensor, i: int) -> torch.Tensor:
    """α_i over the round's clients: the simplex QP with diag(V) + G_i, cut below 10⁻³ and renormalized."""
    g = (means[i] - means).double().flatten(1)
    alpha = simplex_qp((torch.diag(variances.double()) + g @ g.T).numpy())
    alpha = np.where(alpha > CUTOFF, alpha, 0.0)
    return torch.from_numpy(alpha / alpha.sum()).to(means.dtype)


@register("fedpac")
class FedPAC(Algorithm):
    Params = FedPACParams
    hp: FedPACParams

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        c, d = head_shape(self.model)
        head = self.model.layout.select(global_params, "head")
        return {"heads": head.expand(num_clients, -1).clone(), "protos": global_params.new_zeros(c, d),
                "proto_counts": global_params.new_zeros(c)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"body": self.model.layout.select(global_params, "body"), "protos": server_state["protos"],
                "proto_counts": server_state["proto_counts"]}

    def client_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        return {"head": server_state["heads"][client_id]}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, layout, c = self.hp, ctx.model.layout, ctx.model.num_classes
        w = layout.join({"body": payload["body"], "head": payload["head"]})
        x, y = ctx.train_data()
        before = features_of(ctx.model, w, x)
        own, own_counts = class_prototypes(before, y, c)
        variance, means = feature_statistics(before, y, c)
        known = payload["proto_counts"] > 0
        reg = None
        if hp.coupling > 0 and bool(known.any()):
            targets = torch.where(known.unsqueeze(1), payload["protos"], own)
            reg = lambda feats, labels: hp.coupling * alignment(feats, labels, targets, known | (own_counts > 0))
        head_mask = layout.join({"body": torch.zeros_like(payload["body"]), "head": torch.ones_like(payload["head"])})

        def only(mask: torch.Tensor, reg_fn):
            def step(v: torch.Tensor) -> tuple[torch.Tensor, float]:
                g, value = regularized_gradient(ctx, v, hp.batch_size, reg_fn)
                return g * mask, value
            return step

        steps = hp.head_steps
        if steps is None:  # one epoch's worth of batches
            steps = 1 if hp.batch_size is None else math.ceil(int(y.shape[0]) / hp.batch_size)
        w, _ = sgd(ctx, w, hp.head_lr, steps, hp.batch_size, gradient=only(head_mask, None))
        w, loss = sgd(ctx, w, hp.local_lr, hp.local_steps, hp.batch_size, gradient=only(1 - head_mask, reg))
        protos, counts = class_prototypes(features_of(ctx.model, w, x), y, c)
        message = {"body": layout.select(w, "body").clone(), "head": layout.select(w, "head").clone(),
                   "protos": protos, "proto_counts": counts, "variance": variance, "class_means": means}
        return message, state, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        layout = self.model.layout
        body = weighted_average([m.payload["body"] for m in messages], self.aggregation_weights(messages))
        protos, counts = aggregate_prototypes([m.payload["protos"] for m in messages], [m.payload["proto_counts"] for m in messages])
        heads = server_state["heads"].clone()
        uploaded = torch.stack([m.payload["head"] for m in messages])
        variances = torch.cat([m.payload["variance"] for m in messages])
        means = torch.stack([m.payload["class_means"] for m in messages])
        for i, m in enumerate(messages):
            heads[m.client_id] = collaboration_weights(variances, means, i) @ uploaded if self.hp.collaboration else uploaded[i]
        return layout.merge(global_params, "body", body), {"heads": heads, "protos": protos, "proto_counts": counts}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return None  # a shared extractor, but no shared classifier

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return ctx.model.layout.join({"body": payload["body"], "head": payload["head"]})
