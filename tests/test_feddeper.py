"""FedDeper as reconstructed from its paper's description (fedsweep/algorithms/feddeper.py): its reductions,
one round in closed form on quadratics, its client state through a checkpoint, and its MLflow marking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.algorithms import build_algorithm
from fedsweep.algorithms.base import ClientMessage
from fedsweep.algorithms.feddeper import RECONSTRUCTED, FedDeperParams
from fedsweep.cli import main
from fedsweep.engine import local_federation, run_local
from fedsweep.federation import compute_threads
from fedsweep.loading import validate
from fedsweep.tracking import TAG_PREFIX, RunLogger, client, ensure_experiment
from tests.test_layer_aware import Quadratic  # f_i(w) = ½ wᵀA w − bᵀw on every batch


def synthetic(algorithm: dict, rounds: int = 3):
    return validate({
        "seed": 2,
        "data": {"dataset": "synthetic", "num_clients": 6, "alpha": 0.5, "beta": 0.5, "max_samples_per_client": 200},
        "model": {"name": "mlp", "hidden": [10]},
        "algorithm": {"participation_rate": 0.5, "local_steps": 5, "batch_size": 10, "local_lr": 0.05, **algorithm},
        "rounds": rounds,
        "eval_every": 1,
    })


def test_alpha_zero_is_fedavg():
    _, fedavg = run_local(synthetic({"name": "fedavg"}))
    history, feddeper = run_local(synthetic({"name": "feddeper", "personalization_lr": 0.0}))
    assert torch.allclose(fedavg.params, feddeper.params, atol=1e-6)
    # y_i stays zero, so the personalized model is the global one
    assert history[-1]["personalized_accuracy_mean"] == pytest.approx(
        run_local(synthetic({"name": "fedavg"}))[0][-1]["personalized_accuracy_mean"])


def test_one_round_on_two_quadratic_clients_in_closed_form():
    alpha, beta, lam = 0.1, 0.2, 0.5
    hp = FedDeperParams(name="feddeper", alpha=alpha, beta=beta, coupling=lam, local_steps=2, aggregation="uniform")
    algo = build_algorithm(hp)
    x = torch.tensor([1.0, -2.0], dtype=torch.float64)
    clients = [
        (Quadratic(torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64)),
         torch.zeros(2, dtype=torch.float64)),                                       # first round: y = 0
        (Quadratic(torch.tensor([[1.0, 0.0], [0.0, 3.0]], dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)),
         torch.tensor([0.3, -0.1], dtype=torch.float64)),                            # y from its history
    ]
    messages = []
    for i, (q, y0) in enumerate(clients):
        message, state, _ = algo.client_update(q, {"params": x}, {"personal": y0})
        # by hand: τ = 2 alternations of (a) y ← y − α(∇f(v + y) + λy), (b) v ← v − β∇f(v + y)
        v, y = x.clone(), y0.clone()
        for _ in range(2):
            y = y - alpha * (q.a @ (v + y) - q.b + lam * y)
            v = v - beta * (q.a @ (v + y) - q.b)
        w = v + y  # the original local model
        assert torch.allclose(state["personal"], y, atol=1e-12)
        assert torch.allclose(message["params"], v, atol=1e-12)
        assert torch.allclose(message["params"], w - state["personal"], atol=1e-12)  # upload = w − y_i
        messages.append(ClientMessage(i, 10 * (i + 1), message))
    new_x, _ = algo.server_update(x, messages, {}, 2)
    assert torch.allclose(new_x, (messages[0].payload["params"] + messages[1].payload["params"]) / 2, atol=1e-12)
    # personalized model of client 2 at evaluation: x + y_2
    assert torch.allclose(algo.personalize(None, {"params": new_x}, {"personal": clients[1][1]}), new_x + clients[1][1])


def test_a_checkpoint_restores_every_y_i_bit_for_bit_and_the_run_goes_on_unchanged():
    cfg = synthetic({"name": "feddeper", "personalization_lr": 0.05, "coupling": 0.1}, rounds=4)
    with compute_threads():  # as run_local computes, so that the numbers can be compared exactly
        server, pool = local_federation(cfg)
        for rnd in range(3):
            server.step(pool, rnd)
        saved = server.checkpoint(pool, 2)
        fresh_server, fresh_pool = local_federation(cfg)
        assert fresh_server.restore(fresh_pool, saved) == 3
        restored = fresh_pool.snapshot()
        resumed = [fresh_server.step(fresh_pool, r) for r in (3, 4)]
    assert sum(state is not None for state, _ in saved["clients"].values()) >= 3
    for i, (state, times) in restored.items():
        before, times_before = saved["clients"][i]
        assert times == times_before and (state is None) == (before is None)
        if state is not None:
            assert np.array_equal(state["personal"], before["personal"])
    history, uninterrupted = run_local(cfg)
    assert resumed == history[3:]
    assert torch.equal(fresh_server.params, uninterrupted.params)


def test_runs_carry_the_reconstruction_tag_and_the_table_prints_a_feddeper_row(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = ensure_experiment(uri, "feddeper")
    cfg = synthetic({"name": "feddeper", "personalization_lr": 0.05}, rounds=3)
    history, _ = run_local(cfg)
    log = RunLogger(uri, exp, cfg, "feddeper", overrides={"algorithm.personalization_lr": 0.05})
    for metrics in history:
        log.log_round(metrics)
    log.finish(None)
    assert client(uri).get_run(log.run_id).data.tags[f"{TAG_PREFIX}provenance"] == RECONSTRUCTED
    assert main(["table", "--experiment", "feddeper", "--tracking-uri", uri]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| feddeper |")]
    assert len(rows) == 1 and "personalization_lr=0.05" in rows[0]
