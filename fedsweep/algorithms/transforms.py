"""The personalization transforms T_i of PFL (Acar et al., 2021, Sec. 3): identity, MAML and Proto.

A transform enters local training through the gradient of f_i(T_i(w; D); D′) used at each step, and
evaluation through the personalized predictor:

- identity: T(w) = w (FedDyn, SCAFFOLD, FedAvg).
- MAML: T(w; D) = w − η ∇f_i(w; D). The step uses ∇f_i(w̄; D′) at w̄ = T(w; D) (first order, as in
  the paper's Algorithm 1 line "∇f̃_i(w̄; D′)"), or with ``maml_order: 2`` the gradient of f_i(T(w; D); D′)
  itself, (I − η ∇²f_i(w; D)) ∇f_i(w̄; D′) (a Hessian-vector product: what the authors adapt with the
  Higher library, which differentiates through the inner step); evaluation adapts w with one step of size η
  on the client's whole training set. With ``maml_steps: k`` the transform is k such steps on the support
  batch, T(w; D) = w_k with w_{j+1} = w_j − η ∇f_i(w_j; D), and order 2 differentiates through all of them,
  ∏_{j=0}^{k−1} (I − η ∇²f_i(w_j; D)) ∇f_i(w_k; D′) (the authors' code takes k = 5 for PFLDyn, 1 for PFLScaf);
  evaluation then takes k full-batch steps.
- Proto: the classifier is replaced by class prototypes. With r_w(x) the model's representation (its
  input to the last layer) and c_k the mean of r_w over the samples of class k in D, the score of
  class k is −‖r_w(x) − c_k‖²; the step uses the gradient of the cross-entropy of these scores on D′
  with respect to w (through both r_w(x) and the c_k). Evaluation uses the centroids of the client's
  whole training set: a test point gets the label of its nearest centroid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from fedsweep.algorithms.base import Batch, ClientContext, State, grad, hessian_vector, sgd
from fedsweep.algorithms.stacked import PAD, StackedContext

Transform = Literal["identity", "maml", "proto"]


def proto_scores(ctx: ClientContext, w: torch.Tensor, support: Batch, x: torch.Tensor) -> torch.Tensor:
    """−‖r_w(x) − c_k‖² for every class k; classes absent from ``support`` score −inf."""
    if isinstance(ctx, StackedContext):
        return _stacked_scores(ctx, w, support, x)
    return _nearest_centroid(ctx, w, *_centroids(ctx, w, support), x)


def _centroids(ctx: ClientContext, w: torch.Tensor, support: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_k for every class k, the number of ``support`` samples of each class)."""
    xs, ys = support
    feats = ctx.model.features(w, xs)
    num_classes = ctx.model.num_classes
    counts = torch.bincount(ys, minlength=num_classes).to(feats.dtype)
    sums = torch.zeros(num_classes, feats.shape[1], dtype=feats.dtype, device=feats.device).index_add(0, ys, feats)
    return sums / counts.clamp(min=1).unsqueeze(1), counts


def _nearest_centroid(ctx: ClientContext, w: torch.Tensor, centroids: torch.Tensor, counts: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor:
    scores = -torch.cdist(ctx.model.features(w, x), centroids).pow(2)
    return scores.masked_fill(counts == 0, float("-inf"))


def _stacked_scores(ctx: StackedContext, w: torch.Tensor, support: Batch, x: torch.Tensor) -> torch.Tensor:
    """:func:`proto_scores` of C stacked clients: ``w`` [C, P], padded ``support`` and ``x`` [C, B, …] → [C, B, K].
    Each client's centroids are its own support samples' (padding rows, label PAD, count for none)."""
    xs, ys = support
    feats = torch.func.vmap(ctx.model.features)(w, xs)
    member = F.one_hot(ys.clamp(min=0), ctx.model.num_classes).to(feats.dtype) * (ys != PAD).unsqueeze(-1)
    counts = member.sum(1)
    centroids = member.transpose(1, 2) @ feats / counts.clamp(min=1).unsqueeze(-1)
    scores = -torch.cdist(torch.func.vmap(ctx.model.features)(w, x), centroids).pow(2)
    return scores.masked_fill((counts == 0).unsqueeze(1), float("-inf"))


def proto_loss(ctx: ClientContext, w: torch.Tensor, support: Batch, query: Batch) -> torch.Tensor:
    if isinstance(ctx, StackedContext):
        return _stacked_loss(ctx, w, support, query)
    x, y = query
    scores = proto_scores(ctx, w, support, x)
    # A query label absent from the support set cannot be scored; such samples are left out.
    keep = torch.isfinite(scores.gather(1, y.unsqueeze(1))).squeeze(1)
    if not bool(keep.any()):
        return (w * 0).sum()
    return torch.nn.functional.cross_entropy(scores[keep], y[keep])


def _stacked_loss(ctx: StackedContext, w: torch.Tensor, support: Batch, query: Batch) -> torch.Tensor:
    """:func:`proto_loss` of C stacked clients, (f_c)_c: each client's mean over its own samples that can be scored."""
    x, y = query
    scores = _stacked_scores(ctx, w, support, x)
    scorable = y != PAD
    keep = scorable & torch.isfinite(scores.gather(2, torch.where(scorable, y, 0).unsqueeze(-1)).squeeze(-1))
    target = torch.where(keep, y, scores.argmax(-1))  # a finite class where a sample is left out: no inf, no NaN
    ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none").view(y.shape)
    return torch.where(keep, ce, 0).sum(1) / keep.sum(1).clamp(min=1)


def transformed_gradient(
    ctx: ClientContext, transform: Transform, w: torch.Tensor, lr: float, batch_size: int | None, maml_order: int = 1,
    maml_steps: int = 1,
) -> tuple[torch.Tensor, float]:
    """The data term of one local step: ∇ of f_i(T(w; D); D′) as each transform defines it; (gradient, loss)."""
    if transform == "identity":
        return grad(ctx.loss, w, ctx.batch(batch_size))
    support, query = ctx.batch(batch_size), ctx.batch(batch_size)
    if transform == "maml":
        points = [w]  # w_0 … w_k of the inner steps on the support batch
        for _ in range(maml_steps):
            g_inner, _ = grad(ctx.loss, points[-1], support)
            points.append(points[-1] - lr * g_inner)
        g, value = grad(ctx.loss, points[-1], query)
        if maml_order == 2 and lr > 0:
            for point in reversed(points[:-1]):  # the chain rule back through each step: (I − η∇²f(w_j; D)) g
                g = g - lr * hessian_vector(ctx.loss, point, support, g)
        return g, value
    return grad(lambda v, q: proto_loss(ctx, v, support, q), w, query)


def personalized(ctx: ClientContext, transform: Transform, w: torch.Tensor, lr: float, steps: int = 1) -> torch.Tensor:
    """The personalized parameters scored at evaluation (MAML: ``steps`` full-batch steps of size η)."""
    if transform == "maml" and lr > 0:
        for _ in range(steps):
            g, _ = grad(ctx.loss, w, ctx.train_data())
            w = w - lr * g
    return w


def predictor(ctx: ClientContext, transform: Transform, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    if transform == "proto":
        return _ProtoPredictor(ctx, w)
    return lambda x: ctx.model(w, x)


class _ProtoPredictor:
    """Proto's personalized predictor, :func:`proto_scores` against the centroids of the client's whole training
    set; they are computed at the first call and kept (an evaluation scores its test and validation parts with one
    predictor: the training set's features were computed for each before, the same numbers)."""

    def __init__(self, ctx: ClientContext, w: torch.Tensor):
        self.ctx, self.w = ctx, w
        self.centroids: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.ctx, StackedContext):
            return _stacked_scores(self.ctx, self.w, self.ctx.train_data(), x)
        if self.centroids is None:
            self.centroids = _centroids(self.ctx, self.w, self.ctx.train_data())
        return _nearest_centroid(self.ctx, self.w, *self.centroids, x)


class TransformHooks:
    """Mixin for an :class:`~fedsweep.algorithms.base.Algorithm` that trains and personalizes through T_i.

    Identity here (FedDyn, SCAFFOLD); PFLDyn and PFLScaf read the transform and its η from their
    hyperparameters instead.
    """

    transform: Transform = "identity"
    maml_order = 1
    maml_steps = 1

    def transform_lr(self) -> float:
        return 0.0

    def can_vectorize(self) -> bool:
        """Identity and MAML are elementwise in w; Proto's centroids are computed per client from its own support
        samples in the stacked step too (:func:`_stacked_scores`)."""
        return True

    def local_sgd(
        self, ctx: ClientContext, w0: torch.Tensor, lr: float, steps: int, batch_size: int | None, correction: Callable | None = None
    ) -> tuple[torch.Tensor, float]:
        """τ steps w ← w − lr (∇f_i(T(w; D); D′) + c(w))."""
        step = lambda w: transformed_gradient(ctx, self.transform, w, self.transform_lr(), batch_size, self.maml_order,
                                              self.maml_steps)
        options = {k: getattr(self.hp, k) for k in ("weight_decay", "clip_norm") if hasattr(self.hp, k)}  # LocalSGDOptions
        return sgd(ctx, w0, lr, steps, batch_size, correction, gradient=step, **options)

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return personalized(ctx, self.transform, payload["params"], self.transform_lr(), self.maml_steps)

    def predictor(self, ctx: ClientContext, personalized_params: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        return predictor(ctx, self.transform, personalized_params)
