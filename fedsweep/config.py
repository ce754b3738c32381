"""Typed experiment and sweep configs: the schema alone.

A YAML file is the serialized form of :class:`ExperimentConfig`, plus an optional ``sweep:`` section
(:class:`SweepSettings`). Reading files, expanding their grids and searches and rewriting pydantic's errors
into :class:`ConfigError` messages (file, line, field, allowed values) is :mod:`fedsweep.loading`'s; whether a
plan can run here, :mod:`fedsweep.checks`'; the layout a file that gives none gets, :mod:`fedsweep.layout`'s.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from fedsweep.algorithms import ALGORITHMS
from fedsweep.data import DataConfig, SyntheticConfig, input_features, num_classes
from fedsweep.dotted import flatten, overrides_label
from fedsweep.evaluation import VAL
from fedsweep.models import MLPConfig, ModelConfig, parameter_count
from fedsweep.schema import FieldError, StrictModel

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


def unstackable() -> list[str]:
    """The algorithms whose step, at their defaults, does not run on stacked clients (``can_vectorize``)."""
    return sorted(name for name, cls in ALGORITHMS.items() if not cls(cls.Params()).can_vectorize())


class ResourcesConfig(StrictModel):
    """Ray resources of one trial: a placement group of one server bundle and one bundle per client.

    A file that gives none of the layout fields (:data:`fedsweep.layout.LAYOUT_FIELDS`) gets
    :func:`fedsweep.layout.auto_layout`'s (no process per client: a pool of one training the round's clients
    stacked, or a worker pool of one process per CPU); the defaults below apply once any of them is given."""

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
        description="0 = every client lives in its ClientActor (clients_per_actor per actor). "
        "W >= 1 = a pool of W worker processes, the ServerActor and W - 1 ClientActors, each holding every "
        "client's shard: each round's sampled clients are split evenly across them. W = 1 trains every client "
        "inside the ServerActor (no per-round call to another actor). The ServerActor's bundle then holds "
        "server_cpus + client_cpus. Either way a process keeps the states of the clients it trained last, and the "
        "ServerActor keeps a copy of every state (no state is lost with a process). Same numbers as 0.",
    )
    vectorize_clients: bool = Field(
        False,
        description="Train the clients packed in one actor as one batched computation (torch.func.vmap over "
        "their stacked parameters, or its batched products for an MLR or MLP) instead of one after the other; same samples, same numbers up to "
        "floating-point summation order. Not for an algorithm whose step is not elementwise per client (refused "
        "before anything runs, with the names of those algorithms).",
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
        "reloads its clients' shards and gets their latest states from the ServerActor's copy with its next call "
        "(nothing is rolled back). The round it died in aggregates the clients that answered.",
    )
    round_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Seconds a round (and an evaluation) waits for client replies, counted from when the server's "
        "own clients (a worker pool's local share) are done; clients that have not answered by then are left out of "
        "it and counted in clients_dropped. null = wait for every client.",
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
            raise FieldError("client_cpus", "0, and client_gpus is 0 too: a client bundle needs some resource")
        if self.client_workers and self.clients_per_actor != 1:
            raise FieldError(
                "clients_per_actor", f"{self.clients_per_actor} with client_workers={self.client_workers}: every worker "
                "holds every client; allowed: clients_per_actor 1 (the default) with client_workers >= 1, or client_workers 0"
            )
        if self.client_workers and self.client_gpus:
            raise FieldError(
                "client_gpus", f"{self.client_gpus:g} with client_workers={self.client_workers}: the worker pool runs on "
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
    log_train_loss: bool = Field(
        True, description="train_loss at every evaluation: the global model scored on every client's training part (the "
        "curve pFedMe's figures plot). false leaves it out, and with it the largest part of an evaluation's work on a "
        "0.6 / 0.2 / 0.2 split; it changes no other number.",
    )
    log_plot: bool = Field(
        True, description="Figures: each run's accuracy-vs-round plot, and the sweep report's figures (its tables are "
        "logged either way; `fedsweep report` draws them later)."
    )
    outage_limit_s: float = Field(
        600, gt=0, allow_inf_nan=False,
        description="Seconds a trial goes on training while the tracking server does not take its metrics (held "
        "meanwhile, written when it answers again); past them the trial fails, and a sweep retries it from its "
        "last checkpoint (sweep.trial_retries).",
    )


def resolve_tracking_uri(configured: str | None = None) -> str:
    """The config's URI, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///<cwd>/mlflow.db``; local paths made absolute.

    Absolute because Tune runs each trial in its own working directory.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///") :]).resolve())
    if "://" not in uri:
        return Path(uri).resolve().as_uri()
    return uri


class ExperimentConfig(StrictModel):
    """One experiment: data and split, model, algorithm with its hyperparameters, schedule, resources, tracking."""

    name: str = Field("experiment", min_length=1)
    seed: Seed = Field(0, description="Seed of model init, client sampling and minibatches.")
    data: DataConfig = Field(default_factory=SyntheticConfig)
    model: ModelConfigField = Field(default_factory=MLPConfig)
    algorithm: AlgorithmParams
    rounds: int = Field(50, ge=1)
    eval_every: int = Field(5, ge=1, description="Evaluate all clients every k rounds (and at round 0 and the last round).")
    unseen_fraction: float = Field(
        0.0, ge=0, lt=1,
        description="Share of the clients held out of training (the last ⌈f·n⌉ ids): never sampled, scored at every "
        "evaluation with the method's own evaluation-time personalization of what the server sends, as unseen_* "
        "metrics (pFL-Bench's generalization to new clients); the other metrics are the trained clients'. 0 = none.",
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="after")
    def _cross_field(self):
        if self.data.seed == "run":  # the data's own checks that need a seed, with this run's
            try:
                type(self.data).model_validate(self.run_data().model_dump())
            except ValidationError as e:
                raise FieldError("data.seed", f"'run' (this run's seed, {self.seed}): {e.errors()[0]['msg']}") from None
        n = self.data.num_clients
        hp = self.algorithm
        if hp.clients_per_round is not None and hp.participation_rate is not None:
            raise FieldError("algorithm.clients_per_round", "give participation_rate (r) or clients_per_round, not both")
        problem = hp.model_problem(self.model.name)
        if problem:
            raise FieldError("algorithm.name", f"{hp.name} with model.name={self.model.name}: {problem}")
        if self.resources.vectorize_clients and getattr(self.model, "norm", "none") != "none":
            raise FieldError(
                "resources.vectorize_clients", f"true, but model.norm={self.model.norm} keeps running statistics per client, "
                "which a stacked step does not; allowed: false, or model.norm=none"
            )
        algorithm = ALGORITHMS[hp.name](hp) if self.resources.vectorize_clients else None
        if algorithm is not None and not algorithm.can_vectorize():
            raise FieldError(
                "resources.vectorize_clients", f"true, but algorithm.name={hp.name} trains its clients one by one; "
                f"allowed: false, or an algorithm other than {', '.join(unstackable())}"
            )
        if self.model.name == "cnn":
            parameter_count(self.model, input_features(self.data), num_classes(self.data))  # raises if the inputs are not images it can take
        if self.resources.client_workers > n:
            raise FieldError(
                "resources.client_workers", f"{self.resources.client_workers} is more workers than clients "
                f"(data.num_clients={n}); allowed: 0..{n}"
            )
        if hp.clients_per_round is not None and hp.clients_per_round > n:
            raise FieldError(
                "algorithm.clients_per_round", f"{hp.clients_per_round} samples more clients than exist "
                f"(data.num_clients={n}); allowed: 1..{n}"
            )
        trained = self.trained_count()
        if trained < 1:
            raise FieldError("unseen_fraction", f"{self.unseen_fraction} holds out all {n} clients; allowed: a share that "
                                                "leaves at least one client to train")
        if hp.clients_per_round is not None and hp.clients_per_round > trained:
            raise FieldError("algorithm.clients_per_round", f"{hp.clients_per_round} samples more clients than train "
                                                            f"({trained} of {n}, unseen_fraction={self.unseen_fraction}); "
                                                            f"allowed: 1..{trained}")
        return self

    def unseen_count(self) -> int:
        """Clients held out of training: ⌈unseen_fraction · n⌉, the last ids."""
        return math.ceil(round(self.unseen_fraction * self.data.num_clients, 9))

    def trained_count(self) -> int:
        """Clients that train: the first n − :meth:`unseen_count` ids."""
        return self.data.num_clients - self.unseen_count()

    @property
    def num_clients(self) -> int:
        return self.data.num_clients

    def eval_rounds(self) -> set[int]:
        return {0, self.rounds} | set(range(self.eval_every, self.rounds + 1, self.eval_every))

    def run_data(self) -> DataConfig:
        """The data this run builds: ``data.seed: run`` resolved to the run's own seed (the split drawn again per
        seed; the setting, which leaves the seed out, stays one across the seeds)."""
        return self.data.model_copy(update={"seed": self.seed}) if self.data.seed == "run" else self.data

    def setting_key(self) -> str:
        """Identity of a hyperparameter setting: everything that changes the numbers, except the seed. A field of
        :data:`KEY_OMITS_AT_DEFAULT` at its default is left out: the runs made before it existed keep their keys."""
        d = self.model_dump(mode="json", exclude={"seed", "name", "resources", "tracking"})
        d = {name: without_new_defaults(name, value) if isinstance(value, dict) else value for name, value in d.items()}
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]

    def flat_params(self) -> dict[str, Any]:
        """All resolved fields as dotted keys, for MLflow params."""
        return flatten(self.model_dump(mode="json"))


#: Fields added after benchmark results were recorded (``fedsweep bench``'s state keeps setting keys), whose
#: default is the behaviour from before them: at that default they stay out of a setting's identity
#: (:meth:`ExperimentConfig.setting_key`), so those results keep their keys; any other value is part of it.
KEY_OMITS_AT_DEFAULT: dict[tuple[str, str], Any] = {
    ("data", "subsample"): 1.0, ("algorithm", "maml_steps"): 1, ("algorithm", "weight_decay"): 0.0, ("algorithm", "clip_norm"): None,
    ("model", "pool"): "each",
}


#: The same, for fields one algorithm gained after its results were recorded (another algorithm has had them
#: from the start, and keeps them in its keys): P-Avg's transform and the MAML transform's α and order.
KEY_OMITS_AT_DEFAULT_OF: dict[str, dict[str, Any]] = {
    "pavg": {"transform": "proto", "personalization_lr": 0.01, "maml_order": 1},
}


def without_new_defaults(section: str, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` (a dumped ``section``) without the :data:`KEY_OMITS_AT_DEFAULT` (and, in the algorithm section,
    :data:`KEY_OMITS_AT_DEFAULT_OF` its algorithm) fields that are at their default."""
    own = KEY_OMITS_AT_DEFAULT_OF.get(fields.get("name"), {}) if section == "algorithm" else {}
    return {k: v for k, v in fields.items() if KEY_OMITS_AT_DEFAULT.get((section, k), own.get(k, object())) != v}


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
        description="Times Tune reruns a trial that failed (its ServerActor died, a node was lost, the tracking "
        "server was away longer than tracking.outage_limit_s), from its last checkpoint into the same MLflow run; "
        "without one from round 0, the failed attempt's MLflow run deleted (FailureConfig.max_failures).",
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
            raise FieldError("num_samples", f"missing: search: {self.search!r} needs num_samples, the settings to draw for each grid point (e.g. 8)")
        if self.search == "optuna":
            import importlib.util

            if importlib.util.find_spec("optuna") is None:
                raise FieldError("search", "'optuna' needs the optuna package, which is not installed: "
                                 "pip install 'fedsweep[optuna]' (or pip install optuna)")
            if self.scheduler is not None and self.seeds and len(self.seeds) > 1:
                raise FieldError("scheduler", "with search: 'optuna' a trial runs its seeds one after another, so a "
                                 "scheduler would compare rounds of different seeds; allowed: one seed (seeds: [s]), "
                                 "or no scheduler")
        if self.search == "grid" and self.num_samples is not None:
            raise FieldError("num_samples", "only a random or Optuna search draws samples (search: random | optuna); "
                             "a grid runs each point once per seed")
        return self

    @model_validator(mode="after")
    def _distinct_seeds(self):
        if self.seeds and len(set(self.seeds)) < len(self.seeds):
            twice = sorted({s for s in self.seeds if self.seeds.count(s) > 1})
            raise FieldError("seeds", f"{twice} given more than once; each seed is one independent run, give each once")
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
