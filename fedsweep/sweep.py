"""Sweeps: the expanded grid runs as Ray Tune trials, each one an experiment logged as a nested MLflow run."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune

from fedsweep.config import ExperimentConfig, Sweep
from fedsweep.experiment import check_cluster, connect_ray, execute
from fedsweep.tracking import TAG_PREFIX, RunLogger, client, ensure_experiment, resolve_tracking_uri


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _trial(config: dict[str, Any], configs: list[ExperimentConfig], overrides: list[dict], tracking: dict[str, str]) -> None:
    """Tune function trainable: one experiment, reported to Tune at every evaluation round."""
    index = config["point"]["trial"]
    cfg = configs[index]
    ctx = tune.get_context()
    logger = RunLogger(
        tracking["uri"],
        tracking["experiment_id"],
        cfg,
        run_name=f"{cfg.algorithm.name}-{index:03d}",
        parent_run_id=tracking["parent_run_id"],
        overrides=overrides[index],
        tags={"ray.trial_id": ctx.get_trial_id(), f"{TAG_PREFIX}trial_index": str(index)},
    )

    def report(metrics: dict[str, float]) -> None:
        if "global_accuracy" in metrics or metrics.get("diverged"):
            tune.report({k: float(v) for k, v in metrics.items()})

    execute(cfg, logger, report, trial_placement_group=ray.util.get_current_placement_group())


def run_sweep(sweep: Sweep, verbose: int = 1) -> dict[str, Any]:
    """Run every trial of ``sweep``; returns the parent run id, the Tune results and the error count."""
    from ray.tune import PlacementGroupFactory

    configs = [t.config for t in sweep.trials]
    first = configs[0]
    connect_ray(first.resources)
    check_cluster(configs, sweep.path)

    settings = sweep.settings
    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    experiment_id = ensure_experiment(uri, first.tracking.experiment)
    mlflow = client(uri)
    parent = mlflow.create_run(
        experiment_id,
        run_name=settings.name,
        tags={
            f"{TAG_PREFIX}sweep": "true",
            f"{TAG_PREFIX}metric": settings.metric,
            f"{TAG_PREFIX}mode": settings.mode,
            f"{TAG_PREFIX}trials": str(len(configs)),
            f"{TAG_PREFIX}yaml_sha1": sweep.source_hash(),
            f"{TAG_PREFIX}source_file": sweep.path,
            "mlflow.source.git.commit": _git_sha(),
        },
    ).info.run_id
    mlflow.log_text(parent, sweep.source, "sweep.yaml")
    tracking = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent}

    overrides = [t.overrides for t in sweep.trials]
    trainable = tune.with_parameters(_trial, configs=configs, overrides=overrides, tracking=tracking)
    trainable = tune.with_resources(
        trainable,
        lambda spec: PlacementGroupFactory(
            configs[spec["point"]["trial"]].resources.bundles(configs[spec["point"]["trial"]].num_clients),
            strategy="PACK",
        ),
    )
    storage = settings.storage_path
    if "://" not in storage:
        storage = str(Path(storage).resolve())
    tuner = tune.Tuner(
        trainable,
        param_space={"point": tune.grid_search([{"trial": t.index, **t.overrides} for t in sweep.trials])},
        tune_config=tune.TuneConfig(
            metric=settings.metric,
            mode=settings.mode,
            max_concurrent_trials=settings.max_concurrent_trials,
            # A finished trial's actor (torch imported, bundle reserved) runs the next trial of equal
            # resources: one process start fewer per trial.
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            name=f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}", storage_path=storage, verbose=verbose
        ),
    )
    status = "FAILED"
    try:
        results = tuner.fit()
        errors = sum(1 for r in results if r.error is not None)
        status = "FINISHED" if errors == 0 else "FAILED"
    finally:
        mlflow.set_terminated(parent, status)
    return {"parent_run_id": parent, "results": results, "errors": errors, "tracking_uri": uri, "experiment_id": experiment_id}
