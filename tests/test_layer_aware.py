"""The interface's acceptance methods, each checked by hand on one round: what is sent (and how many floats),
what the server computes, what stays on the client. FedPer needs the model's layout, FedAMP per-client payloads,
Local no global model. (Their reductions, checkpoints and transmissions are in tests/test_conformance.py.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats, grad
from fedsweep.algorithms.fedamp import FedAMP, FedAMPParams, attention_weights
from fedsweep.algorithms.fedper import FedPer, FedPerParams
from fedsweep.algorithms.local import Local, LocalParams
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, build_model
from tests.conftest import config_dict

torch.set_default_dtype(torch.float32)


@dataclass
class Quadratic:
    """A client whose loss is f(w) = ½ wᵀAw − bᵀw on every batch: ∇f = Aw − b."""

    a: torch.Tensor
    b: torch.Tensor
    model: object = None

    def loss(self, w, batch):
        a, b = batch
        return 0.5 * w @ a @ w - b @ w

    def grad(self, w, batch):
        return grad(self.loss, w, batch)

    def batch(self, batch_size):
        return self.a, self.b

    def train_data(self):
        return self.a, self.b


def test_fedper_sends_the_body_keeps_the_head_and_averages_bodies():
    model = FlatModel(build_model(MLPConfig(hidden=[3]), 4, 2))
    layout = model.layout
    assert layout.groups["head"] == ("2.weight", "2.bias") and layout.size("head") == 3 * 2 + 2
    algo = FedPer(FedPerParams(local_lr=0.5, local_steps=1, batch_size=None), model)
    w = model.initial_vector(0)
    nb = layout.size("body")
    payload = algo.server_payload(w, {})
    assert list(payload) == ["body"] and floats(payload) == nb == 4 * 3 + 3  # only the body travels
    gen = torch.Generator().manual_seed(1)
    messages, heads = [], []
    for i, n in enumerate((5, 9)):
        x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)
        ctx = ClientContext(model, ClientData(x, y, x, y), torch.Generator())
        head = torch.randn(8, generator=gen)  # each client's own classifier
        msg, state, _ = algo.client_update(ctx, payload, {"head": head})
        full = torch.cat([w[:nb], head]).requires_grad_(True)  # body received + own head
        (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(model(full, x), y), full)
        expected = full.detach() - 0.5 * g
        assert torch.allclose(msg["body"], expected[:nb], atol=1e-6) and floats(msg) == nb
        assert torch.allclose(state["head"], expected[nb:], atol=1e-6)  # stays on the client
        messages.append(ClientMessage(i, n, msg))
        heads.append(state["head"])
    new, _ = algo.server_update(w, messages, {}, 2)
    bodies = [m.payload["body"] for m in messages]
    assert torch.allclose(new[:nb], (5 * bodies[0] + 9 * bodies[1]) / 14, atol=1e-6)  # weighted by n_i
    assert torch.equal(new[nb:], w[nb:])  # the server's head is never touched
    assert algo.global_model(new, {}) is None
    empty = FedPer(FedPerParams(personal_layers=[]), model)
    assert empty.split().size("head") == 0 and torch.equal(empty.global_model(new, {}), new)


def test_fedper_with_an_empty_head_is_fedavg():
    raw = config_dict(algorithm={"participation_rate": 0.67}, rounds=3)
    fedavg = validate(raw)
    fedper = validate({**raw, "algorithm": {**raw["algorithm"], "name": "fedper", "personal_layers": []}})
    (h1, s1), (h2, s2) = run_local(fedavg), run_local(fedper)
    assert (s1.params - s2.params).abs().max() < 1e-6
    assert h1[-1]["transmissions"] == h2[-1]["transmissions"]
    assert abs(h1[-1]["personalized_accuracy_mean"] - h2[-1]["personalized_accuracy_mean"]) < 1e-6


def test_fedamp_sends_each_client_its_attention_weighted_cloud_model():
    models = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    xi = attention_weights(models, 0, alpha=0.5, sigma=1.0)
    # ‖w_0 − w_1‖² = 1, ‖w_0 − w_2‖² = 4: ξ_0j = α e^{−d/σ}/σ, ξ_00 = 1 − Σ
    expected = torch.tensor([1 - 0.5 * math.exp(-1) - 0.5 * math.exp(-4), 0.5 * math.exp(-1), 0.5 * math.exp(-4)])
    assert torch.allclose(xi, expected)
    algo = FedAMP(FedAMPParams(local_lr=0.1, coupling=0.2, attention_step=0.5, sigma=1.0, local_steps=1))
    state = {"models": models}
    assert algo.server_payload(torch.zeros(2), state) == {}
    payload = algo.client_payload(0, torch.zeros(2), state)
    u = expected @ models
    assert torch.allclose(payload["cloud"], u) and floats(payload) == 2  # its own model, P floats
    assert not torch.allclose(algo.client_payload(1, torch.zeros(2), state)["cloud"], u)  # another client's differs
    a, b = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([1.0, -1.0])
    w_i = torch.tensor([0.5, 0.5])
    msg, new_state, _ = algo.client_update(Quadratic(a, b), payload, {"params": w_i})
    step = w_i - 0.1 * (a @ w_i - b + (0.2 / 0.5) * (w_i - u))  # Eq. 8's gradient step from the client's own w_i
    assert torch.allclose(msg["params"], step) and torch.allclose(new_state["params"], step)
    _, server_state = algo.server_update(torch.zeros(2), [ClientMessage(0, 3, msg)], state, 3)
    assert torch.allclose(server_state["models"][0], step)  # stored for the next round's attention
    assert torch.equal(server_state["models"][1:], models[1:])
    assert algo.global_model(torch.zeros(2), server_state) is None
    # held-out clients (the last rows, never trained) are no part of a trained client's cloud model
    _, two = algo.server_update(torch.zeros(2), [ClientMessage(0, 3, msg)], state, 2)  # the federation: clients 0, 1
    rows = two["models"][:2]
    assert torch.allclose(algo.client_payload(0, torch.zeros(2), two)["cloud"],
                          attention_weights(rows, 0, alpha=0.5, sigma=1.0) @ rows)
    held_out = torch.stack([rows[0], rows[1], two["models"][2]])  # a held-out client's own: the federation and its row
    assert torch.allclose(algo.client_payload(2, torch.zeros(2), two)["cloud"],
                          attention_weights(held_out, 2, alpha=0.5, sigma=1.0) @ held_out)


def test_local_sends_nothing_and_trains_alone():
    algo = Local(LocalParams(local_lr=0.1, local_steps=2))
    w0 = torch.tensor([1.0, -1.0])
    state = algo.init_client_state(w0)
    payload = algo.server_payload(torch.zeros(2), {})
    assert payload == {} and floats(payload) == 0
    a, b = torch.eye(2), torch.tensor([0.0, 1.0])
    msg, new_state, _ = algo.client_update(Quadratic(a, b), payload, state)
    w = w0
    for _ in range(2):
        w = w - 0.1 * (a @ w - b)
    assert msg == {} and torch.allclose(new_state["params"], w)
    assert algo.global_model(torch.zeros(2), {}) is None


def test_local_runs_end_to_end_with_no_transmissions_and_no_global_metrics():
    history, _ = run_local(validate(config_dict(algorithm={"_replace": True, "name": "local", "local_lr": 0.1}, rounds=4)))
    assert history[-1]["transmissions"] == 0.0 and history[-1]["floats_down"] == 0.0
    assert "global_accuracy" not in history[-1] and history[-1]["personalized_accuracy_mean"] > history[0]["personalized_accuracy_mean"]
