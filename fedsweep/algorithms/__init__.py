"""Registry of algorithms: one module each, all on the interface in :mod:`fedsweep.algorithms.base`."""

from __future__ import annotations

from typing import Literal, get_args, get_origin

from fedsweep.algorithms.base import Algorithm, HyperParameters
from fedsweep.algorithms.ditto import Ditto
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.feddeper import FedDeper
from fedsweep.algorithms.feddyn import FedDyn
from fedsweep.algorithms.fedprox import FedProx
from fedsweep.algorithms.pavg import PAvg
from fedsweep.algorithms.perfedavg import PerFedAvg
from fedsweep.algorithms.pfedme import PFedMe
from fedsweep.algorithms.pfldyn import PFLDyn
from fedsweep.algorithms.pflscaf import PFLScaf
from fedsweep.algorithms.scaffold import Scaffold
from fedsweep.schema import names_of

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, PerFedAvg, PFedMe, PFLDyn, PFLScaf, PAvg, FedDeper, FedProx, Scaffold, FedDyn, Ditto)
}


def build_algorithm(params: HyperParameters) -> Algorithm:
    return ALGORITHMS[params.name](params)


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
