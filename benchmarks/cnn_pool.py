"""A CNN's pooling in evaluations: whole trials with PyTorch's max-pooling kernel and with ``models.MaxPool2``'s
elementwise maxima (its path where autograd records nothing), in this process, every round's metrics compared.

For each method of a benchmark cell (its first tuning setting, as the cell's tuning sweep runs it) or each algorithm of
an experiment file (its parameters' defaults), runs ``fedsweep.engine.run_local`` ``--repeats`` times each way, the
order alternated from one repetition to the next (after one warm-up round that builds the dataset), and prints the
times, their paired ratios (elementwise / kernel), how often each way pooled without autograd (both must be > 0 for
the comparison to mean anything), and whether every value of every round of every repetition is the same. Ratios
only: the machine's speed moves the seconds from day to day.

    FEDSWEEP_DATA_DIR=../shared/data FEDSWEEP_CONV=native ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE \\
        python benchmarks/cnn_pool.py sweeps/benchmark/mnist_dirichlet_cnn.yaml --methods fedavg,ifca --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from fedsweep import models
from fedsweep.bench import load_bench
from fedsweep.engine import run_local
from fedsweep.loading import load_experiment, read_yaml, validate

WAYS = ("kernel", "elementwise")


def configs(path: str, names: list[str]) -> dict:
    """Method (or algorithm) name -> the config it runs."""
    if "bench" in read_yaml(path)[0]:  # the project's safe, bounded reader
        bench = load_bench(path, check_cluster=False)
        unknown = sorted(set(names) - set(bench.tunes))
        if unknown:
            raise SystemExit(f"--methods: {', '.join(unknown)} not in {path}; allowed: {', '.join(bench.tunes)}")
        return {n: bench.tunes[n].trials[0].config for n in names or list(bench.tunes)}
    cfg = load_experiment(path, check_cluster=False)
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    return {n: cfg if n == cfg.algorithm.name else validate({**raw, "algorithm": {"name": n}})
            for n in names or [cfg.algorithm.name]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="a benchmark cell (bench:) or an experiment file with a CNN")
    ap.add_argument("--methods", default="", help="the cell's method keys, or algorithm names for an experiment file "
                    "(default: every method of the cell, the file's algorithm)")
    ap.add_argument("--repeats", type=int, default=1, help="pairs a method, the order alternated")
    ap.add_argument("--rounds", type=int, choices=range(1, 100_000), metavar="N", help="rounds instead of the file's")
    args = ap.parse_args(argv)
    own, results = models.MaxPool2.forward, {}
    calls = dict.fromkeys(WAYS, 0)

    def counted(way, forward):
        def pool(self, x):
            calls[way] += not torch.is_grad_enabled()
            return forward(self, x)
        return pool

    forwards = {"kernel": counted("kernel", nn.MaxPool2d.forward), "elementwise": counted("elementwise", own)}
    chosen = configs(args.file, [m for m in args.methods.split(",") if m])
    try:
        for name, cfg in chosen.items():
            cfg = cfg.model_copy(update={"rounds": args.rounds}) if args.rounds else cfg
            models.MaxPool2.forward = own
            run_local(cfg.model_copy(update={"rounds": 1}))  # warm-up: the dataset built, the kernels loaded
            times, histories = {w: [] for w in WAYS}, {w: [] for w in WAYS}
            for rep in range(args.repeats):
                for way in WAYS if rep % 2 == 0 else WAYS[::-1]:
                    models.MaxPool2.forward = forwards[way]
                    t = time.perf_counter()
                    histories[way].append(repr(run_local(cfg)[0]))
                    times[way].append(time.perf_counter() - t)
            ratios = [e / k for k, e in zip(times["kernel"], times["elementwise"])]
            results[name] = {**{f"{w}_s": [round(s, 2) for s in times[w]] for w in WAYS},
                             "ratios": [round(r, 3) for r in ratios], "median_ratio": round(statistics.median(ratios), 3),
                             "same_metrics": len(set(histories["kernel"] + histories["elementwise"])) == 1,
                             "no_grad_calls": dict(calls)}
            calls.update(dict.fromkeys(WAYS, 0))
            r = results[name]
            print(f"{name}: kernel {r['kernel_s']} s, elementwise {r['elementwise_s']} s, elementwise / kernel {r['ratios']}, "
                  f"pooled without autograd {r['no_grad_calls']}, every metric of every round the same: {r['same_metrics']}",
                  flush=True)
    finally:
        models.MaxPool2.forward = own
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
