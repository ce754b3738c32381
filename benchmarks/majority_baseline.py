"""The majority-class baseline of a benchmark cell: each client predicts the most frequent label of its own training
part, with no model and no communication. Computed from the cell's data, as its methods see it.

    FEDSWEEP_DATA_DIR=../shared/data python benchmarks/majority_baseline.py sweeps/benchmark/*.yaml \
        --output docs/results/benchmark/majority_baseline.csv

On a label-skewed split this predictor already scores high on the personalized metrics, so a method's row means
something only beside it (docs/benchmark.md: a chosen setting that learned each client's label prior and nothing
more scores exactly this). Printed per cell, as the benchmark tables score it: the mean, 10th percentile and worst
of the trained clients' test accuracies (``fedsweep.evaluation``), and the mean over the unseen clients (their own
training part gives their majority label, as their personalization would see it). Every seed of a cell shares its
split (the data seed), so one number per cell.
"""

from __future__ import annotations

import argparse
import csv

import numpy as np
import torch

from fedsweep.bench import load_bench
from fedsweep.data import build_federated_dataset


def majority_accuracies(clients) -> np.ndarray:
    """Each client's test accuracy when it predicts its training part's most frequent label (the lowest on a tie)."""
    out = []
    for c in clients:
        label = torch.bincount(c.y_train).argmax()
        out.append(float((c.y_test == label).double().mean()))
    return np.array(out)


def cell(path: str) -> dict[str, float | str]:
    bench = load_bench(path, check_cluster=False)
    cfg = bench.first.trials[0].config
    clients = build_federated_dataset(cfg.data).clients
    trained = cfg.trained_count()
    acc = majority_accuracies(clients[:trained])
    row = {"cell": bench.name, "mean": acc.mean(), "p10": np.percentile(acc, 10), "worst": acc.min()}
    row["unseen mean"] = majority_accuracies(clients[trained:]).mean() if trained < len(clients) else float("nan")
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="benchmark files (sweeps/benchmark/*.yaml)")
    parser.add_argument("--output", help="also write the rows (fractions, not percents) to this CSV file")
    args = parser.parse_args(argv)
    print("| cell | mean (%) | p10 (%) | worst (%) | unseen mean (%) |\n|---|---|---|---|---|")
    rows = []
    for path in args.files:
        if path.endswith("methods.yaml"):
            continue
        r = cell(path)
        rows.append(r)
        print(f"| {r['cell']} | {100 * r['mean']:.2f} | {100 * r['p10']:.2f} | {100 * r['worst']:.2f} | {100 * r['unseen mean']:.2f} |",
              flush=True)
    if args.output:
        with open(args.output, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows({k: v if k == "cell" else float(v) for k, v in r.items()} for r in rows)


if __name__ == "__main__":
    main()
