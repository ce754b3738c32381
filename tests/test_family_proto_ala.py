"""The prototype and adaptive-aggregation group of the PFL family (issue 33), each checked by hand on one round of a
tiny MLP (4 inputs, 3 hidden units, 3 classes: P = 12 + 3 + 9 + 3 = 27): what each client sends and how many floats,
what the server computes, what stays on the client. FedProto, FedALA, FedPAC, FedDBE. (Checkpoints, transmissions,
stacking refusal and the declared reductions to FedAvg are in tests/test_conformance.py.)

The expected values are computed from the flat vector by an independent forward pass (:func:`mlp`)."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats
from fedsweep.algorithms.fedala import FedALA, FedALAParams, adaptive_local_aggregation, layers
from fedsweep.algorithms.feddbe import FedDBE, FedDBEParams
from fedsweep.algorithms.fedpac import FedPAC, FedPACParams, collaboration_weights, feature_statistics, simplex_qp
from fedsweep.algorithms.fedproto import FAR, FedProto, FedProtoParams, aggregate_prototypes
from fedsweep.algorithms.local import Local, LocalParams
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, MLRConfig, build_model
from tests.conftest import config_dict

torch.set_default_dtype(torch.float32)
C, D, P = 3, 3, 27


def tiny() -> FlatModel:
    return FlatModel(build_model(MLPConfig(hidden=[D]), 4, C))


def mlp(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_w(x), logits) by hand: r = relu(x W1ᵀ + b1), logits = r W2ᵀ + b2."""
    w1, b1, w2, b2 = w[:12].view(3, 4), w[12:15], w[15:24].view(3, 3), w[24:27]
    r = torch.relu(x @ w1.T + b1)
    return r, r @ w2.T + b2


def client(n: int, seed: int, model: FlatModel, labels=None) -> ClientContext:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = torch.randint(0, C, (n,), generator=g) if labels is None else torch.tensor(labels)
    return ClientContext(model, ClientData(x, y, x, y), torch.Generator().manual_seed(seed + 100))


def grad_of(f, *leaves):
    leaves = [v.detach().clone().requires_grad_(True) for v in leaves]
    return torch.autograd.grad(f(*leaves), leaves)


def means_by_class(feats: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    protos, counts = torch.zeros(C, feats.shape[1]), torch.zeros(C)
    for k in range(C):
        if (y == k).any():
            protos[k], counts[k] = feats[y == k].mean(0), float((y == k).sum())
    return protos, counts


# ---------------------------------------------------------------------------------------------------- FedProto


def test_prototype_aggregation_weights_by_counts_or_uniformly_per_class():
    p1, p2 = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.0, 0.0]]), torch.tensor([[3.0, 4.0], [0.0, 0.0], [5.0, 5.0]])
    n1, n2 = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([3.0, 0.0, 4.0])
    protos, counts = aggregate_prototypes([p1, p2], [n1, n2], "counts")
    assert torch.allclose(protos, torch.tensor([[(1 + 9) / 4, 12 / 4], [2.0, 2.0], [5.0, 5.0]]))  # Σ n_ij C_ij / Σ n_ij
    assert torch.equal(counts, torch.tensor([4.0, 2.0, 4.0]))
    uniform, _ = aggregate_prototypes([p1, p2], [n1, n2], "clients")
    assert torch.allclose(uniform[0], torch.tensor([2.0, 2.0])) and torch.allclose(uniform[1:], protos[1:])
    empty, none = aggregate_prototypes([p1], [torch.zeros(3)])
    assert torch.equal(empty, torch.zeros(3, 2)) and torch.equal(none, torch.zeros(3))


def test_fedproto_sends_prototypes_trains_its_own_model_against_the_global_ones():
    model = tiny()
    lam, lr = 0.7, 0.3
    algo = FedProto(FedProtoParams(local_lr=lr, coupling=lam, local_steps=1, batch_size=None), model)
    server_state = algo.init_server_state(torch.zeros(P), 2)
    glob = torch.tensor([[0.5, 0.1, 0.0], [0.0, 0.0, 0.0], [1.0, 0.2, 0.3]])
    server_state = {"protos": glob, "proto_counts": torch.tensor([4.0, 0.0, 2.0])}  # class 1 has no global prototype
    payload = algo.server_payload(torch.zeros(P), server_state)
    assert set(payload) == {"protos", "proto_counts"} and floats(payload) == C * D + C  # no parameters travel
    messages = []
    for i, (n, seed) in enumerate([(6, 1), (9, 2)]):
        ctx = client(n, seed, model)
        own = model.initial_vector(seed)  # the client's model, never sent
        msg, state, _ = algo.client_update(ctx, payload, {"params": own})
        x, y = ctx.train_data()

        def objective(w, x=x, y=y):
            r, logits = mlp(w, x)
            known = torch.tensor([True, False, True])[y]
            mse = ((r - glob[y]) ** 2 * known[:, None]).sum() / (len(y) * D)  # nn.MSELoss: known rows, over B·d
            return F.cross_entropy(logits, y) + lam * mse

        (g,) = grad_of(objective, own)
        w = own - lr * g
        assert torch.allclose(state["params"], w, atol=1e-6)  # stays on the client
        expected, counts = means_by_class(mlp(w, x)[0], y)  # the trained model's class means on the training set
        assert torch.allclose(msg["protos"], expected, atol=1e-6) and torch.equal(msg["proto_counts"], counts)
        assert floats(msg) == C * D + C
        messages.append(ClientMessage(i, n, msg))
    params, new_state = algo.server_update(torch.zeros(P), messages, server_state, 2)
    (a, na), (b, nb) = [(m.payload["protos"], m.payload["proto_counts"]) for m in messages]
    for k in range(C):
        if na[k] + nb[k] > 0:
            assert torch.allclose(new_state["protos"][k], (na[k] * a[k] + nb[k] * b[k]) / (na[k] + nb[k]), atol=1e-6)
    assert torch.equal(new_state["proto_counts"], na + nb)
    assert torch.equal(params, torch.zeros(P)) and algo.global_model(params, new_state) is None


def test_fedproto_before_any_prototype_and_with_lambda_zero_is_local_training():
    model = tiny()
    ctx_a, ctx_b, ctx_c = client(12, 3, model), client(12, 3, model), client(12, 3, model)
    own = model.initial_vector(5)
    local = Local(LocalParams(local_lr=0.2, local_steps=3, batch_size=4), model)
    _, expected, _ = local.client_update(ctx_a, {}, {"params": own})
    first = FedProto(FedProtoParams(local_lr=0.2, local_steps=3, batch_size=4, coupling=5.0), model)
    payload = first.server_payload(torch.zeros(P), first.init_server_state(torch.zeros(P), 1))  # no prototype yet
    _, state, _ = first.client_update(ctx_b, payload, {"params": own})
    assert torch.allclose(state["params"], expected["params"], atol=1e-6)
    uncoupled = FedProto(FedProtoParams(local_lr=0.2, local_steps=3, batch_size=4, coupling=0.0), model)
    payload = {"protos": torch.ones(C, D), "proto_counts": torch.ones(C)}
    _, state, _ = uncoupled.client_update(ctx_c, payload, {"params": own})
    assert torch.allclose(state["params"], expected["params"], atol=1e-6)


def test_fedproto_classifies_by_the_nearest_global_prototype_of_the_clients_classes():
    model = tiny()
    w = model.initial_vector(0)
    ctx = client(4, 0, model, labels=[0, 0, 2, 2])  # the client holds classes 0 and 2
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(9))
    glob = torch.randn(C, D, generator=torch.Generator().manual_seed(8))
    counts = torch.tensor([1.0, 1.0, 0.0])  # class 2 has no global prototype
    algo = FedProto(FedProtoParams(), model)
    scores = algo.predictor(ctx, algo.personalize(ctx, {"protos": glob, "proto_counts": counts}, {"params": w}))(x)
    r, logits = mlp(w, x)
    assert torch.allclose(scores[:, 0], -((r - glob[0]) ** 2).mean(1), atol=1e-5)  # −MSE to C̄^(0)
    assert torch.equal(scores[:, 1:], torch.full((5, 2), -FAR))  # not held / no prototype: the code's 100
    none = algo.personalize(ctx, {"protos": glob, "proto_counts": torch.tensor([0.0, 1.0, 0.0])}, {"params": w})
    assert torch.allclose(algo.predictor(ctx, none)(x), logits, atol=1e-6)  # no usable prototype: own classifier
    own = FedProto(FedProtoParams(evaluation="classifier"), model)
    assert torch.equal(own.personalize(ctx, {"protos": glob, "proto_counts": counts}, {"params": w}), w)


def test_the_representation_methods_refuse_a_model_without_a_hidden_layer():
    for name in ("fedproto", "fedpac", "feddbe"):
        with pytest.raises(Exception, match="mlr"):
            validate(config_dict(model={"_replace": True, "name": "mlr"}, algorithm={"_replace": True, "name": name}))
    validate(config_dict(model={"_replace": True, "name": "mlr"}, algorithm={"_replace": True, "name": "fedala"}))


# ---------------------------------------------------------------------------------------------------- FedALA


def hand_ala(theta, glob, weights, eta, batches, higher=slice(15, 27)):
    """One epoch of ALA by hand on the last layer (entries 15:27): returns θ̂, W and the epoch's last loss."""
    d = glob[higher] - theta[higher]
    for x, y in batches:
        def loss(h, x=x, y=y):
            return F.cross_entropy(mlp(torch.cat([glob[:15], h]), x)[1], y)
        h = theta[higher] + d * weights
        (g,) = grad_of(loss, h)
        value = float(loss(h))
        weights = (weights - eta * g * d).clamp(0, 1)
    return torch.cat([glob[:15], theta[higher] + d * weights]), weights, value


def test_fedala_layers_and_split():
    model = tiny()
    assert layers(model.layout) == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]
    algo = FedALA(FedALAParams(), model)
    assert algo.split().groups["head"] == ("2.weight", "2.bias") and algo.split().size("head") == 12
    assert FedALA(FedALAParams(ala_layers=None), model).split().size("head") == P
    bare = FlatModel(build_model(MLRConfig(), 4, C))
    assert layers(bare.layout) == [["weight", "bias"]]  # a bare linear model is one layer
    assert FedALA(FedALAParams(), bare).split().size("head") == 4 * C + C


def test_fedala_first_round_takes_the_global_model_then_one_round_by_hand():
    model = tiny()
    hp = FedALAParams(local_lr=0.1, local_steps=2, batch_size=None, ala_lr=200.0, ala_fraction=0.5)
    algo = FedALA(hp, model)
    w0 = model.initial_vector(0)
    state = algo.init_client_state(w0)
    assert torch.equal(state["weights"], torch.ones(12)) and float(state["start_phase"]) == 1.0
    ctx = client(8, 1, model)
    init, ala = adaptive_local_aggregation(ctx, w0, w0.clone(), state, algo.split(), hp)
    assert torch.equal(init, w0) and float(ala["start_phase"]) == 1.0  # θ_i = Θ: ALA skipped, start phase kept
    # A later round, past the start phase: one epoch of W over a contiguous half of the data, then FedAvg's steps.
    theta, glob = model.initial_vector(1), model.initial_vector(2)
    weights = torch.linspace(0.2, 0.9, 12)
    state = {"params": theta, "weights": weights, "start_phase": torch.tensor(0.0)}
    payload = algo.server_payload(glob, {})
    assert floats(payload) == P
    msg, new_state, _ = algo.client_update(ctx, payload, state)
    start = int(torch.randint(0, 8 - 4 + 1, (1,), generator=torch.Generator().manual_seed(101)))
    x, y = ctx.train_data()
    expected_init, expected_w, _ = hand_ala(theta, glob, weights, 200.0, [(x[start : start + 4], y[start : start + 4])])
    clipped = (expected_w == 0) | (expected_w == 1)
    assert bool(clipped.any()) and not bool(clipped.all())  # some weights clipped to [0, 1], others inside
    assert torch.allclose(new_state["weights"], expected_w, atol=1e-6)
    w = expected_init
    for _ in range(2):
        (g,) = grad_of(lambda v: F.cross_entropy(mlp(v, x)[1], y), w)
        w = w - 0.1 * g
    assert torch.allclose(msg["params"], w, atol=1e-5) and floats(msg) == P
    assert torch.allclose(new_state["params"], w, atol=1e-5) and float(new_state["start_phase"]) == 0.0
    # the server is FedAvg's
    other = w + 1
    new, _ = algo.server_update(glob, [ClientMessage(0, 8, msg), ClientMessage(1, 24, {"params": other})], {}, 2)
    assert torch.allclose(new, (8 * w + 24 * other) / 32, atol=1e-6) and torch.equal(algo.global_model(new, {}), new)


def test_fedala_start_phase_trains_the_weights_until_the_losses_settle():
    model = tiny()
    hp = FedALAParams(batch_size=2, ala_lr=0.5, ala_fraction=0.5, ala_window=2, ala_threshold=1e9)
    algo = FedALA(hp, model)
    theta, glob = model.initial_vector(1), model.initial_vector(2)
    ctx = client(8, 4, model)
    init, ala = adaptive_local_aggregation(ctx, theta, glob, algo.init_client_state(theta), algo.split(), hp)
    start = int(torch.randint(0, 5, (1,), generator=torch.Generator().manual_seed(104)))
    x, y = ctx.train_data()
    batches = [(x[start : start + 2], y[start : start + 2]), (x[start + 2 : start + 4], y[start + 2 : start + 4])]
    w, losses = torch.ones(12), []
    for _ in range(3):  # len(losses) > window = 2 after three epochs; std < 10⁹ stops there
        expected, w, value = hand_ala(theta, glob, w, 0.5, batches)
        losses.append(value)
    assert torch.allclose(init, expected, atol=1e-6) and torch.allclose(ala["weights"], w, atol=1e-6)
    assert float(ala["start_phase"]) == 0.0
    strict = FedALAParams(batch_size=2, ala_lr=0.5, ala_fraction=0.5, ala_window=2, ala_threshold=1e-12, ala_max_epochs=5)
    _, capped = adaptive_local_aggregation(client(8, 4, model), theta, glob, algo.init_client_state(theta), algo.split(), strict)
    for _ in range(2):
        expected, w, value = hand_ala(theta, glob, w, 0.5, batches)
        losses.append(value)
    assert statistics.pstdev(losses[-2:]) > 1e-12 and torch.allclose(capped["weights"], w, atol=1e-6)  # stopped at 5


def test_fedala_scores_the_ala_initialized_model_or_its_own():
    model = tiny()
    theta, glob = model.initial_vector(1), model.initial_vector(2)
    state = {"params": theta, "weights": torch.full((12,), 0.5), "start_phase": torch.tensor(0.0)}
    ctx = client(8, 1, model)
    assert torch.equal(FedALA(FedALAParams(evaluation="local"), model).personalize(ctx, {"params": glob}, state), theta)
    algo = FedALA(FedALAParams(batch_size=None, ala_fraction=1.0), model)
    scored = algo.personalize(ctx, {"params": glob}, state)
    x, y = ctx.train_data()
    expected, _, _ = hand_ala(theta, glob, torch.full((12,), 0.5), 1.0, [(x, y)])
    assert torch.allclose(scored, expected, atol=1e-6) and torch.equal(state["weights"], torch.full((12,), 0.5))
    frozen = FedALA(FedALAParams(ala_lr=0.0), model)  # η = 0: W stays 1, θ̂ = Θ (the FedAvg reduction)
    assert torch.equal(frozen.personalize(ctx, {"params": glob}, state), glob)


# ---------------------------------------------------------------------------------------------------- FedPAC


def test_fedpac_statistics_and_the_collaboration_program_by_hand():
    feats = torch.tensor([[1.0, 0.0], [3.0, 2.0], [0.0, 4.0], [2.0, 2.0]])
    y = torch.tensor([0, 0, 1, 0])
    v, h = feature_statistics(feats, y, 3)
    pi = torch.tensor([0.75, 0.25, 0.0])
    mu = torch.tensor([[2.0, 4 / 3], [0.0, 4.0], [0.0, 0.0]])
    e_sq = torch.tensor([(1 + 13 + 8) / 3, 16.0, 0.0])  # E_k ‖r‖²
    assert torch.allclose(v, ((pi * e_sq - pi**2 * (mu**2).sum(1)).sum() / 4).reshape(1))
    assert torch.allclose(h, pi[:, None] * mu)
    # two clients: min a² p11 + 2a(1−a) p12 + (1−a)² p22 over a ∈ [0, 1]
    p = np.array([[2.0, 0.5], [0.5, 1.0]])
    a = (p[1, 1] - p[0, 1]) / (p[0, 0] - 2 * p[0, 1] + p[1, 1])
    assert np.allclose(simplex_qp(p), [a, 1 - a], atol=1e-6)
    assert np.allclose(simplex_qp(np.array([[1.0, 2.0], [2.0, 5.0]])), [1.0, 0.0], atol=1e-6)  # at a vertex
    # G_i from the class means H_j, plus diag(V); a weight under 10⁻³ is cut and the rest renormalized
    means = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[1.0, 0.0]]])
    variances = torch.tensor([1.0, 1e4, 1.0])
    alpha = collaboration_weights(variances, means, 0)
    assert alpha[1] == 0 and torch.allclose(alpha, torch.tensor([0.5, 0.0, 0.5]), atol=1e-4)


def test_fedpac_one_round_by_hand():
    model = tiny()
    lam, lr, head_lr = 0.5, 0.2, 0.3
    hp = FedPACParams(local_lr=lr, head_lr=head_lr, head_steps=2, coupling=lam, local_steps=1, batch_size=None)
    algo = FedPAC(hp, model)
    g0 = model.initial_vector(0)
    server_state = algo.init_server_state(g0, 3)
    assert torch.equal(server_state["heads"], g0[15:].expand(3, -1))
    glob = torch.tensor([[0.4, 0.0, 0.1], [0.2, 0.3, 0.0], [0.0, 0.0, 0.0]])
    server_state = {**server_state, "protos": glob, "proto_counts": torch.tensor([2.0, 3.0, 0.0])}
    server_state["heads"][1] = torch.linspace(-1, 1, 12)
    body = g0[:15]
    messages, uploads = [], []
    for i, (cid, n, seed) in enumerate([(0, 6, 1), (1, 10, 2)]):
        payload = algo.server_payload(g0, server_state) | algo.client_payload(cid, g0, server_state)
        assert floats(payload) == P + C * D + C  # extractor + own classifier + centroids + counts
        ctx = client(n, seed, model)
        msg, state, _ = algo.client_update(ctx, payload, {})
        x, y = ctx.train_data()
        w = torch.cat([body, server_state["heads"][cid]])
        r0 = mlp(w, x)[0]
        own, own_n = means_by_class(r0, y)
        pi = own_n / n
        v = sum(pi[k] * (r0[y == k] ** 2).sum(1).mean() - pi[k] ** 2 * (own[k] ** 2).sum() for k in range(C) if own_n[k]) / n
        assert torch.allclose(msg["variance"], v.reshape(1), atol=1e-6)
        assert torch.allclose(msg["class_means"], pi[:, None] * own, atol=1e-6)
        for _ in range(2):  # the classifier alone
            (g,) = grad_of(lambda h, b=w[:15], x=x, y=y: F.cross_entropy(mlp(torch.cat([b, h]), x)[1], y), w[15:])
            w = torch.cat([w[:15], w[15:] - head_lr * g])
        targets = torch.where(torch.tensor([True, True, False])[:, None], glob, own)  # own centroid where none global

        def objective(b, h=w[15:], x=x, y=y, targets=targets):
            r, logits = mlp(torch.cat([b, h]), x)
            return F.cross_entropy(logits, y) + lam * ((r - targets[y]) ** 2).mean()

        (g,) = grad_of(objective, w[:15])  # then the extractor alone, with feature alignment
        w = torch.cat([w[:15] - lr * g, w[15:]])
        assert torch.allclose(msg["body"], w[:15], atol=1e-6) and torch.allclose(msg["head"], w[15:], atol=1e-6)
        protos, counts = means_by_class(mlp(w, x)[0], y)
        assert torch.allclose(msg["protos"], protos, atol=1e-6) and torch.equal(msg["proto_counts"], counts)
        assert floats(msg) == P + 2 * C * D + C + 1 and state == {}
        messages.append(ClientMessage(cid, n, msg))
        uploads.append(msg)
    params, new_state = algo.server_update(g0, messages, server_state, 3)
    (m0, m1) = uploads
    assert torch.allclose(params[:15], (6 * m0["body"] + 10 * m1["body"]) / 16, atol=1e-6)
    for cid in (0, 1):
        gm = torch.stack([m0["class_means"], m1["class_means"]]).double()
        diff = (gm[cid] - gm).flatten(1)
        q = (torch.diag(torch.cat([m0["variance"], m1["variance"]]).double()) + diff @ diff.T).numpy()
        a = min(max((q[1, 1] - q[0, 1]) / (q[0, 0] - 2 * q[0, 1] + q[1, 1]), 0.0), 1.0)
        alpha = np.array([a, 1 - a])
        alpha = np.where(alpha > 1e-3, alpha, 0.0)
        alpha = alpha / alpha.sum()
        expected = float(alpha[0]) * m0["head"] + float(alpha[1]) * m1["head"]
        assert torch.allclose(new_state["heads"][cid], expected, atol=1e-5)
    assert torch.equal(new_state["heads"][2], server_state["heads"][2])  # not sampled: its classifier kept
    counts = m0["proto_counts"] + m1["proto_counts"]
    k = int(counts.argmax())
    assert torch.allclose(new_state["protos"][k], (m0["proto_counts"][k] * m0["protos"][k]
                                                   + m1["proto_counts"][k] * m1["protos"][k]) / counts[k], atol=1e-6)
    assert algo.global_model(params, new_state) is None
    eval_payload = algo.server_payload(params, new_state) | algo.client_payload(1, params, new_state)
    assert torch.equal(algo.personalize(client(3, 0, model), eval_payload, {}),
                       torch.cat([params[:15], new_state["heads"][1]]))
    alone = FedPAC(FedPACParams(collaboration=False), model)
    _, kept = alone.server_update(g0, messages, server_state, 3)
    assert torch.equal(kept["heads"][1], m1["head"])


def test_fedpac_head_steps_default_to_one_epoch():
    model = tiny()
    ctx_a, ctx_b = client(10, 7, model), client(10, 7, model)
    g0 = model.initial_vector(0)
    default = FedPAC(FedPACParams(batch_size=4, local_steps=1), model)
    state = default.init_server_state(g0, 1)
    payload = default.server_payload(g0, state) | default.client_payload(0, g0, state)
    a, _, _ = default.client_update(ctx_a, payload, {})
    b, _, _ = FedPAC(FedPACParams(batch_size=4, local_steps=1, head_steps=3), model).client_update(ctx_b, payload, {})
    assert torch.equal(a["head"], b["head"]) and torch.equal(a["body"], b["body"])  # ⌈10/4⌉ = 3


# ---------------------------------------------------------------------------------------------------- FedDBE


def test_feddbe_initialization_period_sends_running_means_and_fixes_the_global_mean():
    model = tiny()
    mu, lr = 0.3, 0.2
    algo = FedDBE(FedDBEParams(local_lr=lr, coupling=2.0, momentum=mu, local_steps=2, batch_size=None), model)
    g0 = model.initial_vector(0)
    server_state = algo.init_server_state(g0, 2)
    assert float(server_state["mean_ready"]) == 0.0
    payload = algo.server_payload(g0, server_state)
    assert list(payload) == ["params"] and floats(payload) == P
    messages = []
    for i, (n, seed) in enumerate([(6, 1), (9, 2)]):
        ctx = client(n, seed, model)
        msg, state, _ = algo.client_update(ctx, payload, {"memory": torch.full((D,), 0.5)})
        x, y = ctx.train_data()
        w, running = g0, torch.zeros(D)
        for _ in range(2):  # plain FedAvg steps, no PRBM, the running mean restarted at 0
            running = (1 - mu) * running + mu * mlp(w, x)[0].mean(0)
            (g,) = grad_of(lambda v, x=x, y=y: F.cross_entropy(mlp(v, x)[1], y), w)
            w = w - lr * g
        assert list(msg) == ["running_mean"] and floats(msg) == D
        assert torch.allclose(msg["running_mean"], running, atol=1e-6)
        assert torch.equal(state["memory"], torch.full((D,), 0.5))  # untouched
        messages.append(ClientMessage(i, n, msg))
    params, new_state = algo.server_update(g0, messages, server_state, 2)
    assert torch.equal(params, g0)  # the initialization period leaves the model
    expected = (6 * messages[0].payload["running_mean"] + 9 * messages[1].payload["running_mean"]) / 15
    assert torch.allclose(new_state["global_mean"], expected, atol=1e-6) and float(new_state["mean_ready"]) == 1.0
    assert floats(algo.server_payload(params, new_state)) == P + D
    assert float(FedDBE(FedDBEParams(coupling=0.0), model).init_server_state(g0, 2)["mean_ready"]) == 1.0  # κ = 0: none


def test_feddbe_one_round_by_hand_and_its_personalized_model():
    model = tiny()
    mu, lr, mem_lr, kappa = 0.25, 0.2, 0.5, 3.0
    algo = FedDBE(FedDBEParams(local_lr=lr, memory_lr=mem_lr, coupling=kappa, momentum=mu, local_steps=2, batch_size=None), model)
    g0 = model.initial_vector(0)
    z = torch.tensor([0.3, 0.1, 0.2])
    payload = algo.server_payload(g0, {"global_mean": z, "mean_ready": torch.tensor(1.0)})
    ctx = client(7, 3, model)
    memory = torch.tensor([0.1, -0.2, 0.05])
    msg, state, _ = algo.client_update(ctx, payload, {"memory": memory})
    x, y = ctx.train_data()
    w, c, running = g0, memory, torch.zeros(D)
    for _ in range(2):
        def objective(v, m, prev=running):
            r, _ = mlp(v, x)
            run = (1 - mu) * prev + mu * r.mean(0)
            logits = (r + m) @ v[15:24].view(3, 3).T + v[24:]
            return F.cross_entropy(logits, y) + kappa * (0.5 * (run - z) ** 2).mean()

        gw, gc = grad_of(objective, w, c)
        running = ((1 - mu) * running + mu * mlp(w, x)[0].mean(0)).detach()
        w, c = w - lr * gw, c - mem_lr * gc
    assert torch.allclose(msg["params"], w, atol=1e-6) and floats(msg) == P  # only w travels
    assert torch.allclose(state["memory"], c, atol=1e-6)  # r̄_i stays local
    new, _ = algo.server_update(g0, [ClientMessage(0, 7, msg), ClientMessage(1, 21, {"params": g0})], {}, 2)
    assert torch.allclose(new, (7 * w + 21 * g0) / 28, atol=1e-6) and algo.global_model(new, {}) is not None
    scored = algo.personalize(ctx, {"params": new}, state)
    r, _ = mlp(new, x)
    assert torch.allclose(model(scored, x), (r + c) @ new[15:24].view(3, 3).T + new[24:], atol=1e-5)
