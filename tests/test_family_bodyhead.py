"""The body/head family (issue 33), each checked by hand on one round of a tiny MLP (4 inputs, 3 hidden units, 2 or 3
classes, full-batch steps so that every step is a closed-form computation): what each client sends and how many floats,
what the server computes, what stays on the client. Plus the reductions: FedRep with zero head steps shares FedPer's
body update (exactly on the first step, to first order in β after it), trains as FedBABU; FedRoD with γ = 0 is FedAvg's
client step; the balanced softmax leaves an absent class's generic classifier row alone.
(Checkpoints, stacking, transmissions and the declared FedAvg reductions are in tests/test_conformance.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats, sgd
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.algorithms.fedbabu import FedBABU, FedBABUParams
from fedsweep.algorithms.fedper import FedPer, FedPerParams
from fedsweep.algorithms.fedrep import FedRep, FedRepParams
from fedsweep.algorithms.fedrod import FedRoD, FedRoDParams
from fedsweep.algorithms.lgfedavg import LGFedAvg, LGFedAvgParams
from fedsweep.algorithms.stacked import StackedContext, row
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, build_model
from tests.conftest import config_dict

torch.set_default_dtype(torch.float32)

NB, NH = 4 * 3 + 3, 3 * 2 + 2  # body (first layer) and head (classifier) of the 4-3-2 MLP


def tiny(classes: int = 2) -> FlatModel:
    return FlatModel(build_model(MLPConfig(hidden=[3]), 4, classes))


def client(model: FlatModel, n: int, seed: int, labels: list[int] | None = None) -> ClientContext:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = torch.tensor(labels) if labels is not None else torch.randint(0, model.num_classes, (n,), generator=gen)
    return ClientContext(model, ClientData(x, y, x, y), torch.Generator().manual_seed(seed))


def ce_grads(model: FlatModel, body: torch.Tensor, head: torch.Tensor, ctx: ClientContext):
    """(∇_body f, ∇_head f) of the client's full-batch cross-entropy at (body, head), by autograd on the two parts."""
    b, h = body.clone().requires_grad_(True), head.clone().requires_grad_(True)
    x, y = ctx.train_data()
    return torch.autograd.grad(F.cross_entropy(model(torch.cat([b, h]), x), y), (b, h))


def test_fedrep_trains_the_head_then_the_body_and_sends_the_body():
    model = tiny()
    assert model.layout.size("body") == NB and model.layout.size("head") == NH
    algo = FedRep(FedRepParams(local_lr=0.3, head_lr=0.5, head_steps=2, local_steps=2, batch_size=None), model)
    w = model.initial_vector(0)
    payload = algo.server_payload(w, {})
    assert list(payload) == ["body"] and floats(payload) == NB  # φ^t down, |φ| floats
    messages = []
    for i, n in enumerate((5, 9)):
        ctx = client(model, n, seed=i)
        h0 = torch.randn(NH, generator=torch.Generator().manual_seed(10 + i))  # the client's own head
        msg, state, _ = algo.client_update(ctx, payload, {"head": h0})
        b, h = w[:NB], h0
        for _ in range(2):  # τ_h head steps, φ frozen at φ^t, step 0.5
            h = h - 0.5 * ce_grads(model, b, h, ctx)[1]
        for _ in range(2):  # τ body steps, head frozen at h_i^{t,τ_h}, step β = 0.3
            b = b - 0.3 * ce_grads(model, b, h, ctx)[0]
        assert list(msg) == ["body"] and floats(msg) == NB  # |φ| floats up
        assert torch.allclose(msg["body"], b, atol=1e-6)
        assert torch.allclose(state["head"], h, atol=1e-6)  # stays on the client
        messages.append(ClientMessage(i, n, msg))
    new, _ = algo.server_update(w, messages, {}, 2)
    assert torch.allclose(new[:NB], (5 * messages[0].payload["body"] + 9 * messages[1].payload["body"]) / 14, atol=1e-6)
    assert torch.equal(new[NB:], w[NB:])  # the server never holds a head
    assert algo.global_model(new, {}) is None
    personal = algo.personalize(client(model, 5, 0), algo.server_payload(new, {}), state)
    assert torch.equal(personal, torch.cat([new[:NB], state["head"]]))  # scored with (φ^{t+1}, h_i)


def test_fedrep_with_zero_head_steps_shares_fedpers_first_body_step():
    """FedRep (τ_h = 0) and FedPer from the same (φ^t, h_i): the first body step is the same gradient step, so with
    τ = 1 they send (and the server averages) the same body; FedPer's head moves, FedRep's does not."""
    model = tiny()
    w = model.initial_vector(0)
    hp = {"local_lr": 0.3, "local_steps": 1, "batch_size": None}
    rep, per = FedRep(FedRepParams(head_steps=0, **hp), model), FedPer(FedPerParams(**hp), model)
    payload = rep.server_payload(w, {})
    assert torch.equal(payload["body"], per.server_payload(w, {})["body"])
    rep_msgs, per_msgs = [], []
    for i, n in enumerate((5, 9)):
        h0 = torch.randn(NH, generator=torch.Generator().manual_seed(10 + i))
        m_rep, s_rep, _ = rep.client_update(client(model, n, i), payload, {"head": h0})
        m_per, s_per, _ = per.client_update(client(model, n, i), payload, {"head": h0})
        by_hand = w[:NB] - 0.3 * ce_grads(model, w[:NB], h0, client(model, n, i))[0]
        assert torch.allclose(m_rep["body"], by_hand, atol=1e-6) and torch.allclose(m_rep["body"], m_per["body"], atol=1e-7)
        assert torch.equal(s_rep["head"], h0) and not torch.allclose(s_per["head"], h0)
        rep_msgs.append(ClientMessage(i, n, m_rep))
        per_msgs.append(ClientMessage(i, n, m_per))
    assert torch.allclose(rep.server_update(w, rep_msgs, {}, 2)[0], per.server_update(w, per_msgs, {}, 2)[0], atol=1e-7)


def test_after_the_first_step_fedrep_and_fedper_bodies_differ_at_second_order_in_beta():
    """With τ = 2 the bodies differ by β (∇_φ f(φ_1, h_0) − ∇_φ f(φ_1, h_1)) with h_1 − h_0 = −β ∇_h f: O(β²), so
    halving β quarters the gap; FedRep's second step is the frozen-head step by hand."""
    model = tiny()
    w = model.initial_vector(0)
    h0 = torch.randn(NH, generator=torch.Generator().manual_seed(3))
    gaps = []
    for beta in (0.02, 0.01):
        hp = {"local_lr": beta, "local_steps": 2, "batch_size": None}
        rep, per = FedRep(FedRepParams(head_steps=0, **hp), model), FedPer(FedPerParams(**hp), model)
        payload = rep.server_payload(w, {})
        body_rep = rep.client_update(client(model, 9, 1), payload, {"head": h0})[0]["body"]
        body_per = per.client_update(client(model, 9, 1), payload, {"head": h0})[0]["body"]
        b = w[:NB]
        for _ in range(2):
            b = b - beta * ce_grads(model, b, h0, client(model, 9, 1))[0]
        assert torch.allclose(body_rep, b, atol=1e-6)
        gaps.append(float((body_rep - body_per).norm()))
    assert gaps[0] > 0 and 3.5 < gaps[0] / gaps[1] < 4.5


def test_fedrep_with_zero_head_steps_trains_as_fedbabu():
    raw = config_dict(data={"num_clients": 4}, algorithm={"_replace": True, "name": "fedrep", "head_steps": 0, "local_lr": 0.1,
                                                          "local_steps": 2, "batch_size": 8, "participation_rate": 0.5}, rounds=3)
    babu = {**raw["algorithm"], "name": "fedbabu"}
    babu.pop("head_steps")
    (_, rep), (_, fedbabu) = run_local(validate(raw)), run_local(validate({**raw, "algorithm": babu}))
    assert torch.equal(rep.params, fedbabu.params)


def test_lgfedavg_keeps_the_representation_and_averages_the_classifier():
    model = tiny()
    algo = LGFedAvg(LGFedAvgParams(local_lr=0.3, local_steps=1, batch_size=None), model)
    split = algo.split()
    assert split.groups["head"] == ("0.weight", "0.bias") and split.groups["body"] == ("2.weight", "2.bias")  # local, global
    assert LGFedAvg(LGFedAvgParams(local_layers=["0"]), model).split().groups == split.groups
    w = model.initial_vector(0)
    payload = algo.server_payload(w, {})
    assert list(payload) == ["body"] and floats(payload) == NH and torch.equal(payload["body"], w[NB:])  # θ^g down
    messages = []
    for i, n in enumerate((5, 9)):
        ctx = client(model, n, i)
        local = torch.randn(NB, generator=torch.Generator().manual_seed(10 + i))  # the client's own representation
        msg, state, _ = algo.client_update(ctx, payload, {"head": local})
        g_local, g_global = ce_grads(model, local, w[NB:], ctx)  # one end-to-end step of the whole model
        assert floats(msg) == NH and torch.allclose(msg["body"], w[NB:] - 0.3 * g_global, atol=1e-6)  # θ^g up
        assert torch.allclose(state["head"], local - 0.3 * g_local, atol=1e-6)  # θ^l stays
        messages.append(ClientMessage(i, n, msg))
    new, _ = algo.server_update(w, messages, {}, 2)
    assert torch.allclose(new[NB:], (5 * messages[0].payload["body"] + 9 * messages[1].payload["body"]) / 14, atol=1e-6)
    assert torch.equal(new[:NB], w[:NB]) and algo.global_model(new, {}) is None
    personal = algo.personalize(client(model, 5, 0), algo.server_payload(new, {}), state)
    assert torch.equal(personal, torch.cat([state["head"], new[NB:]]))  # (θ^l_i, θ^g_{t+1})
    assert LGFedAvgParams(local_layers=[]).model_problem("mlr") is None and LGFedAvgParams().model_problem("mlr")


def test_fedbabu_trains_the_body_under_the_initial_head_and_fine_tunes_at_evaluation():
    model = tiny()
    algo = FedBABU(FedBABUParams(local_lr=0.3, local_steps=2, batch_size=None, personalization_lr=0.2,
                                 personalization_steps=3), model)
    w = model.initial_vector(0)
    state = algo.init_client_state(w)
    assert list(state) == ["head"] and torch.equal(state["head"], w[NB:])  # h_0, the seeded classifier
    payload = algo.server_payload(w, {})
    assert list(payload) == ["body"] and floats(payload) == NB
    messages = []
    for i, n in enumerate((5, 9)):
        ctx = client(model, n, i)
        msg, new_state, _ = algo.client_update(ctx, payload, state)
        b = w[:NB]
        for _ in range(2):
            b = b - 0.3 * ce_grads(model, b, w[NB:], ctx)[0]
        assert floats(msg) == NB and torch.allclose(msg["body"], b, atol=1e-6)
        assert torch.equal(new_state["head"], w[NB:])  # the head never trains
        messages.append(ClientMessage(i, n, msg))
    new, _ = algo.server_update(w, messages, {}, 2)
    assert torch.allclose(new[:NB], (5 * messages[0].payload["body"] + 9 * messages[1].payload["body"]) / 14, atol=1e-6)
    assert torch.equal(new[NB:], w[NB:]) and torch.equal(algo.global_model(new, {}), new)  # global model (φ^{t+1}, h_0)
    ctx = client(model, 7, 5)
    tuned = algo.personalize(ctx, algo.server_payload(new, {}), state)
    v = new.clone()
    for _ in range(3):  # full-model fine-tuning, as the authors' analysis.ipynb
        gb, gh = ce_grads(model, v[:NB], v[NB:], ctx)
        v = v - 0.2 * torch.cat([gb, gh])
    assert torch.allclose(tuned, v, atol=1e-6)
    for part, frozen in (("head", slice(0, NB)), ("body", slice(NB, None))):
        only = FedBABU(FedBABUParams(personalization_lr=0.2, personalization_steps=3, fine_tune_part=part), model)
        t = only.personalize(ctx, algo.server_payload(new, {}), state)
        assert torch.equal(t[frozen], new[frozen]) and not torch.equal(t, new)
    assert torch.equal(FedBABU(FedBABUParams(personalization_lr=0.0), model).personalize(ctx, algo.server_payload(new, {}), state), new)


def bsm_by_hand(logits: torch.Tensor, y: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """−log( n_y e^{g_y} / Σ_c n_c e^{g_c} ), averaged: the balanced softmax written out."""
    num = counts[y] * logits.gather(1, y[:, None]).squeeze(1).exp()
    return -(num / (counts * logits.exp()).sum(1)).log().mean()


def test_fedrod_trains_a_balanced_generic_model_and_a_personal_head_on_top():
    model = tiny(classes=3)
    nb, nh, p = NB, 3 * 3 + 3, model.numel
    algo = FedRoD(FedRoDParams(local_lr=0.3, head_lr=0.5, local_steps=1, batch_size=None), model)
    w = model.initial_vector(0)
    state = algo.init_client_state(w)
    assert torch.equal(state["personal_head"], w[nb:])  # φ_i starts as the generic head's initialization
    payload = algo.server_payload(w, {})
    assert floats(payload) == p  # the whole generic model travels
    labels = [0, 0, 0, 1, 0]  # class 2 absent, class 0 four times class 1
    ctx = client(model, 5, 0, labels)
    phi = torch.randn(nh, generator=torch.Generator().manual_seed(4))
    msg, new_state, _ = algo.client_update(ctx, payload, {"personal_head": phi})
    x, y = ctx.train_data()
    counts = torch.tensor([4.0, 1.0, 0.0])
    wg = w.clone().requires_grad_(True)
    (gw,) = torch.autograd.grad(bsm_by_hand(model(wg, x), y, counts), wg)
    assert floats(msg) == p and torch.allclose(msg["params"], w - 0.3 * gw, atol=1e-6)  # the BSM step alone moves (θ, ψ)
    generic_row2 = torch.cat([w[nb + 6 : nb + 9], w[nb + 11 :]])  # class 2's weight row and bias in the generic head
    assert torch.equal(torch.cat([msg["params"][nb + 6 : nb + 9], msg["params"][nb + 11 :]]), generic_row2)  # n_2 = 0: untouched
    with torch.no_grad():
        z, generic = model.features(w, x), model(w, x)
    ph = phi.clone().requires_grad_(True)
    personal_logits = generic + F.linear(z, ph[:9].view(3, 3), ph[9:])  # sg[g(z)] + p(sg[z]; φ)
    (gp,) = torch.autograd.grad(F.cross_entropy(personal_logits, y), ph)
    assert torch.allclose(new_state["personal_head"], phi - 0.5 * gp, atol=1e-6)  # stays on the client
    other = client(model, 9, 1)
    msg2, _, _ = algo.client_update(other, payload, state)
    new, _ = algo.server_update(w, [ClientMessage(0, 5, msg), ClientMessage(1, 9, msg2)], {}, 2)
    assert torch.allclose(new, (5 * msg["params"] + 9 * msg2["params"]) / 14, atol=1e-6)
    assert torch.equal(algo.global_model(new, {}), new)
    predict = algo.predictor(ctx, algo.personalize(ctx, algo.server_payload(new, {}), new_state))
    phi1 = new_state["personal_head"]
    assert torch.allclose(predict(x), model(new, x) + F.linear(model.features(new, x), phi1[:9].view(3, 3), phi1[9:]), atol=1e-6)


def test_fedrod_with_gamma_zero_takes_fedavgs_client_step():
    model = tiny(classes=3)
    w = model.initial_vector(0)
    ctx = lambda: client(model, 9, 2, [0, 1, 1, 1, 1, 0, 1, 1, 1])
    rod = FedRoD(FedRoDParams(local_lr=0.3, local_steps=3, batch_size=4, bsm_gamma=0.0), model)
    avg = FedAvg(FedAvgParams(local_lr=0.3, local_steps=3, batch_size=4), model)
    m_rod = rod.client_update(ctx(), rod.server_payload(w, {}), rod.init_client_state(w))[0]
    m_avg = avg.client_update(ctx(), avg.server_payload(w, {}), {})[0]
    assert torch.allclose(m_rod["params"], m_avg["params"], atol=1e-6)
    expected, _ = sgd(ctx(), w, 0.3, 3, 4)
    assert torch.allclose(m_rod["params"], expected, atol=1e-6)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_fedrod_stacked_clients_equal_one_by_one(batch_size):
    """Two clients of different sizes (padded rows) and class sets (−inf priors) in one stacked step."""
    model = tiny(classes=3)
    algo = FedRoD(FedRoDParams(local_lr=0.3, local_steps=2, batch_size=batch_size), model)
    assert algo.can_vectorize()
    w = model.initial_vector(0)
    heads = [torch.randn(12, generator=torch.Generator().manual_seed(s)) for s in (7, 8)]
    data = [(5, 0, [0, 0, 1, 0, 1]), (8, 1, [2, 1, 2, 2, 1, 2, 2, 1])]
    singles = [algo.client_update(client(model, n, s, lab), {"params": w}, {"personal_head": h})
               for (n, s, lab), h in zip(data, heads)]
    stacked = StackedContext([client(model, n, s, lab) for n, s, lab in data])
    msg, states, stats = algo.client_update(stacked, {"params": torch.stack([w, w])}, {"personal_head": torch.stack(heads)})
    for c, (m, s, st) in enumerate(singles):
        assert torch.allclose(row(msg, c)["params"], m["params"], atol=1e-6)
        assert abs(float(stats["local_train_loss"][c]) - st["local_train_loss"]) < 1e-5
        assert torch.allclose(row(states, c)["personal_head"], s["personal_head"], atol=1e-6)
    assert torch.isfinite(msg["params"]).all()


def test_body_head_methods_refuse_a_model_without_a_hidden_layer():
    assert FedRepParams().model_problem("mlr") and FedRepParams(personal_layers=[]).model_problem("mlr") is None
    assert FedBABUParams().model_problem("mlr") and FedBABUParams().model_problem("mlp") is None
    assert FedRoDParams().model_problem("mlr") is None  # a personal linear head on x is still FedRoD
    with pytest.raises(Exception, match="fedbabu"):
        validate(config_dict(model={"_replace": True, "name": "mlr"}, algorithm={"_replace": True, "name": "fedbabu"}))
