"""Where one trial's time goes: evaluating against training, for an experiment file (or a benchmark cell's config).

Runs the experiment's server and clients in this process (an ``InProcessRunner``, one torch thread as in a trial),
times one evaluation (round 0) and ``--rounds`` training rounds, and prints what a whole trial of the file's
rounds and evaluations would spend on each. Ratios only: run the variants to compare in the same hour.

    FEDSWEEP_DATA_DIR=../shared/data python benchmarks/trial_split.py experiment.yaml [--algorithm ditto] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_sweep import in_process
from fedsweep.experiment import InProcessRunner
from fedsweep.loading import validate


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="an experiment file (one algorithm, no grid)")
    ap.add_argument("--algorithm", help="this algorithm's name instead of the file's (its parameters' defaults)")
    ap.add_argument("--rounds", type=int, default=5, help="training rounds to time")
    args = ap.parse_args(argv)
    raw = yaml.safe_load(Path(args.file).read_text())
    if args.algorithm:
        raw["algorithm"]["name"] = args.algorithm
    cfg = in_process(validate(raw), stack=False)  # every client in this process, one by one
    runner = InProcessRunner(cfg)
    runner.start()
    engine = runner.server
    t = time.perf_counter()
    engine.server.evaluate(engine.pool, 0)
    evaluation = time.perf_counter() - t
    t = time.perf_counter()
    for rnd in range(1, args.rounds + 1):
        engine.server.train_round(engine.pool, rnd)
    round_s = (time.perf_counter() - t) / args.rounds
    evaluations = len(cfg.eval_rounds())
    out = {"algorithm": cfg.algorithm.name, "evaluation_s": round(evaluation, 3), "training_round_s": round(round_s, 3),
           "trial_training_s": round(cfg.rounds * round_s, 1), "trial_evaluation_s": round(evaluations * evaluation, 1),
           "evaluations": evaluations}
    runner.stop()
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
