"""Benchmark 5 - what logging a round's metrics costs: one MLflow write per round against one per evaluation
interval (what :class:`fedsweep.tracking.RunLogger` does since issue 23).

The metrics of a real 200-round FedAvg run (Synthetic(0.5, 0.5), 20 clients, MLR, evaluation every 10
rounds, computed once in process) are logged into a fresh run of a SQLite store, paired and alternated:

  per_round     RunLogger.log_round then RunLogger.flush after every round (the old behaviour: a store
                round trip per round)
  batched       RunLogger.log_round alone (written at each evaluation round, the rest at finish)

Both end with finish() and the same metrics stored (checked). Printed: milliseconds of logging per round,
and the ratio per_round / batched of each pair, with the median.

    python benchmarks/tracking_writes.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from fedsweep.engine import run_local
    from fedsweep.loading import validate
    from fedsweep.tracking import RunLogger, client, ensure_experiment

    cfg = validate({"data": {"dataset": "synthetic", "num_clients": 20}, "model": {"name": "mlr"}, "rounds": args.rounds,
                    "eval_every": 10, "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 10}})
    history, _ = run_local(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{Path(tmp) / 'mlflow.db'}"
        exp = ensure_experiment(uri, "tracking-writes")
        c = client(uri)
        per_round_ms, batched_ms, ratios = [], [], []
        for _ in range(args.repeats):
            seconds = {}
            for mode in ("per_round", "batched"):
                log = RunLogger(uri, exp, cfg, mode)
                t = time.perf_counter()
                for metrics in history:
                    log.log_round(metrics)
                    if mode == "per_round":
                        log.flush()
                log.finish(None)
                seconds[mode] = time.perf_counter() - t
                assert len(c.get_metric_history(log.run_id, "uploads")) == len(history)
            per_round_ms.append(1000 * seconds["per_round"] / len(history))
            batched_ms.append(1000 * seconds["batched"] / len(history))
            ratios.append(seconds["per_round"] / seconds["batched"])
            print(f"per_round {per_round_ms[-1]:.2f} ms/round   batched {batched_ms[-1]:.2f} ms/round   "
                  f"ratio {ratios[-1]:.2f}", flush=True)
    print(f"median: per_round {statistics.median(per_round_ms):.2f} ms/round, batched {statistics.median(batched_ms):.2f} "
          f"ms/round, ratio {statistics.median(ratios):.2f} ({args.repeats} pairs, {len(history)} rounds each)")


if __name__ == "__main__":
    main()
