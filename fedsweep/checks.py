"""Whether a plan can run here, before anything starts: where the runs go (tracking URI, Ray address, storage
path), whether every trial fits the cluster (before connecting: this machine or the ``cluster_*`` fields; after:
the cluster itself, :func:`fedsweep.experiment.check_cluster`; both by :func:`check_fits`), and the datasets."""

from __future__ import annotations

import math
import os
from pathlib import Path

from fedsweep.algorithms import ALGORITHMS
from fedsweep.config import RAY_ADDRESS_PATTERN, ConfigError, ExperimentConfig, resolve_tracking_uri
from fedsweep.data import input_features, num_classes
from fedsweep.models import FlatModel, build_model


def check_fits(cfg: ExperimentConfig, cluster_cpus: float, cluster_gpus: float, memory_mb: float | None, where: str,
               nodes: list[dict[str, float]] | None = None) -> list[str]:
    """Problems that would make the trial's placement group wait forever, or exhaust memory: the whole plan
    against the cluster's CPUs and GPUs, and ``memory_mb`` (None: not checked); where the cluster's live
    ``nodes`` are known (after connecting), also each bundle against the largest of them. The one fit check,
    before connecting (:func:`check_resources`) and after (:func:`fedsweep.experiment.check_cluster`)."""
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
            f"{where}: resources.client_cpus: one trial needs server_cpus + {actors} × client_cpus = "
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
                field, hint = ("model.hidden" if hasattr(cfg.model, "hidden") else "model.name"), "allowed: a smaller model, or fewer clients"
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
    if nodes is not None:
        problems += _bundle_problems(cfg, nodes, where)
    return problems


def _bundle_problems(cfg: ExperimentConfig, nodes: list[dict[str, float]], where: str) -> list[str]:
    """On a cluster of several nodes, a bundle larger than every node would wait forever, though the sum fits."""
    problems = []
    server, *clients = cfg.resources.bundles(cfg.num_clients)
    for holder, bundle in (("server", server), ("client", clients[0] if clients else {})):
        for kind in bundle:
            largest = max((n.get(kind, 0.0) for n in nodes), default=0.0)
            if bundle[kind] > largest + 1e-9:
                problems.append(f"{where}: resources.{holder}_{kind.lower()}s: a bundle of {bundle[kind]:g} {kind} fits on no node of this "
                                f"cluster (the largest has {largest:g}); allowed: <= {largest:g}")
    return problems


def raise_problems(problems: list[str]) -> None:
    """Raise a :class:`ConfigError` of ``problems``, each once, in order; nothing when there is none."""
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))


def parameter_memory(cfg: ExperimentConfig) -> tuple[int, int]:
    """The model's parameter count and the floats of state each client keeps between rounds (the
    algorithm's initial client state, sized on PyTorch's meta device: nothing is allocated)."""
    import torch

    with torch.device("meta"):
        model = FlatModel(build_model(cfg.model, input_features(cfg.data), num_classes(cfg.data)))
    state = ALGORITHMS[cfg.algorithm.name](cfg.algorithm, model).init_client_state(torch.empty(model.numel, device="meta"))
    return model.numel, sum(v.numel() for v in state.values())


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
                f"{file}: resources.cluster_gpus: {gpus:g}, but this machine has {local[1]:g} GPU(s): Ray would count "
                f"GPUs that are not there and the clients would train on the CPU; allowed: 0..{local[1]:g}, or null (detected)"
            )
        problems += check_fits(cfg, cpus, gpus, None if r.address() else local[2], file)
    raise_problems(problems)


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


def _store_problem(location: str) -> str | None:
    """Why the object store at ``location`` cannot be read (no server, no credentials); None when it answers.
    Read only: the sweep creates its folder when it starts (:meth:`fedsweep.storage.Storage.ensure`)."""
    from fedsweep.storage import Storage

    try:
        storage = Storage(location)
        storage.fs.get_file_info(storage.root)
    except (OSError, ValueError) as e:
        return str(e)
    return None


def check_environment(configs: list[ExperimentConfig], file: str, storage_path: str | None = None) -> None:
    """Where the runs will go, before anything starts: the tracking URI, the Ray address (the config's or
    $RAY_ADDRESS) and the sweep's storage path are ones that can be used."""
    import re
    from urllib.parse import urlparse

    problems: list[str] = []
    first = configs[0]
    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    source = "tracking.tracking_uri" if first.tracking.tracking_uri else ("$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "the default tracking URI")
    if problem := tracking_uri_problem(uri):
        problems.append(f"{file}: {source}: {uri!r}: {problem}")
    address, source = first.resources.address(), ("resources.ray_address" if first.resources.ray_address else "$RAY_ADDRESS")
    if address and not re.match(RAY_ADDRESS_PATTERN, address):
        problems.append(f"{file}: {source}: {address!r} is not a Ray address; allowed: auto, host:port or ray://host:port")
    elif address and (problem := _unreachable(address)):
        problems.append(f"{file}: {source}: {address!r}: {problem}; start the cluster (ray start --head) or fix the address")
    if storage_path is not None:
        if "://" in storage_path:
            scheme = urlparse(storage_path).scheme
            if scheme not in STORAGE_SCHEMES:
                problems.append(f"{file}: sweep.storage_path: unknown scheme {scheme!r}; allowed: {', '.join(STORAGE_SCHEMES)}, or a local folder")
            elif scheme == "file":
                if problem := _folder_problem(Path(urlparse(storage_path).path)):
                    problems.append(f"{file}: sweep.storage_path: {problem}")
            elif not urlparse(storage_path).netloc:
                problems.append(f"{file}: sweep.storage_path: {storage_path!r} names no bucket (or host); allowed: "
                                f"{scheme}://bucket/folder")
            elif problem := _store_problem(storage_path):
                problems.append(f"{file}: sweep.storage_path: {storage_path!r} cannot be used: {problem}")
        elif problem := _folder_problem(Path(storage_path).resolve()):
            problems.append(f"{file}: sweep.storage_path: {problem}")
    if problems:
        raise ConfigError(problems)


def check_data(configs: list[ExperimentConfig], file: str, keep: bool = False) -> None:
    """Image datasets: the files are there and the split is feasible, before Ray starts (local runs only:
    on a cluster the files live on the nodes). The dataset of a single experiment is kept for its run in this
    process (:func:`fedsweep.data.built_or_build`; ``keep``: the one experiment `run` takes from a file of several
    seeds): built once per command."""
    from fedsweep.data import ImageConfig, build_federated_dataset, keep_built

    problems: list[str] = []
    seen = set()
    for cfg in configs:
        data = cfg.run_data()
        if not isinstance(data, ImageConfig) or cfg.resources.address() or data in seen:
            continue
        seen.add(data)
        try:
            run_here = len(configs) == 1 or keep  # else the trials build it, in their own processes
            built = build_federated_dataset(data, inputs=run_here)
            if run_here:
                keep_built(data, built)
        except (OSError, ValueError) as e:
            if f"{file}: {e}" not in problems:
                problems.append(f"{file}: {e}")
    if problems:
        raise ConfigError(problems)


def check_before_start(configs: list[ExperimentConfig], file: str, storage_path: str | None = None, keep: bool = False) -> None:
    """What `validate`, `run` and `sweep` all check after the schema and before any Ray or MLflow work:
    where the runs go, whether the trials fit the cluster, and the dataset files."""
    check_environment(configs, file, storage_path)
    check_resources(configs, file)
    check_data(configs, file, keep)
