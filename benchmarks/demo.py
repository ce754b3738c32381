"""Benchmark — the first ten minutes: ``make demo``'s sweep (``fedsweep sweep sweeps/default.yaml``), timed whole.

What is timed is what a new user waits for once installed: the command, interpreter start to exit, on cores 0-1
(taskset), with a fresh SQLite store and Tune folder each time. Beside it, in the same run, the machine's speed:
the in-process loop (``fedsweep.engine.run_local``, one torch thread, core 0) of the sweep's first trial
(FedAvg, seed 0), so that a figure from a slow day can be compared as a ratio.

Variants (interleaved repetition by repetition):
  default       the file as shipped: no ``resources`` section, the layout fedsweep chooses (``config.auto_layout``)
  handwritten   the layout the file carried before (a pool of one per trial: server_cpus 0.2, client_cpus 0.8,
                client_workers 1), to show whether a hand-written layout earns its place

Each run's table is kept: the script prints whether the repetitions of a variant printed the same table, and the
default layout's the README's table (the README says the numbers repeat exactly, and shows them), and exits 1 if
not (a difference from the README's table only on an x86-64 CPU, ``README_MACHINE``: elsewhere PyTorch has neither
these kernels nor MKL). The sweep runs as ``make demo`` runs it: PyTorch's AVX2 kernels unless
``ATEN_CPU_CAPABILITY`` is set, and MKL's branch for every x86-64 CPU unless ``MKL_CBWR`` is set.

    python benchmarks/demo.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._harness import ROOT, median, repeat

SWEEP = ROOT / "sweeps" / "default.yaml"
#: The machines whose every CPU should print the README's table: PyTorch's AVX2 kernels are one code on every x86-64
#: CPU, and MKL's COMPATIBLE branch (SSE2 without the approximate reciprocals) is the one it does not tie to Intel CPUs
#: (its AUTO branch picks kernels by the CPU's maker and model: README, "The two commands"; checked on an Intel Xeon
#: and an AMD EPYC). Elsewhere a difference is printed, not counted as a failure; the repetitions are still
#: compared with each other.
README_MACHINE = "(x86_64)"


def make_demo_settings() -> dict[str, str]:
    """The variables ``make demo`` sets unless they are set (``VAR=$${VAR:-value}`` in its recipe): PyTorch's
    kernels and MKL's branch."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    return dict(re.findall(r"(\w+)=\$\$\{\1:-([^}]+)\}", recipe))


#: The sweep's settings, as `make demo` runs it.
DISPATCH = {var: os.environ.get(var, value) for var, value in make_demo_settings().items()}
LAYOUTS = {"default": None, "handwritten": {"server_cpus": 0.2, "client_cpus": 0.8, "client_workers": 1}}


def sweep_worker(layout: str) -> dict:
    import yaml

    body = yaml.safe_load(SWEEP.read_text())
    with tempfile.TemporaryDirectory(prefix="demo-") as tmp:
        body.pop("resources", None)
        if LAYOUTS[layout]:
            body["resources"] = LAYOUTS[layout]
        body["tracking"]["tracking_uri"] = f"sqlite:///{tmp}/mlflow.db"
        body["sweep"]["storage_path"] = f"{tmp}/ray_results"
        path = Path(tmp) / "default.yaml"
        path.write_text(yaml.safe_dump(body, sort_keys=False))
        env = {**os.environ, **DISPATCH}
        t0 = time.perf_counter()
        proc = subprocess.run([str(Path(sys.executable).with_name("fedsweep")), "sweep", str(path), "--quiet"],
                              capture_output=True, text=True, cwd=tmp, env=env, check=False)
        seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    return {"s": seconds, "table": table_rows(proc.stdout)}


def table_rows(text: str) -> list[str]:
    """The rows of a printed best-setting table (one per algorithm; its header left out)."""
    return [ln for ln in text.splitlines() if re.match(r"\| [a-z]", ln) and not ln.startswith("| algorithm")]


def readme_table() -> list[str]:
    """The rows of the README's table of ``make demo`` (the first code block holding an ``| algorithm`` header)."""
    text = (ROOT / "README.md").read_text()
    return table_rows(next(b for b in text.split("```")[1::2] if "| algorithm |" in b))


def reference_worker() -> dict:
    import torch

    from fedsweep.engine import run_local
    from fedsweep.loading import load_sweep

    torch.set_num_threads(1)
    cfg = load_sweep(SWEEP).trials[0].config
    t0 = time.perf_counter()
    run_local(cfg)
    return {"s": time.perf_counter() - t0, "trial": cfg.algorithm.name, "seed": cfg.seed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--variant", choices=["reference", *LAYOUTS])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(reference_worker() if args.variant == "reference" else sweep_worker(args.variant)))
        return 0

    variants = {"reference": ("0", ["--variant", "reference"])}
    variants |= {name: ("0-1", ["--variant", name]) for name in args.layouts}
    res = repeat(__file__, variants, args.repeats)
    ref = median(res["reference"], "s")
    print(f"\nreference: the in-process loop of the sweep's first trial, median {ref:.2f} s (core 0, one thread)")
    same = True
    for name in args.layouts:
        s = median(res[name], "s")
        tables = {json.dumps(r["table"]) for r in res[name]}
        same &= len(tables) == 1
        print(f"{name:12s} sweep median {s:6.1f} s = {s / ref:5.1f} × reference; "
              f"its {args.repeats} tables {'identical' if len(tables) == 1 else 'DIFFER'}")
    for name in args.layouts:
        print(f"\n{name}, the table of its first repetition:\n" + "\n".join(res[name][0]["table"]))
    if "default" in args.layouts:
        os.environ.update(DISPATCH)  # read at torch's import: the platform the sweep ran on
        from fedsweep.tracking import run_platform

        readme, platform = res["default"][0]["table"] == readme_table(), run_platform()
        comparable = README_MACHINE in platform
        same &= readme or not comparable
        print("\nthe default layout's table " + ("is the README's, row for row" if readme else "DIFFERS from the README's")
              + ("" if readme or comparable else f" (printed on x86-64 CPUs; this platform: {platform})"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
