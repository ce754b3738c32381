"""Models with batch normalization: their running statistics are part of a client's state (checkpoints, the pool's
copies) and travel with the global model exactly when the method has one; FedBN keeps the normalization layers and
their statistics on the client (Li et al. 2021), checked by hand on one round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats
from fedsweep.algorithms.fedbn import FedBN, FedBNParams
from fedsweep.engine import Engine, run_local
from fedsweep.federation import STATS, Client, Setup, compute_threads
from fedsweep.loading import validate
from fedsweep.models import CNNConfig, FlatModel, MLPConfig, build_model
from tests.conftest import config_dict
from tests.test_conformance import resumed_run


def config(name: str, rounds: int = 4, **resources):
    return validate(config_dict(
        data={"num_clients": 4},
        model={"name": "mlp", "hidden": [8], "norm": "batch"},
        algorithm={"_replace": True, "name": name, "local_steps": 3, "batch_size": 8, "participation_rate": 0.5},
        rounds=rounds, eval_every=2, resources=resources,
    ))


def test_batch_norm_models_name_their_layers_and_start_with_fresh_statistics():
    mlp = FlatModel(build_model(MLPConfig(hidden=[5, 4], norm="batch"), 6, 3))
    assert mlp.layout.groups["norm"] == ("1.weight", "1.bias", "4.weight", "4.bias")
    assert torch.equal(mlp.stats, torch.tensor([0.0] * 5 + [1.0] * 5 + [0.0] * 4 + [1.0] * 4))
    cnn = FlatModel(build_model(CNNConfig(channels=[2, 3], hidden=[4], kernel_size=3, norm="batch"), 3 * 12 * 12, 10))
    assert len(cnn.layout.groups["norm"]) == 6 and cnn.stats.numel() == 2 * (2 + 3 + 4)
    assert FlatModel(build_model(MLPConfig(hidden=[5]), 6, 3)).stats is None


def test_training_folds_batch_statistics_into_the_running_ones_and_evaluation_uses_them():
    model = FlatModel(build_model(MLPConfig(hidden=[3], norm="batch"), 2, 2))
    w = model.initial_vector(0)
    x = torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
    h = x @ model.unflatten(w)["0.weight"].T + model.unflatten(w)["0.bias"]
    before = model(w, x)  # evaluation: the fresh statistics (mean 0, variance 1), nothing changes
    assert torch.equal(model.stats, model.initial_stats())
    with model.train_mode():
        model(w, x)
    momentum = 0.1  # PyTorch's default: r ← (1 − m) r + m · (batch statistic, variance unbiased)
    assert torch.allclose(model.stats[:3], momentum * h.mean(0), atol=1e-6)
    assert torch.allclose(model.stats[3:], (1 - momentum) + momentum * h.var(0, unbiased=True), atol=1e-6)
    assert not torch.allclose(model(w, x), before)  # evaluation now normalizes with the updated statistics


def test_fedbn_shares_all_but_the_normalization_layers_by_hand():
    model = FlatModel(build_model(MLPConfig(hidden=[3], norm="batch"), 4, 2))
    algo = FedBN(FedBNParams(local_lr=0.5, local_steps=1, batch_size=None), model)
    layout = algo.split()
    norm = [model.layout.slices[n] for n in ("1.weight", "1.bias")]
    local = torch.zeros(model.numel, dtype=torch.bool)
    for s in norm:
        local[s] = True
    w = model.initial_vector(0)
    payload = algo.server_payload(w, {})
    assert floats(payload) == model.numel - 6 == layout.size("body")  # γ and β of 3 units stay home
    gen = torch.Generator().manual_seed(1)
    messages = []
    for i, n in enumerate((6, 10)):
        x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)
        ctx = ClientContext(model, ClientData(x, y, x, y), torch.Generator())
        own = torch.randn(6, generator=gen)  # the client's γ, β
        with model.train_mode():
            msg, state, _ = algo.client_update(ctx, payload, {"head": own})
        full = w.clone()
        full[local] = own
        full.requires_grad_(True)
        with model.train_mode():  # batch statistics in training
            (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(full, x), y), full)
        expected = full.detach() - 0.5 * g
        assert torch.allclose(msg["body"], expected[~local], atol=1e-6) and floats(msg) == model.numel - 6
        assert torch.allclose(state["head"], expected[local], atol=1e-6)
        messages.append(ClientMessage(i, n, msg))
    new, _ = algo.server_update(w, messages, {}, 2)
    avg = (6 * messages[0].payload["body"] + 10 * messages[1].payload["body"]) / 16
    assert torch.allclose(new[~local], avg, atol=1e-6) and torch.equal(new[local], w[local])
    assert algo.global_model(new, {}) is None


def test_statistics_travel_with_a_global_model_only():
    fedavg, fedbn = run_local(config("fedavg"))[1], run_local(config("fedbn"))[1]
    assert fedavg.stats is not None and not torch.equal(fedavg.stats, fedavg.stats * 0)
    assert fedbn.stats is None  # FedBN: no global model, every client keeps its own
    size = FlatModel(build_model(MLPConfig(hidden=[8], norm="batch"), 64, 10))
    sampled = 2 * 4  # 2 clients a round, 4 rounds
    assert fedavg.floats_up == sampled * (size.numel + size.stats.numel())  # the model and its statistics
    assert fedbn.floats_up == sampled * (size.numel - 2 * 8)  # all but γ and β


def test_the_global_statistics_are_the_sample_weighted_mean_of_the_clients():
    cfg = config("fedavg", rounds=1)
    with compute_threads():
        engine = Engine(cfg)
        server, pool = engine.server, engine.pool
        sent = []
        inner = pool.train

        def train(payloads, rnd):
            replies = inner(payloads, rnd)
            sent.extend((m.num_samples, np.array(m.payload[STATS])) for m in replies)
            return replies

        pool.train = train
        server.train_round(pool, 1)
    n = np.array([s for s, _ in sent], dtype=np.float64)
    expected = sum((k / n.sum()) * v for k, v in sent)
    assert len(sent) == 2 and np.allclose(server.stats.numpy(), expected, atol=1e-7)


@pytest.mark.parametrize("name", ["fedavg", "fedbn", "local", "ditto"])
def test_a_checkpoint_keeps_every_clients_statistics_bit_for_bit(name, tmp_path):
    cfg = config(name)
    reference, _ = run_local(cfg)
    history, second = resumed_run(cfg, tmp_path)
    assert history == reference
    held = [second.pool.held[c][0] for c in range(4)]
    assert all(s is None or STATS in s for s in held) and any(s is not None for s in held)


def test_a_client_moved_to_another_host_takes_its_statistics_along():
    """A worker pool of two in-process hosts: a client trains where the round puts it, its statistics with it."""
    one = run_local(config("fedbn"))[0]
    two = run_local(config("fedbn", client_workers=2))[0]
    assert one == two


def test_a_stacked_step_is_refused_for_models_with_statistics():
    raw = config("fedavg").model_dump()
    raw["resources"] |= {"clients_per_actor": 4, "vectorize_clients": True}
    with pytest.raises(Exception, match="model.norm=batch"):
        validate(raw)


def test_a_client_loaded_with_no_state_starts_from_fresh_statistics():
    cfg = config("local")
    from fedsweep.data import build_federated_dataset

    ds = build_federated_dataset(cfg.data)
    client = Client(0, ds.clients[0], Setup.of(cfg, ds.num_features, ds.num_classes))
    client.train({}, 1)
    assert not torch.equal(client.model.stats, client.model.initial_stats())
    client.load((None, 0))
    assert torch.equal(client.model.stats, client.model.initial_stats())
