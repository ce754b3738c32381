"""Benchmark — does a wider stack pay on the CPU? The cost of one stacked SGD step per client, by stack width.

Issue 35's grid target (16 settings × 200 rounds ≥ 3× pfl-research's processes) is held by each trial's own
arithmetic (docs/performance.md, section 9). One way past it would pack several settings of a grid into one
trial, their clients stacked together: 8 settings × 10 clients trained as one stack of 80. Whether that can pay
depends on how a stacked step's cost per client moves with the stack's width, which this measures with fedsweep's
own stacked kernel (``StackedContext.loss``: each client's mean cross-entropy of ``FlatModel.rows``, the batched
products of a plain MLP; ``algorithms.base.grad`` of their sum, as ``sgd`` takes it; the update), one torch thread, every width alternated
repetition by repetition in one process, so the ratios hold on a loaded machine too.

Models: the peer workloads' MLPs (``benchmarks/pfl_peer.py``): 784-20-10 (dirichlet, MNIST) and 60-20-10
(capped, powerlaw: Synthetic); batch 20.

    python benchmarks/stack_width.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from fedsweep.algorithms.base import ClientContext, grad
from fedsweep.algorithms.stacked import StackedContext
from fedsweep.client_data import ClientData
from fedsweep.models import FlatModel, MLPConfig, build_model

WIDTHS = [1, 5, 10, 20, 40, 80]


def step_seconds(model: FlatModel, features: int, width: int, batch: int, steps: int) -> float:
    """Seconds per stacked step of ``width`` clients (after a warm-up of 10 steps)."""
    gen = torch.Generator().manual_seed(width)
    w = model.initial_vector(0).repeat(width, 1)
    x = torch.rand(width, batch, features, generator=gen)
    y = torch.randint(0, model.num_classes, (width, batch), generator=gen)
    stacked = StackedContext([ClientContext(model, ClientData(x[c], y[c], x[c, :0], y[c, :0]), torch.Generator())
                              for c in range(width)])

    def step(w: torch.Tensor) -> torch.Tensor:
        g, _ = grad(stacked.loss, w, (x, y))  # the stacked clients' own loss and gradient, as sgd takes them
        return w - 0.05 * g

    for _ in range(10):
        w = step(w)
    t0 = time.perf_counter()
    for _ in range(steps):
        w = step(w)
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> dict[int, dict[int, float]]:
    """Prints the tables; returns, per input width, the median seconds a step per client of each stack width."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=20)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out: dict[int, dict[int, float]] = {}
    for features in (784, 60):
        model = FlatModel(build_model(MLPConfig(hidden=[20]), features, 10))
        times: dict[int, list[float]] = {c: [] for c in WIDTHS}
        for _ in range(args.repeats):
            for c in WIDTHS:
                times[c].append(step_seconds(model, features, c, args.batch, args.steps))
        ref = statistics.median(times[10]) / 10
        print(f"\nMLP {features}-20-10, batch {args.batch}, one thread; median of {args.repeats} (alternated)")
        print("width | ms a step | ms per client | per client / width 10's")
        out[features] = {c: statistics.median(times[c]) / c for c in WIDTHS}
        for c, per_client in out[features].items():
            print(f"{c:5d} | {1e3 * per_client * c:9.3f} | {1e3 * per_client:13.4f} | {per_client / ref:6.2f}")
    return out


if __name__ == "__main__":
    main()
