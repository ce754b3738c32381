"""The math of the round loop, in process (no Ray): FedAvg against centralized gradient descent, sampling,
personalization, and the metrics computed from per-client sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsweep.data import build_federated_dataset
from fedsweep.engine import local_federation, run_local
from fedsweep.evaluation import ClientEval, summarize
from fedsweep.federation import Server, compute_threads
from fedsweep.loading import validate
from fedsweep.models import FlatModel, build_model
from tests.conftest import config_dict

GD = {"name": "fedavg", "local_lr": 0.5, "participation_rate": 1.0, "local_steps": 1, "batch_size": None, "aggregation": "weighted"}


def gd_config(model: dict, data: dict | None = None, rounds: int = 5):
    return validate(
        config_dict(
            algorithm={"_replace": True, **GD},
            model={"_replace": True, **model},
            data=data or {"num_clients": 4, "partition": {"name": "label_skew", "classes_per_client": 3}},
            rounds=rounds,
            eval_every=1,
        )
    )


def centralized_gd(cfg, rounds: int) -> list[torch.Tensor]:
    """Full-batch gradient descent on the union of all clients' training data, from the same initial model."""
    ds = build_federated_dataset(cfg.data)
    x = torch.cat([c.x_train for c in ds.clients])
    y = torch.cat([c.y_train for c in ds.clients])
    model = FlatModel(build_model(cfg.model, ds.num_features, ds.num_classes))
    w = model.initial_vector(cfg.seed)
    out = []
    for _ in range(rounds):
        w = w.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(w, x), y), w)
        w = (w - cfg.algorithm.local_lr * g).detach()
        out.append(w)
    return out


@pytest.mark.parametrize("model", [{"name": "mlr"}, {"name": "mlp", "hidden": [16]}])
def test_fedavg_full_batch_one_step_equals_centralized_gd(model):
    """r = 1, τ = 1, full batch, weighted by n_i: Σ_i (n_i/N)(w − β∇f_i(w)) = w − β∇F(w) on the union."""
    cfg = gd_config(model)
    ds = build_federated_dataset(cfg.data)
    assert len({c.num_train for c in ds.clients}) > 1  # unequal sizes, so the weighting matters
    from fedsweep.federation import Client, Setup
    from fedsweep.pool import ClientPool

    server = Server.of(cfg, ds.num_features, ds.num_classes)
    pool = ClientPool.of_clients([Client(i, d, Setup.of(cfg, ds.num_features, ds.num_classes)) for i, d in enumerate(ds.clients)])
    reference = centralized_gd(cfg, 5)
    for rnd in range(1, 6):
        server.train_round(pool, rnd)
        assert torch.allclose(server.params, reference[rnd - 1], atol=1e-5, rtol=0), rnd
        assert (server.params - reference[rnd - 1]).abs().max() < 1e-5


def test_uniform_aggregation_differs_from_weighted_on_unequal_clients():
    cfg_w = gd_config({"name": "mlr"}, rounds=1)
    cfg_u = validate({**cfg_w.model_dump(), "algorithm": {**GD, "aggregation": "uniform"}})
    (_, s_w), (_, s_u) = run_local(cfg_w), run_local(cfg_u)
    assert (s_w.params - s_u.params).abs().max() > 1e-4


def test_sampling_count_and_determinism():
    cfg = validate(config_dict(data={"num_clients": 10, "partition": {"name": "iid"}}, algorithm={"participation_rate": 0.25}))
    server = Server.of(cfg, 64, 10)
    picks = [server.sample(r) for r in range(1, 30)]
    assert all(len(p) == 3 and len(set(p)) == 3 and p == sorted(p) for p in picks)  # ceil(0.25 × 10) = 3
    assert picks == [Server.of(cfg, 64, 10).sample(r) for r in range(1, 30)]
    assert len({tuple(p) for p in picks}) > 5  # different clients in different rounds
    counts = np.bincount(np.concatenate(picks), minlength=10)
    assert counts.min() > 0


@pytest.mark.parametrize("rate,n,expected", [(0.3, 10, 3), (0.1, 100, 10), (0.01, 50, 1), (1.0, 7, 7), (0.5, 5, 3)])
def test_sampled_count_is_ceil_r_n(rate, n, expected):
    hp = validate(config_dict(algorithm={"participation_rate": rate})).algorithm
    assert hp.sampled_count(n) == expected


def test_same_seed_same_numbers_different_seed_different_numbers():
    cfg = validate(config_dict(algorithm={"participation_rate": 0.67}))
    a, _ = run_local(cfg)
    b, _ = run_local(cfg)
    c, _ = run_local(validate({**cfg.model_dump(), "seed": 1}))
    assert a == b
    assert a != c


def test_runs_of_one_process_with_the_same_data_share_one_build_and_keep_their_numbers(monkeypatch):
    """A Tune process runs a sweep's trials one after another: those with the same data section (other seeds and
    hyperparameters) build it once, and every run's numbers are those of a run that built it afresh."""
    from fedsweep import data

    cfgs = [validate(config_dict(seed=s, algorithm={"local_lr": lr})) for s, lr in ((0, 0.1), (1, 0.1), (0, 0.3))]
    fresh = []
    for cfg in cfgs:
        data._BUILT.clear()
        fresh.append(run_local(cfg)[0])
    builds = []
    build = data.build_federated_dataset
    monkeypatch.setattr(data, "build_federated_dataset", lambda cfg: builds.append(cfg) or build(cfg))
    data._BUILT.clear()
    assert [run_local(cfg)[0] for cfg in cfgs] == fresh
    assert builds == [cfgs[0].run_data()]
    other = validate(config_dict(data={"num_clients": 5}))
    run_local(other)
    assert builds == [cfgs[0].run_data(), other.run_data()] and list(data._BUILT) == [other.run_data()]


def test_numbers_do_not_depend_on_the_callers_torch_threads():
    """run_local computes with the actors' one intra-op thread whatever the caller set (a reduction split
    over two threads changes this config's personalized loss in its 8th digit), and restores the caller's count."""
    cfg = validate(config_dict(algorithm={"participation_rate": 1.0, "personalization_lr": 0.05}, rounds=4, eval_every=2))
    before = torch.get_num_threads()
    try:
        histories = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            histories.append(run_local(cfg)[0])
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert histories[0] == histories[1]


def test_personalization_step_alpha():
    """α = 0 scores the global model itself; α > 0 takes full-batch steps on each client's own train data."""
    base = config_dict(algorithm={"personalization_lr": 0.0}, rounds=2)
    plain, _ = run_local(validate(base))
    assert plain[-1]["personalized_accuracy_weighted"] == plain[-1]["global_accuracy"]
    tuned, _ = run_local(validate(config_dict(algorithm={"personalization_lr": 0.5, "personalization_steps": 3}, rounds=2)))
    assert tuned[-1]["global_accuracy"] == plain[-1]["global_accuracy"]  # evaluation does not change training
    assert tuned[-1]["personalized_loss_weighted"] < plain[-1]["personalized_loss_weighted"]


def test_fedavg_learns_on_both_embedded_datasets():
    for data in ({"num_clients": 4, "partition": {"name": "iid"}}, {"_replace": True, "dataset": "synthetic", "num_clients": 5, "max_samples_per_client": 200}):
        hist, _ = run_local(validate(config_dict(data=data, rounds=10, eval_every=10)))
        assert hist[-1]["global_accuracy"] > hist[0]["global_accuracy"] + 0.2
        assert hist[-1]["train_loss"] < hist[0]["train_loss"]


def test_transmissions_count_uploads_and_downloads():
    cfg = validate(config_dict(data={"num_clients": 6, "partition": {"name": "iid"}}, algorithm={"participation_rate": 0.5}, rounds=3))
    hist, _ = run_local(cfg)
    assert [h["transmissions"] for h in hist] == [0, 6, 12, 18]  # 3 sampled: 3 down + 3 up per round
    assert hist[-1]["uploads"] == hist[-1]["downloads"] == 9


def test_eval_cadence():
    cfg = validate(config_dict(rounds=7, eval_every=3))
    hist, _ = run_local(cfg)
    assert [int(h["round"]) for h in hist if "global_accuracy" in h] == [0, 3, 6, 7]


def test_summary_metrics_from_per_client_sums():
    evals = [
        ClientEval(0, 10, 10, personalized_correct=9, personalized_loss_sum=1.0, global_correct=5, global_loss_sum=5.0, train_loss_sum=2.0),
        ClientEval(1, 30, 30, personalized_correct=15, personalized_loss_sum=15.0, global_correct=15, global_loss_sum=30.0, train_loss_sum=6.0),
        ClientEval(2, 20, 40, personalized_correct=40, personalized_loss_sum=0.0, global_correct=20, global_loss_sum=40.0, train_loss_sum=4.0),
    ]
    m = summarize(evals)
    assert m["personalized_accuracy_mean"] == pytest.approx((0.9 + 0.5 + 1.0) / 3)
    assert m["personalized_accuracy_weighted"] == pytest.approx(64 / 80)
    assert m["personalized_accuracy_worst"] == 0.5 and m["personalized_accuracy_best"] == 1.0
    assert m["personalized_accuracy_p10"] == pytest.approx(np.percentile([0.9, 0.5, 1.0], 10))
    assert m["personalized_loss_mean"] == pytest.approx((0.1 + 0.5 + 0.0) / 3)
    assert m["global_accuracy"] == pytest.approx(40 / 80)
    assert m["global_loss"] == pytest.approx(75 / 80)
    assert m["train_loss"] == pytest.approx(12 / 60)
    assert all(math.isfinite(v) for v in m.values())


def test_divergence_is_flagged_and_evaluated():
    cfg = validate(config_dict(algorithm={"local_lr": 1e30, "local_steps": 5}, rounds=6, eval_every=6))
    server, pool = local_federation(cfg)
    m = {}
    for rnd in range(1, 7):
        m = server.step(pool, rnd)
        if m.get("diverged"):
            break
    assert m.get("diverged") == 1.0 and rnd < 6
    assert "personalized_accuracy_mean" in m  # evaluated although not on the cadence


@pytest.mark.parametrize("name", ["local", "fedamp"])
def test_a_method_whose_models_live_on_the_clients_diverges_at_the_evaluation_that_finds_one_non_finite(name):
    """Local and FedAMP hand the server's vector back unchanged: their divergence shows only in the clients' models,
    whose NaN class scores argmax would score as predictions of class 0. The first evaluation after it says so, and
    the run (run_local, as a trial runs) stops there."""
    cfg = validate(config_dict(algorithm={"_replace": True, "name": name, "local_lr": 1e30, "local_steps": 5},
                               rounds=6, eval_every=3))
    history, server = run_local(cfg)
    last = history[-1]
    assert last.get("diverged") == 1.0 and last["round"] == 3.0 and len(history) == 4
    assert math.isnan(last["personalized_loss_mean"])
    assert bool(torch.isfinite(server.params).all())  # the server's vector stayed finite: not what flagged it


def test_an_infinite_loss_of_a_finite_proto_model_is_not_a_divergence():
    """A Proto model scores a class absent from its client's support −inf, so a test sample of that class has an
    infinite loss while every model is finite: the run goes on (an earlier check of a non-finite loss stopped every
    PFLDyn (Proto) run at its first evaluation)."""
    cfg = validate(config_dict(algorithm={"_replace": True, "name": "pfldyn", "transform": "proto", "alpha": 0.01,
                                          "local_lr": 0.05, "local_steps": 2, "batch_size": 10},
                               data={"_replace": True, "dataset": "synthetic", "num_clients": 6},
                               model={"_replace": True, "name": "mlp", "hidden": [8]}, rounds=2, eval_every=1))
    history, _ = run_local(cfg)
    assert len(history) == 3 and not any(m.get("diverged") for m in history)
    assert math.isinf(history[0]["personalized_loss_mean"])  # the case: an infinite loss, no divergence


@pytest.mark.parametrize("algorithm", [
    {"name": "scaffold", "local_lr": 0.05, "participation_rate": 0.6},  # client and server control variates
    {"name": "feddyn", "local_lr": 0.05, "participation_rate": 0.6},
    {"name": "pfedme", "local_lr": 0.05, "participation_rate": 0.6},  # personalized models
])
def test_checkpoint_through_disk_resumes_to_the_same_numbers(algorithm, tmp_path):
    """Run 2 rounds, checkpoint to disk, load into a fresh server and fresh clients, run rounds 3-5: the
    same global vector and metrics as 5 uninterrupted rounds (every draw is seeded per round). A later round's
    folder without its JSON (a process that died while saving) is not taken for a checkpoint."""
    from fedsweep import checkpoint
    from fedsweep.storage import Storage

    cfg = validate(config_dict(algorithm={**algorithm, "local_steps": 3}, rounds=5, eval_every=5))
    reference, ref_server = run_local(cfg)
    with compute_threads():  # as run_local: exact equality needs the same float sums
        server, pool = local_federation(cfg)
        for rnd in range(3):
            server.step(pool, rnd)
        storage = Storage(str(tmp_path))
        checkpoint.save_latest(server.checkpoint(pool, 2), storage, storage.path("trial"), {"run_id": "abc"})
        storage.write_bytes(storage.path("trial", "round_000003", checkpoint.ARRAYS), b"cut short")
        loaded, extra = checkpoint.load_latest(storage, storage.path("trial"))
        assert extra == {"run_id": "abc"} and loaded["round"] == 2

        server, pool = local_federation(cfg)
        start = server.restore(pool, loaded)
        assert start == 3
        last = [server.step(pool, rnd) for rnd in range(start, cfg.rounds + 1)][-1]
    assert torch.equal(server.params, ref_server.params)
    assert last["personalized_accuracy_mean"] == reference[-1]["personalized_accuracy_mean"]
    assert last["transmissions"] == reference[-1]["transmissions"]


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "perfedavg", "variant": "fo"}])
def test_a_personalized_model_equal_to_the_global_one_is_scored_once_with_the_same_numbers(algorithm, monkeypatch):
    """FedAvg's personalized model is the global one: its test and validation scores are taken for the global
    model instead of computed twice — the same sums, bit for bit, as computing both. Per-FedAvg personalizes (a
    step on each client's data): both are computed, and they differ."""
    from fedsweep import federation

    cfg = validate(config_dict(algorithm=algorithm, rounds=2, eval_every=2, data={"validation_fraction": 0.25}))
    calls = []
    real = federation.score
    monkeypatch.setattr(federation, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    shortcut, _ = run_local(cfg)
    n_shortcut = len(calls)
    monkeypatch.setattr(federation, "_same_model", lambda *a: False)
    calls.clear()
    both, _ = run_local(cfg)
    assert shortcut == both  # every metric of every evaluation round, exactly
    evaluations, clients = len(cfg.eval_rounds()), cfg.num_clients
    if algorithm["name"] == "fedavg":
        assert n_shortcut == len(calls) - 2 * evaluations * clients  # test and validation parts, once each fewer
    else:
        assert n_shortcut == len(calls)
        assert both[-1]["personalized_accuracy_mean"] != both[-1]["global_accuracy"] or \
            both[-1]["personalized_loss_mean"] != both[-1]["global_loss"]


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "ditto", "coupling": 0.5}])
@pytest.mark.parametrize("stacked", [False, True])
def test_without_the_train_loss_every_other_number_is_the_same_and_the_training_parts_are_not_scored(algorithm, stacked, monkeypatch):
    """``tracking.log_train_loss: false``: no ``train_loss`` at any evaluation, every other metric of every round
    bit for bit, and one scoring pass a client and evaluation fewer (the global model on the training part)."""
    from fedsweep import federation

    calls = []
    real = federation.score
    monkeypatch.setattr(federation, "score", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    for log in (True, False):
        cfg = validate(config_dict(algorithm=algorithm, rounds=3, eval_every=1, data={"validation_fraction": 0.25},
                                   tracking={"log_train_loss": log}, resources={"vectorize_clients": stacked}))
        calls.clear()
        runs[log] = run_local(cfg)[0], len(calls)
    (on, n_on), (off, n_off) = runs[True], runs[False]
    evaluations = [m for m in on if "personalized_accuracy_mean" in m]
    assert len(evaluations) == 4 and all("train_loss" in m and math.isfinite(m["train_loss"]) for m in evaluations)
    assert not any("train_loss" in m for m in off)
    assert [{k: v for k, v in m.items() if k not in ("train_loss", "wall_time_s")} for m in on] == \
        [{k: v for k, v in m.items() if k != "wall_time_s"} for m in off]
    assert n_on - n_off == len(evaluations) * cfg.num_clients


def test_the_clients_of_a_process_share_one_module_per_architecture_and_keep_their_own_statistics():
    """On the CPU, Setup.flat_model builds the layers once per process and architecture: clients hold no parameters
    of their own beside their vectors; a batch-norm client's statistics stay its own; the numbers are those of
    separate modules (a FlatModel of a module built apart)."""
    from fedsweep.federation import Client, Setup

    cfg = validate(config_dict(data={"num_clients": 3}, model={"name": "mlp", "hidden": [6], "norm": "batch"},
                               algorithm={"_replace": True, "name": "fedbn", "local_steps": 2, "batch_size": 4}))
    ds = build_federated_dataset(cfg.data)
    setup = Setup.of(cfg, ds.num_features, ds.num_classes)
    clients = [Client(i, d, setup) for i, d in enumerate(ds.clients)]
    assert len({id(c.model.module) for c in clients}) == 1
    assert setup.flat_model().module is clients[0].model.module
    other = Setup.of(validate({**config_dict(data={"num_clients": 3}), "model": {"name": "mlp", "hidden": [7]}}),
                     ds.num_features, ds.num_classes)
    assert other.flat_model().module is not clients[0].model.module
    apart = FlatModel(build_model(cfg.model, ds.num_features, ds.num_classes))
    w = apart.initial_vector(cfg.seed)
    assert torch.equal(clients[0].model.initial_vector(cfg.seed), w)
    x = ds.clients[0].x_train
    with clients[0].model.train_mode(), apart.train_mode():
        assert torch.equal(clients[0].model(w, x), apart(w, x))
    assert torch.equal(clients[0].model.stats, apart.stats)
    assert not torch.equal(clients[0].model.stats, clients[1].model.stats)  # folded into client 0's alone
    assert torch.equal(clients[1].model.stats, clients[2].model.stats)


def test_the_initial_vector_is_drawn_on_the_cpu_whatever_the_modules_device():
    """FlatModel.initial_vector draws with the CPU generator on a CPU copy of the layers: the same vector from a
    module on another device (here PyTorch's meta device, which holds no values: a module on a GPU takes the same
    path), where the module's own generator would draw other numbers from the same seed; the global generator's
    state is left as it was, and the vector is a fresh copy each time."""
    from fedsweep.models import CNNConfig

    for cfg in (CNNConfig(channels=[2, 3], hidden=[4], kernel_size=3), CNNConfig(channels=[2, 3], hidden=[4], kernel_size=3, norm="batch")):
        cpu = FlatModel(build_model(cfg, 3 * 12 * 12, 10))
        meta = FlatModel(build_model(cfg, 3 * 12 * 12, 10).to("meta"))
        before = torch.random.get_rng_state()
        w = meta.initial_vector(7)
        assert w.device.type == "cpu" and torch.equal(w, cpu.initial_vector(7))
        assert torch.equal(torch.random.get_rng_state(), before)
        torch.manual_seed(7)  # what the vector is: the module's own initialization under the CPU generator's seed
        fresh = build_model(cfg, 3 * 12 * 12, 10)
        assert torch.equal(w, torch.nn.utils.parameters_to_vector(fresh.parameters()))
        assert not torch.equal(w, cpu.initial_vector(8))
        w.zero_()
        assert not torch.equal(w, cpu.initial_vector(7))


def test_a_resumed_run_counts_its_wall_time_on_from_the_checkpoint(tmp_path):
    """``wall_time_s`` is the run's seconds of rounds: a run resumed from a checkpoint (an interrupted trial, a lost
    node) reported only the seconds since it resumed, so a benchmark's time of a method undercounted its resumed
    trials. The checkpoint now carries the clock through storage, and the resumed rounds count on from it."""
    from fedsweep import checkpoint as files
    from fedsweep.experiment import InProcessRunner, execute
    from fedsweep.storage import Storage

    cfg = validate(config_dict(rounds=6, eval_every=2, resources=None))
    storage = Storage(str(tmp_path))
    saved: dict[int, float] = {}

    def save(metrics, checkpoint):
        saved[int(metrics["round"])] = metrics["wall_time_s"]
        files.save_latest(checkpoint, storage, storage.path("trial"), {"run_id": "r"})

    first = execute(cfg, None, checkpoint_every=3, runner=InProcessRunner(cfg), on_checkpoint=save)
    loaded, _ = files.load_latest(storage, storage.path("trial"))
    assert list(saved) == [3] and loaded["round"] == 3 and loaded["wall_time_s"] == saved[3] > 0
    resumed = execute(cfg, None, runner=InProcessRunner(cfg), resume=loaded)
    assert [int(m["round"]) for m in resumed] == [4, 5, 6]
    assert all(m["wall_time_s"] > saved[3] for m in resumed)
    assert [m["wall_time_s"] for m in first if m["round"] <= 3][-1] == saved[3]
    without = {k: v for k, v in loaded.items() if k != "wall_time_s"}  # a checkpoint written before the clock was kept
    assert [int(m["round"]) for m in execute(cfg, None, runner=InProcessRunner(cfg), resume=without)] == [4, 5, 6]
