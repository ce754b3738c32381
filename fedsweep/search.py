"""Search spaces beyond grids: a field's value in a sweep file may be a distribution,

    local_lr: {loguniform: [1e-4, 1e-1]}      log-uniform on [a, b], 0 < a < b
    coupling: {uniform: [0, 1]}               uniform on [a, b], a < b
    local_steps: {randint: [5, 20]}           an integer in [a, b], both ends included
    transform: {choice: [maml, proto]}        one of the listed values (each may be a mapping)

drawn ``sweep.num_samples`` times for each grid point by a random search (``sweep.search: random``). The
draws are made here, when the file is read, from ``sweep.search_seed`` and the grid point's position:
the same file gives the same sampled settings, every one of them is validated before anything starts,
and each is then crossed with ``sweep.seeds`` like a grid point. A drawn number is rounded to 4
significant digits, so that the value trained with is the one in the trial's name and MLflow params.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsweep.dotted import flatten

#: The distributions a field may be drawn from, and what each takes.
DISTRIBUTIONS = {
    "loguniform": "[low, high] with 0 < low < high",
    "uniform": "[low, high] with low < high",
    "randint": "[low, high], integers with low < high (both included)",
    "choice": "a non-empty list of values",
}


def is_distribution(node: Any) -> bool:
    return isinstance(node, dict) and len(node) == 1 and next(iter(node)) in DISTRIBUTIONS


def distribution_problem(node: dict) -> str | None:
    """Why ``node`` is not a usable distribution; None when it is."""
    (kind, args), = node.items()
    allowed = f"{kind} takes {DISTRIBUTIONS[kind]}"
    if kind == "choice":
        return None if isinstance(args, list) and args else f"{allowed}, got {args!r}"
    if not (isinstance(args, list) and len(args) == 2 and all(_is_number(a) for a in args)):
        return f"{allowed}, got {args!r}"
    low, high = args
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        return f"{allowed}, got {args!r}"
    if not low < high:
        return f"{allowed}, got low={low} >= high={high}"
    if kind == "loguniform" and low <= 0:
        return f"{allowed}, got low={low}"
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def distributions(node: Any, path: tuple = ()) -> list[tuple[tuple, dict]]:
    """Every distribution in ``node`` (a grid point's value), with its key path."""
    if is_distribution(node):
        return [(path, node)]
    if isinstance(node, dict):
        return [d for k, v in node.items() for d in distributions(v, path + (k,))]
    return []


def draw(node: Any, rng: np.random.Generator, path: tuple = ()) -> tuple[Any, dict[str, Any]]:
    """``node`` with every distribution replaced by one draw, and the drawn values by dotted path (a
    choice of a mapping gives each of its leaves)."""
    if is_distribution(node):
        (kind, args), = node.items()
        if kind == "choice":
            value, inner = draw(args[int(rng.integers(len(args)))], rng, path)
            if isinstance(value, dict):
                return value, {**flatten(value, ".".join(path) + "."), **inner}
        elif kind == "randint":
            value = int(rng.integers(args[0], args[1] + 1))
        elif kind == "uniform":
            value = _rounded(rng.uniform(args[0], args[1]))
        else:
            value = _rounded(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
        return value, {".".join(path): value}
    if isinstance(node, dict):
        out, drawn = {}, {}
        for k, v in node.items():
            out[k], d = draw(v, rng, path + (k,))
            drawn.update(d)
        return out, drawn
    return node, {}


def _rounded(value: float, digits: int = 4) -> float:
    return float(f"{value:.{digits - 1}e}")


# --------------------------------------------------------------------------- Optuna (sweep.search: optuna)
# Each grid point is searched by its own Optuna study (fedsweep.optuna_search): a Tune trial is one drawn
# setting, run on every seed of sweep.seeds in turn; the study is told the mean over the seeds.


def optuna_space(value: Any) -> dict[str, Any]:
    """Optuna's distributions for the distributions of a grid point's value, keyed d0, d1, ... in file order
    (a choice is drawn as the index of its value)."""
    import optuna.distributions as od

    space = {}
    for i, (_, node) in enumerate(distributions(value)):
        (kind, args), = node.items()
        if kind == "choice":
            space[f"d{i}"] = od.CategoricalDistribution(list(range(len(args))))
        elif kind == "randint":
            space[f"d{i}"] = od.IntDistribution(args[0], args[1])
        else:
            space[f"d{i}"] = od.FloatDistribution(float(args[0]), float(args[1]), log=kind == "loguniform")
    return space


def substitute(value: Any, drawn: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``value`` with its i-th distribution replaced by ``drawn["d<i>"]`` (rounded as :func:`draw` rounds),
    and the values put in by dotted path."""
    import copy

    out = copy.deepcopy(value)
    picked: dict[str, Any] = {}
    for i, (path, node) in enumerate(distributions(value)):
        (kind, args), = node.items()
        v = drawn[f"d{i}"]
        v = args[int(v)] if kind == "choice" else int(v) if kind == "randint" else _rounded(float(v))
        parent = out
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = v
        picked.update(flatten(v, ".".join(path) + ".") if isinstance(v, dict) else {".".join(path): v})
    return out, picked


def corners(value: Any) -> list[Any]:
    """Values of a grid point that an Optuna search may produce at the edges of its distributions: every
    distribution at its low end, at its high end, and each value of each choice; validating these before
    the search starts finds a bound no drawn setting could satisfy."""
    found = distributions(value)
    if not found:
        return [value]
    lows, highs = {}, {}
    for i, (_, node) in enumerate(found):
        (kind, args), = node.items()
        # in substitute's terms: a choice is drawn as the index of its value
        lows[f"d{i}"], highs[f"d{i}"] = (0, len(args) - 1) if kind == "choice" else (args[0], args[1])
    choices = [{**lows, f"d{i}": j} for i, (_, node) in enumerate(found) if "choice" in node for j in range(len(node["choice"]))]
    # a chosen mapping may hold distributions of its own (a random search draws inside a choice): their edges too
    return [edge for d in [lows, highs, *choices] for edge in corners(substitute(value, d)[0])]
