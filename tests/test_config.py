"""Every validation rule: bad input fails early with one message naming the field and what is allowed."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from fedsweep.checks import check_fits, check_resources, raise_problems
from fedsweep.config import ConfigError
from fedsweep.layout import auto_layout
from fedsweep.loading import load_experiment, load_sweep, validate
from tests.conftest import config_dict


def problems_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as e:
        validate(raw, "cfg.yaml")
    return str(e.value)


def write(tmp_path, text: str, name: str = "cfg.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_base_config_is_valid():
    cfg = validate(config_dict())
    assert cfg.algorithm.name == "fedavg" and cfg.num_clients == 3


def test_greek_aliases_are_accepted():
    greek = {"_replace": True, "name": "fedavg", "β": 0.3, "α": 0.01, "τ": 7, "r": 0.5}
    hp = validate(config_dict(algorithm=greek)).algorithm
    assert (hp.local_lr, hp.personalization_lr, hp.local_steps, hp.participation_rate) == (0.3, 0.01, 7, 0.5)
    latin = {"_replace": True, "name": "fedavg", "beta": 0.3, "alpha": 0.01, "tau": 7}
    hp = validate(config_dict(algorithm=latin)).algorithm
    assert (hp.local_lr, hp.personalization_lr, hp.local_steps) == (0.3, 0.01, 7)


def test_a_field_and_its_alias_together():
    msg = problems_of(config_dict(algorithm={"beta": 0.3}))  # local_lr is in the base config too
    assert "algorithm.beta: 'beta' is another name of 'local_lr', which is given too: give one of them" in msg


def test_unknown_top_level_key_lists_allowed_keys():
    raw = config_dict()
    raw["roundz"] = 3
    msg = problems_of(raw)
    assert "roundz: unknown key 'roundz'" in msg
    assert "allowed keys: name, seed, data, model, algorithm, rounds" in msg


def test_unknown_algorithm_key_lists_the_algorithms_parameters():
    msg = problems_of(config_dict(algorithm={"mu": 0.1}))
    assert "algorithm.mu: unknown key 'mu'" in msg
    assert "local_lr" in msg and "participation_rate" in msg and "beta" in msg


def test_unknown_key_named_like_an_algorithm():
    msg = problems_of(config_dict(algorithm={"fedavg": 1}))
    assert "algorithm.fedavg: unknown key 'fedavg'" in msg


def test_nested_union_paths_are_the_written_ones():
    msg = problems_of(config_dict(data={"partition": {"name": "label_skew", "classes_per_client": 0}}))
    assert "data.partition.classes_per_client: Input should be greater than or equal to 1 (got 0)" in msg


def test_wrong_type():
    msg = problems_of(config_dict(rounds="ten"))
    assert "rounds: Input should be a valid integer" in msg and "'ten'" in msg


@pytest.mark.parametrize("rate", [0, -0.5, 1.5])
def test_participation_rate_outside_unit_interval(rate):
    msg = problems_of(config_dict(algorithm={"participation_rate": rate}))
    assert "algorithm.participation_rate" in msg
    assert ("greater than 0" in msg) or ("less than or equal to 1" in msg)
    assert f"(got {rate})" in msg


def test_participation_rate_alias_is_named_as_written():
    msg = problems_of(config_dict(algorithm={"_replace": True, "name": "fedavg", "r": 2}))
    assert "algorithm.r: Input should be less than or equal to 1 (got 2)" in msg


def test_local_steps_below_one():
    msg = problems_of(config_dict(algorithm={"local_steps": 0}))
    assert "algorithm.local_steps: Input should be greater than or equal to 1 (got 0)" in msg


@pytest.mark.parametrize("field", ["local_lr", "personalization_lr"])
def test_negative_step_sizes(field):
    msg = problems_of(config_dict(algorithm={field: -0.01}))
    assert f"algorithm.{field}" in msg and "(got -0.01)" in msg


def test_more_clients_sampled_than_exist():
    msg = problems_of(config_dict(algorithm={"participation_rate": None, "clients_per_round": 5}))
    assert "algorithm.clients_per_round: 5 samples more clients than exist (data.num_clients=3); allowed: 1..3" in msg


def test_rate_and_count_together():
    msg = problems_of(config_dict(algorithm={"participation_rate": 0.5, "clients_per_round": 2}))
    assert "participation_rate (r) or clients_per_round, not both" in msg


def test_unknown_algorithm_names_the_allowed_ones():
    msg = problems_of(config_dict(algorithm={"_replace": True, "name": "fedsgd"}))
    assert "algorithm.name" in msg and "'fedavg'" in msg


def test_unknown_dataset_names_the_allowed_ones():
    msg = problems_of(config_dict(data={"_replace": True, "dataset": "imagenet"}))
    assert "data" in msg and "'synthetic'" in msg and "'digits'" in msg


def test_unknown_partition_names_the_allowed_ones():
    msg = problems_of(config_dict(data={"partition": {"name": "random"}}))
    assert "data.partition" in msg and "'iid'" in msg and "'label_skew'" in msg


def test_too_many_classes_per_client():
    msg = problems_of(config_dict(data={"partition": {"name": "label_skew", "classes_per_client": 11}}))
    assert "data.partition.classes_per_client: 11 exceeds the 10 classes of digits (allowed: 1..10)" in msg


def test_too_many_clients_for_digits():
    msg = problems_of(config_dict(data={"num_clients": 1500, "partition": {"name": "iid"}}))
    assert "data.num_clients: 1500: digits has 1797 samples and every client needs at least 2" in msg and "allowed: 1..898" in msg


def test_an_unsatisfiable_split_names_the_partition_parameter():
    # 800 clients fit digits' 1797 samples, but a Dirichlet split this skewed leaves some client empty:
    # the concentration is what to change, not only the client count
    msg = problems_of(config_dict(data={"num_clients": 800, "partition": {"name": "dirichlet", "concentration": 0.01}}))
    assert "the dirichlet split of digits leaves client" in msg and "allowed: a larger partition.concentration" in msg


def test_model_fields():
    msg = problems_of(config_dict(model={"hidden": [0]}))
    assert "model.hidden.0" in msg
    msg = problems_of(config_dict(model={"activation": "gelu"}))
    assert "model.activation" in msg and "'relu', 'elu' or 'tanh'" in msg


def test_several_problems_are_reported_together():
    msg = problems_of(config_dict(rounds=0, algorithm={"local_steps": 0, "local_lr": -1}))
    assert msg.count("\n") >= 2 and "rounds" in msg and "local_steps" in msg and "local_lr" in msg


def test_resources_that_cannot_fit_the_cluster():
    # 50 clients × 0.05 CPU + 0.25 > 2 CPUs would leave a placement group pending forever.
    cfg = validate(
        config_dict(
            data={"dataset": "synthetic", "num_clients": 50, "_replace": True},
            resources={"client_cpus": 0.05, "server_cpus": 0.25},
        )
    )
    with pytest.raises(ConfigError) as e:
        check_resources([cfg], "cfg.yaml", capacity=(2.0, 0.0, 24000.0))
    msg = str(e.value)
    assert "resources.client_cpus: one trial needs server_cpus + 50 client actors × client_cpus = 0.25 + 50 × 0.05 = 2.75 CPUs" in msg
    assert "the cluster has 2; allowed: client_cpus <= 0.035 (or fewer clients, or a larger clients_per_actor)" in msg


def test_one_fit_check_before_and_after_connecting_and_each_bundle_against_the_nodes():
    """check_fits is the check of both moments: before connecting (check_resources) and after
    (experiment.check_cluster), which also gives it the cluster's nodes: a bundle larger than every node
    waits forever though the cluster's total fits it."""
    cfg = validate(config_dict(resources={"server_cpus": 1.5, "client_cpus": 0.1}))
    assert check_fits(cfg, 4.0, 0.0, None, "f.yaml") == []
    assert check_fits(cfg, 4.0, 0.0, None, "f.yaml", nodes=[{"CPU": 2.0}, {"CPU": 2.0}]) == []
    (msg,) = check_fits(cfg, 4.0, 0.0, None, "f.yaml", nodes=[{"CPU": 1.0}] * 4)
    assert msg == ("f.yaml: resources.server_cpus: a bundle of 1.5 CPU fits on no node of this cluster (the largest has 1); "
                   "allowed: <= 1")
    with pytest.raises(ConfigError) as e:
        raise_problems([msg, msg, "another"])
    assert e.value.problems == [msg, "another"]
    raise_problems([])  # nothing to report: no error


def test_client_packing_shrinks_the_placement_group():
    # The same 50 clients packed 10 per actor: 5 client bundles of 0.05 CPU fit 2 CPUs.
    raw = config_dict(
        data={"dataset": "synthetic", "num_clients": 50, "_replace": True},
        resources={"client_cpus": 0.05, "server_cpus": 0.25, "clients_per_actor": 10},
    )
    cfg = validate(raw)
    assert cfg.resources.bundles(50) == [{"CPU": 0.25}] + [{"CPU": 0.05}] * 5
    assert cfg.resources.clients_of_actor(4, 50) == list(range(40, 50))
    check_resources([cfg], "cfg.yaml", capacity=(2.0, 0.0, 24000.0))
    # 7 clients, 3 per actor: blocks [0-2], [3-5], [6].
    cfg = validate(config_dict(resources={"clients_per_actor": 3}, data={"num_clients": 7}))
    assert [cfg.resources.clients_of_actor(a, 7) for a in range(cfg.resources.num_client_actors(7))] == [
        [0, 1, 2], [3, 4, 5], [6]
    ]
    assert "resources.clients_per_actor" in problems_of(config_dict(resources={"clients_per_actor": 0}))


def test_a_file_without_a_layout_gets_one_chosen_for_it(tmp_path, monkeypatch):
    """No layout field given. Clients that can train stacked (FedAvg, an MLP): a pool of one on one CPU, stacked,
    whatever the CPUs. Otherwise (the proto transform): a worker pool of one process per CPU the trial may use,
    at most one per client, the CPUs filled and never more. Any layout field given keeps the file's layout."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    body = config_dict(data={"dataset": "synthetic", "num_clients": 20, "_replace": True}, resources={"_replace": True})
    proto = {"name": "pavg", "local_lr": 0.05, "local_steps": 2}

    def layout(text: dict, name: str = "run.yaml"):
        path = tmp_path / name
        path.write_text(yaml.safe_dump(text))
        cfg = (load_sweep(path, check_cluster=False).trials[0].config if "sweep" in text
               else load_experiment(path, check_cluster=False))
        r = cfg.resources
        return r.server_cpus, r.client_cpus, r.client_workers, r.clients_per_actor, r.vectorize_clients

    for cpus in (1, 2, 16):
        assert layout({**body, "resources": {"cluster_cpus": cpus}}) == (0.2, 0.8, 1, 1, True)
    for cpus, expected in [(1, (0.2, 0.8, 1, 1, False)), (2, (0.2, 0.9, 2, 1, False)), (16, (0.2, 0.987, 16, 1, False))]:
        assert layout({**body, "algorithm": proto, "resources": {"cluster_cpus": cpus}}) == expected
        cfg = load_experiment(tmp_path / "run.yaml", check_cluster=False)
        check_resources([cfg], "run.yaml", capacity=(float(cpus), 0.0, 24000.0))  # fits, CPUs filled
    assert layout({**config_dict(), "algorithm": proto, "resources": {"cluster_cpus": 8}})[2] == 3  # BASE: 3 clients
    cnn = auto_layout({**body, "model": {"name": "cnn"}, "resources": {"cluster_cpus": 2}}, 2)["resources"]
    assert (cnn["client_workers"], "vectorize_clients" in cnn) == (2, False)  # stacking not measured for the CNN
    # a sweep shares the CPUs among the trials it runs at once
    assert layout({**body, "algorithm": proto, "resources": {"cluster_cpus": 4}, "sweep": {"max_concurrent_trials": 2}},
                  "sweep.yaml") == (0.2, 0.9, 2, 1, False)
    # on a remote cluster, whose size is unknown before connecting: one CPU per trial
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert layout({**body, "algorithm": proto}) == (0.2, 0.8, 1, 1, False)
    monkeypatch.delenv("RAY_ADDRESS")
    # one layout field given: the file's layout, the other fields at their defaults
    for given, expected in [({"client_cpus": 0.05}, (0.25, 0.05, 0, 1, False)),
                            ({"clients_per_actor": 10}, (0.25, 0.1, 0, 10, False)),
                            ({"client_workers": 0}, (0.25, 0.1, 0, 1, False))]:
        assert layout({**body, "resources": {"cluster_cpus": 2, **given}}) == expected, given
    # vectorize_clients given is kept
    assert layout({**body, "resources": {"vectorize_clients": False}}) == (0.2, 0.8, 1, 1, False)


def test_gpus_that_cannot_fit():
    cfg = validate(config_dict(resources={"client_gpus": 0.5}))
    with pytest.raises(ConfigError) as e:
        check_resources([cfg], "cfg.yaml", capacity=(2.0, 1.0, 24000.0))
    assert "resources.client_gpus: one trial needs 3 client actors × 0.5 = 1.5 GPUs, but the cluster has 1" in str(e.value)


def test_gpu_fraction_above_one():
    assert "resources.client_gpus" in problems_of(config_dict(resources={"client_gpus": 2}))


def test_empty_client_bundle():
    msg = problems_of(config_dict(resources={"client_cpus": 0, "client_gpus": 0}))
    assert "resources.client_cpus: 0, and client_gpus is 0 too" in msg


def test_memory_that_cannot_fit():
    cfg = validate(config_dict(resources={"actor_memory_mb": 10000}))
    with pytest.raises(ConfigError) as e:
        check_resources([cfg], "cfg.yaml", capacity=(2.0, 0.0, 24000.0))
    assert "resources.actor_memory_mb: one trial starts 5 processes × 10000 MB = 50000 MB" in str(e.value)
    assert "not even one client actor fits" in str(e.value)
    # 100 clients one per actor need 102 × 300 MB > 24000 MB; packing is the way out, and the message says how much.
    cfg = validate(config_dict(data={"dataset": "synthetic", "num_clients": 100, "_replace": True}))
    with pytest.raises(ConfigError) as e:
        check_resources([cfg], "cfg.yaml", capacity=(200.0, 0.0, 24000.0))
    assert "102 processes × 300 MB = 30600 MB, more than this machine's 24000 MB" in str(e.value)
    assert "allowed: resources.clients_per_actor >= 2" in str(e.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    p = write(tmp_path, "rounds: 3\nalgorithm: {name: fedavg\nseed: 1\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(p)
    assert f"{p}:" in str(e.value) and "YAML syntax error" in str(e.value)


def test_top_level_must_be_a_mapping(tmp_path):
    p = write(tmp_path, "- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping of config fields at the top level, got list"):
        load_experiment(p)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_sweep(tmp_path / "nope.yaml")


def test_error_names_file_and_line(tmp_path):
    p = write(
        tmp_path,
        """\
        data: {dataset: synthetic, num_clients: 5}
        algorithm:
          name: fedavg
          local_lr: -3
        """,
    )
    with pytest.raises(ConfigError) as e:
        load_experiment(p, check_cluster=False)
    assert f"{p}:4: algorithm.local_lr: Input should be greater than 0 (got -3)" in str(e.value)


def test_yaml_is_read_with_a_safe_loader(tmp_path):
    p = write(tmp_path, "name: !!python/object/apply:os.system ['echo pwned']\nalgorithm: {name: fedavg}\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_experiment(p)


# ------------------------------------------------------------------ sweeps


def sweep_file(tmp_path, body: dict, sweep: dict | None = None):
    doc = dict(body)
    if sweep is not None:
        doc["sweep"] = sweep
    p = tmp_path / "sweep.yaml"
    p.write_text(yaml.safe_dump(doc, allow_unicode=True))
    return p


def test_grid_expansion_crosses_fields_and_seeds(tmp_path):
    body = config_dict(algorithm={"local_lr": {"grid": [0.1, 0.01]}, "local_steps": {"grid": [1, 2, 3]}})
    s = load_sweep(sweep_file(tmp_path, body, {"seeds": [0, 1]}), check_cluster=False)
    assert len(s.trials) == 12
    points = {(t.config.algorithm.local_lr, t.config.algorithm.local_steps, t.config.seed) for t in s.trials}
    assert len(points) == 12
    assert s.trials[0].overrides == {"algorithm.local_lr": 0.1, "algorithm.local_steps": 1, "seed": 0}
    # Settings differ by hyperparameters, not by seed.
    assert len({t.config.setting_key() for t in s.trials}) == 6


def test_nested_grid_over_algorithm_sections(tmp_path):
    body = config_dict()
    body["algorithm"] = {
        "grid": [
            {"name": "fedavg", "local_lr": {"grid": [0.1, 0.2]}},
            {"name": "fedavg", "local_lr": 0.3, "personalization_lr": 0.01},
        ]
    }
    s = load_sweep(sweep_file(tmp_path, body), check_cluster=False)
    assert [t.config.algorithm.local_lr for t in s.trials] == [0.1, 0.2, 0.3]
    assert s.trials[2].overrides["algorithm.personalization_lr"] == 0.01


def test_grid_over_a_field_that_does_not_exist(tmp_path):
    body = config_dict(algorithm={"momentum": {"grid": [0.9, 0.99]}})
    with pytest.raises(ConfigError) as e:
        load_sweep(sweep_file(tmp_path, body), check_cluster=False)
    msg = str(e.value)
    assert "algorithm.momentum: unknown key 'momentum'" in msg
    assert msg.count("algorithm.momentum") == 1  # reported once, not once per trial


def test_grid_with_bad_value_names_the_trial(tmp_path):
    body = config_dict(algorithm={"local_lr": {"grid": [0.1, -0.1]}})
    with pytest.raises(ConfigError) as e:
        load_sweep(sweep_file(tmp_path, body), check_cluster=False)
    assert "algorithm.local_lr: Input should be greater than 0 (got -0.1) [in trial algorithm.local_lr=-0.1]" in str(e.value)


def test_empty_grid(tmp_path):
    body = config_dict(algorithm={"local_lr": {"grid": []}})
    with pytest.raises(ConfigError, match=r"algorithm.local_lr.grid: must be a non-empty list of values"):
        load_sweep(sweep_file(tmp_path, body), check_cluster=False)


def test_grid_with_other_keys(tmp_path):
    body = config_dict(algorithm={"local_lr": {"grid": [0.1], "values": [1]}})
    with pytest.raises(ConfigError, match=r"a grid takes only the key 'grid', found also \['values'\]"):
        load_sweep(sweep_file(tmp_path, body), check_cluster=False)


def test_bad_sweep_settings(tmp_path):
    body = config_dict()
    with pytest.raises(ConfigError) as e:
        load_sweep(sweep_file(tmp_path, body, {"metric": "accuracy", "max_concurrent_trials": 0, "colour": 1}), check_cluster=False)
    msg = str(e.value)
    assert "sweep.metric" in msg and "'personalized_accuracy_mean'" in msg
    assert "sweep.max_concurrent_trials: Input should be greater than or equal to 1 (got 0)" in msg
    assert "sweep.colour: unknown key 'colour'" in msg


def test_run_rejects_grids(tmp_path):
    body = config_dict(algorithm={"local_lr": {"grid": [0.1, 0.2]}})
    with pytest.raises(ConfigError, match=r"algorithm.local_lr: a grid is only allowed in a sweep"):
        load_experiment(sweep_file(tmp_path, body))


def test_sweep_resources_checked_for_every_trial(tmp_path):
    body = config_dict(data={"num_clients": {"grid": [3, 40]}}, resources={"client_cpus": 0.1})
    with pytest.raises(ConfigError, match=r"0.2 \+ 40 × 0.1 = 4.2 CPUs"):
        load_sweep(sweep_file(tmp_path, body))


@pytest.mark.parametrize("section,field", [("tracking", "experiment"), ("resources", "ray_address")])
def test_sweep_wide_fields_cannot_be_gridded(tmp_path, section, field):
    body = config_dict(**{section: {field: {"grid": ["a", "b"]}}})
    with pytest.raises(ConfigError, match=rf"{section}.{field}: one value serves the whole sweep and cannot be a grid"):
        load_sweep(sweep_file(tmp_path, body), check_cluster=False)


def test_a_field_error_crosses_processes_whole():
    """A rule across fields raised where Ray pickles it (an actor building a model) keeps its field and message."""
    import pickle

    from fedsweep.schema import FieldError

    error = pickle.loads(pickle.dumps(FieldError("model.kernel_size", "5 is too large")))
    assert (error.field, error.message, str(error)) == ("model.kernel_size", "5 is too large", "model.kernel_size: 5 is too large")


def test_nesting_past_the_limit_is_refused_at_its_first_bracket_in_bounded_time(tmp_path):
    """PyYAML's scanner works in the square of the ``[``/``{`` depth (3000 levels: 1.3 s before a RecursionError);
    the reader stops at the bracket one past :data:`config_file.MAX_DEPTH`, with its line."""
    import time

    from fedsweep import config_file

    depth = config_file.MAX_DEPTH
    ok = write(tmp_path, "a: 1\nb: " + "[" * depth + "]" * depth + "\n")
    value, _, _ = config_file.read(ok)
    inner = value["b"]
    for _ in range(depth - 1):
        inner = inner[0]
    assert inner == []
    for line, text in ((2, "a: 1\nb: " + "[" * (depth + 1) + "]" * (depth + 1) + "\n"),
                       (3, "a: 1\nb:\n  " + "{x: " * 3000 + "1" + "}" * 3000 + "\n")):
        path = write(tmp_path, text, "deep.yaml")
        t0 = time.perf_counter()
        with pytest.raises(config_file.ConfigFileError, match=rf"deep.yaml:{line}: YAML nested deeper than {depth} levels$"):
            config_file.read(path)
        assert time.perf_counter() - t0 < 0.5
    # block nesting (indentation) has no brackets: the composed tree's walk refuses it
    path = write(tmp_path, "".join("  " * i + f"k{i}:\n" for i in range(depth + 2)) + "  " * (depth + 2) + "1\n", "deep.yaml")
    with pytest.raises(config_file.ConfigFileError, match=rf"YAML nested deeper than {depth} levels"):
        config_file.read(path)
