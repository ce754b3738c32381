"""How a sweep's trials ended: to its last round, stopped early by the scheduler, or interrupted (Ctrl-C).

Tune stops a trial the same way in the last two cases (``SystemExit`` at its next report). The scheduler knows
when it decides: :class:`MarkingASHA` tags the run then (``fedsweep.stopped_after_round``), in MLflow, so the
mark outlives the driver, and before the trial's thread sees the stop. That thread ends a tagged run FINISHED with
outcome ``stopped_early`` (counted, never a best setting) and any other KILLED (:func:`fedsweep.experiment.execute`).
At the sweep's end :func:`mark_stopped_early` does the same for each tagged run whose thread did not (its process
ended first, or the tag came later: an outage). Tune returns from a stopped trial without waiting for its thread,
so both may write; both write the same ending (a KILLED written after the driver's mark failed CI on 2026-11-27),
and the same tag written by both at once is stored once (:func:`fedsweep.tracking.set_shared_tag`: two first
writes collided in CI later that day).
A run stopped without the tag was interrupted, and ``--resume`` reruns it (:func:`fedsweep.sweep._earlier_attempts`
deletes it, or its checkpoint goes on).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from ray.tune.schedulers import ASHAScheduler

from fedsweep.tracking import STOPPED_AFTER, STOPPED_EARLY, TAG_PREFIX, client, set_shared_tag


def sweep_runs(mlflow, tracking: dict[str, str], also: str = ""):
    """The MLflow runs under this sweep's parent run (``also``: more of the filter, starting with " and ")."""
    return mlflow.search_runs([tracking["experiment_id"]], max_results=50000,
                              filter_string=f"tags.`mlflow.parentRunId` = '{tracking['parent_run_id']}'{also}")


def trial_runs(mlflow, tracking: dict[str, str], trial_id: str, also: str = ""):
    """The MLflow runs of Tune trial ``trial_id`` under this sweep's parent run (``also``: more of the filter)."""
    return sweep_runs(mlflow, tracking, f" and tags.`ray.trial_id` = '{trial_id}'{also}")


class MarkingASHA(ASHAScheduler):
    """Tune's ASHA on rounds, which tags the running MLflow run of each trial it stops before that run's last
    round with the round it stopped at, when it decides. A tag the tracking server does not take (an outage) is
    tried again at the next decision; an error here never reaches Tune's loop."""

    def __init__(self, tracking: dict[str, str], **asha):
        super().__init__(**asha)
        self._tracking = tracking
        self._untagged: list[tuple[str, int]] = []

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        decision = super().on_trial_result(tune_controller, trial, result)
        # a result that diverged ends its trial anyway, FAILED: the scheduler's stop is not what ended it
        if decision == self.STOP and "round" in result and not result.get("diverged"):
            self._untagged.append((trial.trial_id, int(result["round"])))
        with contextlib.suppress(Exception):  # the tracking server is away: the next decision tries again
            mlflow = client(self._tracking["uri"]) if self._untagged else None
            while self._untagged:
                trial_id, stopped_at = self._untagged[0]
                for run in trial_runs(mlflow, self._tracking, trial_id):
                    # (an Optuna trial's earlier seeds ran to the end; the stopped seed's run is RUNNING, or KILLED
                    # once its thread saw the stop)
                    if (run.data.tags.get(f"{TAG_PREFIX}outcome") not in ("finished", "diverged")
                            and stopped_at < int(run.data.params.get("rounds", 0))):
                        mlflow.set_tag(run.info.run_id, STOPPED_AFTER, str(stopped_at))
                self._untagged.pop(0)
        return decision


def mark_stopped_early(tracking: dict[str, str]) -> set[str]:
    """Each run of this sweep that the scheduler stopped (tagged, in this driver's life or an earlier one's):
    FINISHED with outcome stopped_early. Returns their trials' ids."""
    mlflow = client(tracking["uri"])
    tagged = sweep_runs(mlflow, tracking, f" and tags.`{STOPPED_AFTER}` LIKE '%'")
    # a run that diverged keeps its outcome: the scheduler's tag may have come first (its stop at the same round)
    tagged = [run for run in tagged if run.data.tags.get(f"{TAG_PREFIX}outcome") != "diverged"]
    for run in tagged:
        if run.data.tags.get(f"{TAG_PREFIX}outcome") != STOPPED_EARLY:
            set_shared_tag(mlflow, run.info.run_id, f"{TAG_PREFIX}outcome", STOPPED_EARLY)
        if run.info.status != "FINISHED":
            mlflow.set_terminated(run.info.run_id, "FINISHED")
    return {run.data.tags["ray.trial_id"] for run in tagged}


def end_interrupted(tracking: dict[str, str]) -> None:
    """After an interrupted Tune run: this sweep's runs still RUNNING (trials whose processes Ray ended before
    their threads saw the stop) ended KILLED, as those whose threads saw it are."""
    mlflow = client(tracking["uri"])
    for run in sweep_runs(mlflow, tracking, " and attributes.status = 'RUNNING'"):
        mlflow.set_terminated(run.info.run_id, "KILLED")


def interrupted(results, total: int, rounds: Callable[[dict], int], stopped: set[str]) -> bool:
    """Whether the sweep's Tune run ended before its trials: fewer than ``total`` trials made, or one that
    neither failed, diverged, ran its last round nor was ``stopped`` by the scheduler (Tune returns from
    Ctrl-C without an error, its stopped trials TERMINATED)."""
    def ended(result) -> bool:
        m = result.metrics or {}
        return (result.error is not None or bool(m.get("diverged")) or "round" not in m  # (a run done before a resume)
                or int(m["round"]) >= rounds(result.config) or m.get("trial_id") in stopped)
    return len(results) < total or not all(ended(r) for r in results)
