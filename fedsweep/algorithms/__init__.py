"""Registry of algorithms: one module each, all on the interface in :mod:`fedsweep.algorithms.base`.

Every module of this package is imported here; a module adds its algorithm with ``@register("name")``, so a
new method is one new file: the config, ``fedsweep algorithms`` and the conformance suite
(``tests/test_conformance.py``) find it in :data:`ALGORITHMS`.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Literal, get_args, get_origin

from fedsweep.algorithms.base import REGISTRY, Algorithm, HyperParameters
from fedsweep.models import FlatModel
from fedsweep.schema import names_of

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: name → algorithm class, in name order.
ALGORITHMS: dict[str, type[Algorithm]] = dict(sorted(REGISTRY.items()))


def build_algorithm(params: HyperParameters, model: FlatModel | None = None) -> Algorithm:
    return ALGORITHMS[params.name](params, model)


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def describe_algorithms() -> list[dict]:
    """Every algorithm with its hyperparameters: name, Greek alias, default, constraints, meaning."""
    rows = []
    for name, cls in ALGORITHMS.items():
        for field_name, info in cls.Params.model_fields.items():
            if field_name == "name":
                continue
            aliases = names_of(field_name, info)[1:]
            bounds = [f"{sym} {getattr(m, attr)}" for m in info.metadata for attr, sym in _BOUNDS if hasattr(m, attr)]
            if get_origin(info.annotation) is Literal:
                bounds.append("one of " + ", ".join(map(str, get_args(info.annotation))))
            rows.append(
                {
                    "algorithm": name,
                    "provenance": cls.provenance or "",
                    "parameter": field_name,
                    "aliases": ", ".join(aliases),
                    "default": info.default,
                    "constraints": ", ".join(bounds),
                    "description": info.description or "",
                }
            )
    return rows


__all__ = ["ALGORITHMS", "Algorithm", "HyperParameters", "build_algorithm", "describe_algorithms"]
