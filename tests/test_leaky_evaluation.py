"""Per-FedAvg's ``evaluation: adapt_on_test_batch`` (what pFedMe's published code did before scoring
Per-FedAvg): its equations, that the default evaluation never reads test data while this one does, and
that its runs are marked in MLflow and get their own, marked table row."""

from __future__ import annotations

import pytest
import torch
from mlflow import MlflowClient

from fedsweep.algorithms import build_algorithm
from fedsweep.algorithms.base import ClientContext, ClientData
from fedsweep.algorithms.perfedavg import PerFedAvgParams
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, build_model
from fedsweep.table import best_settings, load_runs
from fedsweep.tracking import LEAK_TAG, RunLogger, ensure_experiment
from tests.conftest import config_dict

ALPHA, BETA, B = 0.3, 0.07, 5


def client_setup(test_labels_shift: int = 0):
    g = torch.Generator().manual_seed(0)
    x_tr, x_te = torch.randn(12, 4, generator=g), torch.randn(9, 4, generator=g)
    y_tr, y_te = torch.randint(0, 3, (12,), generator=g), torch.randint(0, 3, (9,), generator=g)
    data = ClientData(x_tr, y_tr, x_te, (y_te + test_labels_shift) % 3)
    model = FlatModel(build_model(MLPConfig(hidden=[6]), 4, 3))
    return data, model, model.initial_vector(0)


def personalized(evaluation: str, test_labels_shift: int = 0) -> torch.Tensor:
    data, model, w = client_setup(test_labels_shift)
    hp = PerFedAvgParams(name="perfedavg", alpha=ALPHA, beta=BETA, batch_size=B, evaluation=evaluation)
    ctx = ClientContext(model, data, torch.Generator().manual_seed(7))
    return build_algorithm(hp).personalize(ctx, {"params": w}, {})


def test_adapt_on_test_batch_is_a_step_of_alpha_on_test_data_then_one_of_beta_on_training_data():
    data, model, w = client_setup()
    gen = torch.Generator().manual_seed(7)
    t = torch.randperm(9, generator=gen)[:B]  # the test minibatch is drawn first, then the training one
    d = torch.randperm(12, generator=gen)[:B]

    def grad_at(v, x, y):
        v = v.detach().requires_grad_(True)
        (gv,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(v, x), y), v)
        return gv

    w1 = w - ALPHA * grad_at(w, data.x_test[t], data.y_test[t])
    expected = w1 - BETA * grad_at(w1, data.x_train[d], data.y_train[d])
    assert torch.allclose(personalized("adapt_on_test_batch"), expected, atol=1e-7)


def test_the_default_evaluation_never_reads_test_data_and_the_leaking_one_does():
    assert torch.equal(personalized("train"), personalized("train", test_labels_shift=1))
    assert not torch.allclose(personalized("adapt_on_test_batch"), personalized("adapt_on_test_batch", test_labels_shift=1))


def test_only_an_explicit_setting_leaks_and_bad_values_are_refused():
    cfg = validate(config_dict(algorithm={"_replace": True, "name": "perfedavg"}))
    assert cfg.algorithm.evaluation == "train" and not cfg.algorithm.leaks_test_data
    with pytest.raises(Exception, match="evaluation") as err:
        validate(config_dict(algorithm={"_replace": True, "name": "perfedavg", "evaluation": "test"}))
    assert "adapt_on_test_batch" in str(err.value) and "test_data_step" in str(err.value) and "train" in str(err.value)


def test_leaking_runs_are_tagged_in_mlflow_and_get_their_own_marked_table_row(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = ensure_experiment(uri, "leak")
    ids = {}
    for evaluation, acc in (("train", 0.5), ("adapt_on_test_batch", 0.9)):
        cfg = validate(config_dict(algorithm={"_replace": True, "name": "perfedavg", "evaluation": evaluation}))
        log = RunLogger(uri, exp, cfg, f"perfedavg {evaluation}", overrides={"algorithm.evaluation": evaluation})
        log.log_round({"round": 0.0, "personalized_accuracy_mean": acc})
        log.finish(None)
        ids[evaluation] = log.run_id
    runs, _ = load_runs(uri, "leak")
    assert sorted(runs["algorithm"]) == ["perfedavg", "perfedavg [adapt_on_test_batch (leaks test data)]"]
    table = best_settings(runs, "personalized_accuracy_mean").set_index("algorithm")
    # the leaking run (0.9) does not become Per-FedAvg's best setting: it is a row of its own
    assert table.loc["perfedavg", "personalized_accuracy_mean mean"] == pytest.approx(0.5)
    assert table.loc["perfedavg [adapt_on_test_batch (leaks test data)]", "personalized_accuracy_mean mean"] == pytest.approx(0.9)
    # the tag itself, as MLflow holds it: on the leaking run only
    tags = {evaluation: MlflowClient(uri).get_run(run_id).data.tags for evaluation, run_id in ids.items()}
    assert tags["adapt_on_test_batch"][LEAK_TAG] == "adapt_on_test_batch (leaks test data)"
    assert LEAK_TAG not in tags["train"] and sorted(runs["run_id"]) == sorted(ids.values())


def test_data_step_is_one_step_of_alpha_on_a_test_minibatch_for_perfedavg_and_fedavg():
    """Per-FedAvg's Sec. 5 wording of its Table 1 evaluation (and of FedAvg + update): one stochastic step of α
    with respect to the test data, w' = w − α ∇f(w; T); nothing else."""
    from fedsweep.algorithms.fedavg import FedAvgOwnParams

    data, model, w = client_setup()
    t = torch.randperm(9, generator=torch.Generator().manual_seed(7))[:B]
    v = w.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(v, data.x_test[t]), data.y_test[t]), v)
    expected = w - ALPHA * g
    assert torch.allclose(personalized("test_data_step"), expected, atol=1e-7)
    hp = FedAvgOwnParams(name="fedavg", alpha=ALPHA, batch_size=B, evaluation="test_data_step")
    ctx = ClientContext(model, data, torch.Generator().manual_seed(7))
    assert torch.allclose(build_algorithm(hp).personalize(ctx, {"params": w}, {}), expected, atol=1e-7)
    assert hp.leaks_test_data and not FedAvgOwnParams(name="fedavg").leaks_test_data
    # a leaking evaluation reads the test labels; FedAvg's default does not
    assert not torch.allclose(personalized("test_data_step"), personalized("test_data_step", test_labels_shift=1))


def test_fedavg_test_data_step_is_fedavg_s_own_and_its_runs_are_marked(tmp_path):
    """The methods built on FedAvg's parameters do not get the leaking evaluation; FedAvg's runs with it are tagged."""
    with pytest.raises(Exception, match="evaluation"):
        validate(config_dict(algorithm={"_replace": True, "name": "fedprox", "evaluation": "test_data_step"}))
    cfg = validate(config_dict(algorithm={"_replace": True, "name": "fedavg", "alpha": 0.1, "evaluation": "test_data_step"}))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    log = RunLogger(uri, ensure_experiment(uri, "leak"), cfg, "fedavg leak")
    log.log_round({"round": 0.0, "personalized_accuracy_mean": 0.5})
    log.finish(None)
    runs, _ = load_runs(uri, "leak")
    assert list(runs["algorithm"]) == ["fedavg [test_data_step (leaks test data)]"]


def test_hf_denominator_divides_the_central_difference_by_2_delta_or_by_delta_as_seed_000_prints():
    """On a quadratic f(w) = ½wᵀAw − bᵀw the central difference is exact: [∇f(w+δg) − ∇f(w−δg)]/(2δ) = A g, so
    the HF step is w − β(g' − α A g') with g' = ∇f(w − α∇f(w)); /δ doubles the correction."""
    from fedsweep.algorithms.perfedavg import meta_step

    gen = torch.Generator().manual_seed(3)
    m = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    a, b = m @ m.T + torch.eye(4, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)
    w = torch.randn(4, generator=gen, dtype=torch.float64)
    loss = lambda v, _batch: 0.5 * v @ a @ v - b @ v
    g_outer = a @ (w - ALPHA * (a @ w - b)) - b
    for divisor, factor in ((2.0, 1.0), (1.0, 2.0)):
        new, _ = meta_step(loss, w, (None, None, None), ALPHA, BETA, "hf", 1e-3, divisor=divisor)
        assert torch.allclose(new, w - BETA * (g_outer - factor * ALPHA * (a @ g_outer)), atol=1e-9)
    cfg = validate(config_dict(algorithm={"_replace": True, "name": "perfedavg", "variant": "hf", "hf_denominator": "delta"}))
    assert cfg.algorithm.hf_denominator == "delta"
    with pytest.raises(Exception, match="hf_denominator") as err:
        validate(config_dict(algorithm={"_replace": True, "name": "perfedavg", "variant": "fo", "hf_denominator": "delta"}))
    assert "allowed: two_delta, or variant: hf" in str(err.value)
