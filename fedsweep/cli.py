"""The ``fedsweep`` command: validate, run, sweep, bench, report, table, algorithms, ui.

Exit codes: 0 success, 1 a run or trial failed, 2 bad input (nothing was started or logged), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from fedsweep import cli_table
from fedsweep.cli_common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED, print_problems, tracking_uri
from fedsweep.conv_kernels import conv_problem


def cmd_validate(args) -> int:
    """Every file is checked (one Python start for all, e.g. ``fedsweep validate sweeps/*.yaml``); exit 2 if any is bad."""
    from fedsweep.bench import load_bench
    from fedsweep.config import ConfigError
    from fedsweep.loading import load_sweep, read_yaml
    from fedsweep.tracking import kernel_settings

    code = 0
    for file in args.files:
        try:
            if "bench" in read_yaml(file)[0]:  # a benchmark file: checked as `fedsweep bench` checks it
                bench = load_bench(file)
                print(f"{file}: OK — a benchmark of {len(bench.tunes)} method(s), {bench.budgets[0]} setting(s) each on "
                      f"seeds {bench.sweep_section['seeds']}, the chosen one(s) on seeds {bench.settings.final_seeds}"
                      + (f", kernels {kernel_settings(bench.settings.kernels)}" if bench.settings.kernels else ""))
                continue
            sweep = load_sweep(file)
        except ConfigError as e:
            code = print_problems(e)
            continue
        algorithms = sorted({t.config.algorithm.name for t in sweep.trials})
        print(f"{file}: OK — {sweep.describe()}, algorithms: {', '.join(algorithms)}")
    return code


def cmd_run(args) -> int:
    from fedsweep.tracking_process import TrackingProcess

    tracker = TrackingProcess()  # imports MLflow on the other core while this process imports torch
    try:
        return _run(args, tracker)
    finally:
        tracker.close()


def _run(args, tracker) -> int:
    import time

    import psutil
    from tqdm import tqdm

    from fedsweep.config import resolve_tracking_uri
    from fedsweep.experiment import InProcessRunner, check_cluster, connect_ray, execute, runs_in_process
    from fedsweep.loading import load_experiment
    from fedsweep.tracking import run_record

    cfg = load_experiment(args.file)
    uri = resolve_tracking_uri(cfg.tracking.tracking_uri)
    r = cfg.resources
    runner = None
    if runs_in_process(cfg):
        print(f"running the server and its {cfg.num_clients} clients in this process (a layout of one process on this "
              f"machine: no Ray) ...")
        runner = InProcessRunner(cfg)
        runner.start()  # the dataset the checks built: a problem of the data is raised before the run exists
    else:
        connect_ray(cfg.resources)
        check_cluster([cfg], args.file)
    tracker.start(uri, cfg.tracking.experiment, run_record(cfg), cfg.name)  # the rounds do not wait for it
    if runner is None:
        print(f"starting the server actor and {r.num_client_actors(cfg.num_clients)} client actor(s) for {cfg.num_clients} "
              f"clients" + (f" (a worker pool of {r.client_workers}, the server actor the first)" if r.client_workers else "") + " ...")
    bars: list = []  # created at round 0, once the actors are up
    named: list = []  # the run, named once the tracking process has created it (the rounds do not wait for it)

    def name_run(write) -> None:
        if tracker.run_id and not named:
            named.append(write(f"MLflow run {tracker.run_id} in experiment '{cfg.tracking.experiment}' at {uri}"))

    def on_round(m: dict[str, float]) -> None:
        if not bars:
            bars.append(tqdm(total=cfg.rounds, unit="round", disable=args.quiet, dynamic_ncols=True))
        bar = bars[0]
        name_run(bar.write)
        if m["round"] == 1:  # what a user waits for the first round: imports, Ray, MLflow, actors, rounds 0 and 1
            waited = time.time() - psutil.Process().create_time()
            tracker.log_metric("time_to_first_round_s", waited, step=1)
            bar.write(f"round 1 done {waited:.2f} s after the command started")
        if m["round"] > 0:
            bar.update(1)
        if "personalized_accuracy_mean" in m:  # an evaluation round (global metrics only where there is a global model)
            has_global = "global_accuracy" in m
            bar.set_postfix(pers_acc=f"{m['personalized_accuracy_mean']:.4f}",
                            **({"glob_acc": f"{m['global_accuracy']:.4f}"} if has_global else {}))
            bar.write(
                f"round {int(m['round']):4d}  personalized acc {m['personalized_accuracy_mean']:.4f} "
                f"(worst {m['personalized_accuracy_worst']:.4f})"
                + (f"  global acc {m['global_accuracy']:.4f}" if has_global else "")
                + (f"  train loss {m['train_loss']:.4f}" if "train_loss" in m else "")
                + f"  transmissions {m['transmissions']:g}"
            )

    try:
        history = execute(cfg, tracker, on_round, runner=runner)
    finally:
        for bar in bars:
            bar.close()
        name_run(print)  # known by the end (a run shorter than the run's creation), also of a run that failed
    if history and history[-1].get("diverged"):
        print(f"diverged at round {int(history[-1]['round'])}: the global model, or a client's, is not finite", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_sweep(args) -> int:
    from fedsweep.config import resolve_tracking_uri
    from fedsweep.loading import load_sweep
    from fedsweep.sweep import run_sweep
    from fedsweep.table import best_settings, diverged_settings, load_runs, to_markdown

    sweep = load_sweep(args.file)
    print(f"{args.file}: {sweep.describe()}, at most {sweep.settings.max_concurrent_trials} trial(s) at a time")
    out = run_sweep(sweep, verbose=0 if args.quiet else 1, resume=args.resume)
    experiment = sweep.trials[0].config.tracking.experiment
    runs, _ = load_runs(out["tracking_uri"], experiment, out["parent_run_id"], sweep.settings.target_accuracy)
    print()
    settings = sweep.settings
    print(f"Best setting per algorithm by final {settings.selection_metric()} ({settings.mode}), sweep run {out['parent_run_id']}:")
    print(to_markdown(best_settings(runs, settings.metric, settings.mode, settings.table_group_by, settings.select_on)))
    if diverged := diverged_settings(runs):
        print("\n" + diverged)
    print(f"\nReport (table, figures): artifacts report/ of run {out['parent_run_id']}, experiment '{experiment}' "
          f"(#/experiments/{out['experiment_id']}/runs/{out['parent_run_id']} in `fedsweep ui"
          + (f" --tracking-uri {out['tracking_uri']}" if out["tracking_uri"] != resolve_tracking_uri(None) else "") + "`)")
    if out["interrupted"]:
        print(f"the sweep was interrupted before every trial ended; `fedsweep sweep {args.file} --resume` goes on with it",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if out["errors"]:
        print(f"{out['errors']} trial(s) failed; see the Tune output above", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_bench(args) -> int:
    """Each benchmark file's methods tuned and re-run (fedsweep.bench), then its tables; with several files, also
    the methods × datasets table and heatmap in the output folder."""
    from pathlib import Path

    from fedsweep.bench import load_bench, use_kernels
    from fedsweep.bench_figures import heatmap_figure
    from fedsweep.bench_run import Interrupted, run_bench
    from fedsweep.table import merged_markdown, merged_table
    from fedsweep.tracking import kernel_settings

    only = [m for m in (args.methods or "").split(",") if m] or None
    benches = [load_bench(f, only=only) for f in args.files]  # every file checked before any of them runs
    if kernels := use_kernels(benches):
        print(f"CPU kernels (bench.kernels): {kernel_settings(kernels)}", flush=True)
    failed, tables = 0, []
    for bench in benches:
        print(f"{bench.path}: {len(bench.tunes)} method(s), each {bench.budgets[0]} setting(s) on seeds "
              f"{bench.sweep_section['seeds']}, the chosen one(s) on seeds {bench.settings.final_seeds}", flush=True)
        try:
            folder, n = run_bench(bench, args.output, resume=args.resume, verbose=0 if args.quiet else 1)
        except Interrupted as stop:
            later = benches[benches.index(bench) + 1 :]
            print(f"{stop}; the benchmark stops here{f' ({len(later)} file(s) after it not started)' if later else ''}; "
                  "--resume goes on with it", file=sys.stderr)
            return EXIT_INTERRUPTED
        failed += n
        table_file = folder / f"table_b{bench.budgets[0]}.md"
        if table_file.exists():
            print("\n" + table_file.read_text())
        tables.append((bench, folder))
    if len(benches) > 1:
        from fedsweep.table import best_settings, read_runs

        metric = benches[0].sweep_section.get("metric", "personalized_accuracy_mean")
        sources = []
        for bench, folder in tables:
            saved = folder / f"final_runs_b{bench.budgets[0]}.csv"
            if saved.exists():
                runs, tags = read_runs(str(saved))
                sources.append((bench.name, best_settings(runs, metric, tags.get("fedsweep.mode", "max"), (), "validation")))
        merged = merged_table(sources, metric)
        out = Path(args.output)
        (out / "summary.md").write_text(merged_markdown(merged) + "\n")
        merged.to_csv(out / "summary.csv", index=False)
        if not merged.empty:
            (out / "heatmap.png").write_bytes(heatmap_figure(merged, metric, benches[0].sweep_section.get("mode", "max")))
        print("\n" + merged_markdown(merged))
    if failed:
        print(f"{failed} method phase(s) did not finish; run again with --resume", file=sys.stderr)
        return EXIT_FAILED
    return 0


def cmd_report(args) -> int:
    """Rebuild a sweep's report and log it to its parent run (the newest sweep of the experiment by default)."""
    from fedsweep.report import build_report, log_report, newest_sweep_run

    if (uri := tracking_uri(args.tracking_uri)) is None:
        return EXIT_BAD_INPUT
    try:
        parent, tags = newest_sweep_run(uri, args.experiment, args.sweep_run)
    except LookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    target = float(tags["fedsweep.target_accuracy"]) if "fedsweep.target_accuracy" in tags else None
    report = build_report(uri, args.experiment, parent, group_by=json.loads(tags.get("fedsweep.table_group_by", "[]")),
                          target_accuracy=target)
    log_report(uri, parent, report)
    print(report.markdown)
    print(f"\nlogged to run {parent}: report/ ({', '.join(['table.md', 'table.csv', 'table.parquet', *report.figures])}) "
          f"and {len(report.summary)} best/* metric(s)")
    return 0


def cmd_algorithms(args) -> int:
    from fedsweep.algorithms import describe_algorithms

    rows = describe_algorithms()
    print("| algorithm | parameter | aliases | default | constraints | meaning |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        name = r["algorithm"] + (" †" if r["provenance"] else "")
        print(f"| {name} | {r['parameter']} | {r['aliases']} | {r['default']} | {r['constraints']} | {r['description']} |")
    for name, provenance in dict.fromkeys((r["algorithm"], r["provenance"]) for r in rows if r["provenance"]):
        print(f"\n† {name}: {provenance}.")
    return 0


def cmd_ui(args) -> int:
    if (uri := tracking_uri(args.tracking_uri)) is None:
        return EXIT_BAD_INPUT
    # this interpreter's MLflow: `mlflow` need not be on PATH (.venv/bin/fedsweep run without the venv activated)
    # one worker process, for one analyst's browser, unless MLFLOW_WORKERS says otherwise (as in infra/mlflow_server.sh,
    # whose default stays MLflow's 4 for many trials): up in 15-16 s against 36-42 s with 4 on a loaded 2-core machine
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", args.host, "--port", str(args.port),
           "--workers", os.environ.get("MLFLOW_WORKERS") or "1"]
    print(f"MLflow UI on http://{args.host}:{args.port} for {uri}")
    # MLflow's job execution (eight processes with MLflow loaded, for GenAI jobs fedsweep never runs) unless asked for,
    # as in infra/mlflow_server.sh
    return subprocess.call(cmd, env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsweep", description="Personalized federated learning experiments and sweeps on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("validate", help="check config or sweep files; start nothing")
    s.add_argument("files", nargs="+", metavar="file")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("run", help="run one experiment (no grids), logged to MLflow")
    s.add_argument("file")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("sweep", help="run a sweep file's grid with Ray Tune, logged to MLflow, then print the table")
    s.add_argument("file")
    s.add_argument("--quiet", action="store_true", help="no Tune status output")
    s.add_argument("--resume", action="store_true",
                   help="continue this sweep's newest interrupted run: finished trials are kept, the others rerun")
    s.set_defaults(func=cmd_sweep)

    s = sub.add_parser("bench", help="the PFL benchmark: every method tuned with the same budget on validation, "
                       "its chosen setting re-run on fresh seeds, the tables (docs/benchmark.md)")
    s.add_argument("files", nargs="+", metavar="file", help="benchmark files (sweeps/benchmark/*.yaml)")
    s.add_argument("--output", default="benchmark_results", help="folder of the tables and figures (default: %(default)s)")
    s.add_argument("--methods", default=None, metavar="KEY,KEY", help="only these methods of the methods file")
    s.add_argument("--resume", action="store_true",
                   help="go on with an interrupted benchmark: finished sweeps are kept, an interrupted one resumes")
    s.add_argument("--quiet", action="store_true", help="no Tune status output")
    s.set_defaults(func=cmd_bench)

    cli_table.add_parser(sub)

    s = sub.add_parser("report", help="rebuild a sweep's report (table, figures, best/* metrics) on its parent MLflow run")
    s.add_argument("--experiment", required=True, help="MLflow experiment name")
    s.add_argument("--sweep-run", default=None, help="the sweep's parent run id (default: the experiment's newest sweep)")
    s.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("algorithms", help="list the algorithms and their hyperparameters")
    s.set_defaults(func=cmd_algorithms)

    s = sub.add_parser("ui", help="open the MLflow UI (binds 127.0.0.1 unless --host is given)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=5000)
    s.add_argument("--tracking-uri", default=None)
    s.set_defaults(func=cmd_ui)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.environ.get("FEDSWEEP_DATA_DIR"):
        # relative to where the command was typed, for every process it starts (actors may run elsewhere)
        os.environ["FEDSWEEP_DATA_DIR"] = str(Path(os.environ["FEDSWEEP_DATA_DIR"]).expanduser().resolve())
    if problem := conv_problem():  # read by every process that builds a CNN: refused before anything starts
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return args.func(args)
    except Exception as e:
        from fedsweep.config import ConfigError  # imported by then: it is the configuration's error

        if isinstance(e, ConfigError):
            return print_problems(e)
        raise


def entry() -> None:
    """The ``fedsweep`` command: :func:`main`, then the end of the process as Python's own without its last step.
    Python stops its thread pools and waits for the threads that are not daemons, runs the exit handlers (MLflow's,
    Ray's shutdown, logging's flush), then finalizes every module: for torch, Ray, MLflow and SQLAlchemy that took
    1.0-1.6 s at the end of every command (docs/performance.md, section 9), and nothing of fedsweep's is left to it
    (its files are written and closed). So the first two steps run here (CPython's own functions for them), stdout
    and stderr are flushed, and the process ends (``os._exit``) with :func:`main`'s code. An exception out of
    :func:`main` ends the process as Python does."""
    import atexit
    import threading

    code = main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # here, not from its exit handler, which first sleeps 0.5 s for workers' last log lines
    threading._shutdown()  # what Python's end does first: stop the thread pools, wait for non-daemon threads
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if code is None else int(code))  # as sys.exit(code) for main's codes: None is 0


if __name__ == "__main__":
    entry()
