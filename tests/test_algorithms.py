"""Each algorithm checked against its paper's equations (in process, no Ray)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from fedsweep.algorithms import ALGORITHMS
from fedsweep.algorithms.base import ClientContext, ClientData, ClientMessage
from fedsweep.algorithms.feddyn import FedDyn, FedDynParams
from fedsweep.algorithms.perfedavg import meta_step
from fedsweep.algorithms.pfedme import PFedMe, PFedMeParams, prox_solve
from fedsweep.algorithms.pfldyn import PFLDyn, PFLDynParams
from fedsweep.algorithms.transforms import predictor, proto_scores, transformed_gradient
from fedsweep.config import ConfigError
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.models import FlatModel, MLPConfig, MLRConfig, build_model
from tests.conftest import config_dict, stacked

torch.set_default_dtype(torch.float32)


def quadratic(w, batch):
    """f(w; (A, b)) = ½ wᵀAw − bᵀw: ∇f = Aw − b, ∇²f = A."""
    a, b = batch
    return 0.5 * w @ a @ w - b @ w


def spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m @ m.T / n + torch.eye(n, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)


def cfg_for(algorithm: dict, **sections):
    return validate(config_dict(algorithm={"_replace": True, **algorithm}, **sections))


def final_params(algorithm: dict, **sections):
    _, server = run_local(cfg_for(algorithm, **sections))
    return server.params


# ------------------------------------------------------------------ Per-FedAvg


def test_perfedavg_exact_matches_hand_computed_maml_on_a_quadratic():
    (a1, b1), (a2, b2), (a3, b3) = spd(5, 1), spd(5, 2), spd(5, 3)
    w = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    alpha, beta = 0.1, 0.05
    w_tilde = w - alpha * (a1 @ w - b1)
    g = a2 @ w_tilde - b2
    expected = w - beta * (torch.eye(5, dtype=torch.float64) - alpha * a3) @ g
    got, _ = meta_step(quadratic, w, ((a1, b1), (a2, b2), (a3, b3)), alpha, beta, "exact", 1e-3)
    assert (got - expected).abs().max() < 1e-6
    fo, _ = meta_step(quadratic, w, ((a1, b1), (a2, b2), (a3, b3)), alpha, beta, "fo", 1e-3)
    assert (fo - (w - beta * g)).abs().max() < 1e-12


class QuadraticClient:
    """What transformed_gradient asks of a client: its loss, and batches (the support, then the query set)."""

    def __init__(self, *batches):
        self.loss, self.batches = quadratic, list(batches)

    def batch(self, batch_size):
        return self.batches.pop(0)


def test_second_order_maml_differentiates_through_the_inner_step_on_a_quadratic():
    """PFL's MAML transform (issue 37): maml_order 2 is ∇_w f(w − η∇f(w; D); D′) = (I − ηA_D)(A_D′ w̄ − b_D′);
    order 1 drops the (I − ηA_D), as the paper's Algorithm 1 writes it."""
    (a1, b1), (a2, b2) = spd(5, 1), spd(5, 2)
    w = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    eta = 0.1
    g_query = a2 @ (w - eta * (a1 @ w - b1)) - b2
    second, _ = transformed_gradient(QuadraticClient((a1, b1), (a2, b2)), "maml", w, eta, None, maml_order=2)
    assert (second - (torch.eye(5, dtype=torch.float64) - eta * a1) @ g_query).abs().max() < 1e-10
    first, _ = transformed_gradient(QuadraticClient((a1, b1), (a2, b2)), "maml", w, eta, None, maml_order=1)
    assert (first - g_query).abs().max() < 1e-12
    v = w.clone().requires_grad_(True)  # the same as autograd through the step
    (through,) = torch.autograd.grad(quadratic(v - eta * (a1 @ v - b1), (a2, b2)), v)
    assert (second - through).abs().max() < 1e-10


def test_several_maml_steps_match_the_closed_form_on_a_quadratic():
    """maml_steps k: k inner steps on the support batch, w_{j+1} = w_j − η(A_D w_j − b_D); order 1 takes the query
    gradient at w_k, order 2 multiplies it by (I − ηA_D)^k (the chain rule through the k steps); both equal autograd."""
    (a1, b1), (a2, b2) = spd(5, 1), spd(5, 2)
    w = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    eta, k = 0.1, 3
    w_k = w
    for _ in range(k):
        w_k = w_k - eta * (a1 @ w_k - b1)
    g_query = a2 @ w_k - b2
    first, _ = transformed_gradient(QuadraticClient((a1, b1), (a2, b2)), "maml", w, eta, None, maml_order=1, maml_steps=k)
    assert (first - g_query).abs().max() < 1e-12
    second, _ = transformed_gradient(QuadraticClient((a1, b1), (a2, b2)), "maml", w, eta, None, maml_order=2, maml_steps=k)
    shrink = torch.linalg.matrix_power(torch.eye(5, dtype=torch.float64) - eta * a1, k)
    assert (second - shrink @ g_query).abs().max() < 1e-10
    v = w.clone().requires_grad_(True)
    inner = v
    for _ in range(k):
        inner = inner - eta * (a1 @ inner - b1)
    (through,) = torch.autograd.grad(quadratic(inner, (a2, b2)), v)
    assert (second - through).abs().max() < 1e-10


def test_several_maml_steps_personalize_with_as_many_full_batch_steps():
    from fedsweep.algorithms.transforms import personalized

    class Client:
        loss = staticmethod(quadratic)

        def __init__(self, data):
            self.data = data

        def train_data(self):
            return self.data

    a, b = spd(5, 1)
    w = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expected = w
    for _ in range(4):
        expected = expected - 0.05 * (a @ expected - b)
    assert (personalized(Client((a, b)), "maml", w, 0.05, steps=4) - expected).abs().max() < 1e-12
    assert torch.equal(personalized(Client((a, b)), "proto", w, 0.05, steps=4), w)


def test_maml_steps_is_refused_without_the_maml_transform_and_stays_out_of_the_key_at_one():
    with pytest.raises(ConfigError, match=r"algorithm.maml_steps: 5 steps of the MAML transform, but transform is 'proto'"):
        cfg_for({"name": "pfldyn", "transform": "proto", "maml_steps": 5})
    one, default, five = (cfg_for({"name": "pfldyn", "transform": "maml", **extra}) for extra in ({"maml_steps": 1}, {}, {"maml_steps": 5}))
    assert one.setting_key() == default.setting_key() != five.setting_key()  # runs made before the field keep their keys
    assert five.algorithm.maml_steps == 5 and "algorithm.maml_steps" in five.flat_params()


def test_local_sgd_clips_then_decays_as_torch_does():
    """clip_norm and weight_decay: one step equals clip_grad_norm_ then torch.optim.SGD(weight_decay) on the same
    gradient; a stacked gradient is clipped row by row (each client's own norm)."""
    from fedsweep.algorithms.base import sgd

    a, b = spd(5, 1)
    w0 = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 50  # a long gradient
    g = a @ w0 - b
    gradient = lambda v: (a @ v - b, 0.0)
    got, _ = sgd(None, w0, 0.1, 1, None, gradient=gradient, weight_decay=1e-3, clip_norm=1.0)
    p = torch.nn.Parameter(w0.clone())
    p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    torch.optim.SGD([p], lr=0.1, weight_decay=1e-3).step()
    assert (got - p.detach()).abs().max() < 1e-12
    rows = torch.stack([w0, w0 / 1000])
    short = a @ rows[1] - b
    clip = 2 * float(short.norm())  # row 0's gradient is longer: scaled down; row 1's is shorter: left as it is
    assert g.norm() > clip
    stacked, _ = sgd(None, rows, 0.1, 1, None, gradient=lambda v: (v @ a - b, 0.0), clip_norm=clip)
    assert (stacked[0] - (w0 - 0.1 * g * (clip / (g.norm() + 1e-6)))).abs().max() < 1e-12
    assert (stacked[1] - (rows[1] - 0.1 * short)).abs().max() < 1e-12


def test_the_local_sgd_options_stay_out_of_the_key_at_their_defaults():
    plain = cfg_for({"name": "pfldyn", "transform": "maml"})
    same = cfg_for({"name": "pfldyn", "transform": "maml", "weight_decay": 0.0, "clip_norm": None})
    authors = cfg_for({"name": "pfldyn", "transform": "maml", "weight_decay": 1e-3, "clip_norm": 10})
    assert plain.setting_key() == same.setting_key() != authors.setting_key()
    assert cfg_for({"name": "pavg", "weight_decay": 1e-3, "clip_norm": 10}).algorithm.clip_norm == 10
    with pytest.raises(ConfigError, match=r"algorithm.clip_norm"):
        cfg_for({"name": "pflscaf", "clip_norm": 0})
    with pytest.raises(ConfigError, match=r"weight_decay"):
        cfg_for({"name": "fedavg", "weight_decay": 1e-3})  # only where the step has the option


def test_second_order_maml_is_refused_without_the_maml_transform():
    with pytest.raises(ConfigError, match=r"algorithm.maml_order: 2 differentiates through the MAML step, but transform is 'proto'"):
        cfg_for({"name": "pfldyn", "transform": "proto", "maml_order": 2})
    assert cfg_for({"name": "pflscaf", "transform": "maml", "maml_order": 2}).algorithm.maml_order == 2


def test_perfedavg_outer_step_from_the_adapted_point_is_pfedmes_code_before_its_fix():
    """pFedMe's published Per-FedAvg (FO), before CharlieDinh/pFedMe 71ae947: w ← w̃ − β∇f(w̃; D′), not w − β∇f(w̃; D′)."""
    (a1, b1), (a2, b2) = spd(5, 1), spd(5, 2)
    w = torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    alpha, beta = 0.1, 0.05
    w_tilde = w - alpha * (a1 @ w - b1)
    got, _ = meta_step(quadratic, w, ((a1, b1), (a2, b2), None), alpha, beta, "fo", 1e-3, from_adapted=True)
    assert (got - (w_tilde - beta * (a2 @ w_tilde - b2))).abs().max() < 1e-12
    with pytest.raises(ConfigError, match=r"algorithm.outer_step_from: 'adapted' is pFedMe's code's first-order step, but variant is 'hf'"):
        cfg_for({"name": "perfedavg", "variant": "hf", "outer_step_from": "adapted"})
    assert cfg_for({"name": "perfedavg", "variant": "fo", "outer_step_from": "adapted"}).algorithm.outer_step_from == "adapted"


def test_perfedavg_hf_approaches_exact_as_delta_shrinks():
    torch.manual_seed(0)
    model = FlatModel(build_model(MLPConfig(hidden=[8], activation="elu"), 6, 3).double())
    w = model.initial_vector(0).double()

    def ce(v, batch):
        return torch.nn.functional.cross_entropy(model(v, batch[0]), batch[1])

    batches = [(torch.randn(20, 6, dtype=torch.float64), torch.randint(0, 3, (20,))) for _ in range(3)]
    exact, _ = meta_step(ce, w, batches, 0.5, 0.1, "exact", 0.0)
    errors = [float((meta_step(ce, w, batches, 0.5, 0.1, "hf", d)[0] - exact).norm()) for d in (1e-1, 1e-2, 1e-3)]
    assert errors[0] > errors[1] > errors[2]
    assert errors[2] < 1e-6 * float(exact.norm()) + 1e-8


@pytest.mark.parametrize("variant", ["fo", "hf", "exact"])
def test_perfedavg_with_alpha_zero_is_fedavg(variant):
    common = {"local_lr": 0.1, "local_steps": 3, "batch_size": None, "participation_rate": 1.0}
    fedavg = final_params({"name": "fedavg", **common}, rounds=2)
    per = final_params({"name": "perfedavg", "variant": variant, "personalization_lr": 0.0, **common}, rounds=2)
    assert torch.allclose(per, fedavg, atol=1e-7, rtol=0)


# ------------------------------------------------------------------ pFedMe


def test_pfedme_inner_solver_reaches_the_proximal_point():
    a, b = spd(4, 5)
    w = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    lam = 3.0
    closed_form = torch.linalg.solve(a + lam * torch.eye(4, dtype=torch.float64), b + lam * w)
    theta = prox_solve(quadratic, w.clone(), w, (a, b), lr=0.05, steps=2000, lam=lam)
    assert (theta - closed_form).abs().max() < 1e-6


def test_pfedme_server_step_with_beta_one_is_the_plain_average():
    algo = PFedMe(PFedMeParams(server_mixing=1.0, aggregation="uniform"))
    w = torch.zeros(3)
    models = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 0.0, -1.0]), torch.tensor([2.0, 1.0, 4.0])]
    msgs = [ClientMessage(i, 10 * (i + 1), {"params": m}) for i, m in enumerate(models)]
    new, _ = algo.server_update(w, msgs, {}, 3)
    assert torch.allclose(new, sum(models) / 3)
    mixed, _ = PFedMe(PFedMeParams(server_mixing=2.0, aggregation="uniform")).server_update(w, msgs, {}, 3)
    assert torch.allclose(mixed, (1 - 2.0) * w + 2.0 * sum(models) / 3)


def test_pfedme_trains_every_client_and_aggregates_the_sampled():
    cfg = cfg_for(
        {"name": "pfedme", "participation_rate": 0.5, "local_steps": 2, "inner_steps": 2, "coupling": 15, "server_mixing": 1.0},
        data={"num_clients": 4, "partition": {"name": "iid"}},
        rounds=2,
    )
    hist, _ = run_local(cfg)
    assert hist[-1]["downloads"] == 2 * 4  # broadcast to all 4 clients each round
    assert hist[-1]["uploads"] == 2 * 2  # S = 2 aggregated
    assert hist[1]["clients_sampled"] == 2


# ------------------------------------------------------------------ SCAFFOLD / PFLScaf


COMMON = {"local_lr": 0.1, "local_steps": 4, "batch_size": 8, "participation_rate": 1.0}


def test_scaffold_first_round_with_zero_control_variates_is_fedavg():
    fedavg = final_params({"name": "fedavg", **COMMON}, rounds=1)
    scaffold = final_params({"name": "scaffold", **COMMON}, rounds=1)
    assert torch.allclose(scaffold, fedavg, atol=1e-6, rtol=0)
    later_f = final_params({"name": "fedavg", **COMMON}, rounds=3)
    later_s = final_params({"name": "scaffold", **COMMON}, rounds=3)
    assert (later_f - later_s).abs().max() > 1e-4  # the control variates act from round 2 on


def test_pflscaf_first_round_with_zero_control_variates_is_fedavg():
    full = {**COMMON, "batch_size": None}
    fedavg = final_params({"name": "fedavg", **full}, rounds=1)
    maml = final_params({"name": "pflscaf", "transform": "maml", "personalization_lr": 0.0, **full}, rounds=1)
    assert torch.allclose(maml, fedavg, atol=1e-6, rtol=0)
    pavg = final_params({"name": "pavg", **COMMON}, rounds=1)
    proto = final_params({"name": "pflscaf", "transform": "proto", **COMMON}, rounds=1)
    assert torch.allclose(proto, pavg, atol=1e-6, rtol=0)
    # P-Avg through the MAML transform (the PFL authors' Per-FedAvg: several inner steps, through them, clipped, with
    # weight decay) is PFLScaf's MAML step without control variates
    maml = {"transform": "maml", "personalization_lr": 0.05, "maml_steps": 3, "maml_order": 2, "clip_norm": 0.5,
            "weight_decay": 1e-3, **COMMON}
    pavg = final_params({"name": "pavg", **maml}, rounds=1)
    scaf = final_params({"name": "pflscaf", **maml}, rounds=1)
    assert torch.allclose(scaf, pavg, atol=1e-6, rtol=0)
    assert not torch.allclose(pavg, final_params({"name": "pavg", **COMMON}, rounds=1), atol=1e-3)


def test_scaffold_control_variate_rule():
    """c_i⁺ = c_i − c + (x − y)/(Kβ); server c ← c + (1/N) Σ Δc_i; x ← x + η_g Σ p_i Δy_i."""
    from fedsweep.algorithms.scaffold import Scaffold, ScaffoldParams

    algo = Scaffold(ScaffoldParams(local_lr=0.1, local_steps=2, aggregation="uniform", global_lr=0.5))
    x = torch.tensor([1.0, -1.0])
    msgs = [
        ClientMessage(0, 5, {"delta_params": torch.tensor([0.2, 0.0]), "delta_control": torch.tensor([1.0, 2.0])}),
        ClientMessage(1, 5, {"delta_params": torch.tensor([0.0, 0.4]), "delta_control": torch.tensor([3.0, -2.0])}),
    ]
    new_x, state = algo.server_update(x, msgs, {"control": torch.tensor([0.5, 0.5])}, num_clients=4)
    assert torch.allclose(new_x, x + 0.5 * torch.tensor([0.1, 0.2]))
    assert torch.allclose(state["control"], torch.tensor([0.5, 0.5]) + torch.tensor([4.0, 0.0]) / 4)


def test_pflscaf_costs_two_transmissions_per_client():
    hist, _ = run_local(cfg_for({"name": "pflscaf", **COMMON}, rounds=2))
    assert hist[-1]["transmissions"] == 2 * 2 * 3 * 2  # 2 rounds × 3 clients × (down + up) × 2 vectors


# ------------------------------------------------------------------ FedDyn / PFLDyn


@pytest.mark.parametrize("cls,params", [(FedDyn, FedDynParams), (PFLDyn, PFLDynParams)])
def test_dynamic_regularizer_server_recursion_two_clients(cls, params):
    algo = cls(params(regularization=0.5))
    w_t = torch.tensor([1.0, 2.0])
    msgs = [ClientMessage(0, 1, {"params": torch.tensor([2.0, 2.0])}), ClientMessage(1, 1, {"params": torch.tensor([0.0, 4.0])})]
    new_w, state = algo.server_update(w_t, msgs, {"h": torch.tensor([0.1, -0.2])}, num_clients=4)
    # h = h − (λ/m) Σ (w_i − w_t) = [0.1, −0.2] − 0.125·[0, 2];  w = mean w_i − h/λ = [1, 3] − [0.2, −0.9]
    assert torch.allclose(state["h"], torch.tensor([0.1, -0.45]))
    assert torch.allclose(new_w, torch.tensor([0.8, 3.9]))


def test_feddyn_client_gradient_state_recursion():
    cfg = cfg_for({"name": "feddyn", "regularization": 0.3, **COMMON}, rounds=1)
    from fedsweep.data import build_federated_dataset
    from fedsweep.federation import Client, Setup, to_numpy

    ds = build_federated_dataset(cfg.data)
    client = Client(0, ds.clients[0], Setup.of(cfg, ds.num_features, ds.num_classes))
    w_t = torch.randn(client.model.numel) * 0.1
    g_before = torch.randn(client.model.numel) * 0.01
    client.state = {"grad_state": g_before.clone()}
    msg = client.train(to_numpy({"params": w_t}), 1)
    w_new = torch.from_numpy(msg.payload["params"])
    assert torch.allclose(client.state["grad_state"], g_before - 0.3 * (w_new - w_t), atol=1e-6)


# ------------------------------------------------------------------ FedProx, Ditto


def test_fedprox_with_mu_zero_is_fedavg():
    fedavg = final_params({"name": "fedavg", **COMMON}, rounds=3)
    prox0 = final_params({"name": "fedprox", "mu": 0.0, **COMMON}, rounds=3)
    assert torch.equal(prox0, fedavg)
    prox = final_params({"name": "fedprox", "mu": 1.0, **COMMON}, rounds=3)
    assert (prox - fedavg).abs().max() > 1e-4


def run_clients(cfg, rounds: int):
    """The round loop in process, keeping the clients (and their states) at hand."""
    from fedsweep.data import build_federated_dataset
    from fedsweep.federation import Client, Server, Setup
    from fedsweep.pool import ClientPool

    ds = build_federated_dataset(cfg.data)
    server = Server.of(cfg, ds.num_features, ds.num_classes)
    w0 = server.params.clone()
    clients = [Client(i, d, Setup.of(cfg, ds.num_features, ds.num_classes)) for i, d in enumerate(ds.clients)]
    for rnd in range(1, rounds + 1):
        server.train_round(ClientPool.of_clients(clients), rnd)
    return server, clients, w0


def test_ditto_with_lambda_zero_personal_models_are_local_training():
    from fedsweep.algorithms.base import sgd

    ditto = {"name": "ditto", "personalization_lr": 0.2, **COMMON, "batch_size": None}
    _, clients, w0 = run_clients(cfg_for({**ditto, "coupling": 0.0}), 3)
    for c in clients:
        ctx = ClientContext(c.model, c.data, torch.Generator().manual_seed(0))
        local, _ = sgd(ctx, w0, 0.2, 3 * 4, None)  # 3 rounds × τ = 4 full-batch steps, from the first w^t
        assert torch.allclose(c.state["personal"], local, atol=1e-5)
    # λ > 0 pulls each personal model towards the global model
    server, pulled, _ = run_clients(cfg_for({**ditto, "coupling": 5.0}), 3)
    for free, tied in zip(clients, pulled):
        assert (tied.state["personal"] - server.params).norm() < (free.state["personal"] - server.params).norm()


# ------------------------------------------------------------------ Proto, registry


def test_proto_scores_pick_the_nearest_class_centroid():
    model = FlatModel(build_model(MLRConfig(), 2, 3))  # representation = the input itself
    support = (torch.tensor([[0.0, 0.0], [0.0, 2.0], [10.0, 0.0], [12.0, 0.0]]), torch.tensor([0, 0, 2, 2]))
    ctx = ClientContext(model, ClientData(*support, *support), torch.Generator())
    w = model.initial_vector(0)
    x = torch.tensor([[1.0, 1.0], [9.0, 1.0]])
    scores = proto_scores(ctx, w, support, x)
    assert scores.argmax(1).tolist() == [0, 2]
    assert torch.isinf(scores[:, 1]).all()  # class 1 has no support samples
    assert torch.allclose(scores[0, 0], torch.tensor(-(1.0**2 + 0.0**2)))  # centroid (0, 1)


def test_the_proto_predictor_computes_the_training_centroids_once_with_the_same_scores():
    model = FlatModel(build_model(MLPConfig(hidden=[5]), 4, 3))
    g = torch.Generator().manual_seed(0)
    train = (torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g))
    ctx = ClientContext(model, ClientData(*train, *train), torch.Generator())
    w = model.initial_vector(0)
    parts = [torch.randn(7, 4, generator=g), torch.randn(5, 4, generator=g)]  # an evaluation's test and validation parts
    seen = []
    features = model.features
    model.features = lambda v, x: seen.append(x.shape[0]) or features(v, x)
    predict = predictor(ctx, "proto", w)
    scores = [predict(x) for x in parts]
    assert seen == [30, 7, 5]  # the training set's features once, then each part's
    for x, got in zip(parts, scores):
        assert torch.equal(got, proto_scores(ctx, w, train, x))  # what it scored before, bit for bit


def test_every_algorithm_declares_its_hyperparameters():
    for name, cls in ALGORITHMS.items():
        fields = cls.Params.model_fields
        assert fields["name"].default == name
        assert "local_steps" in fields and "participation_rate" in fields
    with pytest.raises(Exception, match="unknown key 'mu'"):
        cfg_for({"name": "fedavg", "mu": 0.1})
    with pytest.raises(Exception, match="unknown key 'lambda'"):
        cfg_for({"name": "pavg", "lambda": 0.1})
    with pytest.raises(Exception, match="unknown key 'aggregation'"):
        cfg_for({"name": "feddyn", "aggregation": "uniform"})  # the paper's server takes the plain mean
    with pytest.raises(Exception, match="unknown key 'lambda'"):
        cfg_for({"name": "scaffold", "lambda": 0.1})


# ------------------------------------------------------------------ all of them on Synthetic(0.5, 0.5)

SYNTHETIC = {
    "data": {"dataset": "synthetic", "num_clients": 20, "alpha": 0.5, "beta": 0.5, "max_samples_per_client": 300, "seed": 0},
    "model": {"name": "mlp", "hidden": [20]},
    "rounds": 30,
    "eval_every": 30,
    "seed": 0,
}
SHARED = {"participation_rate": 0.5, "local_steps": 10, "batch_size": 20, "local_lr": 0.05}
SETTINGS = {
    "fedavg": {"name": "fedavg"},
    "perfedavg": {"name": "perfedavg", "variant": "hf", "personalization_lr": 0.05},
    "pfedme": {"name": "pfedme", "personalization_lr": 0.05, "coupling": 15, "server_mixing": 1.0, "inner_steps": 5},
    "pfldyn": {"name": "pfldyn", "regularization": 0.01, "transform": "maml", "personalization_lr": 0.05},
    "pfldyn_proto": {"name": "pfldyn", "regularization": 0.01, "transform": "proto"},
    "pflscaf": {"name": "pflscaf", "transform": "maml", "personalization_lr": 0.05},
    "pflscaf_proto": {"name": "pflscaf", "transform": "proto"},
    "pavg": {"name": "pavg"},
    "fedprox": {"name": "fedprox", "mu": 0.01},
    "scaffold": {"name": "scaffold"},
    "feddyn": {"name": "feddyn", "regularization": 0.01},
    "ditto": {"name": "ditto", "personalization_lr": 0.05, "coupling": 0.1},
    "feddeper": {"name": "feddeper", "personalization_lr": 0.05},
}
# every registered algorithm takes part; one without a setting above runs with its defaults
SETTINGS.update({name: {"name": name} for name in ALGORITHMS if name not in {s["name"] for s in SETTINGS.values()}})


@pytest.fixture(scope="module")
def synthetic_results():
    """(round-0, final) personalized accuracy per setting; the runs are independent, so they share the
    machine's cores (fresh spawned processes, one thread each, as in the actors). A round's clients train stacked
    where the algorithm declares it can (the layout fedsweep chooses for such a file)."""
    def stacked_where_declared(cfg):
        return stacked(cfg) if ALGORITHMS[cfg.algorithm.name](cfg.algorithm).can_vectorize() else cfg

    cfgs = {key: stacked_where_declared(validate({**SYNTHETIC, "algorithm": {**SHARED, **algorithm}}))
            for key, algorithm in SETTINGS.items()}
    workers = min(len(cfgs), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
        runs = dict(zip(cfgs, ex.map(run_local, cfgs.values())))
    return {key: (hist[0]["personalized_accuracy_mean"], hist[-1]["personalized_accuracy_mean"]) for key, (hist, _) in runs.items()}


@pytest.mark.slow
def test_every_algorithm_improves_on_its_round_zero_accuracy(synthetic_results):
    # Proto starts high (nearest centroid on random features is already ~0.77 here), so no margin is imposed.
    for key, (start, end) in synthetic_results.items():
        assert end > start, (key, start, end)


@pytest.mark.slow
@pytest.mark.parametrize("key", ["perfedavg", "pfedme", "pfldyn", "ditto"])
def test_personalized_algorithms_beat_fedavgs_global_model(synthetic_results, key):
    # FedAvg with α = 0 scores its global model: its "personalized" mean is the global model's mean over clients.
    fedavg_global = synthetic_results["fedavg"][1]
    assert synthetic_results[key][1] > fedavg_global + 0.02, (key, synthetic_results[key][1], fedavg_global)
