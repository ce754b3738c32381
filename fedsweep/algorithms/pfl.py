"""What the PFL algorithms (Acar et al., 2021) share: the choice of transform and its step size η (α)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsweep.algorithms.base import HyperParameters
from fedsweep.schema import aliases


class TransformMixin(HyperParameters):
    transform: Literal["maml", "proto"] = Field("maml", description="Personalization transform T_i: MAML step or class prototypes.")
    personalization_lr: float = Field(
        0.01,
        ge=0,
        validation_alias=aliases("personalization_lr", "alpha", "α", "eta", "η"),
        description="α (the paper's η): step size of the MAML transform; unused by Proto.",
    )

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
