"""What the PFL algorithms (Acar et al., 2021) share: the choice of transform, its step size η (α), and the
order and number of the MAML transform's inner steps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedsweep.algorithms.base import LocalSGDOptions
from fedsweep.schema import FieldError, aliases


class TransformMixin(LocalSGDOptions):
    transform: Literal["maml", "proto"] = Field("maml", description="Personalization transform T_i: MAML step or class prototypes.")
    personalization_lr: float = Field(
        0.01,
        ge=0,
        validation_alias=aliases("personalization_lr", "alpha", "α", "eta", "η"),
        description="α (the paper's η): step size of the MAML transform; unused by Proto.",
    )

    maml_order: Literal[1, 2] = Field(
        1,
        description="1: the MAML step's first-order gradient ∇f_i(w̄; D′) at w̄ = T(w; D) (the paper's Algorithm 1); "
        "2: the gradient through the inner step, (I − η∇²f_i(w; D)) ∇f_i(w̄; D′), what the authors' Higher library "
        "differentiates. Only with transform: maml.",
    )

    maml_steps: int = Field(
        1,
        ge=1,
        le=100,
        description="k: inner steps of size α of the MAML transform on the support batch, and full-batch steps at "
        "evaluation (1: the paper's Algorithm 1; the authors' code takes 5 for PFLDyn, 1 for PFLScaf). Only with "
        "transform: maml.",
    )

    @model_validator(mode="after")
    def _order_of_maml(self):
        if self.maml_order == 2 and self.transform != "maml":
            raise FieldError("maml_order", f"2 differentiates through the MAML step, but transform is {self.transform!r}; "
                                           "allowed: 1, or transform: maml")
        if self.maml_steps != 1 and self.transform != "maml":
            raise FieldError("maml_steps", f"{self.maml_steps} steps of the MAML transform, but transform is "
                                           f"{self.transform!r}; allowed: 1, or transform: maml")
        return self

    def model_problem(self, model_name: str) -> str | None:
        if self.transform == "proto" and model_name == "mlr":
            return "the proto transform needs a representation: use a model with a hidden layer (mlp), not mlr"
        return None


class TransformedAlgorithm:
    """Mixin: read the transform and its step from the hyperparameters."""

    @property
    def transform(self):  # type: ignore[override]
        return self.hp.transform

    def transform_lr(self) -> float:
        return self.hp.personalization_lr

    @property
    def maml_order(self) -> int:  # type: ignore[override]
        return self.hp.maml_order

    @property
    def maml_steps(self) -> int:  # type: ignore[override]
        return self.hp.maml_steps
