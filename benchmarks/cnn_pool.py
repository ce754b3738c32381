"""A CNN's pooling in evaluations: whole trials with PyTorch's max-pooling kernel and with ``models.MaxPool2``'s
elementwise maxima (its path where autograd records nothing), alternated in this process, every round's metrics
compared.

For each method of a benchmark cell (its first tuning setting, as the cell's tuning sweep runs it) or each algorithm of
an experiment file (its parameters' defaults), runs ``fedsweep.engine.run_local`` ``--repeats`` times each way and
prints the times, their paired ratios (elementwise / kernel) and whether every value of every round is the same. Ratios
only: the machine's speed moves the seconds from day to day.

    FEDSWEEP_DATA_DIR=../shared/data FEDSWEEP_CONV=native ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE \\
        python benchmarks/cnn_pool.py sweeps/benchmark/mnist_dirichlet_cnn.yaml --methods fedavg,ifca --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch import nn

from fedsweep import models
from fedsweep.bench import load_bench
from fedsweep.engine import run_local
from fedsweep.loading import validate


def configs(path: str, names: list[str], rounds: int | None) -> dict:
    raw = yaml.safe_load(Path(path).read_text())
    if "bench" in raw:
        bench = load_bench(path, check_cluster=False)
        out = {n: bench.tunes[n].trials[0].config for n in names or list(bench.tunes)}
    else:
        own = raw["algorithm"]["name"]
        out = {n: validate({**raw, "algorithm": raw["algorithm"] if n == own else {"name": n}}) for n in names or [own]}
    return {n: c.model_copy(update={"rounds": rounds}) if rounds else c for n, c in out.items()}


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(x[k] == y[k] or (math.isnan(x[k]) and math.isnan(y[k])) for k in x) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a benchmark cell (bench:) or an experiment file with a CNN")
    ap.add_argument("--methods", default="", help="the cell's method keys, or algorithm names for an experiment file "
                    "(default: every method of the cell, the file's algorithm)")
    ap.add_argument("--repeats", type=int, default=1, help="alternated pairs a method")
    ap.add_argument("--rounds", type=int, help="rounds instead of the file's (a short check)")
    args = ap.parse_args(argv)
    elementwise, results = models.MaxPool2.forward, {}
    for name, cfg in configs(args.file, [m for m in args.methods.split(",") if m], args.rounds).items():
        times, histories = {"kernel": [], "elementwise": []}, {}
        for _ in range(args.repeats):
            for way, seconds in times.items():
                models.MaxPool2.forward = nn.MaxPool2d.forward if way == "kernel" else elementwise
                try:
                    t = time.perf_counter()
                    histories[way] = run_local(cfg)[0]
                    seconds.append(time.perf_counter() - t)
                finally:
                    models.MaxPool2.forward = elementwise
        ratios = [c / k for k, c in zip(times["kernel"], times["elementwise"])]
        results[name] = {**{f"{w}_s": [round(s, 2) for s in v] for w, v in times.items()},
                         "ratios": [round(r, 3) for r in ratios], "median_ratio": round(statistics.median(ratios), 3),
                         "same_metrics": same(histories["kernel"], histories["elementwise"])}
        print(f"{name}: kernel {results[name]['kernel_s']} s, elementwise {results[name]['elementwise_s']} s, elementwise / kernel "
              f"{results[name]['ratios']}, every metric of every round the same: {results[name]['same_metrics']}", flush=True)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
