"""Benchmark — where the seconds of ``fedsweep run`` go, before the first round and after the last.

Runs the steps of ``fedsweep run FILE`` (``fedsweep.cli.cmd_run``) one after the other in a fresh process on
cores 0-1 and prints the time since the interpreter started at the end of each: the tracking process started
(:mod:`fedsweep.tracking_process`, which imports MLflow while this process goes on), importing fedsweep.cli,
reading and checking the file (torch imported with it), importing Ray, the clients built (in process) or Ray started, round 0
(evaluation of the initial model), round 1, the remaining rounds with the run's end in MLflow, and
``ray.shutdown()`` (which the command's exit runs); the rounds do not wait for the child's creation of the run,
which has no step of its own (the variant logging in a thread has two: the store open, the run created). Three variants, alternated: ``in process``
(what the command does with a layout of one process, ``fedsweep.experiment.runs_in_process``: the server and its
clients built in this process, no Ray), ``in process, MLflow in a thread`` (the same with the run logged in this
process, MLflow's store opened in a thread while the clients are built: the command before 2026-11-27's
tracking process) and ``on Ray`` (the path of a layout with processes to place). The default file is the peer
benchmark's single run of ``--workload`` without a layout: the stacked worker pool of one is chosen, which runs in
process; the Ray variant runs it on Ray.

    python benchmarks/startup.py --repeats 3 [--workload dirichlet] [--file F] [--fresh-store]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("in process", "in process, MLflow in a thread", "on Ray")


def worker(path: str, variant: str) -> dict:
    marks: dict[str, float] = {}

    def mark(step: str) -> None:
        marks[step] = round(time.perf_counter() - T0, 3)

    in_thread = variant == "in process, MLflow in a thread"
    if not in_thread:
        from fedsweep.tracking_process import TrackingProcess

        tracker = TrackingProcess()
        mark("tracking process started")
    import fedsweep.cli  # noqa: F401 - what the command imports first
    mark("import fedsweep")
    from fedsweep.loading import load_experiment

    cfg = load_experiment(path)
    mark("file read and checked")
    from fedsweep.config import resolve_tracking_uri
    from fedsweep.experiment import InProcessRunner, check_cluster, connect_ray, execute
    from fedsweep.tracking import RunLogger, ensure_experiment, run_record, warm_up

    mark("import Ray")
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    runner = None
    if variant == "on Ray":
        connect_ray(cfg.resources)
        check_cluster([cfg], path)
        mark("Ray started")
    if in_thread:
        ready = warm_up(uri)
    if variant != "on Ray":
        runner = InProcessRunner(cfg)
        runner.start()
        mark("server and clients built")
    if in_thread:
        ready.join()
        mark("MLflow store open")
        logger = RunLogger(uri, ensure_experiment(uri, cfg.tracking.experiment), cfg, run_name=cfg.name)
        mark("MLflow run created")
    else:  # as the command: the rounds do not wait for the run's creation
        tracker.start(uri, cfg.tracking.experiment, run_record(cfg), cfg.name)
        logger = tracker

    def on_round(m: dict) -> None:
        if m["round"] == 0:
            mark("round 0" if runner else "actors up, round 0")
        elif m["round"] == 1:
            mark("round 1")

    execute(cfg, logger, on_round, runner=runner)
    mark("rounds 2-50, run finished")
    if not in_thread:
        tracker.close()
    if runner is None:
        import ray

        ray.shutdown()
        mark("ray.shutdown")
    return marks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker")
    ap.add_argument("--file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fresh-store", action="store_true", help="a new SQLite store each repetition (else one, reused)")
    ap.add_argument("--variant", default="in process", choices=VARIANTS)
    ap.add_argument("--workload", default="dirichlet", help="the peer benchmark's workload (benchmarks/_harness.py)")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.variant)))
        return 0
    import yaml

    from benchmarks._harness import measure
    from benchmarks.pfl_peer import SINGLE, experiment  # the peer workload, as its benchmark runs it

    folder = Path(tempfile.mkdtemp(prefix="fedsweep-startup-"))
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for rep in range(args.repeats):
        for variant in VARIANTS:
            path = Path(args.file) if args.file else folder / "run.yaml"
            if not args.file:
                db = folder / (f"mlflow-{variant.replace(' ', '-')}{rep}.db" if args.fresh_store else "mlflow.db")
                path.write_text(yaml.safe_dump(experiment(50, *SINGLE, "default", db, args.workload)))
            runs[variant].append(measure(__file__, "0,1", [str(path), "--variant", variant]))
            print(f"  rep {rep + 1} {variant}: {runs[variant][-1]}", flush=True)
    print("\nseconds since the interpreter started, median of the repetitions (and the step's own share):")
    for variant, rs in runs.items():
        print(f"  {variant}:")
        before = 0.0
        for step in rs[0]:
            at = sorted(r[step] for r in rs)[len(rs) // 2]
            print(f"    {step:28s} {at:7.2f} (+{at - before:.2f})")
            before = at
    last = "rounds 2-50, run finished"
    for other in VARIANTS[1:]:
        pairs = sorted(o[last] / r[last] for r, o in zip(runs["in process"], runs[other]))
        print(f"the run's end, {other} / in process: median of paired ratios {pairs[len(pairs) // 2]:.3f} {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
