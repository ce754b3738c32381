"""How a benchmark phase's end is recorded (``fedsweep.bench_run._settle``), without Ray: a final sweep stopped with
one method's runs all there and another's not, then the same sweep finished; the tuning case runs on a real Ray
instance in tests/test_resume.py."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from fedsweep.bench import load_bench, read_state
from fedsweep.bench_run import Interrupted, _settle
from tests.test_bench import METHODS, bench_file


def runs_of(pairs: list[tuple[str, int]]) -> pd.DataFrame:
    return pd.DataFrame({"setting": [s for s, _ in pairs], "seed": [seed for _, seed in pairs], "outcome": "finished",
                         "trial": [(i, 0.0) for i in range(len(pairs))]})


def test_a_stopped_final_sweep_records_the_methods_with_every_run_and_lands_when_the_rest_finish(tmp_path):
    folder = tmp_path
    (folder / "methods.yaml").write_text(yaml.safe_dump(METHODS))
    bench = load_bench(bench_file(folder, "skew", {"name": "label_skew", "classes_per_client": 4}), check_cluster=False)
    seeds = bench.settings.final_seeds
    owed = {"fedavg": ["a1"], "local": ["l1", "l2"]}  # local chose two settings (one a budget)
    state = {"methods": {"fedavg": {"chosen": {"1": "a1"}}, "local": {"chosen": {"1": "l1", "3": "l2"}}}}
    out = folder / "out"
    first = runs_of([("a1", s) for s in seeds] + [("l1", s) for s in seeds] + [("l2", seeds[0])])
    with pytest.raises(Interrupted, match=r"the final sweep stopped with 1 of 6 runs missing; 1 of its 2 methods had "
                                          r"every run and are recorded \(fedavg\)"):
        _settle(bench, state, "final", owed, ["fedavg", "local"], out, {"interrupted": True, "errors": 0, "parent_run_id": "s1"},
                first, 1)
    saved = read_state(out)
    assert saved["methods"]["fedavg"]["final_run"] == "s1" and "final_run" not in saved["methods"]["local"]
    assert saved["in_flight"] == {"final": {"methods": ["fedavg", "local"], "sweep_run": "s1"}}
    assert (out / "runs" / "s1.csv").exists()

    # the sweep resumed by Tune and finished: the method left is recorded, the sweep no longer in flight
    done = runs_of([("a1", s) for s in seeds] + [("l1", s) for s in seeds] + [("l2", s) for s in seeds])
    assert _settle(bench, saved, "final", owed, ["local"], out, {"interrupted": False, "errors": 0, "parent_run_id": "s1"},
                   done, 0)
    saved = read_state(out)
    assert saved["methods"]["local"]["final_run"] == "s1" and "in_flight" not in saved
    assert len(pd.read_csv(out / "runs" / "s1.csv")) == 6

    # failed trials with a run missing: recorded as far as they go, False (--resume goes on), no Interrupted
    state = {"methods": {"fedavg": {"chosen": {"1": "a1"}}, "local": {"chosen": {"1": "l1", "3": "l2"}}}}
    assert not _settle(bench, state, "final", owed, ["fedavg", "local"], folder / "out2",
                       {"interrupted": False, "errors": 1, "parent_run_id": "s2"}, first, 1)
    assert read_state(folder / "out2")["in_flight"]["final"]["sweep_run"] == "s2"
