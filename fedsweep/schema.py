"""The base of every config object: strict (unknown keys are errors), immutable, with documented aliases."""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict
from pydantic.fields import FieldInfo


class StrictModel(BaseModel):
    """Read from a file with ``model_validate(..., strict=True)``: no bool or string where a number belongs,
    no number where a bool or string belongs; and never an infinite or NaN float."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def aliases(name: str, *others: str) -> AliasChoices:
    """Accept a field under its descriptive name or any of ``others`` (e.g. the paper's Greek letter)."""
    return AliasChoices(name, *others)


def names_of(name: str, info: FieldInfo) -> list[str]:
    """A field's name followed by its aliases."""
    return [name] + [a for a in getattr(info.validation_alias, "choices", ()) if a != name]


class FieldError(ValueError):
    """A rule across fields broken, raised by a model's validator with the field at fault (relative to that
    model, e.g. ``partition.classes_per_client``): the message then names it by its dotted path from the top
    of the file, as every other message does (:func:`fedsweep.loading._format_errors`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message

    def __reduce__(self):  # pickled across processes (a Ray actor's error) with both its parts
        return FieldError, (self.field, self.message)
