"""benchmarks/cell_diff.py on two small hand-made cell folders whose differences are known: one choice moved, one
final run moved, the rows, the CI test, the order, and the documents' quotes of a number that moved."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from benchmarks.cell_diff import compare, every_run, main, stale_quotes

M = "personalized_accuracy_mean"


def _cell(folder, chosen: dict[str, str], runs: dict[str, list[float]], ci: dict[str, float], compact: str):
    folder.mkdir()
    (folder / "bench_state.json").write_text(json.dumps({"methods": {k: {"chosen": {"16": s}} for k, s in chosen.items()}}))
    rows = [{"run_id": f"{k}{seed}", "algorithm": k, "setting": chosen[k], "seed": seed, "trial_index": 0, "trial_start": 0, M: v}
            for k, vs in runs.items() for seed, v in enumerate(vs, 1)]
    pd.DataFrame(rows).to_csv(folder / "final_runs_b16.csv", index=False)
    (folder / "final_runs_b16.csv.tags.json").write_text(json.dumps({"fedsweep.metric": M, "fedsweep.mode": "max"}))
    table = [{"algorithm": k, f"{M} mean": sum(vs) / len(vs), f"{M} ci95": ci[k]} for k, vs in runs.items()]
    pd.DataFrame(table).to_csv(folder / "table_b16.csv", index=False)
    (folder / "compact.md").write_text(compact)
    return folder


@pytest.fixture
def cells(tmp_path):
    old = _cell(tmp_path / "old", {"a": "sa", "b": "sb", "c": "sc"},
                {"a": [0.90, 0.91, 0.92], "b": [0.80, 0.81, 0.82], "c": [0.70, 0.70, 0.70]},
                {"a": 0.01, "b": 0.0001, "c": 0.0}, "| 1 | a | 91.00 ± 1.00 |\n| 2 | b | 81.00 ± 0.01 |\n")
    new = _cell(tmp_path / "new", {"a": "sa", "b": "sb2", "c": "sc"},
                {"a": [0.90, 0.91, 0.925], "b": [0.85, 0.85, 0.85], "c": [0.70, 0.70, 0.70]},
                {"a": 0.012, "b": 0.0, "c": 0.0}, "| 1 | a | 91.17 ± 1.20 |\n| 2 | b | 85.00 ± 0.00 |\n")
    return new, old


def test_a_moved_choice_a_moved_run_and_the_rows_they_move(cells):
    new, old = cells
    d = compare(new, old, 16)
    assert d["choices_moved"] == ["b"]
    # b's new setting has no run before: a's and c's three runs each are compared, one of a's moved by 0.5 points
    assert (d["runs_compared"], d["runs_equal"], d["runs_moved"]) == (6, 5, 1)
    assert d["run_move_median"] == pytest.approx(0.5) and d["run_move_max"] == pytest.approx(0.5)
    assert d["run_move_max_at"] == ("a", 3)
    assert d["rows_moved"] == d["rows_moved_shown"] == 2 and d["row_move_max_at"] == "b" and d["row_move_max"] == pytest.approx(4.0)
    assert d["rows_outside_old_ci"] == ["b"]  # a moved 0.17 points inside its old ± 1.00; b 4 points outside ± 0.01
    assert d["spearman"] == pytest.approx(1.0) and d["top5"]["new"] == d["top5"]["old"] == ["a", "b", "c"]


def test_a_method_without_a_row_in_one_table_is_compared_by_its_choice_and_runs_only(cells):
    """A method whose chosen setting diverged on a final seed has a choice and runs but no table row (the CIFAR-10
    pathological cut's PFLScaf (MAML)): its choice and runs are compared, the rows of the others."""
    new, old = cells
    table = pd.read_csv(new / "table_b16.csv")
    table[table["algorithm"] != "c"].to_csv(new / "table_b16.csv", index=False)
    d = compare(new, old, 16)
    assert (d["methods"], d["rows"], d["runs_compared"]) == (3, 2, 6) and d["rows_moved"] == 2
    assert d["top5"]["new"] == ["a", "b"] and d["top5"]["old"] == ["a", "b"]


def test_a_row_that_moves_in_its_third_decimal_moved_but_not_in_the_two_shown(tmp_path):
    """A row whose mean moves by less than the table shows counts as moved, and not among those the reader sees
    move (93.816 and 93.819 both show 93.82; 93.814 shows 93.81)."""
    old = _cell(tmp_path / "old", {"a": "sa", "b": "sb"}, {"a": [0.93816] * 3, "b": [0.93814] * 3}, {"a": 0.0, "b": 0.0}, "")
    new = _cell(tmp_path / "new", {"a": "sa", "b": "sb"}, {"a": [0.93819] * 3, "b": [0.93816] * 3}, {"a": 0.0, "b": 0.0}, "")
    d = compare(new, old, 16)
    assert (d["rows_moved"], d["rows_moved_shown"]) == (2, 1)


def test_the_documents_quotes_of_a_number_that_moved_are_listed_across_line_breaks(cells, tmp_path):
    new, old = cells
    doc = tmp_path / "page.md"
    doc.write_text("a kept its place (91.00 ±\n  1.00), b too: 81.00 ± 0.01; unrelated 50.00 ± 1.00\n")
    assert stale_quotes(new, old, docs=[str(doc)]) == [f"{doc}:1: 91.00 ± 1.00", f"{doc}:2: 81.00 ± 0.01"]


def test_the_command_prints_each_budget(cells, capsys):
    new, old = cells
    main([str(new), str(old)])
    out = capsys.readouterr().out
    assert out.startswith("budget 16: 1 of 3 choices moved ['b']; of 6 final runs of a setting both ran, 5 equal, 1 moved")


def _recorded(folder, phases: dict[str, list[dict]], state: dict[str, dict]):
    """A folder's saved phases (``runs/<sweep run id>.csv``, newest run first, as MLflow lists them) and the state that
    names which phase holds each method's runs (replacing the chosen-only state of :func:`_cell`)."""
    (folder / "runs").mkdir(exist_ok=True)
    base = {"run_id": "r", "algorithm": "a", "outcome": "finished", "trial_index": 0, "wall_time_s": 1.0,
            "param:algorithm.local_lr": "0.1", "rounds_to_target": float("nan")}
    for name, rows in phases.items():
        pd.DataFrame([{**base, "setting_label": f"method={r['setting'][0]}", "trial_start": 100 - i, **r}
                      for i, r in enumerate(rows)]).to_csv(folder / "runs" / f"{name}.csv", index=False)
    (folder / "bench_state.json").write_text(json.dumps({"methods": state}))


def test_every_recorded_run_is_compared_in_its_outcome_and_every_metric_column_times_left_out(cells, capsys):
    """Tuning and final runs alike, each method's from the phases its state names, matched by (setting, seed): a NaN
    metric on both sides is equal, a run whose wall time alone differs is equal, one metric or the outcome differing
    is not; a run only in the new folder is counted, not compared. A phase run again (FedAMP's after its fix) replaces
    the one before, whose copy stays in runs/: the superseded copy is never read, whichever file or row comes first."""
    new, old = cells
    tuning = [{"setting": "a1", "seed": 0, M: 0.5}, {"setting": "a2", "seed": 0, M: 0.6},
              {"setting": "b1", "seed": 0, M: 0.7}, {"setting": "b2", "seed": 0, M: 0.8}]
    final = [{"setting": "a2", "seed": s, M: 0.61 + s, "rounds_to_target": 5.0} for s in (1, 2)]
    state = {"a": {"settings": ["a1", "a2"], "chosen": {"16": "a2", "4": "a1"}, "tune_run": "t", "final_run": "f"},
             "b": {"settings": ["b1", "b2"], "chosen": {"16": "b2"}, "tune_run": "t2", "final_run": "f"}}
    superseded = [{**r, M: 0.0, "outcome": "diverged"} for r in tuning[2:]]
    # the old folder: b's first tuning (in "t", the whole cell's sweep) superseded by its rerun "t2"
    _recorded(old, {"t": tuning[:2] + superseded, "t2": tuning[2:], "f": final}, state)
    moved = [dict(r) for r in tuning]
    moved[0]["wall_time_s"] = 9.0  # seconds are not a metric
    moved[1][M] = 0.6000001
    moved[2]["outcome"] = "diverged"
    extra = {"setting": "c1", "seed": 1, M: 0.9}
    _recorded(new, {"t": moved[:2], "t2": moved[2:], "f": final + [extra]},
              {**state, "c": {"settings": ["c1"], "chosen": {"16": "c1"}, "final_run": "f"}})
    d = every_run(new, old)
    assert (d["runs"], d["compared"], d["equal"], d["columns"]) == (7, 6, 4, 2)
    assert d["differ"] == [("method=a", "a2", 0), ("method=b", "b1", 0)]
    main([str(new), str(old)])
    assert "every recorded run: 7 in the new folder, 6 of them in the old; 4 equal in their outcome and all 2 metric columns" in capsys.readouterr().out
