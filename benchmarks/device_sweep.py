"""A sweep file's trials in processes on this machine's GPU, without Ray or MLflow; then logged into MLflow here.

For a lent GPU machine that has torch but neither Ray nor MLflow, and no internet (the `device` tool's: Ray's
wheel alone, 79 MB, is over the 64 MiB a call may carry). Two steps:

    python benchmarks/device_sweep.py run sweeps/pfl_acid_cifar10.yaml --out DIR [--workers 12] [--time-box 450]
    python benchmarks/device_sweep.py log sweeps/pfl_acid_cifar10.yaml DIR     # here: one MLflow sweep, a run per trial

``run``: each trial of the file (its grid × seeds, in the file's order) in its own process, ``--workers`` at a time
(``--workers 1``: one after the other in this process),
the whole experiment in that process (:class:`fedsweep.engine.Engine`, one host holding every client: a worker pool
of one, as ``fedsweep run`` runs in process) with the clients' data and models on ``--device``; the clients a round
samples train as one stacked computation where the algorithm allows it (``vectorize_clients``; ``--no-stack``: one
by one). Neither changes what is computed (tests/test_conformance.py: a pool of one equals client actors, stacked
equals one by one up to summation order). Every round's metrics are appended to ``DIR/trial_NNNN.jsonl`` as it
ends; past ``--time-box`` seconds (from the command's start) a trial stops after its round and its last line says
so. ``--rounds N`` cuts every trial to N rounds (a probe of the per-round cost; a cut run is never logged).

``log``: a parent run tagged as ``fedsweep sweep`` tags it (:func:`fedsweep.sweep.sweep_tags`), then per trial a run
with the trial's params and every round, through the same :class:`fedsweep.tracking.RunLogger` a trial uses; a
trial stopped by the time box ends FINISHED with outcome ``stopped_early`` and its last evaluation round, as a
scheduler's stop (``fedsweep table`` counts it and never chooses it); a trial that raised, or whose file has no
end line (its process killed), ends FAILED with outcome ``error``. Each run is tagged ``fedsweep.device_run``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedsweep.config import ConfigError, Sweep, Trial, resolve_tracking_uri
from fedsweep.layout import AUTO_SERVER_CPUS
from fedsweep.loading import load_sweep, validate


def in_process(cfg, stack: bool):
    """``cfg`` laid out as one process holding every client (a worker pool of one); stacked where allowed."""
    raw = cfg.model_dump(mode="json", by_alias=True)
    # no GPU share: that is for Ray's actors; here the process's one device (``run --device``) holds every client
    one = {"server_cpus": AUTO_SERVER_CPUS, "client_cpus": round(1 - AUTO_SERVER_CPUS, 3), "client_gpus": 0,
           "clients_per_actor": 1, "client_workers": 1}
    alone = validate({**raw, "resources": {**raw["resources"], **one, "vectorize_clients": False}})
    try:
        return validate({**raw, "resources": {**raw["resources"], **one, "vectorize_clients": True}}) if stack else alone
    except ConfigError:  # the algorithm trains its clients one by one (the message says why)
        return alone


def trial_file(out: Path, index: int) -> Path:
    return out / f"trial_{index:04d}.jsonl"


def run_trial(path: str, index: int, out: str, device: str, stack: bool, deadline: float, rounds: int | None) -> dict:
    """Trial ``index`` of the sweep file ``path``, into ``out`` (:func:`run_one`)."""
    sweep = load_sweep(path, check_cluster=False)
    return run_one(sweep.trials[index], index, sweep.source_hash(), trial_file(Path(out), index), device, stack, deadline, rounds)


def run_one(trial: Trial, index: int, yaml_sha1: str, file: Path, device: str, stack: bool, deadline: float,
            rounds: int | None, code: str | None = None) -> dict:
    """``trial`` (trial ``index`` of the sweep whose text hashes to ``yaml_sha1``) to its last round (or ``rounds``, or
    the deadline), a line per round into ``file``; its first line names the platform and the code (``code``, else
    :func:`fedsweep.tracking.code_version`: a copy of the repository without its .git names only the version)."""
    import torch

    from fedsweep.engine import Engine
    from fedsweep.federation import compute_threads
    from fedsweep.tracking import code_version, run_platform

    cfg = in_process(trial.config, stack)
    last = min(cfg.rounds, rounds) if rounds else cfg.rounds
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    reached, diverged, start = -1, False, time.perf_counter()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()  # this trial's peak, when a process runs several
    with compute_threads(), file.open("w") as f:
        head = {"trial": index, "overrides": trial.overrides, "yaml_sha1": yaml_sha1, "device": name,
                "vectorize_clients": cfg.resources.vectorize_clients, "rounds": cfg.rounds, "cut_to": rounds,
                "platform": run_platform(), "code": code or code_version()}
        f.write(json.dumps(head) + "\n")
        f.flush()
        try:
            engine = Engine(cfg, device)
            f.write(json.dumps({"setup_s": time.perf_counter() - start}) + "\n")
            for rnd in range(last + 1):
                for m in engine.steps(rnd, rnd, 1):
                    f.write(json.dumps(m) + "\n")
                    f.flush()
                    reached, diverged = rnd, bool(m.get("diverged"))
                if diverged or time.time() > deadline:
                    break
            end = {"end": True, "reached": reached, "complete": reached >= cfg.rounds, "diverged": diverged,
                   "wall_s": time.perf_counter() - start, "clients": engine.client_table() if reached >= cfg.rounds else None}
        except Exception as err:  # noqa: BLE001 - the trial failed: its file says so, the other trials go on
            end = {"end": True, "reached": reached, "complete": False, "diverged": False, "error": repr(err),
                   "wall_s": time.perf_counter() - start, "clients": None}
        if device.startswith("cuda"):
            end["max_memory_mb"] = torch.cuda.max_memory_allocated() / 2**20
        f.write(json.dumps(end) + "\n")
    if device.startswith("cuda"):
        # the trial's blocks back to the card: a worker process runs trial after trial, and torch's cache kept up to
        # 11.5 GiB a process between them, so that 14 workers ran the H200 out of memory (2026-12-04)
        engine = None
        gc.collect()
        torch.cuda.empty_cache()
    return {k: v for k, v in end.items() if k != "clients"} | {"trial": index}


def run(args) -> None:
    deadline = time.time() + args.time_box
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.glob("trial_*.jsonl")):  # `log` reads every trial file there: no mixing of two runs
        raise SystemExit(f"{out}: holds trial files of an earlier run; give an empty --out")
    n = len(load_sweep(args.file, check_cluster=False).trials)
    chosen = [int(i) for i in args.trials.split(",")] if args.trials else list(range(n))
    work = [(args.file, i, str(out), args.device, not args.no_stack, deadline, args.rounds) for i in chosen]
    if args.workers == 1:  # one after the other in this process: no process to start
        for job in work:
            print(json.dumps(run_trial(*job)), flush=True)
        return
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for job in as_completed([pool.submit(run_trial, *job) for job in work]):
            print(json.dumps(job.result()), flush=True)


def read_trial(path: Path) -> tuple[dict, list[dict], dict | None]:
    """(head, rounds, end: None when the file stops mid-run) of a ``run`` file; a last line cut off mid-write (a copy
    taken while the trial ran) is left out."""
    text = path.read_text().splitlines()
    lines = []
    for i, line in enumerate(text):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(text) - 1:
                raise
    if not lines:
        raise SystemExit(f"{path}: empty (its trial was stopped before it wrote anything)")
    head, rows = lines[0], [m for m in lines[1:] if "round" in m]
    end = lines[-1] if lines[-1].get("end") else None
    return head, rows, end


def log_trials(sweep: Sweep, trials: list[tuple[dict, list[dict], dict | None]], uri: str, experiment: str,
               tags: dict[str, str] | None = None) -> tuple[str, int]:
    """``run``'s trial files (:func:`read_trial`) of ``sweep`` logged as that sweep: a parent run (the sweep's tags,
    and ``tags``), a run per trial with its params, every round, its trial index and the platform and code its first
    line names. Returns the parent's run id and how many trials failed."""
    from fedsweep.sweep import sweep_tags
    from fedsweep.tracking import (
        CODE_TAG,
        PLATFORM_TAG,
        STOPPED_EARLY,
        TAG_PREFIX,
        RunLogger,
        client,
        ensure_experiment,
        trial_title,
    )

    experiment_id = ensure_experiment(uri, experiment)
    c = client(uri)
    device = {head["device"] for head, _, _ in trials}
    parent = c.create_run(experiment_id, run_name=sweep.settings.name, tags={
        **sweep_tags(sweep, len(sweep.trials)), f"{TAG_PREFIX}device_run": ", ".join(sorted(device)), **(tags or {})}).info.run_id
    c.log_text(parent, sweep.source, "sweep.yaml")
    errors = 0
    for head, rows, end in trials:
        trial = sweep.trials[head["trial"]]
        cfg = in_process(trial.config, head["vectorize_clients"])
        where = {PLATFORM_TAG: head["platform"], CODE_TAG: head["code"]} if "platform" in head else {}  # older files: none
        logger = RunLogger(uri, experiment_id, cfg, trial_title(cfg, trial.overrides), parent, trial.overrides,
                           tags={f"{TAG_PREFIX}device_run": head["device"], f"{TAG_PREFIX}in_process": "true",
                                 f"{TAG_PREFIX}trial_index": str(head["trial"]), **where})
        for m in rows:
            logger.log_round(m)
        complete = bool(end and end["complete"])
        diverged = bool(rows and rows[-1].get("diverged"))
        # no end line (killed) or an error: FAILED, as the sweep path ends a trial that broke; else the time box's stop
        failed = end is None or "error" in end
        logger.finish(end["clients"] if complete else None, "FAILED" if diverged or failed else "FINISHED",
                      "diverged" if diverged else "error" if failed else (None if complete else STOPPED_EARLY))
        if not (complete or diverged or failed):
            evaluated = [m for m in rows if "personalized_accuracy_mean" in m]  # as Tune's last report: an evaluation
            c.set_tag(logger.run_id, f"{TAG_PREFIX}stopped_after_round", str(int(evaluated[-1]["round"]) if evaluated else -1))
        errors += failed
    c.set_terminated(parent, "FAILED" if errors else "FINISHED")
    return parent, errors


def log(args) -> None:
    sweep = load_sweep(args.file, check_cluster=False)
    files = sorted(Path(args.dir).glob("trial_*.jsonl"))
    trials = [read_trial(f) for f in files]
    for f, (head, _, _) in zip(files, trials, strict=True):
        if head["yaml_sha1"] != sweep.source_hash() or head["cut_to"]:
            raise SystemExit(f"{f}: run from another version of {args.file}, or cut with --rounds: not logged")
    first = sweep.trials[0].config
    uri = resolve_tracking_uri(first.tracking.tracking_uri)
    parent, _ = log_trials(sweep, trials, uri, first.tracking.experiment)
    print(f"logged {len(trials)} trial(s) under run {parent} of experiment {first.tracking.experiment!r} ({uri})")


def paces(a: Path, b: Path) -> list[dict]:
    """Per trial file of two probe folders (``run --rounds``): the trial, and per folder its head, seconds a round over
    rounds 2.. (an evaluation of every client in, at the last) and peak memory; the largest difference of the scores
    of the last round both evaluated (nan where their last evaluated rounds differ) and that round."""
    keys = ["personalized_accuracy_mean", "personalized_loss_mean", "global_accuracy", "global_loss"]
    out = []
    for path in sorted(Path(a).glob("trial_*.jsonl")):
        sides = []
        for folder in (a, b):
            head, rows, end = read_trial(Path(folder) / path.name)
            sides.append({"head": head, "scored": [m for m in rows if keys[0] in m][-1],
                          "s": (rows[-1]["wall_time_s"] - rows[1]["wall_time_s"]) / (len(rows) - 2),
                          "max_memory_mb": (end or {}).get("max_memory_mb", float("nan"))})
        x, y = sides[0]["scored"], sides[1]["scored"]
        gap = max(abs(x[k] - y[k]) for k in keys if k in x) if x["round"] == y["round"] else float("nan")
        out.append({"trial": path.name, "sides": sides, "gap": gap, "round": int(x["round"])})
    return out


def pace(args) -> None:
    """:func:`paces`, a line per trial."""
    for t in paces(args.a, args.b):
        over = t["sides"][0]["head"]["overrides"]
        print(f"{t['trial']} {over.get('algorithm.name')} {over.get('algorithm.transform', '')}: "
              + ", ".join(f"{'stacked' if d['head']['vectorize_clients'] else 'one by one'} {d['s']:.4f} s a round, "
                          f"peak {d['max_memory_mb']:.0f} MB" for d in t["sides"])
              + f"; ratio {t['sides'][1]['s'] / t['sides'][0]['s']:.2f}; largest difference of the scores at round "
                f"{t['round']}: {t['gap']:.2e}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    r = sub.add_parser("run")
    r.add_argument("file")
    r.add_argument("--out", required=True)
    r.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    r.add_argument("--time-box", type=float, default=float("inf"), help="seconds from the start; then stop after a round")
    r.add_argument("--device", default="cuda")
    r.add_argument("--no-stack", action="store_true")
    r.add_argument("--trials", help="comma-separated trial indices (default: all)")
    r.add_argument("--rounds", type=int, help="cut every trial to this many rounds (a probe; never logged)")
    lg = sub.add_parser("log")
    lg.add_argument("file")
    lg.add_argument("dir")
    pc = sub.add_parser("pace")
    pc.add_argument("a")
    pc.add_argument("b")
    args = ap.parse_args(argv)
    {"run": run, "log": log, "pace": pace}[args.step](args)


if __name__ == "__main__":
    main()
