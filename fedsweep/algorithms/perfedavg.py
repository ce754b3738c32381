"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, 2020): Algorithm 1, with the FO and HF variants of App. G/H.

Each local step t = 1..τ of a sampled client draws three independent batches D, D′, D″ and sets

    w̃ = w − α ∇f_i(w; D)
    g = ∇f_i(w̃; D′)
    exact: w ← w − β (I − α ∇²f_i(w; D″)) g        (Hessian-vector product by double backward)
    fo:    w ← w − β g
    hf:    w ← w − β (g − α d),  d = [∇f_i(w + δg; D″) − ∇f_i(w − δg; D″)] / (2δ)

The HF difference is divided by 2δ as seed 002 writes it (App. G, (117) and (119)): the central difference,
d → ∇²f_i(w; D″) g as δ → 0. Seed 000's Sec. 5 prints /δ, which is twice that; ``hf_denominator: delta``
runs it as printed, for the Table 1 ablation only.

``outer_step_from: adapted`` is not Per-FedAvg's step either: it is the FO step of the code published with
pFedMe until its fix of 2021-03-20 (CharlieDinh/pFedMe, ``UserPerAvg.train``, commit ``71ae947``, "fixed: the
second update in Per-FedAvg(FO)", which restores the parameters of before the first update): the β step is
taken from the point the α step reached,

    w ← w̃ − β ∇f_i(w̃; D′),

for checking the pFedMe paper's Per-FedAvg rows (trained with that code) only.

Server: the FedAvg average. Evaluation (``evaluation: train``, the default): ``personalization_steps``
steps of size α on the client's training data (default one). With α = 0 all three variants are SGD on
D′, i.e. FedAvg.

``evaluation: adapt_on_test_batch`` is not Per-FedAvg's evaluation: it is what the code published with
pFedMe (CharlieDinh/pFedMe, ``UserPerAvg.train_one_step`` as of June 2020, the code behind pFedMe's
Table 1) did before scoring Per-FedAvg. From the global w, with a minibatch T of the client's *test* data
and a minibatch D of its training data (both of size |D|),

    w' = w − α ∇f_i(w; T),    w'' = w' − β ∇f_i(w'; D),    score w'' on the client's test data.

It LEAKS TEST DATA into the score, and exists only to check that code's published figures; runs with it
carry the MLflow tag ``fedsweep.evaluation`` and their own, marked table row.

``evaluation: test_data_step`` is the paper's own words for Table 1 (Sec. 5): "one step of local stochastic
gradient descent is performed during test time" — with respect to the test data, as its FedAvg + update is.
One step of α on a minibatch T of the client's test data, w' = w − α ∇f_i(w; T), scored on that test data.
It LEAKS TEST DATA too, is never the default, and is marked the same way.
Reads: α, β, τ, r, and D, D′, D″, δ.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from fedsweep.algorithms.base import Batch, ClientContext, LossFn, State, grad, hessian_vector, register
from fedsweep.algorithms.fedavg import FedAvg, PersonalizationMixin, test_data_step
from fedsweep.schema import FieldError, aliases

Variant = Literal["fo", "hf", "exact"]


class PerFedAvgParams(PersonalizationMixin):
    variant: Variant = Field("hf", description="fo: first order; hf: Hessian-free (finite differences); exact: Hessian-vector product.")
    personalization_lr: float = Field(
        0.01, ge=0, validation_alias=aliases("personalization_lr", "alpha", "α"), description="α: inner (MAML) step, also used at evaluation."
    )
    local_lr: float = Field(0.001, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: outer (meta) step.")
    outer_batch_size: int | None = Field(None, ge=1, description="|D′|; null = batch_size.")
    hessian_batch_size: int | None = Field(None, ge=1, description="|D″| (hf and exact); null = batch_size.")
    hf_delta: float = Field(1e-3, gt=0, validation_alias=aliases("hf_delta", "delta", "δ"), description="δ of the HF finite difference.")
    hf_denominator: Literal["two_delta", "delta"] = Field(
        "two_delta",
        description="HF only. two_delta: the central difference / 2δ (seed 002, App. G (117), (119)), a Hessian-vector "
        "product as δ → 0; delta: / δ as printed in seed 000 Sec. 5 (twice it), for the Table 1 ablation only.",
    )
    evaluation: Literal["train", "adapt_on_test_batch", "test_data_step"] = Field(
        "train",
        description="train: personalization_steps steps of α on the client's training data (the paper's). "
        "adapt_on_test_batch: LEAKS TEST DATA — one step of α on a minibatch of the client's test data, then one of "
        "β on a training minibatch, as pFedMe's published code scored Per-FedAvg; for checking that code's figures only. "
        "test_data_step: LEAKS TEST DATA — one step of α on a minibatch of the client's test data (the paper's Sec. 5 "
        "wording); for checking its Table 1 only.",
    )

    outer_step_from: Literal["start", "adapted"] = Field(
        "start",
        description="start: the β step from the local step's starting w (the paper's Algorithm 1). adapted: from "
        "w̃ = w − α∇f(w; D), w ← w̃ − β∇f(w̃; D′), as pFedMe's published Per-FedAvg (FO) code trained until its fix "
        "(commit 71ae947); fo only, for checking that code's figures.",
    )

    @model_validator(mode="after")
    def _outer_step(self):
        if self.outer_step_from == "adapted" and self.variant != "fo":
            raise FieldError("outer_step_from", f"'adapted' is pFedMe's code's first-order step, but variant is "
                                                f"{self.variant!r}; allowed: start, or variant: fo")
        if self.hf_denominator != "two_delta" and self.variant != "hf":
            raise FieldError("hf_denominator", f"{self.hf_denominator!r} divides the HF finite difference, but variant "
                                               f"is {self.variant!r}; allowed: two_delta, or variant: hf")
        return self

    @property
    def leaks_test_data(self) -> bool:
        return self.evaluation != "train"


def meta_step(
    loss: LossFn, w: torch.Tensor, batches: tuple[Batch, Batch, Batch | None], alpha: float, beta: float, variant: Variant, delta: float,
    from_adapted: bool = False, divisor: float = 2.0,
) -> tuple[torch.Tensor, float]:
    """One Per-FedAvg local step on (D, D′, D″); returns the new w and f(w̃; D′). FO needs no D″.
    ``from_adapted``: the β step from w̃ (pFedMe's code before ``71ae947``; FO). ``divisor``: the HF difference
    is divided by ``divisor``·δ (2: seed 002's central difference; 1: seed 000 as printed)."""
    d_inner, d_outer, d_hess = batches
    g_inner, _ = grad(loss, w, d_inner)
    w_tilde = w - alpha * g_inner
    g, value = grad(loss, w_tilde, d_outer)
    if from_adapted:
        return w_tilde - beta * g, value
    if variant == "fo" or alpha == 0:
        correction = torch.zeros_like(g)
    elif variant == "exact":
        correction = hessian_vector(loss, w, d_hess, g)
    else:
        plus, _ = grad(loss, w + delta * g, d_hess)
        minus, _ = grad(loss, w - delta * g, d_hess)
        correction = (plus - minus) / (divisor * delta)
    return w - beta * (g - alpha * correction), value


@register("perfedavg")
class PerFedAvg(FedAvg):
    Params = PerFedAvgParams
    hp: PerFedAvgParams

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        outer = hp.outer_batch_size or hp.batch_size
        hess = hp.hessian_batch_size or hp.batch_size
        w, total = payload["params"].clone(), 0.0
        for _ in range(hp.local_steps):
            batches = (ctx.batch(hp.batch_size), ctx.batch(outer), ctx.batch(hess) if hp.variant != "fo" else None)
            w, value = meta_step(ctx.loss, w, batches, hp.personalization_lr, hp.local_lr, hp.variant, hp.hf_delta,
                                 hp.outer_step_from == "adapted", 2.0 if hp.hf_denominator == "two_delta" else 1.0)
            total += value
        return {"params": w}, state, {"local_train_loss": total / hp.local_steps}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        hp = self.hp
        if hp.evaluation == "train":
            return super().personalize(ctx, payload, state)
        if hp.evaluation == "test_data_step":
            return test_data_step(ctx, payload["params"], hp.personalization_lr, hp.batch_size)
        w = payload["params"]
        g, _ = grad(ctx.loss, w, ctx.test_batch(hp.batch_size))
        w = w - hp.personalization_lr * g
        g, _ = grad(ctx.loss, w, ctx.batch(hp.batch_size))
        return w - hp.local_lr * g
