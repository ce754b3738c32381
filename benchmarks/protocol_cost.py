"""What a protocol file would cost on this machine, before running it.

For each distinct setting of a sweep file (its grid without the seeds), build the data, time ``--rounds``
training rounds and one evaluation of every client in this process with one torch thread (as an actor
computes), and extrapolate to the file's rounds, evaluation rounds and seeds. The figures are CPU-seconds
of one core; a sweep's wall time is about their sum over the cores its trials run on at once, plus start-up.

    FEDSWEEP_DATA_DIR=../shared/data python benchmarks/protocol_cost.py sweeps/pfl_acid_cifar10.yaml --rounds 2
"""

from __future__ import annotations

import argparse
import time

from fedsweep.engine import local_federation
from fedsweep.federation import compute_threads
from fedsweep.loading import load_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--rounds", type=int, default=3, help="training rounds timed per setting")
    args = ap.parse_args()
    sweep = load_sweep(args.file, check_cluster=False)
    seeds = len(sweep.settings.seeds or [None])
    settings: dict[str, object] = {}
    for t in sweep.trials:
        settings.setdefault(t.config.setting_key(), t)
    print(f"{args.file}: {len(settings)} setting(s) × {seeds} seed(s); {args.rounds} round(s) timed each\n")
    print("| setting | round (s) | evaluation (s) | rounds | evaluations | one trial (min) |")
    print("|---|---|---|---|---|---|")
    total = 0.0
    for t in settings.values():
        cfg = t.config
        with compute_threads():
            server, pool = local_federation(cfg)
            start = time.perf_counter()
            for rnd in range(1, args.rounds + 1):
                server.train_round(pool, rnd)
            per_round = (time.perf_counter() - start) / args.rounds
            start = time.perf_counter()
            server.evaluate(pool, args.rounds)
            evaluation = time.perf_counter() - start
        evaluations = len(cfg.eval_rounds())
        trial = per_round * cfg.rounds + evaluation * evaluations
        total += trial * seeds
        print(f"| {t.label()} | {per_round:.3f} | {evaluation:.2f} | {cfg.rounds} | {evaluations} | {trial / 60:.1f} |", flush=True)
    print(f"\nwhole file: {total / 3600:.2f} core-hours ({len(settings) * seeds} trials)")


if __name__ == "__main__":
    main()
