"""Fair tuning (issue 24): a validation part held out of each client's training data, settings selected on
it and reported on test; selection on test stays what it was."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import yaml

from fedsweep.cli import main
from fedsweep.config import ConfigError, load_sweep, validate
from fedsweep.data import build_federated_dataset, partitions
from fedsweep.evaluation import VAL
from fedsweep.federation import run_local
from fedsweep.table import best_settings, load_runs, to_markdown
from fedsweep.tracking import TAG_PREFIX, client, ensure_experiment
from tests.conftest import config_dict

SYNTHETIC = {"dataset": "synthetic", "num_clients": 8, "max_samples_per_client": 80}


def test_validation_split_is_stratified_seeded_and_never_empty():
    labels = np.repeat([0, 1, 2], [50, 30, 20])
    keep, val = partitions.validation_split(labels, 0.2, np.random.default_rng(0))
    assert len(val) == 20 and len(keep) == 80 and not set(keep) & set(val)
    assert Counter(labels[val].tolist()) == {0: 10, 1: 6, 2: 4}  # each label its share
    again = partitions.validation_split(labels, 0.2, np.random.default_rng(0))
    assert np.array_equal(val, again[1])
    for n, fraction in ((2, 0.01), (2, 0.99), (3, 0.5)):  # at least one held out, at least one kept
        keep, val = partitions.validation_split(np.zeros(n, np.int64), fraction, np.random.default_rng(0))
        assert len(val) >= 1 and len(keep) >= 1
    # remainders go to the labels with the largest fractional parts; the total is exact
    keep, val = partitions.validation_split(np.repeat([0, 1, 2], [3, 3, 4]), 0.5, np.random.default_rng(1))
    assert len(val) == 5


def test_the_validation_part_comes_out_of_the_training_part_and_the_test_part_is_unchanged():
    from fedsweep.data import SyntheticConfig

    plain = build_federated_dataset(SyntheticConfig(**SYNTHETIC))
    held = build_federated_dataset(SyntheticConfig(**SYNTHETIC, validation_fraction=0.25))
    for a, b in zip(plain.clients, held.clients):
        assert b.num_train + b.num_val == a.num_train and b.num_val == max(1, round(0.25 * a.num_train))
        assert np.array_equal(a.x_test.numpy(), b.x_test.numpy())
        rows = {r.tobytes() for r in a.x_train.numpy()}
        assert all(r.tobytes() in rows for x in (b.x_train, b.x_val) for r in x.numpy())
        assert not {r.tobytes() for r in b.x_train.numpy()} & {r.tobytes() for r in b.x_val.numpy()}


def test_val_metrics_each_evaluation_and_none_without_a_validation_part():
    body = {"seed": 1, "data": {**SYNTHETIC}, "model": {"name": "mlr"}, "rounds": 4, "eval_every": 2,
            "algorithm": {"name": "perfedavg", "participation_rate": 0.5, "local_steps": 2, "personalization_lr": 0.01,
                          "local_lr": 0.05}}
    history, _ = run_local(validate(body))
    assert not any(k.startswith(VAL) for m in history for k in m)
    body["data"]["validation_fraction"] = 0.3
    history, _ = run_local(validate(body))
    evaluated = [m for m in history if "global_accuracy" in m]
    assert [m["round"] for m in evaluated] == [0, 2, 4]
    for m in evaluated:
        assert {VAL + k for k in m if k.startswith(("personalized_", "global_"))} <= set(m)
        assert 0 <= m[VAL + "personalized_accuracy_mean"] <= 1


def test_select_on_validation_needs_a_validation_part_in_every_trial(tmp_path):
    body = config_dict(data={"validation_fraction": {"grid": [0.0, 0.2]}})
    body["sweep"] = {"select_on": "validation"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.select_on: 'validation' needs a validation part in every trial, "
                                          r"but data.validation_fraction is 0 in 1 of 2"):
        load_sweep(tmp_path / "s.yaml", check_cluster=False)
    body["sweep"]["select_on"] = "holdout"
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    with pytest.raises(ConfigError, match=r"sweep.select_on: Input should be 'test' or 'validation'"):
        load_sweep(tmp_path / "s.yaml", check_cluster=False)


def _log(c, exp, lr, seed, test, val):
    run = c.create_run(exp, tags={f"{TAG_PREFIX}algorithm": "fedavg", f"{TAG_PREFIX}setting": f"lr={lr}",
                                  f"{TAG_PREFIX}setting_label": f"local_lr={lr}", f"{TAG_PREFIX}seed": str(seed)}).info.run_id
    for key, value in (("personalized_accuracy_mean", test), (VAL + "personalized_accuracy_mean", val), ("global_accuracy", test)):
        c.log_metric(run, key, value, step=10)
    c.set_terminated(run, "FINISHED")


def test_selection_on_validation_reports_the_test_numbers_of_the_setting_validation_chose(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    c, exp = client(uri), ensure_experiment(uri, "crafted")
    for seed in (0, 1):  # lr 0.3 is best on test, lr 0.1 on validation
        _log(c, exp, 0.3, seed, test=0.80 + 0.02 * seed, val=0.70)
        _log(c, exp, 0.1, seed, test=0.75 + 0.02 * seed, val=0.72)
    runs, _ = load_runs(uri, "crafted")
    on_test = best_settings(runs, "personalized_accuracy_mean")
    on_val = best_settings(runs, "personalized_accuracy_mean", select_on="validation")
    assert on_test["best setting"].tolist() == ["local_lr=0.3"] and on_val["best setting"].tolist() == ["local_lr=0.1"]
    assert on_val["personalized_accuracy_mean mean"].iloc[0] == pytest.approx(0.76)  # lr 0.1's test mean
    assert on_val[VAL + "personalized_accuracy_mean mean"].iloc[0] == pytest.approx(0.72)
    assert "Settings selected on validation" in to_markdown(on_val) and "selected on" not in to_markdown(on_test)
    with pytest.raises(KeyError, match="select on validation needs runs with data.validation_fraction > 0"):
        best_settings(runs.drop(columns=[VAL + "personalized_accuracy_mean"]), "personalized_accuracy_mean", select_on="validation")


@pytest.mark.ray
def test_a_real_sweep_where_validation_and_test_pick_different_settings(ray_session, tmp_path, capsys):
    """Two learning rates × two seeds on Synthetic with a 30% validation part: the test data would pick
    local_lr = 0.3, the validation parts pick 0.1 (found once; same seeds, same numbers). The sweep selects
    on validation: its table reports lr 0.1's test accuracy, and says how it chose."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    body = {
        "data": {**SYNTHETIC, "validation_fraction": 0.3}, "model": {"name": "mlr"}, "rounds": 5, "eval_every": 5,
        "algorithm": {"name": "fedavg", "participation_rate": 0.5, "local_steps": 5, "batch_size": 10,
                      "local_lr": {"grid": [0.1, 0.3]}},
        "resources": {"server_cpus": 0.2, "client_cpus": 0.3, "client_workers": 1},
        "tracking": {"experiment": "fair", "tracking_uri": uri},
        "sweep": {"name": "fair", "seeds": [0, 1], "max_concurrent_trials": 2, "select_on": "validation",
                  "storage_path": str(tmp_path / "ray_results")},
    }
    (tmp_path / "fair.yaml").write_text(yaml.safe_dump(body))
    assert main(["sweep", str(tmp_path / "fair.yaml"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "by final val_personalized_accuracy_mean" in printed and "Settings selected on validation" in printed
    runs, tags = load_runs(uri, "fair")
    assert tags[f"{TAG_PREFIX}select_on"] == "validation" and len(runs) == 4
    means = runs.groupby("param:algorithm.local_lr")[["personalized_accuracy_mean", VAL + "personalized_accuracy_mean"]].mean()
    assert means["personalized_accuracy_mean"].idxmax() == "0.3" and means[VAL + "personalized_accuracy_mean"].idxmax() == "0.1"
    table = best_settings(runs, "personalized_accuracy_mean", select_on="validation")
    assert table["best setting"].tolist() == ["local_lr=0.1"]
    assert table["personalized_accuracy_mean mean"].iloc[0] == pytest.approx(means.loc["0.1", "personalized_accuracy_mean"])
    # `fedsweep table` follows the sweep's choice, and can be asked for the other
    assert main(["table", "--experiment", "fair", "--tracking-uri", uri]) == 0
    assert "| fedavg | local_lr=0.1 |" in capsys.readouterr().out
    assert main(["table", "--experiment", "fair", "--tracking-uri", uri, "--select-on", "test"]) == 0
    assert "| fedavg | local_lr=0.3 |" in capsys.readouterr().out
