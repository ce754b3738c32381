"""The ``fedsweep table`` command: each algorithm's best setting, mean ± 95% CI over seeds, from an MLflow store or
from runs saved with ``--runs-output``; several sources make one methods × datasets table."""

from __future__ import annotations

import sys
from collections import Counter

from fedsweep.cli_common import EXIT_BAD_INPUT, tracking_uri


def add_parser(sub) -> None:
    """The ``table`` subcommand's options, on ``sub`` (the ``fedsweep`` command's subparsers)."""
    s = sub.add_parser("table", help="best setting per algorithm, mean ± 95%% CI over seeds, read from MLflow")
    s.add_argument("--experiment", action="append", default=[],
                   help="MLflow experiment name (required unless --from-runs); several: a methods × experiments table")
    s.add_argument("--sweep-run", default=None, help="only the trials of this sweep parent run id")
    s.add_argument("--runs-output", default=None, metavar="CSV",
                   help="also save the runs behind the table (parameters, reduced metrics; the sweep's tags in CSV.tags.json)")
    s.add_argument("--from-runs", action="append", default=[], metavar="CSV",
                   help="build the table from runs saved with --runs-output instead of an MLflow store (docs/results/); "
                   "several (or with --experiment): one methods × datasets table, a column pair per source")
    s.add_argument(
        "--metric", default=None,
        help="metric to rank by, at the final round unless --last-evaluations or --max-over-rounds (default: the sweep's)",
    )
    s.add_argument("--mode", choices=["max", "min"], default=None)
    s.add_argument(
        "--select-on", choices=["test", "validation"], default=None,
        help="rank settings by the metric on test data, or on the clients' validation parts (val_<metric>) and "
        "report the chosen settings' test metrics (default: the sweep's sweep.select_on, else test)",
    )
    s.add_argument(
        "--budget", type=int, default=None, metavar="N",
        help="each algorithm's best of only the first N settings its search tried (trial order), so that "
        "algorithms with more hyperparameters do not win by having more tries",
    )
    s.add_argument("--format", choices=["markdown", "csv", "parquet"], default="markdown")
    s.add_argument("--output", default=None, help="file to write (required for csv and parquet)")
    s.add_argument("--heatmap", default=None, metavar="PNG",
                   help="with several sources: also write the methods × datasets heatmap (each method's rank within "
                   "a dataset, labelled with its mean), as `fedsweep bench` writes it for several files")
    s.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db")
    s.add_argument(
        "--last-evaluations", type=int, default=1, metavar="N",
        help="report each run's mean over its last N evaluation rounds (default 1: the final round)",
    )
    s.add_argument(
        "--max-over-rounds", action="store_true",
        help="report each run's best evaluation round instead of its final one (how pFedMe's published code "
        "scores a run); not with --last-evaluations",
    )
    s.add_argument(
        "--target-accuracy", type=float, default=None, metavar="ACC",
        help="also report the round and the model transmissions at which personalized_accuracy_mean first "
        "reached ACC (a fraction, e.g. 0.876), over the seeds that reached it",
    )
    s.add_argument(
        "--group-by", action="append", default=[], metavar="PARAM",
        help="split rows by this logged parameter too (e.g. model.name, algorithm.local_steps); repeatable",
    )
    s.set_defaults(func=cmd_table)


def cmd_table(args) -> int:
    from fedsweep.table import best_settings, diverged_settings, merged_markdown, merged_table, to_markdown

    if args.last_evaluations < 1:
        print(f"error: --last-evaluations: {args.last_evaluations}; allowed: an integer >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.max_over_rounds and args.last_evaluations > 1:
        print("error: --max-over-rounds and --last-evaluations exclude each other; give one", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.target_accuracy is not None and not 0 < args.target_accuracy <= 1:
        print(f"error: --target-accuracy: {args.target_accuracy} is outside (0, 1]; give a fraction, e.g. 0.876", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.budget is not None and args.budget < 1:
        print(f"error: --budget: {args.budget}; allowed: an integer >= 1 (settings per algorithm)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if len(args.from_runs) + len(args.experiment) > 1 and (args.runs_output or args.sweep_run):
        print("error: --runs-output and --sweep-run take one source; several --experiment/--from-runs make a merged "
              "methods × datasets table", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.heatmap and len(args.from_runs) + len(args.experiment) < 2:
        print("error: --heatmap: a heatmap is of methods × datasets; give two or more --from-runs/--experiment", file=sys.stderr)
        return EXIT_BAD_INPUT
    sources = _table_sources(args)
    if sources is None:
        return EXIT_BAD_INPUT
    if twice := sorted(label for label, n in Counter(label for label, _, _ in sources).items() if n > 1):
        print(f"error: --from-runs/--experiment: {', '.join(twice)} given more than once (a merged table has one column "
              "per source, named by its benchmark or experiment); allowed: each source once", file=sys.stderr)
        return EXIT_BAD_INPUT
    # each source's ranking: the options', else what its sweep ranked by
    ranking = [(args.metric or t.get("fedsweep.metric", "personalized_accuracy_mean"), args.mode or t.get("fedsweep.mode", "max"))
               for _, _, t in sources]
    if len(set(ranking)) > 1:
        print(f"error: the sources rank by different metrics or modes ({', '.join(f'{m} {o}' for m, o in sorted(set(ranking)))}); "
              "a merged table ranks every source alike: give --metric and --mode", file=sys.stderr)
        return EXIT_BAD_INPUT
    tables = []
    for (label, runs, sweep_tags), (metric, mode) in zip(sources, ranking):
        select_on = args.select_on or sweep_tags.get("fedsweep.select_on", "test")
        try:
            tables.append((label, best_settings(runs, metric, mode, args.group_by, select_on, args.budget)))
        except KeyError as e:
            print(f"error: --metric/--group-by: {e.args[0]}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if len(tables) > 1:
        table = merged_table(tables, metric)
        text = merged_markdown(table)
        if args.heatmap and not table.empty:
            from fedsweep.bench_figures import heatmap_figure

            with open(args.heatmap, "wb") as f:
                f.write(heatmap_figure(table, metric, mode))
    else:
        table = tables[0][1]
        text = to_markdown(table)
        if diverged := diverged_settings(sources[0][1]):
            text += "\n\n" + diverged
    if args.format == "markdown":
        if args.output:
            with open(args.output, "w") as f:
                f.write(text + "\n")
        print(text)
        return 0
    if not args.output:
        print("error: --output FILE is required with --format csv|parquet", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.format == "csv":
        table.to_csv(args.output, index=False)
    else:
        table.to_parquet(args.output, index=False)
    print(text)  # the selection and the notes (settings not eligible, methods without a row) the file cannot hold
    print(f"wrote {len(table)} row(s) to {args.output}")
    return 0


def _table_sources(args) -> list[tuple[str, object, dict]] | None:
    """(column label, runs, sweep tags) of each --from-runs file and each --experiment; None after an error."""
    from pathlib import Path

    from fedsweep.table import load_runs, read_runs, save_runs

    sources = []
    if args.from_runs and (args.sweep_run or args.target_accuracy is not None or args.last_evaluations > 1 or args.max_over_rounds):
        print("error: --from-runs: the saved runs are reduced already; give no --sweep-run, --target-accuracy, "
              "--last-evaluations or --max-over-rounds (save with them instead)", file=sys.stderr)
        return None
    for path in args.from_runs:  # the runs a table was built from, saved with --runs-output: no MLflow store
        try:
            runs, sweep_tags = read_runs(path)
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --from-runs: {path} cannot be read as saved runs: {e}", file=sys.stderr)
            return None
        sources.append((sweep_tags.get("fedsweep.bench", Path(path).stem), runs, sweep_tags))
    if not args.experiment and not sources:
        print("error: --experiment is required (or --from-runs FILE)", file=sys.stderr)
        return None
    if args.experiment and (uri := tracking_uri(args.tracking_uri)) is None:
        return None
    for experiment in args.experiment:
        try:
            runs, sweep_tags = load_runs(
                uri, experiment, args.sweep_run, args.target_accuracy, args.last_evaluations, args.max_over_rounds
            )
        except LookupError as e:
            print(f"error: {e}", file=sys.stderr)
            return None
        if args.runs_output:
            save_runs(runs, sweep_tags, args.runs_output)
            print(f"wrote {len(runs)} run(s) to {args.runs_output} (and the sweep's tags to {args.runs_output}.tags.json)")
        sources.append((experiment, runs, sweep_tags))
    return sources
