"""The PFL family, per-client models from the server and mixtures/clusters: FedFomo, pFedHN, APFL and IFCA, each
checked by hand on one round (what each client receives and sends, and how many floats; what the server computes;
what stays on the client), and the reductions to FedAvg the issue names (APFL with α = 0, IFCA with one cluster).
Checkpoints, stacking, transmissions and global metrics are in tests/test_conformance.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedsweep.algorithms.apfl import APFL, APFLParams
from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats
from fedsweep.algorithms.fedfomo import FedFomo, FedFomoParams, split
from fedsweep.algorithms.ifca import IFCA, IFCAParams
from fedsweep.algorithms.pfedhn import PFedHN, PFedHNParams
from fedsweep.engine import run_local
from fedsweep.models import FlatModel, MLPConfig, build_model
from tests.test_conformance import config
from tests.test_layer_aware import Quadratic

torch.set_default_dtype(torch.float32)


def tiny_client(n: int, seed: int, model: FlatModel) -> ClientContext:
    """A client of a 4-feature, 2-class model; its validation part is NaN, so any use of it would show."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)
    nan = torch.full((3, 4), math.nan)
    return ClientContext(model, ClientData(x, y, x, y, nan, torch.zeros(3, dtype=torch.long)), torch.Generator().manual_seed(7))


def ce(model, w, x, y):
    return F.cross_entropy(model(w, x), y)


# ------------------------------------------------------------------ IFCA


def test_ifca_clusters_start_from_permutations_of_the_seeded_initialization():
    theta0 = torch.arange(8.0)
    models = IFCA(IFCAParams(clusters=3)).init_server_state(theta0, 4)["models"]
    assert models.shape == (3, 8) and torch.equal(models[0], theta0)  # cluster 1 is θ_0 itself
    for j in (1, 2):  # the others: θ_0's values, in another order
        assert torch.equal(models[j].sort().values, theta0) and not torch.equal(models[j], theta0)
    assert not torch.equal(models[1], models[2])
    assert torch.equal(IFCA(IFCAParams(clusters=3)).init_server_state(theta0, 4)["models"], models)  # deterministic
    model = FlatModel(build_model(MLPConfig(hidden=[3]), 4, 2))
    w = model.initial_vector(0)
    inits = IFCA(IFCAParams(clusters=2), model).init_server_state(w, 4)["models"]
    for s in model.layout.slices.values():  # each parameter tensor is permuted within itself: same init distribution
        assert torch.equal(inits[1][s].sort().values, w[s].sort().values)
    assert not torch.equal(inits[1], w)


def test_ifca_client_picks_the_lowest_loss_cluster_trains_it_and_the_server_averages_per_cluster():
    algo = IFCA(IFCAParams(clusters=3, local_lr=0.1, local_steps=1, batch_size=None))
    state = {"models": torch.tensor([[0.0, 0.0], [3.0, 3.0], [-3.0, -3.0]])}
    payload = algo.server_payload(torch.zeros(2), state)
    assert floats(payload) == 3 * 2  # all k models, k·P floats down
    eye = torch.eye(2)
    # f(w) = ½‖w‖² − bᵀw. b = (2, 2): losses 0, −3, 21 → cluster 1; b = (−1, −1): 0, 15, 3 → cluster 0
    msg_a, state_a, _ = algo.client_update(Quadratic(eye, torch.tensor([2.0, 2.0])), payload, {})
    assert int(msg_a["cluster"]) == 1 and torch.allclose(msg_a["params"], torch.tensor([2.9, 2.9]))  # θ_1 − 0.1(θ_1 − b)
    assert floats(msg_a) == 2 + 1 and state_a == {}  # the model and its index up; nothing stays
    msg_b, _, _ = algo.client_update(Quadratic(eye, torch.tensor([-1.0, -1.0])), payload, {})
    assert int(msg_b["cluster"]) == 0 and torch.allclose(msg_b["params"], torch.tensor([-0.1, -0.1]))
    msg_c = {"params": torch.tensor([2.0, 4.0]), "cluster": torch.tensor(1)}
    messages = [ClientMessage(0, 2, msg_a), ClientMessage(1, 3, msg_b), ClientMessage(2, 6, msg_c)]
    params, new = algo.server_update(torch.zeros(2), messages, state, 3)
    assert torch.allclose(new["models"][1], (2 * msg_a["params"] + 6 * msg_c["params"]) / 8)  # cluster 1: weighted by n_i
    assert torch.allclose(new["models"][0], msg_b["params"])  # cluster 0: its one client
    assert torch.equal(new["models"][2], state["models"][2])  # chosen by nobody: unchanged
    assert torch.equal(params, new["models"][0]) and algo.global_model(params, new) is None  # k > 1: no global model
    assert torch.equal(algo.personalize(Quadratic(eye, torch.tensor([-4.0, -4.0])), {"models": new["models"]}, {}), new["models"][2])
    single = IFCA(IFCAParams(clusters=1))
    assert torch.equal(single.global_model(params, {}), params)


def test_ifca_with_one_cluster_is_fedavg_exactly():
    (h1, s1), (h2, s2) = run_local(config("fedavg", local_lr=0.1)), run_local(config("ifca", local_lr=0.1, clusters=1))
    assert torch.equal(s1.params, s2.params)
    for a, b in zip(h1, h2):
        assert a.get("global_accuracy") == b.get("global_accuracy") and a.get("personalized_accuracy_mean") == b.get("personalized_accuracy_mean")
    assert "global_accuracy" in h2[-1]  # with one cluster there is a global model
    assert h2[-1]["floats_up"] == h1[-1]["floats_up"] + 4 * 2  # the cluster index: one float per upload (4 rounds × 2)


# ------------------------------------------------------------------ APFL


def test_apfl_one_step_by_hand():
    algo = APFL(APFLParams(local_lr=0.1, mixing=0.4, mixing_lr=0.2, local_steps=1, batch_size=None))
    a, b = torch.diag(torch.tensor([2.0, 1.0])), torch.tensor([1.0, -1.0])
    w0 = torch.tensor([0.5, 0.5])
    state = {"personal": torch.tensor([1.0, 0.0]), "mixing": torch.tensor(0.4)}
    msg, new, _ = algo.client_update(Quadratic(a, b), {"params": w0}, state)
    # ∇f(w) = (0, 1.5); v̄ = 0.4 v + 0.6 w = (0.7, 0.3), ∇f(v̄) = (0.4, 1.3); ⟨v − w, ∇f(v̄)⟩ = 0.2 − 0.65 = −0.45
    assert torch.allclose(msg["params"], torch.tensor([0.5, 0.35])) and floats(msg) == 2  # w − β∇f(w): only w travels
    assert torch.allclose(new["personal"], torch.tensor([1 - 0.1 * 0.4 * 0.4, -0.1 * 0.4 * 1.3]))  # v − β α ∇f(v̄)
    assert torch.allclose(new["mixing"], torch.tensor(0.4 + 0.2 * 0.45))  # α − η_α ⟨v − w, ∇f(v̄)⟩ = 0.49
    mixed = algo.personalize(Quadratic(a, b), {"params": w0}, new)  # scored: α v + (1 − α) w, w the global model
    assert torch.allclose(mixed, 0.49 * new["personal"] + 0.51 * w0)
    fast = APFL(APFLParams(local_lr=0.1, mixing=0.4, mixing_lr=10.0, local_steps=1, batch_size=None))
    _, clipped, _ = fast.client_update(Quadratic(a, b), {"params": w0}, state)
    assert float(clipped["mixing"]) == 1.0  # 0.4 + 10 × 0.45 is clipped to [0, 1]
    init = algo.init_client_state(w0)
    assert torch.equal(init["personal"], w0) and float(init["mixing"]) == pytest.approx(0.4)


def test_apfl_server_is_fedavg_and_with_alpha_zero_the_global_model_is_fedavgs_exactly():
    algo = APFL(APFLParams())
    msgs = [ClientMessage(0, 1, {"params": torch.tensor([1.0, 0.0])}), ClientMessage(1, 3, {"params": torch.tensor([0.0, 1.0])})]
    params, _ = algo.server_update(torch.zeros(2), msgs, {}, 2)
    assert torch.allclose(params, torch.tensor([0.25, 0.75]))
    assert APFL.fedavg_reduction == {"mixing": 0.0, "mixing_lr": 0.0}
    (h1, s1), (h2, s2) = run_local(config("fedavg", local_lr=0.1)), run_local(config("apfl", local_lr=0.1, mixing=0.0, mixing_lr=0.0))
    assert torch.equal(s1.params, s2.params)
    for a, b in zip(h1, h2):  # FedAvg with α = 0 scores its global model; APFL's v̄ = w when α = 0
        assert a.get("global_accuracy") == b.get("global_accuracy") and a.get("personalized_accuracy_mean") == b.get("personalized_accuracy_mean")
        assert a.get("transmissions") == b.get("transmissions")


# ------------------------------------------------------------------ pFedHN


def explicit_hypernet(phi, v, e=2, h=3, p=3):
    """h(v; φ) written out: Linear(e, H) → ReLU → Linear(H, H) → Linear(H, P) (no activation before the output)."""
    sizes = [h * e, h, h * h, h, p * h, p]
    w1, b1, w2, b2, wo, bo = torch.split(phi, sizes)
    f = F.linear(torch.relu(F.linear(v, w1.view(h, e), b1)), w2.view(h, h), b2)
    return F.linear(f, wo.view(p, h), bo), f


def test_pfedhn_first_round_by_hand():
    hp = PFedHNParams(local_lr=0.1, local_steps=1, batch_size=None, server_lr=0.5, embedding_dim=2, hidden_width=3, hidden_layers=1)
    algo = PFedHN(hp)
    theta0 = torch.tensor([1.0, -1.0, 0.5])
    state = algo.init_server_state(theta0, 2)
    assert state["embeddings"].shape == (2, 2) and state["hypernet"].numel() == 6 + 3 + 9 + 3 + 9 + 3
    phi, emb = state["hypernet"], state["embeddings"]
    assert torch.equal(phi[-12:-3], torch.zeros(9)) and torch.equal(phi[-3:], theta0)  # output layer: 0 and θ_0
    assert torch.equal(algo.init_server_state(theta0, 2)["hypernet"], phi)  # deterministic
    assert algo.server_payload(theta0, state) == {} and algo.global_model(theta0, state) is None
    quads = [Quadratic(torch.eye(3), torch.tensor([0.0, 1.0, 2.0])), Quadratic(2 * torch.eye(3), torch.tensor([1.0, 0.0, 0.0]))]
    messages = []
    for i, q in enumerate(quads):
        payload = algo.client_payload(i, theta0, state)
        assert torch.allclose(payload["params"], theta0) and floats(payload) == 3  # h(v_i; φ) = θ_0 at first
        msg, kept, _ = algo.client_update(q, payload, {})
        assert torch.allclose(msg["delta"], -0.1 * (q.a @ theta0 - q.b)) and floats(msg) == 3 and kept == {}
        messages.append(ClientMessage(i, 5, msg))
    params, new = algo.server_update(theta0, messages, state, 2)
    assert torch.equal(params, theta0)
    d0, d1 = messages[0].payload["delta"], messages[1].payload["delta"]
    f0, f1 = explicit_hypernet(phi, emb[0])[1], explicit_hypernet(phi, emb[1])[1]
    # output weight 0: only the output layer moves, φ ← φ + (η/|S|) Σ (∂θ_i/∂φ)ᵀ Δθ_i
    assert torch.allclose(new["hypernet"][-3:], theta0 + 0.25 * (d0 + d1))
    assert torch.allclose(new["hypernet"][-12:-3], 0.25 * (torch.outer(d0, f0) + torch.outer(d1, f1)).flatten())
    assert torch.equal(new["hypernet"][:-12], phi[:-12]) and torch.equal(new["embeddings"], emb)
    assert torch.allclose(algo.client_payload(0, theta0, new)["params"], explicit_hypernet(new["hypernet"], emb[0])[0])


def test_pfedhn_server_step_is_the_chain_rule_through_the_hypernetwork():
    hp = PFedHNParams(server_lr=0.3, embedding_lr=0.7, embedding_dim=2, hidden_width=3, hidden_layers=1)
    algo = PFedHN(hp)
    gen = torch.Generator().manual_seed(3)
    state = {"hypernet": torch.randn(33, generator=gen), "embeddings": torch.randn(4, 2, generator=gen)}
    delta = torch.randn(3, generator=gen)
    _, new = algo.server_update(torch.zeros(3), [ClientMessage(2, 1, {"delta": delta})], state, 4)
    j_phi, j_v = torch.autograd.functional.jacobian(lambda p, v: explicit_hypernet(p, v)[0], (state["hypernet"], state["embeddings"][2]))
    assert torch.allclose(new["hypernet"], state["hypernet"] + 0.3 * j_phi.T @ delta, atol=1e-6)
    assert torch.allclose(new["embeddings"][2], state["embeddings"][2] + 0.7 * j_v.T @ delta, atol=1e-6)
    assert torch.equal(new["embeddings"][[0, 1, 3]], state["embeddings"][[0, 1, 3]])  # other clients' embeddings


# ------------------------------------------------------------------ FedFomo


def fomo_state(models: torch.Tensor, uploaded: list[int], affinity_row: list[float]) -> dict:
    n = models.shape[0]
    affinity = torch.zeros(n, n)
    affinity[0] = torch.tensor(affinity_row)
    return {"models": models, "uploaded": torch.tensor([1.0 if j in uploaded else 0.0 for j in range(n)]),
            "affinity": affinity, "round": torch.tensor(3)}


def test_fedfomo_sends_the_highest_affinity_uploaded_models_and_explores_with_epsilon():
    models = torch.arange(25.0).view(5, 5)
    state = fomo_state(models, [0, 1, 3, 4], [9.0, 0.5, 5.0, -0.2, 0.9])
    greedy = FedFomo(FedFomoParams(models_per_round=2, epsilon=0.0))
    assert greedy.choose(0, state) == [4, 1]  # not itself (0), not 2 (never uploaded): P_04 > P_01 > P_03
    payload = greedy.client_payload(0, torch.zeros(5), state)
    assert torch.equal(payload["models"], models[[4, 1]]) and floats(payload) == 2 * 5  # M·P floats down
    assert greedy.server_payload(torch.zeros(5), state) == {}
    explore = FedFomo(FedFomoParams(models_per_round=3, epsilon=1.0, epsilon_decay=0.0))
    picks = explore.choose(0, state)
    assert sorted(picks) == [1, 3, 4] and explore.choose(0, state) == picks  # distinct, deterministic (round count)
    assert FedFomo(FedFomoParams(models_per_round=9)).choose(0, state).__len__() == 3  # at most the candidates
    assert floats(greedy.eval_payload(0, torch.zeros(5), state)) == 0  # scored with its own θ_i: no models sent
    fresh = greedy.init_server_state(torch.ones(5), 5)
    assert greedy.choose(0, fresh) == [] and floats(greedy.client_payload(0, torch.zeros(5), fresh)) == 0  # round 1: alone


def test_fedfomo_evaluation_sends_no_models_where_training_sends_m_per_client():
    """An evaluation scores every client with the θ_i it keeps: its payloads hold none of the n·M models a training
    payload for every client would copy (the server's own payloads, after two rounds)."""
    _, server = run_local(config("fedfomo", rounds=2, models_per_round=2))
    ids = list(range(server.num_clients))
    sent = [p["models"] for p in server.payloads(ids).values()]
    assert sum(m.shape[0] for m in sent) > len(ids) and all(m.shape[1:] == (server.model_floats,) for m in sent)
    assert all("models" not in p for p in server.payloads(ids, scoring=True).values())


def test_fedfomo_held_out_split_is_part_of_the_training_data_and_fixed():
    held, fit = split(10, 0.25)
    assert len(held) == 3 and len(fit) == 7 and sorted(torch.cat([held, fit]).tolist()) == list(range(10))
    again = split(10, 0.25)
    assert torch.equal(again[0], held) and torch.equal(again[1], fit)
    assert len(split(10, 0.3)[0]) == 3 and len(split(2, 0.9)[1]) == 1  # ⌈f·n⌉ held out; at least one sample trains


def test_fedfomo_client_weighs_the_downloaded_models_on_held_out_training_data_then_trains():
    model = FlatModel(build_model(MLPConfig(hidden=[3]), 4, 2))
    p = model.numel
    ctx = tiny_client(10, 0, model)
    theta = model.initial_vector(0)
    x, y = ctx.train_data()
    held, fit = split(10, 0.3)
    xh, yh, xf, yf = x[held], y[held], x[fit], y[fit]
    g = torch.func.grad(lambda w: ce(model, w, xh, yh))(theta)
    gen = torch.Generator().manual_seed(1)
    models = torch.stack([theta - 1.0 * g, theta + 0.5 * torch.randn(p, generator=gen), theta - 0.3 * g])
    own, losses = ce(model, theta, xh, yh), torch.stack([ce(model, m, xh, yh) for m in models])
    assert losses[0] < own and losses[1] > own and losses[2] < own  # two better models, one worse
    d = (own - losses) / (models - theta).norm(dim=1)
    w = d.clamp(min=0) / d.clamp(min=0).sum()
    assert w[1] == 0 and torch.allclose(w.sum(), torch.tensor(1.0))
    mixed = theta + (w[:, None] * (models - theta)).sum(0)
    expected = mixed - 0.5 * torch.func.grad(lambda v: ce(model, v, xf, yf))(mixed)  # τ = 1 step on the rest
    algo = FedFomo(FedFomoParams(local_lr=0.5, local_steps=1, batch_size=None, holdout_fraction=0.3))
    msg, state, stats = algo.client_update(ctx, {"models": models}, {"params": theta})
    assert torch.allclose(msg["params"], expected, atol=1e-6) and torch.equal(state["params"], msg["params"])  # kept
    assert torch.allclose(msg["affinity"], d / d.sum().abs(), atol=1e-5) and floats(msg) == p + 3  # P + M up
    assert math.isfinite(stats["local_train_loss"])  # the NaN validation part was never read
    assert torch.equal(algo.personalize(ctx, {}, state), state["params"]) and algo.global_model(theta, {}) is None
    alone, _, _ = algo.client_update(ctx, {"models": models[:0]}, {"params": theta})  # nothing downloaded
    assert torch.allclose(alone["params"], theta - 0.5 * torch.func.grad(lambda v: ce(model, v, xf, yf))(theta), atol=1e-6)
    assert floats(alone) == p


def test_fedfomo_server_stores_the_model_and_adds_the_report_to_the_affinities():
    models = torch.arange(25.0).view(5, 5)
    state = fomo_state(models, [1, 3, 4], [0.0, 0.5, 0.0, -0.2, 0.9])
    algo = FedFomo(FedFomoParams(models_per_round=2, epsilon=0.0))
    new_params = torch.full((5,), -1.0)
    msg = ClientMessage(0, 8, {"params": new_params, "affinity": torch.tensor([0.7, -0.1])})  # for [4, 1], as sent
    params, new = algo.server_update(torch.zeros(5), [msg], state, 5)
    assert torch.equal(params, torch.zeros(5))
    assert torch.allclose(new["affinity"][0], torch.tensor([0.0, 0.4, 0.0, -0.2, 1.6]))
    assert torch.equal(new["affinity"][1:], state["affinity"][1:])
    assert torch.equal(new["models"][0], new_params) and torch.equal(new["models"][1:], models[1:])
    assert new["uploaded"].tolist() == [1.0, 1.0, 0.0, 1.0, 1.0] and int(new["round"]) == 4
