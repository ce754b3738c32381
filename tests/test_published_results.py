"""The benchmark's published results hold together: each cell folder's tables are computed from the runs it saved,
its choices from its tuning runs' validation scores, and docs/benchmark.md's tables are those folders' tables.

What `fedsweep bench` wrote into ``docs/results/benchmark/<cell>/`` is read back as ``fedsweep table --from-runs``
reads it (no MLflow store), and every step between the runs and the page is done again: a table edited by hand, a
number copied wrongly into the page, or a choice the saved runs do not give fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fedsweep.bench import BENCH_METRICS, bench_table, choose, compact_markdown, load_bench, read_state
from fedsweep.bench_folder import code_note, method_runs, row_codes
from fedsweep.table import read_runs
from fedsweep.tracking import names_kernels

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "benchmark"
CELLS = sorted(p for p in RESULTS.iterdir() if (p / "bench_state.json").exists())


def _done(state: dict) -> dict[str, dict]:
    return {k: e for k, e in state["methods"].items() if "final_run" in e}


def _ranking(folder: Path) -> tuple[str, str]:
    """The metric and mode the cell ranked by, as `fedsweep bench` recorded them beside its final runs (its tags)."""
    tags = read_runs(str(next(folder.glob("final_runs_b*.csv"))))[1]
    assert tags["fedsweep.select_on"] == "validation"
    return tags["fedsweep.metric"], tags["fedsweep.mode"]


@pytest.mark.parametrize("folder", CELLS, ids=[p.name for p in CELLS])
def test_each_cells_tables_are_computed_from_its_saved_final_runs(folder):
    """Each budget's table (``table_b<B>.csv``) and the page's table (``compact.md``) rebuilt from
    ``final_runs_b<B>.csv`` and the choices in ``bench_state.json``, as `fedsweep bench` builds them."""
    import pandas as pd

    done, (metric, mode) = _done(read_state(folder)), _ranking(folder)
    chosen = {k: {int(b): s for b, s in e["chosen"].items()} for k, e in done.items()}
    tables = {}
    for path in sorted(folder.glob("final_runs_b*.csv")):
        budget = int(path.stem.rsplit("_b", 1)[1])
        runs, _ = read_runs(str(path))
        assert set(runs["algorithm"]) <= set(done), "a saved final run of a method whose final runs are not recorded"
        labels = dict(zip(runs["setting"], runs["setting_label"], strict=True))
        table, _ = bench_table(runs, chosen, {k: e["tried"] for k, e in done.items()}, budget, metric, mode, labels)
        table.attrs["mode"] = mode
        published = pd.read_csv(folder / f"table_b{budget}.csv")
        assert list(table["algorithm"]) == list(published["algorithm"])
        for column in (f"{m} {x}" for m in BENCH_METRICS for x in ("mean", "ci95")):
            if column in published:
                assert table[column].tolist() == pytest.approx(published[column].tolist(), rel=1e-12, nan_ok=True), column
        tables[budget] = table
    assert tables, f"{folder.name}: no final_runs_b*.csv"
    assert compact_markdown(tables, metric) + "\n" == (folder / "compact.md").read_text()
    # each table names the code of its runs (commits differ where a phase resumed after one, or a method ran again)
    for budget, table in tables.items():
        codes = row_codes(folder, done, read_runs(str(folder / f"final_runs_b{budget}.csv"))[0], [budget])[budget]
        note = code_note({k: codes[k] for k in table["algorithm"]})
        assert (folder / f"table_b{budget}.md").read_text().endswith(note), budget


@pytest.mark.parametrize("folder", [p for p in CELLS if (p / "runs").is_dir()],
                         ids=[p.name for p in CELLS if (p / "runs").is_dir()])
def test_each_recorded_choice_is_what_the_saved_tuning_runs_give_on_validation(folder):
    """Where a cell saved its tuning runs (``runs/``), each method's choice at each budget made again from them with
    every test column removed: selection reads validation scores only, and the saved runs give the recorded choice.
    A method tuned before phases were saved (2026-11-26; its entry, as old, records no seeds either) has none, in a
    cell where a method added since was run alone (P-Avg (MAML) in the MNIST-family MLP cells)."""
    checked, (metric, mode) = 0, _ranking(folder)
    methods = {k: e for k, e in read_state(folder)["methods"].items() if "chosen" in e}
    tuning = method_runs(folder, methods, "tune_run")
    for key, entry in methods.items():
        if (runs := tuning.get(key)) is None:
            assert "seeds" not in entry, f"{key}: tuned since phases are saved, but its tuning runs are not in runs/"
            continue
        runs = runs.drop(columns=[c for c in runs.columns if re.match(r"(personalized|global|unseen)_|train_loss", c)])
        for budget, setting in entry["chosen"].items():
            assert choose(runs, metric, mode, int(budget)) == setting, (key, budget)
            checked += 1
    assert checked


def test_every_results_table_of_the_page_is_one_cells_compact_table():
    """docs/benchmark.md's tables of results (those headed ``| rank | method |``) are, line for line, the
    ``compact.md`` of a cell folder."""
    compact = {p.name: (p / "compact.md").read_text().splitlines() for p in CELLS}
    lines = (ROOT / "docs" / "benchmark.md").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("| rank | method |")]
    assert len(starts) >= 6
    for i in starts:
        end = next((j for j in range(i, len(lines)) if not lines[j].startswith("|")), len(lines))
        assert lines[i:end] in compact.values(), f"docs/benchmark.md:{i + 1}: a results table that is no cell's compact.md"


def test_the_summary_is_the_merge_of_the_cells_it_names(tmp_path):
    """``summary.csv`` and ``summary.md`` are what `fedsweep table --from-runs` (docs/benchmark.md's command) gives
    from the final runs of the cells they name (each cell's own budget, its largest): a cell's rows rerun or added
    without the summary built again fail here."""
    import pandas as pd

    from fedsweep.cli import main

    published = pd.read_csv(RESULTS / "summary.csv")
    labels = [c.removesuffix(" mean") for c in published.columns if c.endswith(" mean")]
    assert len(labels) >= 5
    sources = []
    for label in labels:
        saved = max((RESULTS / label).glob("final_runs_b*.csv"), key=lambda p: int(p.stem.rsplit("_b", 1)[1]))
        sources += ["--from-runs", str(saved)]
    assert main(["table", *sources, "--format", "csv", "--output", str(tmp_path / "summary.csv")]) == 0
    assert main(["table", *sources, "--output", str(tmp_path / "summary.md")]) == 0
    merged = pd.read_csv(tmp_path / "summary.csv")
    assert list(merged.columns) == list(published.columns)
    assert list(merged["algorithm"]) == list(published["algorithm"])
    for column in published.columns[1:]:
        assert merged[column].tolist() == pytest.approx(published[column].tolist(), rel=1e-12, nan_ok=True), column
    assert (tmp_path / "summary.md").read_text() == (RESULTS / "summary.md").read_text()


#: The cell files that declare ``bench.kernels`` (read as YAML: the methods file is no cell)
DECLARING = [f for f in sorted((ROOT / "sweeps" / "benchmark").glob("*.yaml"))
             if (yaml.safe_load(f.read_text()).get("bench") or {}).get("kernels")]


def test_the_embedded_cell_and_the_mlp_cells_run_again_declare_make_demos_kernels():
    """The embedded Synthetic cell and the four MNIST-family MLP cells were run again with ``make demo``'s kernels
    (2026-12-05 and 06), and the four small-CNN cells (2026-12-06 to 08), so that they repeat on any x86-64 CPU: their
    files declare them (a CNN cell with its convolutions without oneDNN beside them: docs/reproduction.md,
    "Convolutions without oneDNN"), and each place that gives the Synthetic cell's command gives it as it is typed (no
    variables before it)."""
    from benchmarks.demo import make_demo_settings

    assert {f.name for f in DECLARING} >= {"synthetic.yaml", "mnist_dirichlet.yaml", "mnist_pathological.yaml",
                                          "fmnist_dirichlet.yaml", "fmnist_pathological.yaml", "mnist_dirichlet_cnn.yaml",
                                          "mnist_pathological_cnn.yaml", "fmnist_dirichlet_cnn.yaml",
                                          "fmnist_pathological_cnn.yaml"}
    for f in DECLARING:
        bench = load_bench(f, check_cluster=False)
        cnn = bench.first.trials[0].config.model.name == "cnn"
        assert bench.settings.kernels == {**make_demo_settings(), **({"FEDSWEEP_CONV": "native"} if cnn else {})}, f.name
    for doc in ("README.md", "docs/benchmark.md", "sweeps/benchmark/synthetic.yaml"):
        assert "fedsweep bench sweeps/benchmark/synthetic.yaml --resume" in (ROOT / doc).read_text(), doc
        assert "MKL_CBWR=COMPATIBLE fedsweep bench sweeps/benchmark/synthetic.yaml --resume" not in (ROOT / doc).read_text(), doc


@pytest.mark.parametrize("file", DECLARING, ids=[f.stem for f in DECLARING])
def test_every_run_of_a_cell_whose_file_declares_kernels_names_them(file):
    """A cell whose file declares ``bench.kernels`` was computed with them: every run of its folder, tuning
    (``runs/``) and final, names them in its ``platform`` column, so `--resume` owes nothing again."""
    bench = load_bench(file, check_cluster=False)
    folder = RESULTS / bench.name
    finals, phases = sorted(folder.glob("final_runs_b*.csv")), sorted((folder / "runs").glob("*.csv"))
    # each budget's final runs, and the runs of the phases its state names: the whole cell's two sweeps (tuning,
    # final seeds), and one or two more for a method run again alone (FedAMP since 4646042, FedEM's final runs since
    # 2ec44ec); nothing else
    named = {e[k] for e in read_state(folder)["methods"].values() for k in ("tune_run", "final_run") if k in e}
    assert len(finals) == 1 + len(bench.settings.budgets) and {p.stem for p in phases} == named, (finals, phases, named)
    paths = finals + phases
    for path in paths:
        platforms = set(read_runs(str(path))[0]["platform"])
        assert platforms and all(names_kernels(p, bench.settings.kernels) for p in platforms), (path.name, platforms)
