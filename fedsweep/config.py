"""Typed experiment and sweep configs, validated in one place.

A YAML file is the serialized form of :class:`ExperimentConfig`, plus an
optional ``sweep:`` section (:class:`SweepSettings`). In a sweep file any value
may be replaced by ``{grid: [v1, v2, ...]}``; grids may nest (a grid over
``algorithm`` sections whose own fields are grids). :func:`load_sweep` expands
the grids, crosses them with ``sweep.seeds`` and validates every resulting
trial config before anything starts. Every problem is reported as a
:class:`ConfigError` naming the file, line, field and the allowed values.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

import numpy as np
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from fedsweep import config_file, search
from fedsweep.algorithms import ALGORITHMS
from fedsweep.data import DataConfig, SyntheticConfig, input_features, num_classes
from fedsweep.evaluation import VAL
from fedsweep.models import MLPConfig, ModelConfig, parameter_count
from fedsweep.schema import StrictModel, names_of

_PARAMS = tuple(cls.Params for cls in ALGORITHMS.values())
# A discriminated union needs two members or more; with one, the class itself validates.
AlgorithmParams = Annotated[Union[_PARAMS], Field(discriminator="name")] if len(_PARAMS) > 1 else _PARAMS[0]  # noqa: UP007 (a tuple of classes)
ModelConfigField = Annotated[ModelConfig, Field(discriminator="name")]

#: Metrics a sweep may optimise (all logged at every evaluation round).
METRICS = (
    "personalized_accuracy_mean",
    "personalized_accuracy_weighted",
    "personalized_accuracy_worst",
    "personalized_accuracy_best",
    "personalized_accuracy_p10",
    "personalized_loss_mean",
    "personalized_loss_weighted",
    "global_accuracy",
    "global_loss",
    "train_loss",
)


#: Ray counts resources in units of 0.0001 (``ray._raylet.RESOURCE_UNIT_SCALING``); a smaller fraction is refused.
RESOURCE_UNIT = 1e-4
#: The largest seed every random generator fedsweep seeds accepts (numpy's legacy bound; torch takes 64 bits).
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
#: 'auto', 'local', host:port or ray://host:port.
RAY_ADDRESS_PATTERN = r"^(auto|local|(ray://)?[A-Za-z0-9._\-]+:[0-9]{1,5})$"


class ResourcesConfig(StrictModel):
    """Ray resources of one trial: a placement group of one server bundle and one bundle per client.

    A file that gives none of the layout fields (:data:`LAYOUT_FIELDS`) gets :func:`auto_layout`'s (no process
    per client: a pool of one training the round's clients stacked, or a worker pool of one process per CPU);
    the defaults below apply once any of them is given."""

    server_cpus: float = Field(0.25, gt=0, description="CPUs of the server bundle (trial driver and ServerActor).")
    client_cpus: float = Field(0.1, ge=0, description="CPUs of each ClientActor.")
    client_gpus: float = Field(0.0, ge=0, le=1, description="GPU fraction of each ClientActor (0 = CPU only).")
    clients_per_actor: int = Field(
        1,
        ge=1,
        description="Clients hosted by one ClientActor (their shards, states and models share the process); "
        "1 = one actor per client. Packing trades parallelism for memory and start-up time.",
    )
    client_workers: int = Field(
        0,
        ge=0,
        description="0 = every client lives in its ClientActor (clients_per_actor per actor), its state kept there. "
        "W >= 1 = a pool of W worker processes, the ServerActor and W - 1 ClientActors, each holding every "
        "client's shard: each round's sampled clients are split evenly across them, and the ServerActor keeps "
        "the client states between rounds and sends them with each call. W = 1 trains every client inside the "
        "ServerActor (no per-round call to another actor). The ServerActor's bundle then holds "
        "server_cpus + client_cpus. Same numbers as 0 (clients one by one).",
    )
    pool_channel: Literal["socket", "ray"] = Field(
        "socket",
        description="With a worker pool (client_workers >= 2): how the ServerActor sends a round's part to a "
        "ClientActor and gets its reply. 'socket' = a Unix-domain socket between the two processes when they run "
        "on the same node (Ray calls otherwise); 'ray' = Ray actor calls always (about 1 ms more each way a "
        "round). Same numbers either way.",
    )
    vectorize_clients: bool = Field(
        False,
        description="Train the clients packed in one actor as one batched computation (torch.func.vmap over "
        "their stacked parameters) instead of one after the other; same samples, same numbers up to "
        "floating-point summation order. Not for the proto transform (pavg, pfldyn/pflscaf with transform: proto).",
    )
    placement_strategy: Literal["pack", "spread"] = Field(
        "pack",
        description="How a trial's bundles (server, ClientActors) are placed on a multi-node cluster: 'pack' = on "
        "as few nodes as fit them (actors of one node talk over sockets or shared memory), 'spread' = over as many "
        "nodes as possible (more memory and network bandwidth per actor). Both are Ray's soft strategies: a trial "
        "starts as long as its bundles fit the cluster somehow. Same numbers either way.",
    )
    cluster_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local Ray instance to start (whole CPUs); null = all cores of this machine."
    )
    cluster_gpus: int | None = Field(
        None, ge=0, description="GPUs of the local Ray instance (whole GPUs, at most this machine's); null = detected."
    )
    ray_address: str | None = Field(
        None,
        pattern=RAY_ADDRESS_PATTERN,
        description="Address of a running Ray cluster ('auto', host:port or ray://host:port); null = $RAY_ADDRESS or a local instance.",
    )
    client_max_restarts: int = Field(
        1,
        ge=-1,
        description="Times Ray restarts a ClientActor whose process died (-1 = always). A restarted actor "
        "reloads its clients' shards, and their algorithm states from the last checkpoint (sweep.checkpoint_every; "
        "fresh states before the first). The round it died in aggregates the clients that answered.",
    )
    round_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds a round (and an evaluation) waits for client replies; clients that have not "
        "answered by then are left out of it and counted in clients_dropped. null = wait for every client.",
    )
    actor_memory_mb: float = Field(
        300, gt=0, description="Resident memory one actor process costs (torch loaded); used to check the plan fits."
    )

    @field_validator("server_cpus", "client_cpus", "client_gpus")
    @classmethod
    def _resource_unit(cls, value: float) -> float:
        if 0 < value < RESOURCE_UNIT:
            raise ValueError(f"{value:g} is below Ray's resource unit; allowed: 0 (clients only) or >= {RESOURCE_UNIT:g}")
        return value

    @model_validator(mode="after")
    def _nonempty(self):
        if self.client_cpus == 0 and self.client_gpus == 0:
            raise ValueError("client_cpus and client_gpus are both 0: a client bundle needs some resource")
        if self.client_workers and self.clients_per_actor != 1:
            raise ValueError(
                f"client_workers={self.client_workers} with clients_per_actor={self.clients_per_actor}: every worker "
                "holds every client; allowed: clients_per_actor 1 (the default) with client_workers >= 1, or client_workers 0"
            )
        if self.client_workers and self.client_gpus:
            raise ValueError(
                f"client_workers={self.client_workers} with client_gpus={self.client_gpus:g}: the worker pool runs on "
                "CPUs only; allowed: client_gpus 0 with client_workers >= 1, or client_workers 0"
            )
        return self

    def address(self) -> str | None:
        return self.ray_address or os.environ.get("RAY_ADDRESS") or None

    def num_client_actors(self, num_clients: int) -> int:
        """⌈n / clients_per_actor⌉ ClientActors host the n clients; with a worker pool, client_workers - 1."""
        if self.client_workers:
            return self.client_workers - 1
        return -(-num_clients // self.clients_per_actor)

    def clients_of_actor(self, actor: int, num_clients: int) -> list[int]:
        """Client ids hosted by ClientActor ``actor``: a contiguous block of ``clients_per_actor``; every
        client with a worker pool."""
        if self.client_workers:
            return list(range(num_clients))
        k = self.clients_per_actor
        return list(range(actor * k, min((actor + 1) * k, num_clients)))

    def server_cpus_total(self) -> float:
        """CPUs of the server bundle: server_cpus, plus one worker's client_cpus when the ServerActor trains clients."""
        return self.server_cpus + (self.client_cpus if self.client_workers else 0.0)

    def bundles(self, num_clients: int) -> list[dict[str, float]]:
        """Placement-group bundles of one trial: [server] + [client actor] × :meth:`num_client_actors`."""
        client = {"CPU": self.client_cpus}
        if self.client_gpus:
            client["GPU"] = self.client_gpus
        return [{"CPU": self.server_cpus_total()}] + [dict(client) for _ in range(self.num_client_actors(num_clients))]


class TrackingConfig(StrictModel):
    experiment: str = Field("fedsweep", min_length=1, description="MLflow experiment name.")
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; null = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the working directory."
    )
    log_client_table: bool = True
    log_plot: bool = True


class ExperimentConfig(StrictModel):
    """One experiment: data and split, model, algorithm with its hyperparameters, schedule, resources, tracking."""

    name: str = Field("experiment", min_length=1)
    seed: Seed = Field(0, description="Seed of model init, client sampling and minibatches.")
    data: DataConfig = Field(default_factory=SyntheticConfig)
    model: ModelConfigField = Field(default_factory=MLPConfig)
    algorithm: AlgorithmParams
    rounds: int = Field(50, ge=1)
    eval_every: int = Field(5, ge=1, description="Evaluate all clients every k rounds (and at round 0 and the last round).")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _cross_field(self):
        n = self.data.num_clients
        hp = self.algorithm
        if hp.clients_per_round is not None and hp.participation_rate is not None:
            raise ValueError("algorithm: give participation_rate (r) or clients_per_round, not both")
        problem = hp.model_problem(self.model.name)
        if problem:
            raise ValueError(f"algorithm.name={hp.name} with model.name={self.model.name}: {problem}")
        if self.resources.vectorize_clients and not ALGORITHMS[hp.name](hp).can_vectorize():
            raise ValueError(
                f"resources.vectorize_clients=true: algorithm.name={hp.name} with transform "
                f"{getattr(hp, 'transform', 'proto')!r} trains its clients one by one; allowed: false, or an "
                "algorithm without the proto transform"
            )
        if self.model.name == "cnn":
            parameter_count(self.model, input_features(self.data), num_classes(self.data))  # raises if the inputs are not images it can take
        if self.resources.client_workers > n:
            raise ValueError(
                f"resources.client_workers={self.resources.client_workers} is more workers than clients "
                f"(data.num_clients={n}); allowed: 0..{n}"
            )
        if hp.clients_per_round is not None and hp.clients_per_round > n:
            raise ValueError(
                f"algorithm.clients_per_round={hp.clients_per_round} samples more clients than exist "
                f"(data.num_clients={n}); allowed: 1..{n}"
            )
        return self

    @property
    def num_clients(self) -> int:
        return self.data.num_clients

    def eval_rounds(self) -> set[int]:
        return {0, self.rounds} | set(range(self.eval_every, self.rounds + 1, self.eval_every))

    def setting_key(self) -> str:
        """Identity of a hyperparameter setting: everything that changes the numbers, except the seed."""
        d = self.model_dump(mode="json", exclude={"seed", "name", "resources", "tracking"})
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def flat_params(self) -> dict[str, Any]:
        """All resolved fields as dotted keys, for MLflow params."""
        return flatten(self.model_dump(mode="json"))


class ASHASettings(StrictModel):
    """Ray Tune's asynchronous successive halving: at each rung (grace_rounds × reduction_factor^k rounds) a
    trial whose selection metric is not in the best 1/reduction_factor of those that reached the rung stops."""

    grace_rounds: int = Field(..., ge=1, description="Rounds every trial runs before it can be stopped.")
    reduction_factor: float = Field(3.0, gt=1, description="1/reduction_factor of the trials go on at each rung.")


class SchedulerSettings(StrictModel):
    asha: ASHASettings


class SweepSettings(StrictModel):
    name: str = Field(
        "sweep",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="Tune run name (a folder under storage_path) and MLflow parent run name: letters, digits, "
        "'.', '_' and '-', not starting with '.', '_' or '-', at most 100 characters.",
    )
    metric: Literal[METRICS] = Field("personalized_accuracy_mean", description="Final-round metric the table ranks by.")  # type: ignore[valid-type]
    mode: Literal["max", "min"] = "max"
    max_concurrent_trials: int = Field(1, ge=1)
    seeds: list[Seed] | None = Field(
        None, min_length=1, description="Seeds crossed with the grid, each once; null = the config's seed."
    )
    storage_path: str = Field("ray_results", description="Where Tune keeps trial results (absolute, relative or URI).")
    checkpoint_every: int = Field(
        5,
        ge=0,
        description="Rounds between a trial's checkpoints (global model, server and client states); a "
        "resumed or retried trial restarts after its last one. 0 = no checkpoints (restart from round 0).",
    )
    trial_retries: int = Field(
        1,
        ge=0,
        description="Times Tune reruns a trial that failed (its ServerActor died, a node was lost), from "
        "round 0; the failed attempt's MLflow run is deleted (FailureConfig.max_failures).",
    )
    target_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Personalized accuracy (a fraction, e.g. 0.876) whose first round and model transmissions "
        "the table and the report give for each best setting; null = none.",
    )
    search: Literal["grid", "random", "optuna"] = Field(
        "grid",
        description="'grid': every grid point once per seed; 'random': each grid point's distributions "
        "({loguniform|uniform|randint|choice: ...}) drawn num_samples times, each draw once per seed; 'optuna': "
        "num_samples settings per grid point chosen by an Optuna study (TPE) told each one's mean over the seeds "
        "(the optuna extra).",
    )
    num_samples: int | None = Field(
        None, ge=1, description="Settings a random or Optuna search draws for each grid point (required by both)."
    )
    search_seed: Seed = Field(0, description="Seed of a search's draws: the same file draws the same settings.")
    scheduler: SchedulerSettings | None = Field(
        None,
        description="Early stopping of bad settings: {asha: {grace_rounds, reduction_factor}}; a stopped trial's run "
        "ends FINISHED with fedsweep.outcome=stopped_early and is never a best setting. null = every trial runs to the end.",
    )
    select_on: Literal["test", "validation"] = Field(
        "test",
        description="Which data picks each algorithm's best setting: 'validation' ranks settings by the metric on "
        "the clients' validation parts (val_<metric>; needs data.validation_fraction > 0) and reports the test "
        "metrics of the chosen one; 'test' ranks by the reported test metric itself (optimistic; the papers' way).",
    )
    table_group_by: list[str] = Field(
        default_factory=list,
        description="Parameters (flat names, e.g. model.name, algorithm.local_steps) that split the table's "
        "rows further: one row per algorithm and value of each.",
    )

    def selection_metric(self) -> str:
        """The logged metric that ranks settings (and that Tune's searchers and schedulers see)."""
        return VAL + self.metric if self.select_on == "validation" else self.metric

    @model_validator(mode="after")
    def _search(self):
        if self.search != "grid" and self.num_samples is None:
            raise ValueError(f"search: {self.search!r} needs num_samples, the settings to draw for each grid point (e.g. 8)")
        if self.search == "optuna":
            import importlib.util

            if importlib.util.find_spec("optuna") is None:
                raise ValueError("search: 'optuna' needs the optuna package, which is not installed: "
                                 "pip install 'fedsweep[optuna]' (or pip install optuna)")
            if self.scheduler is not None and self.seeds and len(self.seeds) > 1:
                raise ValueError("scheduler: with search: 'optuna' a trial runs its seeds one after another, so a "
                                 "scheduler would compare rounds of different seeds; allowed: one seed (seeds: [s]), "
                                 "or no scheduler")
        if self.search == "grid" and self.num_samples is not None:
            raise ValueError("num_samples: only a random or Optuna search draws samples (search: random | optuna); "
                             "a grid runs each point once per seed")
        return self

    @model_validator(mode="after")
    def _distinct_seeds(self):
        if self.seeds and len(set(self.seeds)) < len(self.seeds):
            twice = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
            raise ValueError(f"seeds: {twice} given more than once; each seed is one independent run, give each once")
        return self


#: Fields the sweep driver reads once for all trials (where to log, which cluster to join).
SWEEP_WIDE = ("tracking", "resources.ray_address", "resources.cluster_cpus", "resources.cluster_gpus")


@dataclass(frozen=True)
class Trial:
    """One point of a sweep: its validated config and the grid values that picked it."""

    index: int
    config: ExperimentConfig
    overrides: dict[str, Any]

    def label(self) -> str:
        return overrides_label(self.overrides)


def overrides_label(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "(base config)"


@dataclass(frozen=True)
class Sweep:
    """A sweep file, read and validated. ``trials`` are its trials; for an Optuna search, whose settings are
    chosen while it runs, ``points`` are what its studies search (a grid point's value with its
    distributions, and the grid values that picked it) and ``trials`` one validated trial per point and seed
    (the distributions at their low ends), which stand for the point's trials in every check."""

    settings: SweepSettings
    trials: list[Trial]
    source: str
    path: str
    points: list[tuple[Any, dict[str, Any]]] | None = None

    def source_hash(self) -> str:
        return hashlib.sha1(self.source.encode()).hexdigest()[:12]

    def describe(self) -> str:
        if self.points is None:
            return f"{len(self.trials)} trial(s)"
        seeds = len(self.settings.seeds or [None])
        return (f"an Optuna search of {self.settings.num_samples} setting(s) for each of {len(self.points)} grid "
                f"point(s), each on {seeds} seed(s): {self.settings.num_samples * len(self.points) * seeds} run(s)")


class ConfigError(ValueError):
    """A config problem, reported before any Ray or MLflow work; the CLI exits 2 on it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


# --------------------------------------------------------------------------- YAML reading


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict) and d:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def read_yaml(path: str | Path) -> tuple[dict, str, dict[tuple, int]]:
    """The file's top-level mapping, its text and the line of each key path (:mod:`fedsweep.config_file`)."""
    try:
        return config_file.read(path)
    except config_file.ConfigFileError as e:
        raise ConfigError([str(e)]) from None


# --------------------------------------------------------------------------- grids


def _is_grid(node: Any) -> bool:
    return isinstance(node, dict) and "grid" in node


def _expand(
    node: Any, path: tuple, problems: list[str], locate: Callable[[tuple], str] = lambda path: ""
) -> list[tuple[Any, dict[str, Any]]]:
    """All concrete values of ``node`` with the grid choices (dotted path → value) that produce each.
    ``locate(path)`` prefixes a problem with where it is in the file."""
    if _is_grid(node):
        where = locate(path) + (".".join(map(str, path)) or "<top level>")
        extra = sorted(set(node) - {"grid"})
        if extra:
            problems.append(f"{where}: a grid takes only the key 'grid', found also {extra}")
            return [(None, {})]
        choices = node["grid"]
        if not isinstance(choices, list) or not choices:
            problems.append(f"{where}.grid: must be a non-empty list of values, got {choices!r}")
            return [(None, {})]
        out = []
        for choice in choices:
            for value, sub in _expand(choice, path, problems, locate):
                picked = flatten(value, ".".join(map(str, path)) + ".") if isinstance(value, dict) else {".".join(map(str, path)): value}
                out.append((value, {**picked, **sub}))
        return out
    if isinstance(node, dict):
        keys = list(node)
        options = [_expand(node[k], path + (k,), problems, locate) for k in keys]
        out = []
        for combo in itertools.product(*options):
            value = {k: v for k, (v, _) in zip(keys, combo)}
            overrides: dict[str, Any] = {}
            for _, ov in combo:
                overrides.update(ov)
            out.append((value, overrides))
        return out
    return [(node, {})]


# --------------------------------------------------------------------------- validation


def _allowed_keys(model: type[BaseModel] | None) -> list[str]:
    if model is None:
        return []
    return [key for name, info in model.model_fields.items() for key in names_of(name, info)]


def _alias_of(model: type[BaseModel] | None, key: Any) -> str | None:
    """The field that ``key`` is an alias (or the name) of, if any."""
    for name, info in (model.model_fields.items() if model else ()):
        if key in names_of(name, info):
            return name
    return None


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside a (possibly Annotated / Union) field annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _submodels(a)]


def _tags(model: type[BaseModel]) -> tuple:
    """The values of a union member's tag field (``name`` or ``dataset``): its Literal's values."""
    for key in ("name", "dataset"):
        if key in model.model_fields:
            return get_args(model.model_fields[key].annotation)
    return ()


def _model_at(loc: tuple, raw: dict, root: type[BaseModel]) -> type[BaseModel] | None:
    """The pydantic model that validates the mapping at ``loc`` (to list its allowed keys)."""
    model: type[BaseModel] | None = root
    node: Any = raw
    for part in loc:
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        node = node.get(part) if isinstance(node, dict) else None
        candidates = _submodels(field.annotation)
        tag = (node.get("name", node.get("dataset")) if isinstance(node, dict) else None)
        chosen = [m for m in candidates if tag is not None and tag in _tags(m)]
        model = chosen[0] if chosen else (candidates[0] if len(candidates) == 1 else None)
    return model


def _without_union_tags(loc: tuple, root: type[BaseModel]) -> tuple:
    """Pydantic puts the selected member's tag after a discriminated-union field in an error's location
    (``algorithm.fedavg.local_lr``); drop exactly those, so the path is the one written in the file."""
    out: list = []
    model: type[BaseModel] | None = root
    i = 0
    while i < len(loc):
        part = loc[i]
        out.append(part)
        field = model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        candidates = _submodels(field.annotation) if field is not None else []
        model = candidates[0] if len(candidates) == 1 else None
        if len(candidates) > 1 and i + 1 < len(loc):
            tagged = [m for m in candidates if loc[i + 1] in _tags(m)]
            if tagged:
                model = tagged[0]
                i += 1  # skip the tag
        i += 1
    return tuple(out)


def _line(lines: dict[tuple, int], loc: tuple) -> int | None:
    """The line of ``loc`` in the file, else of its nearest enclosing key that has one."""
    for end in range(len(loc), -1, -1):
        if tuple(loc[:end]) in lines:
            return lines[tuple(loc[:end])]
    return None


def _where(file: str, lines: dict[tuple, int], loc: tuple) -> str:
    line = _line(lines, loc)
    return f"{file}:{line}" if line else file


def _format_errors(
    err: ValidationError, raw: dict, file: str, lines: dict[tuple, int], root: type[BaseModel] = ExperimentConfig, prefix: tuple = ()
) -> list[str]:
    """One line per pydantic error: ``file:line: field: problem; allowed values``. ``prefix``: where the
    section ``root`` validates sits in the file (``("sweep",)``)."""
    problems = []
    for e in err.errors():
        loc = _without_union_tags(e["loc"], root)
        field = _dotted(prefix + loc) or "<config>"
        where = _where(file, lines, prefix + loc)
        msg = e["msg"]
        msg = msg.removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            model = _model_at(loc[:-1], raw, root)
            twin = _alias_of(model, loc[-1])
            if twin:
                msg = f"{loc[-1]!r} is another name of '{twin}', which is given too: give one of them"
            else:
                allowed = _allowed_keys(model)
                msg = f"unknown key {loc[-1]!r}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
        elif e["type"] == "union_tag_invalid":
            key = e["ctx"]["discriminator"].strip("'")
            field = f"{field}.{key}"
            msg = f"unknown value {e['ctx']['tag']!r}; allowed: {e['ctx']['expected_tags']}"
        elif e["type"] == "union_tag_not_found":
            key = e["ctx"]["discriminator"].strip("'")
            field = f"{field}.{key}"
            msg = "missing; it selects which kind this section is"
        elif "input" in e and e["type"] != "missing" and loc and not isinstance(e["input"], (dict, list)):
            msg = f"{msg} (got {_short(e['input'])})"
        # A cross-field rule (empty location) names its fields in its own message.
        problems.append(f"{where}: {field}: {msg}" if loc else f"{where}: {'.'.join(prefix) + ': ' if prefix else ''}{msg}")
    return problems


def _dotted(loc: tuple) -> str:
    """A key path as written, with invisible or unprintable characters in a key shown escaped."""
    return ".".join(k if isinstance(k, str) and k.isprintable() else ascii(k).strip("'") for k in map(str, loc))


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validate(raw: dict, file: str = "<config>", lines: dict[tuple, int] | None = None) -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(raw, strict=True)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, raw, file, lines or {})) from None


def check_fits(cfg: ExperimentConfig, cluster_cpus: float, cluster_gpus: float, memory_mb: float | None, where: str) -> list[str]:
    """Problems that would make the trial's placement group wait forever, or exhaust memory."""
    problems = []
    bundles = cfg.resources.bundles(cfg.num_clients)
    need_cpus = sum(b.get("CPU", 0) for b in bundles)
    need_gpus = sum(b.get("GPU", 0) for b in bundles)
    r = cfg.resources
    a = r.client_workers or len(bundles) - 1  # holders of client_cpus (a worker pool's first is the ServerActor)
    if r.client_workers:
        actors, fewer = f"{a} client workers", "or fewer client_workers"
    else:
        actors = f"{a} client actors" if r.clients_per_actor == 1 else f"{a} client actors ({r.clients_per_actor} clients each)"
        fewer = "or fewer clients, or a larger clients_per_actor"
    if r.server_cpus_total() > cluster_cpus + 1e-9:
        problems.append(
            f"{where}: resources.server_cpus: the server bundle alone needs {r.server_cpus_total():g} CPUs"
            + (f" (server_cpus {r.server_cpus:g} + one worker's client_cpus {r.client_cpus:g})" if r.client_workers else "")
            + f", but the cluster has {cluster_cpus:g}; allowed: server_cpus <= {max(cluster_cpus - r.server_cpus_total() + r.server_cpus, 0):g}"
        )
    elif need_cpus > cluster_cpus + 1e-9:
        problems.append(
            f"{where}: resources: one trial needs server_cpus + {actors} × client_cpus = "
            f"{r.server_cpus:g} + {a} × {r.client_cpus:g} = {need_cpus:g} CPUs, but the cluster has {cluster_cpus:g}; "
            f"allowed: client_cpus <= {max(cluster_cpus - r.server_cpus, 0) / a:.4g} ({fewer})"
        )
    if need_gpus > cluster_gpus + 1e-9:
        problems.append(
            f"{where}: resources.client_gpus: one trial needs {actors} × {r.client_gpus:g} = {need_gpus:g} GPUs, "
            f"but the cluster has {cluster_gpus:g}; allowed: client_gpus <= {cluster_gpus / a:.4g}"
        )
    if memory_mb is not None:
        processes = len(bundles) + 1  # the driver, the ServerActor and the ClientActors
        params, per_client = parameter_memory(cfg)
        model_mb = 4 * (2 * params * len(bundles) + per_client * cfg.num_clients) / 2**20
        need_mb = processes * r.actor_memory_mb + model_mb
        if need_mb > memory_mb:
            fit = int(memory_mb // r.actor_memory_mb) - 2  # client actors that fit beside the driver and server
            field = "resources.actor_memory_mb"
            if model_mb > memory_mb / 2:
                field, hint = "model", "allowed: a smaller model, or fewer clients"
            elif fit < 1:
                hint = "not even one client actor fits"
            elif r.client_workers:
                hint = f"allowed: resources.client_workers <= {fit + 1}"
            else:
                hint = f"allowed: resources.clients_per_actor >= {math.ceil(cfg.num_clients / fit)}"
            model = (f" + its {params} model parameters at 4 bytes × (2 per actor"
                     + (f" + {per_client / params:g} per client" if per_client else "") + f") = {model_mb:.0f} MB") if model_mb >= 1 else ""
            problems.append(
                f"{where}: {field}: one trial starts {processes} processes × {r.actor_memory_mb:g} MB = "
                f"{processes * r.actor_memory_mb:.0f} MB{model}, more than this machine's {memory_mb:.0f} MB; {hint}"
            )
    return problems


def parameter_memory(cfg: ExperimentConfig) -> tuple[int, int]:
    """The model's parameter count and the floats of state each client keeps between rounds (the
    algorithm's initial client state, sized on PyTorch's meta device: nothing is allocated)."""
    import torch

    params = parameter_count(cfg.model, input_features(cfg.data), num_classes(cfg.data))
    state = ALGORITHMS[cfg.algorithm.name](cfg.algorithm).init_client_state(torch.empty(params, device="meta"))
    return params, sum(v.numel() for v in state.values())


def local_cpus() -> int:
    """CPUs of a local Ray instance started without ``cluster_cpus``: this machine's cores."""
    return os.cpu_count() or 1


def local_capacity() -> tuple[float, float, float]:
    """CPUs, GPUs and memory (MB) of this machine, as a local Ray instance would see them."""
    import psutil
    import torch

    return float(local_cpus()), float(torch.cuda.device_count()), psutil.virtual_memory().total / 2**20


def check_resources(configs: list[ExperimentConfig], file: str, capacity: tuple[float, float, float | None] | None = None) -> None:
    """Raise if a trial cannot fit the cluster it will run on (local: this machine, or the explicit cluster_* fields)."""
    problems: list[str] = []
    local = local_capacity() if capacity is None else capacity
    for cfg in configs:
        r = cfg.resources
        if r.address() and capacity is None and r.cluster_cpus is None:
            continue  # a remote cluster is checked after connecting, before any trial starts
        cpus = r.cluster_cpus if r.cluster_cpus is not None else local[0]
        gpus = r.cluster_gpus if r.cluster_gpus is not None else local[1]
        if not r.address() and gpus > local[1]:
            problems.append(
                f"{file}: resources.cluster_gpus={gpus:g}, but this machine has {local[1]:g} GPU(s): Ray would count "
                f"GPUs that are not there and the clients would train on the CPU; allowed: 0..{local[1]:g}, or null (detected)"
            )
        for p in check_fits(cfg, cpus, gpus, None if r.address() else local[2], file):
            if p not in problems:
                problems.append(p)
    if problems:
        raise ConfigError(problems)


#: Schemes of an MLflow tracking URI (a database's may name its driver: postgresql+psycopg2).
TRACKING_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
#: Schemes of a Tune storage path (pyarrow's file systems), besides a local path.
STORAGE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "abfs", "abfss", "az")


def _folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be (or become) a folder this process writes to; None when it can."""
    if path.exists():
        if not path.is_dir():
            return f"{path} exists and is not a folder"
        return None if os.access(path, os.W_OK | os.X_OK) else f"{path} is not writable"
    parent = next((a for a in path.parents if a.exists()), None)
    if parent is None or not parent.is_dir():
        return f"{parent} is not a folder, so {path} cannot be created"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{path} cannot be created: {parent} is not writable"


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow could not use ``uri`` as its tracking store; None when it can (a server is not contacted)."""
    from urllib.parse import urlparse

    if "://" not in uri:
        return _folder_problem(Path(uri).resolve())
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme not in TRACKING_SCHEMES:
        return f"unknown scheme {parsed.scheme!r}; allowed: {', '.join(TRACKING_SCHEMES)}, or a local folder"
    if scheme == "sqlite":
        db = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
        if not db:
            return "a SQLite URI is sqlite:///relative/path.db or sqlite:////absolute/path.db"
        db_path = Path(db).resolve()
        if db_path.is_dir():
            return f"{db_path} is a folder, not a database file"
        return _folder_problem(db_path.parent)
    if scheme == "file":
        return _folder_problem(Path(parsed.path).resolve())
    if scheme != "databricks" and not parsed.hostname:
        return f"no host in {uri!r}"
    return None


def _unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a host:port Ray address (a TCP connect; Ray's own would wait minutes); None
    when something listens, or for 'auto' and 'local', which Ray resolves itself."""
    import socket

    if address in ("auto", "local"):
        return None
    host, port = address.removeprefix("ray://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        return f"nothing answers there ({e.strerror or type(e).__name__})"
    return None


def check_environment(configs: list[ExperimentConfig], file: str, storage_path: str | None = None) -> None:
    """Where the runs will go, before anything starts: the tracking URI, the Ray address (the config's or
    $RAY_ADDRESS) and the sweep's storage path are ones that can be used."""
    import re
    from urllib.parse import urlparse

    problems: list[str] = []
    first = configs[0]
    from fedsweep.tracking import resolve_tracking_uri  # (tracking imports this module)

    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    source = "tracking.tracking_uri" if first.tracking.tracking_uri else ("$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the default tracking URI")
    if problem := tracking_uri_problem(uri):
        problems.append(f"{file}: {source} ({uri}): {problem}")
    address, source = first.resources.address(), ("resources.ray_address" if first.resources.ray_address else "$RAY_ADDRESS")
    if address and not re.match(RAY_ADDRESS_PATTERN, address):
        problems.append(f"{file}: {source}={address!r} is not a Ray address; allowed: auto, host:port or ray://host:port")
    elif address and (problem := _unreachable(address)):
        problems.append(f"{file}: {source}={address!r}: {problem}; start the cluster (ray start --head) or fix the address")
    if storage_path is not None:
        if "://" in storage_path:
            scheme = urlparse(storage_path).scheme
            if scheme not in STORAGE_SCHEMES:
                problems.append(f"{file}: sweep.storage_path: unknown scheme {scheme!r}; allowed: {', '.join(STORAGE_SCHEMES)}, or a local folder")
            elif scheme == "file" and (problem := _folder_problem(Path(urlparse(storage_path).path))):
                problems.append(f"{file}: sweep.storage_path: {problem}")
        elif problem := _folder_problem(Path(storage_path).resolve()):
            problems.append(f"{file}: sweep.storage_path: {problem}")
    if problems:
        raise ConfigError(problems)


def check_data(configs: list[ExperimentConfig], file: str) -> None:
    """Image datasets: the files are there and the split is feasible, before Ray starts (local runs only:
    on a cluster the files live on the nodes)."""
    from fedsweep.data import ImageConfig, build_federated_dataset

    problems: list[str] = []
    seen = set()
    for cfg in configs:
        if not isinstance(cfg.data, ImageConfig) or cfg.resources.address() or cfg.data in seen:
            continue
        seen.add(cfg.data)
        try:
            build_federated_dataset(cfg.data)
        except (OSError, ValueError) as e:
            if f"{file}: {e}" not in problems:
                problems.append(f"{file}: {e}")
    if problems:
        raise ConfigError(problems)


def check_before_start(configs: list[ExperimentConfig], file: str, storage_path: str | None = None) -> None:
    """What `validate`, `run` and `sweep` all check after the schema and before any Ray or MLflow work:
    where the runs go, whether the trials fit the cluster, and the dataset files."""
    check_environment(configs, file, storage_path)
    check_resources(configs, file)
    check_data(configs, file)


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
      proto transform) on an ``mlr`` or ``mlp`` model: a worker pool of one, the ServerActor training each round's
      clients together, on one CPU (``server_cpus`` 0.2 + ``client_cpus`` 0.8). The stack is always the round's
      sampled clients, whatever the machine, so the numbers do not depend on the CPUs found (they equal one by one
      up to floating-point summation order). Two at a time on 2 cores it ran a 16-setting grid of 50 rounds 1.24×
      faster than the pool of one without stacking, of 200 rounds 1.54× (36.2 s against 55.9 s), and a single run
      within 15% of a pool of two.
    - otherwise: a worker pool of one process per CPU the trial may use (``cpus``, at most one per client), the
      ServerActor the first; ``server_cpus`` 0.2 and the rest shared by the workers. Same numbers as one by one.

    Either way no process per client: one actor per client cost 2.55× the in-process time on one CPU, and each
    process start about 2.3 s of imports here. A layout of one process (the first rule) is one ``fedsweep run`` runs
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


def _stacks(raw: dict) -> bool:
    """Whether the trial's clients can train as one stacked computation on a model it was measured for."""
    model, algorithm = raw.get("model", {}), raw.get("algorithm")
    if not isinstance(model, dict) or model.get("name", "mlp") not in ("mlr", "mlp") or not isinstance(algorithm, dict):
        return False
    try:
        hp = TypeAdapter(AlgorithmParams).validate_python(algorithm, strict=True)
    except ValidationError:
        return False  # reported by the validation that follows
    return ALGORITHMS[hp.name](hp).can_vectorize()


def load_experiment(path: str | Path, check_cluster: bool = True) -> ExperimentConfig:
    """Read and validate a single-experiment file (no grids; a ``sweep:`` section is ignored)."""
    raw, _, lines = read_yaml(path)
    raw = {k: v for k, v in raw.items() if k != "sweep"}
    grids = [k for k, v in flatten_grids(raw)]
    if grids:
        raise ConfigError([f"{path}: {g}: a grid is only allowed in a sweep ('fedsweep sweep {path}')" for g in grids])
    cfg = validate(auto_layout(raw, trial_cpus(raw.get("resources"), 1)) if isinstance(raw, dict) else raw, str(path), lines)
    if check_cluster:
        check_before_start([cfg], str(path))
    return cfg


def flatten_grids(node: Any, path: tuple = ()) -> list[tuple[str, Any]]:
    if _is_grid(node):
        return [(".".join(map(str, path)), node)]
    if isinstance(node, dict):
        return [g for k, v in node.items() for g in flatten_grids(v, path + (k,))]
    return []


#: Trials one sweep file may expand to: the grids are crossed (a product) and every point is validated.
MAX_TRIALS = 10_000


def _grid_points(node: Any) -> int:
    """How many configs ``node`` expands to (without expanding it)."""
    if _is_grid(node):
        return sum(_grid_points(c) for c in node["grid"]) if isinstance(node["grid"], list) else 1
    if isinstance(node, dict):
        return math.prod(_grid_points(v) for v in node.values())
    return 1


def load_sweep(path: str | Path, check_cluster: bool = True) -> Sweep:
    """Read a sweep file, expand its grids × seeds and validate every trial config."""
    raw, source, lines = read_yaml(path)
    file = str(path)
    problems: list[str] = []
    section = raw.get("sweep", {})
    settings = None
    if not isinstance(section, dict):
        problems.append(f"{_where(file, lines, ('sweep',))}: sweep: must be a mapping of sweep settings, got {_short(section)}; "
                        "leave the section out for the defaults")
    else:
        try:
            settings = SweepSettings.model_validate(section, strict=True)
        except ValidationError as err:
            problems += _format_errors(err, section, file, lines, SweepSettings, ("sweep",))
    body = {k: v for k, v in raw.items() if k != "sweep"}
    if settings is not None and settings.seeds and "seed" in body:  # replaced in every trial, but still checked
        try:
            TypeAdapter(Seed).validate_python(body["seed"], strict=True)
        except ValidationError as err:
            problems.append(f"{_where(file, lines, ('seed',))}: seed: {err.errors()[0]['msg']} (got {_short(body['seed'])}); "
                            "sweep.seeds replaces it in every trial: give a valid seed or leave it out")
    for field, _ in flatten_grids(body):
        if _within(field, SWEEP_WIDE):
            problems.append(
                f"{_where(file, lines, tuple(field.split('.')))}: {field}: one value serves the whole sweep and cannot be "
                f"a grid (sweep-wide fields: {', '.join(SWEEP_WIDE)})"
            )
    samples = settings.num_samples if settings and settings.search == "random" else 1
    points = _grid_points(body) * samples * len(settings.seeds if settings and settings.seeds else [None])
    if points > MAX_TRIALS:
        grids = ", ".join(f"{f} ({_grid_points(g)})" for f, g in flatten_grids(body))
        raise ConfigError(problems + [f"{file}: the grids ({grids})" + (f" × sweep.num_samples ({samples})" if samples > 1 else "")
                                      + f" × sweep.seeds make {points} trials; at most {MAX_TRIALS} per sweep"])
    expanded = _expand(body, (), problems, lambda at: f"{_where(file, lines, at)}: ")
    if settings is not None:
        expanded = _sample(expanded, settings, problems, lambda at: _where(file, lines, at))
        expanded = [(auto_layout(value, trial_cpus(value.get("resources"), settings.max_concurrent_trials))
                     if isinstance(value, dict) else value, overrides) for value, overrides in expanded]
    if problems:
        raise ConfigError(problems)
    search_points = None
    if settings is not None and settings.search == "optuna":
        # the settings are drawn while the sweep runs: validate every point at the edges of its distributions
        search_points = [(value, _without_drawn(value, overrides)) for value, overrides in expanded]
        expanded = []
        for value, fixed in search_points:
            edges = search.corners(value)
            for corner in edges:
                try:
                    validate({**corner, **({"seed": settings.seeds[0]} if settings.seeds else {})}, file, lines)
                except ConfigError as e:
                    for p in e.problems:
                        if (line := f"{p} [at an edge of the search space of {overrides_label(fixed)}]") not in problems:
                            problems.append(line)
            expanded.append((edges[0], fixed))  # the point's stand-in trial: every distribution at its low end
        if problems:
            raise ConfigError(problems)
    seeds = settings.seeds if settings and settings.seeds else [None]
    trials: list[Trial] = []
    failing: dict[str, list[str]] = {}  # problem -> labels of the grid points that have it
    points = list(itertools.product(expanded, seeds))
    for (value, overrides), seed in points:
        if seed is not None:
            value = {**value, "seed": seed}
            overrides = {**overrides, "seed": seed}
        try:
            trials.append(Trial(len(trials), validate(value, file, lines), overrides))
        except ConfigError as e:
            for p in e.problems:
                failing.setdefault(p, []).append(overrides_label(overrides))
    for p, labels in failing.items():
        # A problem common to every grid point is the file's; otherwise name the points that have it.
        problems.append(p if len(labels) == len(points) else f"{p} [in trial {'; '.join(labels[:3])}{' ...' if len(labels) > 3 else ''}]")
    if settings is not None and settings.select_on == "validation":
        without = [t.label() for t in trials if t.config.data.validation_fraction == 0]
        if without:
            problems.append(
                f"{_where(file, lines, ('sweep', 'select_on'))}: sweep.select_on: 'validation' needs a validation part in "
                f"every trial, but data.validation_fraction is 0 in {len(without)} of {len(trials)} (e.g. {without[0]}); "
                "allowed: data.validation_fraction > 0 (e.g. 0.2), or select_on: test")
    if settings is not None and settings.scheduler is not None and trials:
        grace = settings.scheduler.asha.grace_rounds
        short = [t for t in trials if t.config.rounds <= grace]
        if short:
            problems.append(
                f"{_where(file, lines, ('sweep', 'scheduler', 'asha', 'grace_rounds'))}: sweep.scheduler.asha.grace_rounds: "
                f"{grace}, but {len(short)} trial(s) run {short[0].config.rounds} round(s) or fewer, so the scheduler could "
                f"stop nothing there; allowed: grace_rounds < rounds ({min(t.config.rounds for t in trials)}), or no scheduler")
    if settings is not None and trials:
        known = {k for t in trials for k in t.config.flat_params()}
        for name in settings.table_group_by:
            if name not in known:
                close = sorted(k for k in known if k.split(".")[-1] == name.split(".")[-1]) or sorted(known)[:8]
                problems.append(f"{file}: sweep.table_group_by: {name!r} is not a parameter of the trials; e.g. {', '.join(close)}")
    if problems:
        raise ConfigError(problems)
    assert settings is not None
    if check_cluster:
        check_before_start([t.config for t in trials], file, settings.storage_path)
    return Sweep(settings, trials, source, file, search_points)


def _sample(points: list[tuple[Any, dict[str, Any]]], settings: SweepSettings, problems: list[str],
            locate: Callable[[tuple], str]) -> list[tuple[Any, dict[str, Any]]]:
    """The distributions of the grid points checked, and a random search's settings: each grid point's
    distributions drawn ``num_samples`` times (:mod:`fedsweep.search`), from a generator seeded by
    ``search_seed`` and the point's position. An Optuna search's points are returned as they are."""
    found = {path: node for value, _ in points for path, node in search.distributions(value)}
    for path, node in found.items():
        field = ".".join(map(str, path))
        if _within(field, SWEEP_WIDE):
            problems.append(f"{locate(path)}: {field}: one value serves the whole sweep and cannot be drawn "
                            f"(sweep-wide fields: {', '.join(SWEEP_WIDE)})")
        elif settings.search == "grid":
            problems.append(f"{locate(path)}: {field}: a distribution ({next(iter(node))}) is drawn by a search; "
                            "allowed: sweep.search: random or optuna with sweep.num_samples, or a grid: [values]")
        elif problem := search.distribution_problem(node):
            problems.append(f"{locate(path)}: {field}: {problem}")
    if settings.search == "grid":
        return points
    if not found:
        problems.append(f"{locate(('sweep', 'search'))}: sweep.search: {settings.search!r} draws the fields given as "
                        f"distributions ({', '.join('{' + k + ': ...}' for k in search.DISTRIBUTIONS)}), but the file has none")
    if settings.search == "optuna":
        for path, node in found.items():
            field = ".".join(map(str, path))
            if field.startswith("resources."):
                problems.append(f"{locate(path)}: {field}: an Optuna search places its trials before it draws them, so "
                                "resources cannot be drawn; allowed: a fixed value or a grid")
            elif "choice" in node and any(search.distributions(v) for v in node["choice"]):
                problems.append(f"{locate(path)}: {field}: an Optuna search does not draw inside a choice; allowed: a "
                                "grid of mappings, each with its own distributions, or search: random")
        return points
    if problems:
        return points
    out = []
    for index, (value, overrides) in enumerate(points):
        rng = np.random.default_rng([settings.search_seed, index])
        fixed = _without_drawn(value, overrides)
        for _ in range(settings.num_samples or 1):
            drawn, picked = search.draw(value, rng)
            out.append((drawn, {**fixed, **picked}))
    return out


def _without_drawn(value: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """A grid point's overrides without the leaves of its distributions (a grid point that chose a mapping
    lists its leaves; a distribution among them is a drawn value instead)."""
    drawn_at = tuple(".".join(map(str, path)) for path, _ in search.distributions(value))
    return {k: v for k, v in overrides.items() if not _within(k, drawn_at)}


def _within(field: str, roots: tuple[str, ...]) -> bool:
    """Whether the dotted ``field`` is one of ``roots`` or a field inside one (``resources.ray_address``
    inside ``resources``; not ``resources_x``)."""
    return any(field == root or field.startswith(root + ".") for root in roots)


def format_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}" if math.isfinite(v) else str(v)
    return str(v)
