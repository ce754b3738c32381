"""The layout of a trial whose file gives none: how many processes train its clients, and with which CPUs
(:func:`auto_layout`, measured in docs/performance.md, section 1)."""

from __future__ import annotations

import functools
import math
import os
from typing import Any

from pydantic import TypeAdapter, ValidationError

from fedsweep.algorithms import ALGORITHMS
from fedsweep.checks import local_cpus
from fedsweep.config import AlgorithmParams

#: The resources fields that choose a trial's layout; a file that gives none of them gets :func:`auto_layout`'s.
LAYOUT_FIELDS = ("server_cpus", "client_cpus", "client_gpus", "clients_per_actor", "client_workers")
#: The ServerActor's own share of the first CPU in an automatic layout (its worker trains on the rest).
AUTO_SERVER_CPUS = 0.2


def trial_cpus(resources: Any, concurrent_trials: int) -> int:
    """Whole CPUs one trial may use when ``concurrent_trials`` run at once: the local instance's (``cluster_cpus``,
    else this machine's cores) shared out, at least 1; 1 on a remote cluster, whose size is not known before
    connecting."""
    resources = resources if isinstance(resources, dict) else {}
    cpus = resources.get("cluster_cpus")
    if not isinstance(cpus, int) or isinstance(cpus, bool):
        remote = resources.get("ray_address") or os.environ.get("RAY_ADDRESS")
        cpus = 1 if remote else local_cpus()
    return max(1, cpus // max(1, concurrent_trials))


def auto_layout(raw: dict, cpus: int) -> dict:
    """The layout of a trial whose file gives none of :data:`LAYOUT_FIELDS`, by two rules measured on the peer
    workload and in section 1 of docs/performance.md:

    - an algorithm whose clients train as one stacked computation (``vectorize_clients``; every algorithm but the
      proto transform, whose stacked step has not been timed on the CPU) on an ``mlr`` or ``mlp`` model: a worker pool of one, the ServerActor training each round's
      clients together, on one CPU (``server_cpus`` 0.2 + ``client_cpus`` 0.8). The stack is always the round's
      sampled clients, whatever the machine, so the numbers do not depend on the CPUs found (they equal one by one
      up to floating-point summation order). Measured in docs/performance.md, section 8 (twelfth session).
    - otherwise: a worker pool of one process per CPU the trial may use (``cpus``, at most one per client), the
      ServerActor the first; ``server_cpus`` 0.2 and the rest shared by the workers. Same numbers as one by one.

    Either way no process per client: it cost most of section 1's overhead and a process start each
    (docs/performance.md, sections 1 and 8). A layout of one process (the first rule) is one ``fedsweep run`` runs
    in its own process, without Ray (:func:`fedsweep.experiment.runs_in_process`). Returns ``raw`` with the fields
    filled in, or unchanged when it gives any of them (``vectorize_clients`` given is kept)."""
    resources = raw.get("resources", {})
    if not isinstance(resources, dict) or any(f in resources for f in LAYOUT_FIELDS):
        return raw
    layout = {"server_cpus": AUTO_SERVER_CPUS}
    if _stacks(raw):
        layout.update(client_cpus=round(1 - AUTO_SERVER_CPUS, 3), client_workers=1,
                      vectorize_clients=resources.get("vectorize_clients", True))
    else:
        n = raw.get("data", {}).get("num_clients") if isinstance(raw.get("data"), dict) else None
        workers = min(cpus, n) if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else cpus
        layout.update(client_cpus=math.floor((cpus - AUTO_SERVER_CPUS) / workers * 1000) / 1000, client_workers=workers)
    return {**raw, "resources": {**resources, **layout}}


@functools.cache
def _algorithm_section() -> TypeAdapter:
    """The validator of an ``algorithm`` section, built once per process: its schema, the union of every method's
    parameters, took 3.5 ms to build, more than the rest of a config's checks."""
    return TypeAdapter(AlgorithmParams)


def _stacks(raw: dict) -> bool:
    """Whether the trial's clients can train as one stacked computation on a model it was measured for."""
    model, algorithm = raw.get("model", {}), raw.get("algorithm")
    if (not isinstance(model, dict) or model.get("name", "mlp") not in ("mlr", "mlp") or model.get("norm", "none") != "none"
            or not isinstance(algorithm, dict)):
        return False
    try:
        hp = _algorithm_section().validate_python(algorithm, strict=True)
    except ValidationError:
        return False  # reported by the validation that follows
    algorithm = ALGORITHMS[hp.name](hp)
    # The proto transform stacks (``vectorize_clients: true``; written for the GPU, where stacking paid 3.06× for
    # MAML, docs/performance.md "GPU in process"), but its stacked step has not been timed on these CPU layouts:
    # chosen automatically, it trains one by one, as before.
    return algorithm.can_vectorize() and getattr(algorithm, "transform", None) != "proto"
