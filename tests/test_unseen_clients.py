"""``unseen_fraction`` (issue 34's generalization column, after pFL-Bench): the last ⌈f·n⌉ clients are never
sampled, the metrics are the trained clients', and the unseen ones are scored apart (``unseen_*``) with the
method's own evaluation-time personalization of what the server sends."""

from __future__ import annotations

import pytest
import torch

from fedsweep.config import ConfigError
from fedsweep.engine import run_local
from fedsweep.evaluation import summarize
from fedsweep.loading import validate
from tests.conftest import config_dict

FEDAVG = {"_replace": True, "name": "fedavg", "local_lr": 0.1, "participation_rate": 0.5, "local_steps": 3, "batch_size": 16}


def test_unseen_clients_never_train_and_are_scored_apart():
    cfg = validate(config_dict(data={"num_clients": 8}, algorithm=FEDAVG, unseen_fraction=0.2))  # ⌈1.6⌉ = 2 held out
    history, server = run_local(cfg)
    assert server.trained == 6 and cfg.unseen_count() == 2
    evals = server.last_evals
    assert [e.client_id for e in evals] == list(range(8)) and [e.times_trained for e in evals[6:]] == [0, 0]
    assert all(e.times_trained > 0 for e in evals[:6])  # r = 0.5 of the 6, over 4 rounds
    last = history[-1]
    assert last["clients_sampled"] == 3  # ⌈0.5 · 6⌉: the rate is of the clients that train
    assert last["personalized_accuracy_mean"] == pytest.approx(summarize(evals[:6])["personalized_accuracy_mean"])
    assert last["unseen_personalized_accuracy_mean"] == pytest.approx(summarize(evals[6:])["personalized_accuracy_mean"])
    # FedAvg without fine-tuning scores its global model on an unseen client: the global model's accuracy there
    assert last["unseen_personalized_accuracy_weighted"] == last["unseen_global_accuracy"]
    assert last["clients_evaluated"] == 8


def test_no_unseen_clients_changes_nothing():
    base = config_dict(data={"num_clients": 6}, algorithm=FEDAVG)
    plain, _ = run_local(validate(base))
    zero, _ = run_local(validate({**base, "unseen_fraction": 0.0}))
    assert plain == zero and not any(k.startswith("unseen_") for k in plain[-1])


def test_a_local_model_for_an_unseen_client_is_its_untrained_initial_one():
    """Local trains nothing for a client it never sampled: its unseen score is the initial model's."""
    cfg = validate(config_dict(data={"num_clients": 4}, algorithm={**FEDAVG, "name": "local"}, unseen_fraction=0.25))
    history, _ = run_local(cfg)
    first, last = history[0], history[-1]
    assert last["unseen_personalized_accuracy_mean"] == first["unseen_personalized_accuracy_mean"]
    assert torch.isfinite(torch.tensor(last["personalized_accuracy_mean"]))


def test_unseen_settings_that_leave_nothing_to_train_are_refused():
    with pytest.raises(ConfigError, match="unseen_fraction: 0.9 holds out all 3 clients"):
        validate(config_dict(unseen_fraction=0.9))
    with pytest.raises(ConfigError, match=r"algorithm.clients_per_round: 3 samples more clients than train \(2 of 3"):
        validate(config_dict(algorithm={**FEDAVG, "participation_rate": None, "clients_per_round": 3}, unseen_fraction=0.2))
