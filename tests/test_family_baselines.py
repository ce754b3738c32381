"""The baselines every PFL table carries (issue 33), each checked by hand on one round: FedOpt (Adam, Yogi, Adagrad),
FedAvgM, FedNova, MOON, FedEM and FedAvg-FT. What each client sends (and how many floats), what the server computes,
what stays local; the reductions to FedAvg the issue names. (Checkpoints, transmissions and the declared
reductions on a real run are in tests/test_conformance.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage, floats, grad
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.algorithms.fedavgft import FedAvgFT, FedAvgFTParams
from fedsweep.algorithms.fedavgm import FedAvgM, FedAvgMParams
from fedsweep.algorithms.fedem import FedEM, FedEMParams
from fedsweep.algorithms.fednova import FedNova, FedNovaParams, normalizer
from fedsweep.algorithms.fedopt import FedOpt, FedOptParams
from fedsweep.algorithms.moon import MOON, MOONParams
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, build_model
from tests.conftest import config_dict
from tests.test_layer_aware import Quadratic as LayerAwareQuadratic

torch.set_default_dtype(torch.float32)


def messages_of(*pairs) -> list[ClientMessage]:
    """ClientMessages (client i, n_i samples, {"params": x_i}) from (n_i, x_i) pairs."""
    return [ClientMessage(i, n, {"params": x}) for i, (n, x) in enumerate(pairs)]


def tiny_model() -> FlatModel:
    """4 inputs, one hidden layer of 3 (ReLU), 2 classes: P = 4·3 + 3 + 3·2 + 2 = 23."""
    return FlatModel(build_model(MLPConfig(hidden=[3]), 4, 2))


def tiny_client(model: FlatModel, n: int, seed: int) -> ClientContext:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)
    return ClientContext(model, ClientData(x, y, x, y), torch.Generator().manual_seed(seed + 100))


# ---------------------------------------------------------------- FedOpt


X0 = torch.tensor([1.0, -2.0, 0.5])
CLIENTS = ((1, torch.tensor([1.75, -2.0, 0.0])), (3, torch.tensor([0.75, -1.5, 0.5])))  # (n_i, x_i), exact in binary
DELTA = torch.tensor([0.0, 0.375, -0.125])  # Σ p_i (x_i − x) with p ∝ n_i = (1/4, 3/4)


def test_fedopt_adam_first_step_has_the_closed_form():
    eta, b1, b2, eps = 0.1, 0.9, 0.99, 1e-3
    algo = FedOpt(FedOptParams(variant="adam", server_lr=eta, beta1=b1, beta2=b2, epsilon=eps))
    state = algo.init_server_state(X0, 2)
    assert torch.equal(state["m"], torch.zeros(3)) and torch.equal(state["v"], torch.zeros(3))
    new, state = algo.server_update(X0, messages_of(*CLIENTS), state, 2)
    m, v = (1 - b1) * DELTA, (1 - b2) * DELTA**2
    assert torch.allclose(state["m"], m) and torch.allclose(state["v"], v)
    assert torch.allclose(new, X0 + eta * m / (v.sqrt() + eps))
    # a coordinate with Δ = 0 does not move; the others move by about η(1 − β1)/√(1 − β2) = η in Δ's direction
    assert new[0] == X0[0] and torch.allclose(new[1:] - X0[1:], eta * (1 - b1) * DELTA[1:].sign() / (math.sqrt(1 - b2) + eps / DELTA[1:].abs()))


def test_fedopt_each_variants_first_and_second_steps():
    eta, b1, b2, eps = 0.1, 0.5, 0.9, 1e-2
    hp = {"server_lr": eta, "beta1": b1, "beta2": b2, "epsilon": eps}
    d1, d2 = DELTA, torch.tensor([0.2, 0.01, -0.1])
    for variant, second in [
        ("adam", lambda v, d: b2 * v + (1 - b2) * d**2),
        ("adagrad", lambda v, d: v + d**2),
        ("yogi", lambda v, d: v - (1 - b2) * d**2 * torch.sign(v - d**2)),
    ]:
        algo = FedOpt(FedOptParams(variant=variant, **hp))
        state = algo.init_server_state(X0, 2)
        x1, state = algo.server_update(X0, messages_of(*CLIENTS), state, 2)
        v1 = d1**2 if variant == "adagrad" else (1 - b2) * d1**2  # Yogi's first step is Adam's: sign(0 − Δ²) = −1
        assert torch.allclose(state["v"], v1), variant
        assert torch.allclose(x1, X0 + eta * (1 - b1) * d1 / (v1.sqrt() + eps)), variant
        x2, state = algo.server_update(x1, [ClientMessage(0, 1, {"params": x1 + d2})], state, 2)
        m2, v2 = b1 * (1 - b1) * d1 + (1 - b1) * d2, second(v1, d2)
        assert torch.allclose(state["m"], m2) and torch.allclose(state["v"], v2), variant
        assert torch.allclose(x2, x1 + eta * m2 / (v2.sqrt() + eps)), variant
    # Yogi's v moves by (1 − β2)Δ² towards Δ² only: up where v < Δ², down where v > Δ² (coordinates 0 and 1 here)
    v1 = (1 - b2) * d1**2
    yogi = v1 - (1 - b2) * d2**2 * torch.sign(v1 - d2**2)
    assert yogi[0] > v1[0] and yogi[1] < v1[1]


def test_fedopt_initial_accumulator_and_what_travels():
    algo = FedOpt(FedOptParams(variant="adam", initial_accumulator=1e-4, beta2=0.99))
    state = algo.init_server_state(X0, 2)
    assert torch.allclose(state["v"], torch.full((3,), 1e-4))
    _, state = algo.server_update(X0, messages_of(*CLIENTS), state, 2)
    assert torch.allclose(state["v"], 0.99 * 1e-4 + 0.01 * DELTA**2)
    model = tiny_model()
    w = model.initial_vector(0)
    payload = algo.server_payload(w, algo.init_server_state(w, 2))
    ctx = tiny_client(model, 8, 1)
    msg, client_state, _ = algo.client_update(ctx, payload, {})
    ref, _, _ = FedAvg(FedAvgParams(**algo.hp.model_dump(include={"local_lr", "local_steps", "batch_size"}))).client_update(tiny_client(model, 8, 1), payload, {})
    assert floats(payload) == floats(msg) == model.numel == 23 and client_state == {}  # FedAvg's client: P each way
    assert torch.equal(msg["params"], ref["params"])


# ---------------------------------------------------------------- FedAvgM


def test_fedavgm_two_server_steps_by_hand_and_the_papers_sign():
    mu, eta = 0.9, 0.5
    algo = FedAvgM(FedAvgMParams(server_momentum=mu, server_lr=eta))
    state = algo.init_server_state(X0, 2)
    x1, state = algo.server_update(X0, messages_of(*CLIENTS), state, 2)
    assert torch.allclose(state["velocity"], DELTA) and torch.allclose(x1, X0 + eta * DELTA)
    d2 = torch.tensor([0.1, -0.2, 0.0])
    x2, state = algo.server_update(x1, [ClientMessage(0, 1, {"params": x1 + d2})], state, 2)
    assert torch.allclose(state["velocity"], mu * DELTA + d2) and torch.allclose(x2, x1 + eta * (mu * DELTA + d2))
    # Hsu et al.: Δw = Σ p_i (w − w_i), v ← μv + Δw, w ← w − v (η = 1): the same iterates
    paper = FedAvgM(FedAvgMParams(server_momentum=mu, server_lr=1.0))
    w, v, s = X0, torch.zeros(3), paper.init_server_state(X0, 2)
    for msgs in (messages_of(*CLIENTS), [ClientMessage(0, 1, {"params": X0 + d2})]):
        ours, s = paper.server_update(w, msgs, s, 2)
        dw = sum(m.num_samples * (w - m.payload["params"]) for m in msgs) / sum(m.num_samples for m in msgs)
        v = mu * v + dw
        w = w - v
        assert torch.allclose(ours, w, atol=1e-6)


def test_fedavgm_without_momentum_at_step_one_is_the_fedavg_average():
    algo = FedAvgM(FedAvgMParams(**FedAvgM.fedavg_reduction))
    new, _ = algo.server_update(X0, messages_of(*CLIENTS), algo.init_server_state(X0, 2), 2)
    fedavg, _ = FedAvg(FedAvgParams()).server_update(X0, messages_of(*CLIENTS), {}, 2)
    assert torch.allclose(new, fedavg, atol=1e-7)


# ---------------------------------------------------------------- FedNova


class Quadratic(LayerAwareQuadratic):
    """test_layer_aware's quadratic client f(w) = ½ wᵀAw − bᵀw, with n samples (what FedNova's epochs count)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, n: int):
        super().__init__(a, b)
        self.n = n

    def train_data(self):
        return torch.zeros(self.n, 1), torch.zeros(self.n)


def test_fednova_unequal_steps_by_hand():
    """Two clients of 8 and 24 samples, one local epoch at batch 8: τ = 1 and 3 steps. Each sends (x − y_i)/τ_i and
    τ_i (P + 1 floats); the server steps by τ_eff = Σ p_i τ_i along Σ p_i d_i, not to the plain average."""
    beta = 0.1
    algo = FedNova(FedNovaParams(local_lr=beta, local_epochs=1, batch_size=8))
    assert not algo.can_vectorize() and FedNova(FedNovaParams()).can_vectorize()
    x = torch.tensor([1.0, -1.0])
    a = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    clients = [Quadratic(a, torch.tensor([1.0, 0.0]), 8), Quadratic(a, torch.tensor([0.0, 2.0]), 24)]
    messages, ys = [], []
    for i, (c, steps) in enumerate(zip(clients, (1, 3))):
        assert algo.steps_of(c) == steps
        y = x.clone()
        for _ in range(steps):
            y = y - beta * (a @ y - c.b)
        msg, state, _ = algo.client_update(c, {"params": x}, {})
        assert torch.allclose(msg["update"], (x - y) / steps) and msg["a"].tolist() == [steps]
        assert floats(msg) == 2 + 1 and state == {}
        messages.append(ClientMessage(i, c.n, msg))
        ys.append(y)
    new, _ = algo.server_update(x, messages, {}, 2)
    p = torch.tensor([0.25, 0.75])
    tau_eff = 0.25 * 1 + 0.75 * 3
    assert torch.allclose(new, x - tau_eff * (p[0] * (x - ys[0]) / 1 + p[1] * (x - ys[1]) / 3))
    fedavg = p[0] * ys[0] + p[1] * ys[1]
    assert not torch.allclose(new, fedavg)  # FedAvg over-weights the client that took more steps


def test_fednova_momentum_normalizer_and_a_constant_gradient():
    """‖a‖₁ = Σ_t (1 − ρ^t)/(1 − ρ) (Eq. 12's closed form). On a linear loss (constant gradient g) every client's
    normalized update is β g whatever its τ_i and ρ, so the server steps by τ_eff β g."""
    for steps, rho in [(1, 0.0), (4, 0.0), (1, 0.5), (5, 0.9)]:
        expected = sum((1 - rho**t) / (1 - rho) for t in range(1, steps + 1)) if rho else steps
        assert normalizer(steps, rho) == pytest.approx(expected)
    beta, rho, g = 0.1, 0.5, torch.tensor([1.0, -2.0])
    algo = FedNova(FedNovaParams(local_lr=beta, local_momentum=rho, local_epochs=2, batch_size=4))
    x = torch.zeros(2)
    messages = []
    for i, n in enumerate((4, 12)):  # τ = 2 and 6
        c = Quadratic(torch.zeros(2, 2), -g, n)  # f(w) = gᵀw
        msg, _, _ = algo.client_update(c, {"params": x}, {})
        assert torch.allclose(msg["update"], beta * g) and msg["a"].item() == pytest.approx(normalizer(2 * n // 4, rho))
        messages.append(ClientMessage(i, n, msg))
    new, _ = algo.server_update(x, messages, {}, 2)
    tau_eff = 0.25 * normalizer(2, rho) + 0.75 * normalizer(6, rho)
    assert torch.allclose(new, x - tau_eff * beta * g)
    # on a quadratic: the heavy-ball loop by hand (buffer from zero), divided by ‖a‖₁ for τ = 3
    a, b = torch.tensor([[2.0, 0.5], [0.5, 1.0]]), torch.tensor([1.0, -1.0])
    y, buf = torch.tensor([1.0, 1.0]), torch.zeros(2)
    for _ in range(3):
        buf = rho * buf + (a @ y - b)
        y = y - beta * buf
    one = FedNova(FedNovaParams(local_lr=beta, local_momentum=rho, local_steps=3))
    msg, _, _ = one.client_update(Quadratic(a, b, 12), {"params": torch.tensor([1.0, 1.0])}, {})
    assert torch.allclose(msg["update"], (torch.tensor([1.0, 1.0]) - y) / (1 + (1 + rho) + (1 + rho + rho**2)))


def test_fednova_with_equal_steps_is_the_fedavg_average():
    algo = FedNova(FedNovaParams(local_lr=0.1, local_steps=3, **FedNova.fedavg_reduction))
    x = torch.tensor([1.0, -1.0])
    a = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    messages, ys = [], []
    for i, (n, b) in enumerate(((5, torch.tensor([1.0, 0.0])), (15, torch.tensor([0.0, 2.0])))):
        msg, _, _ = algo.client_update(Quadratic(a, b, n), {"params": x}, {})
        messages.append(ClientMessage(i, n, msg))
        ys.append(x - 3 * msg["update"])
    new, _ = algo.server_update(x, messages, {}, 2)
    assert torch.allclose(new, 0.25 * ys[0] + 0.75 * ys[1], atol=1e-7)


# ---------------------------------------------------------------- MOON


def hand_features(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The tiny MLP's hidden layer by hand: relu(x W1ᵀ + b1), W1 the first 12 entries (3 × 4), b1 the next 3."""
    return torch.relu(x @ w[:12].view(3, 4).T + w[12:15])


def hand_moon_loss(model, w, x, y, anchor, previous, mu, temp):
    """CE + μ · −log(e^{cos(z, z_g)/T} / (e^{cos(z, z_g)/T} + e^{cos(z, z_p)/T})), averaged over the samples."""
    z, zg, zp = hand_features(w, x), hand_features(anchor, x), hand_features(previous, x)
    cos = lambda u, v: (u * v).sum(1) / (u.norm(dim=1) * v.norm(dim=1))
    pos, neg = torch.exp(cos(z, zg) / temp), torch.exp(cos(z, zp) / temp)
    return F.cross_entropy(model(w, x), y) + mu * (-torch.log(pos / (pos + neg))).mean()


def test_moon_one_step_by_hand_keeps_its_model_as_the_next_previous():
    model = tiny_model()
    beta, mu, temp = 0.3, 2.0, 0.5
    algo = MOON(MOONParams(local_lr=beta, contrastive_strength=mu, temperature=temp, local_steps=1, batch_size=None), model)
    anchor = model.initial_vector(0)
    previous = model.initial_vector(1)  # the client's model at the end of its last round
    anchor[12:15] = previous[12:15] = 2.0  # hidden biases that keep every representation nonzero (cosines defined)
    ctx = tiny_client(model, 12, 3)
    x, y = ctx.train_data()
    assert (hand_features(anchor, x) > 0).all() and (hand_features(previous, x) > 0).all()
    payload = algo.server_payload(anchor, {})
    msg, state, _ = algo.client_update(ctx, payload, {"previous": previous})
    w = anchor.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(hand_moon_loss(model, w, x, y, anchor, previous, mu, temp), w)
    expected = anchor - beta * g
    assert torch.allclose(msg["params"], expected, atol=1e-6)
    assert torch.equal(state["previous"], msg["params"])  # z_prev of the next round comes from this model
    assert floats(payload) == floats(msg) == model.numel  # P each way; the previous model never travels
    ce_only = anchor - beta * grad(ctx.loss, anchor, (x, y))[0]
    assert not torch.allclose(msg["params"], ce_only, atol=1e-4)  # the contrastive term did act
    new, _ = algo.server_update(anchor, [ClientMessage(0, 12, msg), ClientMessage(1, 4, {"params": anchor})], {}, 2)
    assert torch.allclose(new, 0.75 * msg["params"] + 0.25 * anchor)  # FedAvg's average


def test_moon_first_round_and_mu_zero_are_fedavgs_step():
    model = tiny_model()
    anchor = model.initial_vector(0)
    payload = {"params": anchor}
    fedavg, _, _ = FedAvg(FedAvgParams(local_lr=0.3, local_steps=3, batch_size=5)).client_update(tiny_client(model, 12, 3), payload, {})
    zero = MOON(MOONParams(local_lr=0.3, local_steps=3, batch_size=5, **MOON.fedavg_reduction), model)
    msg, _, _ = zero.client_update(tiny_client(model, 12, 3), payload, {"previous": model.initial_vector(1)})
    assert torch.equal(msg["params"], fedavg["params"])
    # before its first round a client's previous model is the initialization: z_glob = z_prev, ℓ_con ≡ log 2, no pull
    first = MOON(MOONParams(local_lr=0.3, local_steps=3, batch_size=5, contrastive_strength=5.0), model)
    msg, _, _ = first.client_update(tiny_client(model, 12, 3), payload, first.init_client_state(anchor))
    assert torch.allclose(msg["params"], fedavg["params"], atol=1e-6)


def test_moon_refuses_a_model_without_a_hidden_layer():
    raw = config_dict(algorithm={"_replace": True, "name": "moon"}, model={"_replace": True, "name": "mlr"})
    with pytest.raises(Exception, match="moon.*mlr|mlr.*hidden layer"):
        validate(raw)


# ---------------------------------------------------------------- FedEM


def test_fedem_one_round_by_hand():
    """M = 2 components, π_i = (0.3, 0.7): responsibilities from the received components, π_i ← their mean, each
    component one full-batch step on its responsibility-weighted loss; M·P floats each way; the server averages each
    component; the client is scored with Σ_m π_m p_m(y | x)."""
    model = tiny_model()
    beta, m_count, p = 0.4, 2, model.numel
    algo = FedEM(FedEMParams(local_lr=beta, components=m_count, local_steps=1, batch_size=None), model)
    w0 = model.initial_vector(0)
    server_state = algo.init_server_state(w0, 3)
    comps = server_state["components"]
    assert comps.shape == (2, p) and torch.equal(comps[0], w0) and not torch.allclose(comps[1], w0)
    assert torch.equal(algo.init_server_state(w0, 3)["components"], comps)  # deterministic
    payload = algo.server_payload(w0, server_state)
    assert floats(payload) == m_count * p
    assert torch.equal(algo.init_client_state(w0)["weights"], torch.tensor([0.5, 0.5]))
    pi = torch.tensor([0.3, 0.7])
    ctx = tiny_client(model, 10, 5)
    x, y = ctx.train_data()
    msg, state, stats = algo.client_update(ctx, payload, {"weights": pi})

    logp = torch.stack([F.log_softmax(model(w, x), dim=1)[torch.arange(10), y] for w in comps])  # log p_m(y_j | x_j)
    joint = pi[:, None] * logp.exp()
    q = joint / joint.sum(0)
    assert torch.allclose(q.sum(0), torch.ones(10))
    assert torch.allclose(state["weights"], q.mean(1))  # stays on the client
    assert stats["local_train_loss"] == pytest.approx(float(-joint.sum(0).log().mean()), rel=1e-5)
    for m in range(m_count):
        w = comps[m].clone().requires_grad_(True)
        (g,) = torch.autograd.grad((q[m] * F.cross_entropy(model(w, x), y, reduction="none")).sum() / 10, w)
        assert torch.allclose(msg["components"][m], comps[m] - beta * g, atol=1e-6)
    assert floats(msg) == m_count * p

    other = torch.randn(2, p)
    new, server_state = algo.server_update(w0, [ClientMessage(0, 10, msg), ClientMessage(1, 30, {"components": other})], server_state, 3)
    assert torch.allclose(server_state["components"], 0.25 * msg["components"] + 0.75 * other)
    assert torch.equal(new, server_state["components"][0]) and algo.global_model(new, server_state) is None

    predict = algo.predictor(ctx, algo.personalize(ctx, algo.server_payload(new, server_state), state))
    mixture = sum(state["weights"][m] * F.softmax(model(server_state["components"][m], x), dim=1) for m in range(2))
    assert torch.allclose(predict(x).exp(), mixture, atol=1e-6)


def test_fedem_minibatches_weigh_each_sample_by_its_responsibility():
    """With batches, component m's step uses the batch's rows of q (drawn with the client's generator) and divides
    the weighted sum by the batch size (the authors' learner.fit_batch)."""
    model = tiny_model()
    algo = FedEM(FedEMParams(local_lr=0.2, components=2, local_steps=1, batch_size=4), model)
    comps = algo.init_server_state(model.initial_vector(0), 2)["components"]
    pi = torch.tensor([0.6, 0.4])
    msg, _, _ = algo.client_update(tiny_client(model, 10, 7), {"components": comps}, {"weights": pi})
    ctx = tiny_client(model, 10, 7)
    x, y = ctx.train_data()
    logp = torch.stack([-F.cross_entropy(model(w, x), y, reduction="none") for w in comps])
    q = torch.softmax(pi.log()[:, None] + logp, dim=0)
    for m in range(2):
        idx = torch.randperm(10, generator=ctx.generator)[:4]  # component 0's batch, then component 1's
        w = comps[m].clone().requires_grad_(True)
        (g,) = torch.autograd.grad((q[m, idx] * F.cross_entropy(model(w, x[idx]), y[idx], reduction="none")).sum() / 4, w)
        assert torch.allclose(msg["components"][m], comps[m] - 0.2 * g, atol=1e-6)


def test_fedem_with_one_component_is_fedavg():
    model = tiny_model()
    w0 = model.initial_vector(0)
    algo = FedEM(FedEMParams(local_lr=0.3, local_steps=3, batch_size=4, **FedEM.fedavg_reduction), model)
    state = algo.init_server_state(w0, 2)
    msg, client_state, _ = algo.client_update(tiny_client(model, 10, 2), algo.server_payload(w0, state), algo.init_client_state(w0))
    ref, _, _ = FedAvg(FedAvgParams(local_lr=0.3, local_steps=3, batch_size=4)).client_update(tiny_client(model, 10, 2), {"params": w0}, {})
    assert torch.allclose(msg["components"][0], ref["params"], atol=1e-6) and torch.equal(client_state["weights"], torch.ones(1))
    new, state = algo.server_update(w0, [ClientMessage(0, 10, msg)], state, 2)
    assert torch.equal(algo.global_model(new, state), msg["components"][0])


def test_fedem_held_out_client_fits_its_mixture_weights_by_em():
    """A held-out client (never trained) is scored with the π that maximizes its training data's likelihood under the
    components received: where π_m > 0, Σ_j p_mj / Σ_k π_k p_kj = n (the likelihood's stationarity on the simplex),
    and no π of a fine grid does better; a trained client keeps its own π."""
    from fedsweep.algorithms.fedem import mixture_weights, sample_losses

    model = tiny_model()
    algo = FedEM(FedEMParams(local_lr=0.2, components=2), model)
    comps = algo.init_server_state(model.initial_vector(0), 2)["components"]
    ctx = tiny_client(model, 40, 3)
    x, y = ctx.train_data()
    losses = sample_losses(ctx, comps, x, y).double()
    pi = mixture_weights(losses, tol=1e-14, iterations=1_000_000)
    lik = (-losses).exp()
    assert float(pi.sum()) == pytest.approx(1.0) and 0.01 < float(pi[0]) < 0.99  # interior here: the check below applies
    assert torch.allclose((lik / (pi @ lik)).sum(1), torch.full((2,), 40.0, dtype=torch.float64), rtol=1e-6)
    grid = torch.linspace(0, 1, 2001, dtype=torch.float64)
    loglik = torch.stack([grid, 1 - grid], dim=1).matmul(lik).clamp_min(1e-300).log().sum(1)
    assert float((torch.stack([pi[0], pi[1]]) @ lik).log().sum()) >= float(loglik.max()) - 1e-9

    own = {"weights": torch.tensor([0.9, 0.1])}
    payload = algo.server_payload(comps[0], {"components": comps})
    assert torch.equal(algo.personalize(ctx, payload, own)[:2], own["weights"])
    held_out = ClientContext(ctx.model, ctx.data, ctx.generator, held_out=True)
    fitted = algo.personalize(held_out, payload, algo.init_client_state(comps[0]))[:2]
    assert torch.allclose(fitted.double(), pi, atol=1e-6)


def test_the_last_clients_are_held_out_in_their_contexts():
    """``unseen_fraction``'s clients (the last ids) get ``held_out`` in their contexts, the others not."""
    from fedsweep.data import built_or_build
    from fedsweep.federation import Client, Setup

    cfg = validate({**config_dict(data={"num_clients": 4}), "unseen_fraction": 0.25})
    ds = built_or_build(cfg.run_data())
    setup = Setup.of(cfg, ds.num_features, ds.num_classes)
    assert [Client(i, d, setup).context(1).held_out for i, d in enumerate(ds.clients)] == [False, False, False, True]


# ---------------------------------------------------------------- FedAvg-FT


def test_fedavgft_scores_the_fine_tuned_model_and_trains_as_fedavg():
    model = tiny_model()
    w = model.initial_vector(0)
    algo = FedAvgFT(FedAvgFTParams(local_lr=0.1, local_steps=2, batch_size=4), model)
    assert (algo.hp.personalization_lr, algo.hp.personalization_steps) == (0.01, 5)  # pFL-Bench's finetune defaults
    ctx = tiny_client(model, 10, 4)
    personal = algo.personalize(ctx, {"params": w}, {})
    x, y = ctx.train_data()
    gen, v = torch.Generator().manual_seed(104), w.clone()  # the evaluation context's generator: 5 minibatches of 4
    for _ in range(5):
        idx = torch.randperm(10, generator=gen)[:4]
        v = v - 0.01 * grad(lambda u, b: F.cross_entropy(model(u, b[0]), b[1]), v, (x[idx], y[idx]))[0]
    assert torch.allclose(personal, v, atol=1e-7) and not torch.allclose(personal, w)
    fedavg = FedAvg(FedAvgParams(local_lr=0.1, local_steps=2, batch_size=4), model)
    a, _, _ = algo.client_update(tiny_client(model, 10, 4), {"params": w}, {})
    b, _, _ = fedavg.client_update(tiny_client(model, 10, 4), {"params": w}, {})
    assert torch.equal(a["params"], b["params"]) and floats(a) == model.numel


def test_fedavgft_global_model_is_fedavgs_and_its_personalized_scores_differ():
    raw = config_dict(rounds=2)
    (h1, s1) = run_local(validate(raw))
    (h2, s2) = run_local(validate({**raw, "algorithm": {**raw["algorithm"], "name": "fedavgft", "personalization_lr": 0.05}}))
    assert torch.equal(s1.params, s2.params)
    assert h1[-1]["global_accuracy"] == h2[-1]["global_accuracy"] and h1[-1]["transmissions"] == h2[-1]["transmissions"]
    assert h1[-1]["personalized_loss_mean"] != h2[-1]["personalized_loss_mean"]
