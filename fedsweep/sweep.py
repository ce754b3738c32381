"""Sweeps: the expanded grid runs as Ray Tune trials, each one an experiment logged as a nested MLflow run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import tune

from fedsweep import checkpoint as checkpoint_files
from fedsweep import search
from fedsweep.config import ConfigError, ExperimentConfig, Sweep, resolve_tracking_uri
from fedsweep.experiment import check_cluster, connect_ray, execute
from fedsweep.stopping import STOPPED_AFTER, MarkingASHA, end_interrupted, interrupted, mark_stopped_early, trial_runs
from fedsweep.storage import Storage
from fedsweep.tracking import (
    STOPPED_EARLY,
    TAG_PREFIX,
    RunLogger,
    client,
    end_run,
    ensure_experiment,
    pyplot,
    trial_title,
    warm_up,
)


def _git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


#: Written into the Tune experiment folder when a sweep starts: what `--resume` needs to find it again.
SWEEP_STATE = "fedsweep_sweep.json"
#: Seconds between two evaluation rounds a trial without a scheduler reports to Tune (its last one always).
REPORT_EVERY_S = 0.5


def _earlier_attempts(tracking: dict[str, str], trial_id: str, seed: int, keep: str | None = None):
    """Before a trial's experiment on ``seed`` (re)starts, its earlier MLflow runs under this sweep: one that
    finished (or diverged, or was stopped early) is returned, so it is not rerun — Tune may not have recorded
    its end before the driver died; unfinished ones (driver killed: RUNNING; crashed: FAILED) are marked
    KILLED and deleted, so that the sweep ends with exactly one run per trial and seed; ``keep`` (the run a
    checkpoint continues) stays."""
    mlflow = client(tracking["uri"])
    earlier = trial_runs(mlflow, tracking, trial_id, f" and tags.`{TAG_PREFIX}seed` = '{seed}'")
    done = None
    for run in earlier:
        tags = run.data.tags
        # stopped by the scheduler (marked stopped_early at the sweep's end); without one nothing stops a trial
        # early, and a stopped_early mark there is an interruption's (fedsweep before 2026-11-26): rerun
        stopped = bool(tracking.get("scheduler")) and (tags.get(f"{TAG_PREFIX}outcome") == STOPPED_EARLY or STOPPED_AFTER in tags)
        if (tags.get(f"{TAG_PREFIX}outcome") in ("finished", "diverged") or stopped) and done is None:
            done = run
        elif run.info.run_id != keep:
            if run.info.status == "RUNNING":
                mlflow.set_terminated(run.info.run_id, "KILLED")
            mlflow.delete_run(run.info.run_id)
    return done


def quiet_ignored_exit() -> None:
    """In this (trial) process, an exit that Python could not raise is not printed. At a sweep's end Ray ends an idle
    reused trial process with SIGTERM; its handler raises SystemExit, and when that lands in a garbage-collector
    callback Python ignores it and prints "Exception ignored in ..." with a traceback into the sweep's log, for an
    ending that is no error. Every other ignored exception is printed as before."""
    if getattr(sys.unraisablehook, "fedsweep_quiet_exit", False):
        return
    printed = sys.unraisablehook

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, SystemExit):
            printed(unraisable)

    hook.fedsweep_quiet_exit = True
    sys.unraisablehook = hook


def _experiment(cfg: ExperimentConfig, overrides: dict, index: int, tracking: dict[str, str], checkpoint_every: int,
                checkpoints: tuple[Storage, str] | None, to_tune: Callable[[dict[str, float]], None]) -> dict[str, float]:
    """One experiment of a trial, its own MLflow run, its evaluation rounds passed to ``to_tune`` (all of them under
    a scheduler; else one at most every :data:`REPORT_EVERY_S`, and the last); returns its last evaluation's
    metrics. Every ``checkpoint_every`` rounds it saves a checkpoint in ``checkpoints`` (the sweep's storage and
    this experiment's folder there; kept by fedsweep, not Tune, so that what is stored never depends on when Tune
    last saved its own state); an experiment that starts again (resume, retry, on any node) goes on from the
    newest one."""
    # A process Tune reuses for its next trial (reuse_actors) is reset only once this trial's thread has ended — its
    # MLflow run closed, plots and table written — and Tune waits TUNE_FUNCTION_THREAD_TIMEOUT_S for that (2 s by
    # default), then fails the *next* trial ("Trainable runner reuse requires reset_config() ..."). A trial ASHA
    # stopped took longer than 2 s to close on a loaded 2-core machine (the suite under two pytest workers).
    os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", "300")
    quiet_ignored_exit()
    ctx = tune.get_context()
    saved = checkpoint_files.load_latest(*checkpoints) if checkpoints else None
    resume, run_id = saved[0] if saved else None, saved[1]["run_id"] if saved else None
    done = _earlier_attempts(tracking, ctx.get_trial_id(), cfg.seed, keep=run_id)
    if done is not None:  # finished before an interruption: its final metrics, not a rerun
        tags = done.data.tags
        diverged = tags.get(f"{TAG_PREFIX}outcome") == "diverged"
        final = {k: float(v) for k, v in done.data.metrics.items()}
        if diverged:
            final["diverged"] = 1.0
        else:  # the round a scheduler counts in (a run stopped early: the round it was stopped at)
            final["round"] = float(tags.get(STOPPED_AFTER, cfg.rounds))
        to_tune(final)
        return final
    logger = RunLogger(
        tracking["uri"],
        tracking["experiment_id"],
        cfg,
        run_name=f"{trial_title(cfg, overrides)} #{index}",
        parent_run_id=tracking["parent_run_id"],
        overrides=overrides,
        tags={"ray.trial_id": ctx.get_trial_id(), f"{TAG_PREFIX}trial_index": str(index)},
        run_id=run_id,
    )
    if resume is not None:
        logger.client.set_tag(logger.run_id, f"{TAG_PREFIX}resumed_after_round", str(resume["round"]))
    last: dict[str, float] = {}
    told = {"at": -math.inf, "round": None}  # when Tune was last told an evaluation round, and which

    def report(metrics: dict[str, float]) -> None:
        if "personalized_accuracy_mean" in metrics or metrics.get("diverged"):  # an evaluation round
            last.clear()
            last.update({k: float(v) for k, v in metrics.items()})
            scheduled = bool(tracking.get("scheduler"))
            if scheduled:  # the scheduler may stop the trial on this report, and its process may end
                logger.flush()  # before the writer's thread wrote the rounds: written first
            # A report holds the trial until Tune's driver has taken it (a round trip through the driver's loop:
            # 4-5 ms, 0.1 s of a 1.5-s trial's 21); without a scheduler nothing decides on the rounds between, so
            # Tune hears of one at most every REPORT_EVERY_S, and of the last one always (below)
            if scheduled or metrics.get("diverged") or time.monotonic() - told["at"] >= REPORT_EVERY_S:
                to_tune(dict(last))
                told.update(at=time.monotonic(), round=last["round"])

    def save_and_report(metrics: dict[str, float], checkpoint: dict) -> None:
        # saved once MLflow holds every round before it (a resumed run finds them there), by the writer's thread:
        # the trial does not wait for the writes (0.45 s of a 3.6-s MNIST trial's checkpoints every 5 rounds did)
        files = checkpoint_files.encode(checkpoint, {"run_id": logger.run_id})
        logger.after_written(lambda: checkpoint_files.write_latest(*checkpoints, checkpoint["round"], *files))
        report(metrics)

    execute(cfg, logger, report, trial_placement_group=ray.util.get_current_placement_group(),
            checkpoint_every=checkpoint_every if checkpoints else 0, on_checkpoint=save_and_report, resume=resume)
    if last and last["round"] != told["round"]:  # the final evaluation round, which Tune selects on
        to_tune(dict(last))
    return last


def _trial(config: dict[str, Any], configs: list[ExperimentConfig], overrides: list[dict], tracking: dict[str, str],
           checkpoint_every: int = 0, checkpoint_root: tuple[Storage, str] | None = None) -> None:
    """Tune function trainable of a grid or random search: one experiment, reported to Tune at every
    evaluation round, checkpointed under ``checkpoint_root`` (a storage and a folder there) ``/trial_NNNN``."""
    index = config["trial"]
    _experiment(configs[index], overrides[index], index, tracking, checkpoint_every, _under(checkpoint_root, f"trial_{index:04d}"),
                lambda metrics: tune.report(metrics))


def _under(folder: tuple[Storage, str] | None, *parts: str) -> tuple[Storage, str] | None:
    return (folder[0], posixpath.join(folder[1], *parts)) if folder else None


def _setting_trial(config: dict[str, Any], points: list[tuple[Any, dict]], seeds: list[int | None], metric: str,
                   tracking: dict[str, str], file: str, checkpoint_every: int = 0,
                   checkpoint_root: tuple[Storage, str] | None = None) -> None:
    """Tune function trainable of an Optuna search: the drawn setting on every seed, one after another, each its
    own MLflow run. Each report carries the seed's metrics, and as ``metric`` the mean over the seeds so far
    (the finished ones' last value and the running one's current value): the study is told the mean over
    every seed's final value."""
    index = config["trial"]
    cfgs, overrides = setting_configs(config, points, seeds, file)
    finals: list[float] = []
    for cfg in cfgs:
        trial_dir = _under(checkpoint_root, f"trial_{index:04d}", f"seed_{cfg.seed}")

        def to_tune(metrics: dict[str, float], seed: int = cfg.seed) -> None:
            if metric in metrics:
                metrics = {**metrics, metric: float(sum(finals) + metrics[metric]) / (len(finals) + 1)}
            tune.report({**metrics, "seed": float(seed)})

        last = _experiment(cfg, {**overrides, "seed": cfg.seed}, index, tracking, checkpoint_every, trial_dir, to_tune)
        if last.get("diverged") or metric not in last:
            return  # a setting any of whose seeds diverged is not eligible: its other seeds need not run
        finals.append(last[metric])


def setting_configs(config: dict[str, Any], points: list[tuple[Any, dict]], seeds: list[int | None],
                    file: str = "<sweep>") -> tuple[list[ExperimentConfig], dict[str, Any]]:
    """The configs (one per seed) and the overrides of the setting an Optuna study drew (``config`` as
    :class:`~fedsweep.optuna_search.PointwiseOptuna` suggests it)."""
    from fedsweep.loading import validate

    value, fixed = points[config["point"]]
    drawn, picked = search.substitute(value, config["drawn"])
    cfgs = [validate({**drawn, **({"seed": seed} if seed is not None else {})}, file) for seed in seeds]
    return cfgs, {**fixed, **picked}


class _Progress(tune.Callback):
    """One line at each trial's end: trials done, running and waiting, and the time left at the pace so far."""

    def __init__(self, total: int):
        self.total, self.t0, self.ended_here = total, time.monotonic(), set()

    def setup(self, **info) -> None:  # also when a resumed sweep starts: its pace is this process's
        self.t0, self.ended_here = time.monotonic(), set()

    def on_trial_complete(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trials, trial)

    def on_trial_error(self, iteration: int, trials: list, trial, **info) -> None:
        self._line(trials, trial)

    def _line(self, trials: list, ended) -> None:
        self.ended_here.add(ended.trial_id)
        done = {t.trial_id for t in trials if t.status in ("TERMINATED", "ERROR")} | {ended.trial_id}
        running = sum(t.status == "RUNNING" and t.trial_id not in done for t in trials)
        elapsed = time.monotonic() - self.t0
        left = elapsed / len(self.ended_here) * (self.total - len(done))
        print(f"[fedsweep] {len(done)}/{self.total} trials done, {running} running, "
              f"{self.total - len(done) - running} waiting; {_duration(elapsed)} so far, about {_duration(left)} left",
              flush=True)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m{s:02d}s"


def _import_for_the_report(figures: bool) -> None:
    """Import the report's libraries (pandas, SciPy's t quantile, with ``figures`` matplotlib's pyplot) in a thread
    while the trials run: the sweep's end, where this process alone works and the cores are idle, no longer waits
    for them (the 0.5-s import of pyplot of a 1.3-s end; docs/performance.md, "Fifty-second session"). An import
    that fails here fails again, and is reported, where the report imports it."""

    def load() -> None:
        with contextlib.suppress(Exception):
            import scipy.special  # noqa: F401

            from fedsweep import report  # noqa: F401

            if figures:
                pyplot()

    threading.Thread(target=load, name="report-imports", daemon=True).start()


def _log_report(uri: str, first: ExperimentConfig, parent: str, settings) -> None:
    """The sweep's report on its parent run (:mod:`fedsweep.report`; figures unless ``tracking.log_plot`` is off);
    a failure to draw it is said, and loses nothing the trials logged."""
    from fedsweep.report import build_report, log_report

    experiment = first.tracking.experiment
    try:
        report = build_report(uri, experiment, parent, settings.metric, settings.mode, settings.table_group_by,
                              settings.target_accuracy, settings.select_on, first.tracking.log_plot)
        log_report(uri, parent, report)
    except Exception as e:  # noqa: BLE001 - the trials' runs are what matters; the report can be rebuilt
        print(f"warning: the sweep report was not logged ({type(e).__name__}: {e}); rebuild it with "
              f"fedsweep report --experiment {experiment} --sweep-run {parent}", file=sys.stderr)


def _scheduler(settings, configs: list[ExperimentConfig], tracking: dict[str, str]):
    """Tune's ASHA on rounds (each report is an evaluation round; ``round`` grows with it), marking the runs it
    stops (:mod:`fedsweep.stopping`), or None."""
    if settings.scheduler is None:
        return None
    asha = settings.scheduler.asha
    return MarkingASHA(tracking, time_attr="round", grace_period=asha.grace_rounds, reduction_factor=asha.reduction_factor,
                       max_t=max(c.rounds for c in configs))


def open_storage(sweep: Sweep) -> Storage:
    """The sweep's storage, its folder created; a ConfigError naming ``sweep.storage_path`` when it cannot be
    reached (no such bucket, no credentials, no server), before any cluster work."""
    try:
        storage = Storage(sweep.settings.storage_path)
        storage.ensure()
    except (OSError, ValueError) as e:
        raise ConfigError([f"{sweep.path}: sweep.storage_path: {sweep.settings.storage_path!r} cannot be used: {e}"]) from None
    return storage


def find_resumable(sweep: Sweep, storage: Storage) -> tuple[str, dict]:
    """The newest Tune experiment folder of this sweep (same name, same file contents) in ``storage`` that Tune
    can restore, with its saved state; a ConfigError naming ``sweep.storage_path`` when there is none. It reads
    the storage only: a driver on another machine than the interrupted one finds it the same way."""
    states = [storage.path(folder, SWEEP_STATE) for folder in storage.folders(storage.root, f"{sweep.settings.name}-")]
    written = {f: storage.file_mtime(f) for f in states}
    candidates = sorted((f for f, t in written.items() if t is not None), key=written.__getitem__, reverse=True)
    for state_file in candidates:
        state = json.loads(storage.read_bytes(state_file))
        folder = posixpath.dirname(state_file)
        if state.get("yaml_sha1") == sweep.source_hash() and tune.Tuner.can_restore(
                folder, storage_filesystem=storage.tune_location()[1]):
            if unsafe := storage.others_could_write(folder):  # Tune unpickles them: code another user put there
                raise ConfigError([(f"{sweep.path}: sweep.storage_path: refusing to resume from {folder}: Ray Tune "
                                    f"unpickles its files, and another user could have written {'; '.join(unsafe)}; "
                                    "allowed: a folder and files only you can write (chmod go-w)")])
            return folder, state
    raise ConfigError([
        f"{sweep.path}: sweep.storage_path: nothing to resume — no restorable Tune experiment of sweep "
        f"'{sweep.settings.name}' with this file's contents under {storage.location}"
        + (f" (found {len(candidates)} of other contents or unrestorable)" if candidates else "")
    ])


def sweep_tags(sweep: Sweep, trials: int) -> dict[str, str]:
    """The tags of a sweep's parent run: what ``fedsweep table`` and the report read (metric, mode, selection, …)."""
    settings = sweep.settings
    return {
        f"{TAG_PREFIX}sweep": "true",
        f"{TAG_PREFIX}metric": settings.metric,
        f"{TAG_PREFIX}mode": settings.mode,
        f"{TAG_PREFIX}select_on": settings.select_on,
        f"{TAG_PREFIX}search": settings.search,
        **({f"{TAG_PREFIX}scheduler": json.dumps(settings.scheduler.model_dump())} if settings.scheduler else {}),
        **({f"{TAG_PREFIX}target_accuracy": str(settings.target_accuracy)} if settings.target_accuracy else {}),
        f"{TAG_PREFIX}table_group_by": json.dumps(settings.table_group_by),
        f"{TAG_PREFIX}trials": str(trials),
        f"{TAG_PREFIX}yaml_sha1": sweep.source_hash(),
        f"{TAG_PREFIX}source_file": sweep.path,
        "mlflow.source.git.commit": _git_sha(),
    }


def run_sweep(sweep: Sweep, verbose: int = 1, resume: bool = False, tags: dict[str, str] | None = None) -> dict[str, Any]:
    """Run every trial of ``sweep``; returns the parent run id, the Tune results and the error count.

    ``resume``: continue the newest interrupted run of this sweep (Tune's restore). Finished trials
    are not rerun; unfinished and errored ones start again from round 0 (same seeds, same numbers),
    their earlier, unfinished MLflow runs deleted; the parent MLflow run is the original one.
    ``tags``: more tags of the parent run (`fedsweep bench` nests a method's sweeps under its own run).
    """
    from ray.tune import PlacementGroupFactory
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

    configs = [t.config for t in sweep.trials]
    first = configs[0]
    storage = open_storage(sweep)  # before any cluster work
    restore_from = find_resumable(sweep, storage) if resume else None
    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    mlflow_ready = warm_up(uri)  # while Ray starts
    connect_ray(first.resources)
    check_cluster(configs, sweep.path)
    mlflow_ready.join()

    settings = sweep.settings
    experiment_id = ensure_experiment(uri, first.tracking.experiment)
    mlflow = client(uri)
    if restore_from is not None:
        experiment_dir, state = restore_from
        parent = state["parent_run_id"]
        mlflow.update_run(parent, status="RUNNING")
    else:
        name = f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        experiment_dir = storage.path(name)
        parent = mlflow.create_run(experiment_id, run_name=settings.name, tags={**sweep_tags(sweep, len(configs)), **(tags or {})}
                                   ).info.run_id
    tracking = {"uri": uri, "experiment_id": experiment_id, "parent_run_id": parent,
                "scheduler": "asha" if settings.scheduler is not None else ""}
    checkpoint_root = (storage, posixpath.join(experiment_dir, "fedsweep_checkpoints"))
    if sweep.points is None:  # grid or random search: the trials are known; Tune runs them by index
        trainable = tune.with_parameters(
            _trial, configs=configs, overrides=[t.overrides for t in sweep.trials], tracking=tracking,
            checkpoint_every=settings.checkpoint_every, checkpoint_root=checkpoint_root,
        )
        placed = lambda spec: configs[spec["trial"]]
        titles = [trial_title(t.config, t.overrides) for t in sweep.trials]
        title = lambda config: titles[config["trial"]]
        total, search_config = len(sweep.trials), {"param_space": {"trial": tune.grid_search([t.index for t in sweep.trials])}}
    else:  # an Optuna search: a trial is a setting its study draws, run on every seed
        seeds = settings.seeds or [None]
        trainable = tune.with_parameters(
            _setting_trial, points=sweep.points, seeds=seeds, metric=settings.selection_metric(), tracking=tracking,
            file=sweep.path, checkpoint_every=settings.checkpoint_every, checkpoint_root=checkpoint_root,
        )
        placed = lambda spec: configs[spec["point"] * len(seeds)]

        def title(config: dict) -> str:
            cfgs, overrides = setting_configs(config, sweep.points, seeds[:1])
            return trial_title(cfgs[0], overrides).replace(f"seed={cfgs[0].seed}", f"{len(seeds)} seed(s)")

        total = settings.num_samples * len(sweep.points)
        from fedsweep.optuna_search import PointwiseOptuna

        study = PointwiseOptuna([search.optuna_space(value) for value, _ in sweep.points], settings.num_samples,
                                settings.selection_metric(), settings.mode, settings.search_seed)
        search_config = {"search_alg": study, "num_samples": total}
    trainable = tune.with_resources(
        trainable,
        lambda spec: PlacementGroupFactory(placed(spec).resources.bundles(placed(spec).num_clients),
                                           strategy=placed(spec).resources.placement_strategy.upper()),
    )
    # Tune's result files per trial: its CSV and JSON ones (what its ResultGrid reads), not its TensorBoard files,
    # which cost the driver CPU on every report (docs/performance.md, section 8) for metrics MLflow holds.
    # TUNE_DISABLE_AUTO_CALLBACK_LOGGERS=0 brings them back.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    callbacks = [*([_Progress(total)] if verbose else []), CSVLoggerCallback(), JsonLoggerCallback()]
    if restore_from is not None:
        tuner = tune.Tuner.restore(experiment_dir, trainable, resume_unfinished=True, restart_errored=True,
                                   storage_filesystem=storage.tune_location()[1])
    else:
        mlflow.log_text(parent, sweep.source, "sweep.yaml")
        tuner = tune.Tuner(
            trainable,
            # a grid's param space is the trial's index only: its values are in its name, its MLflow params and
            # the sweep file (a dict here made Tune's console show a truncated "point" column)
            param_space=search_config.get("param_space"),
            tune_config=tune.TuneConfig(
                search_alg=search_config.get("search_alg"),
                num_samples=search_config.get("num_samples", 1),
                # the console and the Tune folders name trials by what they are, not by an opaque point
                trial_name_creator=lambda trial: f"{title(trial.config)} #{trial.config['trial']}",
                trial_dirname_creator=lambda trial: f"trial_{trial.config['trial']:04d}_{trial.trial_id}",
                metric=settings.selection_metric(),  # what a searcher or scheduler optimises
                mode=settings.mode,
                max_concurrent_trials=settings.max_concurrent_trials,
                scheduler=_scheduler(settings, configs, tracking),
                # A finished trial's actor (torch imported, bundle reserved) runs the next trial of equal
                # resources: one process start fewer per trial.
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=name,
                storage_path=storage.tune_location()[0],
                storage_filesystem=storage.tune_location()[1],
                verbose=verbose,
                failure_config=tune.FailureConfig(max_failures=settings.trial_retries),
                callbacks=callbacks,
            ),
        )
        state = {"parent_run_id": parent, "yaml_sha1": sweep.source_hash(), "source_file": sweep.path}
        storage.write_bytes(posixpath.join(experiment_dir, SWEEP_STATE), json.dumps(state, indent=1).encode())
    status = "FAILED"
    try:
        _import_for_the_report(first.tracking.log_plot)
        results = tuner.fit()
        stopped = mark_stopped_early(tracking) if settings.scheduler is not None else set()
        if cut := interrupted(results, total, lambda config: placed(config).rounds, stopped):  # Ctrl-C
            end_interrupted(tracking)
        errors = sum(1 for r in results if r.error is not None)
        status = "KILLED" if cut else "FINISHED" if errors == 0 else "FAILED"
        _log_report(uri, first, parent, settings)
    finally:
        end_run(uri, parent, status)
    return {"parent_run_id": parent, "results": results, "errors": errors, "interrupted": cut, "tracking_uri": uri,
            "experiment_id": experiment_id}
