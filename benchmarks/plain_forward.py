"""A plain model's direct path against the general one, on a peer workload, in one process.

An MLR or an MLP without normalization runs layer by layer on views of its parameter vector, and its stacked
clients as batched products (``FlatModel._plain``, ``FlatModel.rows``); every other model through
``torch.func.functional_call``, under ``torch.func.vmap`` when stacked. Both give the same numbers bit for bit
(on an AMD CPU only with MKL's COMPATIBLE branch, ``MKL_CBWR=COMPATIBLE``: with its own branch the stacked
gradients differ in the last bits there; ``tests/test_stacked.py``).
This times a whole run (``fedsweep.engine.run_local``, one torch thread) of a workload of ``pfl_peer.py`` in the
layout fedsweep chooses (clients stacked) and one by one, each with the direct path and with the general path
(``fedsweep.models._plain_layers`` replaced so that no model counts as plain), alternated in one process, and
checks that every round's metrics are the same on both paths. Printed: median CPU seconds of each, their ratio.

    python benchmarks/plain_forward.py --workload dirichlet --rounds 200 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._harness import WORKLOADS


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="dirichlet")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    data_dir, threads = os.environ.get("FEDSWEEP_DATA_DIR"), torch.get_num_threads()
    os.environ.setdefault("FEDSWEEP_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    try:
        return _measure(args)
    finally:  # called from a test's process: left as found
        torch.set_num_threads(threads)
        if data_dir is None:
            os.environ.pop("FEDSWEEP_DATA_DIR", None)


def _measure(args) -> dict:
    import torch

    from benchmarks.pfl_peer import SINGLE, experiment
    from fedsweep import models
    from fedsweep.engine import run_local
    from fedsweep.layout import auto_layout
    from fedsweep.loading import validate

    torch.set_num_threads(1)
    raw = experiment(args.rounds, SINGLE[0], SINGLE[1], "default", Path("unused.db"), args.workload)
    layouts = {"stacked": validate(auto_layout(raw, 1)), "one by one": validate(raw)}
    plain = models._plain_layers
    seconds: dict[tuple[str, str], list[float]] = {}
    histories: dict[tuple[str, str], str] = {}
    for _ in range(args.repeats):
        for layout, cfg in layouts.items():
            for path, find in (("general", lambda module: None), ("direct", plain)):
                models._plain_layers = find
                try:
                    start = time.process_time()
                    history, _ = run_local(cfg)
                    seconds.setdefault((layout, path), []).append(time.process_time() - start)
                finally:
                    models._plain_layers = plain
                histories.setdefault((layout, path), repr(history))
                assert histories[(layout, path)] == repr(history), f"{layout}, {path}: another history on a repetition"
    out = {"workload": args.workload, "rounds": args.rounds, "repeats": args.repeats}
    print(f"{args.workload}, {args.rounds} rounds, {args.repeats} repetitions alternated: median CPU s (per repetition)")
    for layout in layouts:
        general, direct = (statistics.median(seconds[(layout, p)]) for p in ("general", "direct"))
        same = histories[(layout, "general")] == histories[(layout, "direct")]
        out[layout] = {"general_s": general, "direct_s": direct, "ratio": direct / general, "same_metrics": same}
        print(f"  {layout:10s} general {general:6.2f} {[round(s, 2) for s in seconds[(layout, 'general')]]}  direct "
              f"{direct:6.2f} {[round(s, 2) for s in seconds[(layout, 'direct')]]}  ratio {direct / general:.3f}  "
              f"every round's metrics {'the same' if same else 'DIFFER'}")
    return out


if __name__ == "__main__":
    result = main()
    sys.exit(0 if all(result[k]["same_metrics"] for k in ("stacked", "one by one")) else 1)
