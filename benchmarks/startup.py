"""Benchmark — where the seconds of ``fedsweep run`` go, before the first round and after the last.

Runs the steps of ``fedsweep run FILE`` (``fedsweep.cli.cmd_run``) one after the other in a fresh process on
cores 0-1 and prints the time since the interpreter started at the end of each: importing fedsweep, reading
and checking the file, importing Ray, starting Ray while MLflow's store opens in a thread
(``fedsweep.tracking.warm_up``), the MLflow run, the actors up with round 0 (evaluation of the initial model),
round 1, the remaining rounds with the run's end in MLflow, and ``ray.shutdown()`` (which the command's exit
runs). Three variants, alternated: ``on Ray`` (the path of a layout with processes to place), ``sequential``
(the same, MLflow's store opened before Ray starts, as before the overlap) and ``in process`` (what the command
does with a layout of one process, ``fedsweep.experiment.runs_in_process``: the server and its clients built in
this process while MLflow's store opens, no Ray). The default file is the peer workload (issue 23) without a
layout: the stacked worker pool of one is chosen, which runs in process; the Ray variants run it on Ray.

    python benchmarks/startup.py --repeats 3 [--file F] [--fresh-store]
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

VARIANTS = ("on Ray", "sequential", "in process")


def worker(path: str, variant: str) -> dict:
    marks: dict[str, float] = {}

    def mark(step: str) -> None:
        marks[step] = round(time.perf_counter() - T0, 3)

    import fedsweep.cli  # noqa: F401 - what the command imports first
    mark("import fedsweep")
    from fedsweep.loading import load_experiment

    cfg = load_experiment(path)
    mark("file read and checked")
    from fedsweep.config import resolve_tracking_uri
    from fedsweep.experiment import InProcessRunner, check_cluster, connect_ray, execute
    from fedsweep.tracking import RunLogger, ensure_experiment, warm_up

    mark("import Ray")
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    ready = warm_up(uri)
    runner = None
    if variant == "in process":
        runner = InProcessRunner(cfg)
        runner.start()
        mark("server and clients built")
    else:
        if variant == "sequential":  # as before the overlap: MLflow's store opened, then Ray started
            ready.join()
        connect_ray(cfg.resources)
        check_cluster([cfg], path)
        mark("Ray started")
    ready.join()
    mark("MLflow store open")
    logger = RunLogger(uri, ensure_experiment(uri, cfg.tracking.experiment), cfg, run_name=cfg.name)
    mark("MLflow run created")

    def on_round(m: dict) -> None:
        if m["round"] == 0:
            mark("round 0" if runner else "actors up, round 0")
        elif m["round"] == 1:
            mark("round 1")

    execute(cfg, logger, on_round, runner=runner)
    mark("rounds 2-50, run finished")
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
    ap.add_argument("--variant", default="on Ray", choices=VARIANTS)
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
                path.write_text(yaml.safe_dump(experiment(50, *SINGLE, "default", db)))
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
    for other in ("sequential", "in process"):
        pairs = sorted(o["round 1"] - r["round 1"] for r, o in zip(runs["on Ray"], runs[other]))
        print(f"round 1, {other} minus on Ray: median of paired differences {pairs[len(pairs) // 2]:.2f} s {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
