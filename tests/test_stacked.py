"""Vectorized local training (resources.vectorize_clients): the stacked computation gives each client
its own loss, gradient and update, the same samples as one by one, and every algorithm that allows it
reaches the same model as the one-by-one path (in process, no Ray)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from fedsweep.algorithms import plain_grad
from fedsweep.algorithms.base import ClientContext, ClientData, grad
from fedsweep.algorithms.stacked import PAD, StackedContext, pad_stack
from fedsweep.config import ConfigError
from fedsweep.engine import run_local
from fedsweep.loading import validate
from fedsweep.models import CNNConfig, FlatModel, MLPConfig, MLRConfig, build_model
from tests.conftest import ROOT, config_dict


def contexts(sizes, seed=0):
    """One context per client, with ``sizes[c]`` training samples each and a shared MLP."""
    model = FlatModel(build_model(MLPConfig(hidden=[7]), 5, 3))
    g = torch.Generator().manual_seed(seed)
    out = []
    for c, n in enumerate(sizes):
        x, y = torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)
        out.append(ClientContext(model, ClientData(x, y, x, y), torch.Generator().manual_seed(100 + c)))
    return model, out


def test_pad_stack_keeps_each_batch_and_marks_padding():
    xs, ys = pad_stack([(torch.ones(2, 3), torch.tensor([1, 2])), (torch.full((4, 3), 2.0), torch.tensor([0, 1, 2, 0]))])
    assert xs.shape == (2, 4, 3) and ys.tolist() == [[1, 2, PAD, PAD], [0, 1, 2, 0]]
    assert torch.equal(xs[0, :2], torch.ones(2, 3)) and torch.equal(xs[1], torch.full((4, 3), 2.0))


def test_pad_stack_of_whole_batches_is_their_stack():
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, 2, 0])), (torch.randn(4, 3), torch.tensor([2, 2, 1, 0]))]
    xs, ys = pad_stack(batches)
    assert torch.equal(xs, torch.stack([x for x, _ in batches])) and torch.equal(ys, torch.stack([y for _, y in batches]))


def _values_and_gradient(f, w, x, y):
    """f(w, x)'s outputs and the gradient of their cross-entropy against ``y`` (PAD ignored), at a copy of ``w``."""
    w = w.clone().requires_grad_(True)
    out = f(w, x)
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), ignore_index=PAD)
    (g,) = torch.autograd.grad(loss, w)
    return out.detach(), g


@pytest.mark.parametrize("cfg", [MLPConfig(hidden=[20]), MLPConfig(hidden=[9, 5], activation="elu"),
                                 MLPConfig(hidden=[4], activation="tanh"), MLRConfig()], ids=lambda c: f"{c.name}")
def test_a_plain_model_runs_layer_by_layer_bit_for_bit_as_functional_call_and_vmap(cfg):
    """MLR and MLPs skip functional_call (one vector, and its features) and vmap (rows): the same values and
    gradients to the last bit, for every shape of rows, batch and inputs tried, padding included."""
    model = FlatModel(build_model(cfg, 12, 4))
    assert model._layers is not None
    general = FlatModel(build_model(cfg, 12, 4))
    general._layers = None  # the general path: functional_call, under vmap for rows
    for rows, size in itertools.product((1, 3, 10), (1, 5, 20)):
        g = torch.Generator().manual_seed(rows * 100 + size)
        w = 0.3 * torch.randn(rows, model.numel, generator=g)
        x, y = torch.randn(rows, size, 12, generator=g), torch.randint(0, 4, (rows, size), generator=g)
        y[0, size // 2 + 1:] = PAD
        fast = _values_and_gradient(model.rows, w, x, y)
        slow = _values_and_gradient(torch.func.vmap(general), w, x, y)
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
        one, other = (_values_and_gradient(m, w[0], x[0], y[0]) for m in (model, general))
        assert torch.equal(one[0], other[0]) and torch.equal(one[1], other[1])
        assert torch.equal(model.features(w[0], x[0]), general.features(w[0], x[0]))


def test_models_with_state_or_convolutions_keep_the_general_path():
    assert FlatModel(build_model(MLPConfig(hidden=[4], norm="batch"), 12, 4))._layers is None
    assert FlatModel(build_model(CNNConfig(channels=[2, 2], hidden=[4], kernel_size=3), 256, 4))._layers is None


def test_the_direct_path_applies_a_module_used_twice_and_rows_of_other_shapes_as_the_general_path():
    act = torch.nn.Tanh()  # one instance in two places: named_children lists it once
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), act, torch.nn.Linear(5, 5), act, torch.nn.Linear(5, 3))
    model, general = FlatModel(module), FlatModel(module)
    general._layers = None
    w, x = torch.randn(4, model.numel), torch.randn(4, 6)
    assert torch.equal(model(w[0], x), general(w[0], x))
    assert torch.equal(model.rows(w, x), torch.func.vmap(general)(w, x))  # [C, features]: one sample a row


#: The models and dtypes of the bit-for-bit check below.
PLAIN_MODELS = [MLPConfig(hidden=[20]), MLPConfig(hidden=[9, 5], activation="elu"), MLPConfig(hidden=[4], activation="tanh"),
                MLRConfig()]


def plain_gradients_differ() -> list[str]:
    """The (model, dtype, shape)s where StackedContext.grad (plain_grad: autograd's backward kernels called directly)
    differs from autograd on StackedContext.loss in any client's gradient or loss, for rows, batches and input widths
    from tiny to the peer workloads' (784 inputs, ten clients of 20), with padding rows and a client all padding."""
    differ = []
    for cfg, dtype in itertools.product(PLAIN_MODELS, (torch.float32, torch.float64)):
        for features, rows, size in itertools.product((12, 784), (1, 3, 10), (1, 5, 20)):
            model = FlatModel(build_model(cfg, features, 4).to(dtype))
            ctx = StackedContext([ClientContext(model, None, None)])
            g = torch.Generator().manual_seed(features + rows * 100 + size)
            w = (0.3 * torch.randn(rows, model.numel, generator=g)).to(dtype)
            x = torch.randn(rows, size, features, generator=g).to(dtype)
            y = torch.randint(0, 4, (rows, size), generator=g)
            y[0, size // 2 + 1:] = PAD
            if rows == 3:
                y[1] = PAD
            assert plain_grad.supported(model, x)
            fast, slow = ctx.grad(w, (x, y)), grad(ctx.loss, w, (x, y))
            if not (torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])):
                differ.append(f"{cfg.name} {cfg.model_dump().get('activation', '')} {dtype} {features}x{rows}x{size}")
    return differ


def test_a_plain_models_stacked_gradient_without_autograd_is_autograds_bit_for_bit():
    """plain_grad writes a weight's gradient as gᵀ·inputs where autograd computes (inputsᵀ·g)ᵀ: the same products,
    which MKL sums alike for both operand orders on an Intel CPU and in its COMPATIBLE branch on any x86-64 CPU, not in
    its own branch on an AMD one (2026-12-06, an AMD EPYC: 84 of the 144 cases differ in their last bits). So the check runs
    where it holds on every CPU: in a process with ``MKL_CBWR=COMPATIBLE`` (read when MKL starts), as ``make demo``
    and every benchmark cell that declares kernels run."""
    code = "import json; from tests.test_stacked import plain_gradients_differ as d; print(json.dumps(d()))"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MKL_CBWR": "COMPATIBLE"}, cwd=ROOT,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_stacked_gradient_without_autograd_leaves_other_models_and_shapes_to_autograd():
    act = torch.nn.Tanh()  # one instance in two places: its gradient sums over both, in autograd's engine
    shared = FlatModel(torch.nn.Sequential(torch.nn.Linear(6, 5), act, torch.nn.Linear(5, 5), act, torch.nn.Linear(5, 3)))
    x = torch.randn(2, 4, 6)
    assert not plain_grad.supported(shared, x)
    assert not plain_grad.supported(FlatModel(build_model(MLPConfig(hidden=[4], norm="batch"), 6, 3)), x)
    assert not plain_grad.supported(FlatModel(build_model(MLPConfig(hidden=[4]), 6, 3)), x[0])  # [C, features]
    ctx = StackedContext([ClientContext(shared, None, None)])
    w, y = torch.randn(2, shared.numel), torch.randint(0, 3, (2, 4))
    fast, slow = ctx.grad(w, (x, y)), grad(ctx.loss, w, (x, y))
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])


def test_stacked_loss_and_gradient_are_each_clients_own():
    """Unequal sizes (3 < batch 8 ≤ 11, 30): row c of ∇Σ_c f_c is ∇f_c(w_c; D_c); the same minibatches are drawn."""
    model, ctxs = contexts([3, 11, 30])
    twins = [ClientContext(c.model, c.data, torch.Generator().manual_seed(100 + i)) for i, c in enumerate(ctxs)]
    w = torch.stack([model.initial_vector(s) for s in range(3)])
    stacked = StackedContext(ctxs)
    batch = stacked.batch(8)
    g, values = grad(stacked.loss, w, batch)
    for c, ctx in enumerate(twins):
        own = ctx.batch(8)
        assert torch.equal(batch[1][c, : own[1].shape[0]], own[1])  # the same samples, from the client's generator
        g_c, v_c = grad(ctx.loss, w[c], own)
        assert values[c].item() == pytest.approx(v_c, rel=1e-6)
        assert torch.allclose(g[c], g_c, atol=1e-6)
    assert values.shape == (3,)


COMMON = {"participation_rate": 0.5, "local_steps": 4, "batch_size": 8, "local_lr": 0.05}
# Variants of the algorithms that stack (every registered algorithm is checked by tests/test_conformance.py).
VECTORIZABLE = {
    "fedavg": {"name": "fedavg", "personalization_lr": 0.05},
    "perfedavg_fo": {"name": "perfedavg", "variant": "fo", "personalization_lr": 0.05},
    "perfedavg_fo_from_adapted": {"name": "perfedavg", "variant": "fo", "personalization_lr": 0.05, "outer_step_from": "adapted"},
    "perfedavg_hf": {"name": "perfedavg", "variant": "hf", "personalization_lr": 0.05},
    "perfedavg_exact": {"name": "perfedavg", "variant": "exact", "personalization_lr": 0.05},
    "pfedme": {"name": "pfedme", "personalization_lr": 0.05, "coupling": 15, "server_mixing": 1.5, "inner_steps": 3},
    "fedprox": {"name": "fedprox", "mu": 0.1},
    "ditto": {"name": "ditto", "personalization_lr": 0.05, "coupling": 0.1},
    "feddeper": {"name": "feddeper", "personalization_lr": 0.05, "coupling": 0.1},
    "scaffold": {"name": "scaffold"},
    "feddyn": {"name": "feddyn", "regularization": 0.01},
    "pfldyn_maml": {"name": "pfldyn", "transform": "maml", "personalization_lr": 0.05},
    "pfldyn_maml_second_order": {"name": "pfldyn", "transform": "maml", "personalization_lr": 0.05, "maml_order": 2},
    "pfldyn_maml_three_steps": {"name": "pfldyn", "transform": "maml", "personalization_lr": 0.05, "maml_order": 2,
                                "maml_steps": 3},
    "pflscaf_maml": {"name": "pflscaf", "transform": "maml", "personalization_lr": 0.05},
    "pfldyn_proto": {"name": "pfldyn", "transform": "proto"},
    "pfldyn_maml_clipped_decayed": {"name": "pfldyn", "transform": "maml", "personalization_lr": 0.05, "weight_decay": 0.01,
                                    "clip_norm": 0.5},
    "pflscaf_proto": {"name": "pflscaf", "transform": "proto"},
    "pavg": {"name": "pavg"},
}


def synthetic(algorithm: dict, vectorize: bool):
    return validate(
        {
            "seed": 3,
            # power-law sizes: some clients hold fewer samples than a batch, so batches are ragged
            "data": {"dataset": "synthetic", "num_clients": 8, "alpha": 0.5, "beta": 0.5, "seed": 1},
            "model": {"name": "mlp", "hidden": [10]},
            "algorithm": {**COMMON, **algorithm},
            "rounds": 3,
            "eval_every": 3,
            "resources": {"clients_per_actor": 4, "vectorize_clients": vectorize},
        }
    )


@pytest.mark.parametrize("key", sorted(VECTORIZABLE))
def test_vectorized_training_reaches_the_same_model(key):
    one_by_one, s1 = run_local(synthetic(VECTORIZABLE[key], False))
    stacked, s2 = run_local(synthetic(VECTORIZABLE[key], True))
    assert torch.allclose(s1.params, s2.params, atol=1e-5), float((s1.params - s2.params).abs().max())
    for a, b in zip(one_by_one, stacked):
        assert a.keys() == b.keys()
        for k in a:
            assert b[k] == pytest.approx(a[k], abs=1e-4), (key, k)


def test_vectorizing_an_algorithm_that_trains_one_by_one_is_refused_early_naming_them():
    raw = config_dict(algorithm={"_replace": True, "name": "moon"})
    raw["resources"]["vectorize_clients"] = True
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert "resources.vectorize_clients" in str(err.value) and "fedala, feddbe, fedem, fedfomo, fedpac, fedproto, moon" in str(err.value)


def test_stacked_proto_loss_and_gradient_are_each_clients_own():
    """The Proto step on stacked clients: each client's centroids from its own support samples (padding left out),
    its query samples whose class its support lacks left out, its own mean; ragged sizes (3 < batch 8 ≤ 11, 30)."""
    from fedsweep.algorithms.transforms import proto_loss

    model, ctxs = contexts([3, 11, 30], seed=4)
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(5))
    y = torch.tensor([0] * 10 + [1, 2])  # rare classes: a support batch of 8 can lack one its query batch has
    ctxs.append(ClientContext(model, ClientData(x, y, x, y), torch.Generator().manual_seed(103)))
    twins = [ClientContext(c.model, c.data, torch.Generator().manual_seed(100 + i)) for i, c in enumerate(ctxs)]
    w = torch.stack([model.initial_vector(s) for s in range(4)])
    stacked = StackedContext(ctxs)
    support, query = stacked.batch(8), stacked.batch(8)
    g, values = grad(lambda v, q: proto_loss(stacked, v, support, q), w, query)
    left_out = 0
    for c, ctx in enumerate(twins):
        own_support, own_query = ctx.batch(8), ctx.batch(8)
        left_out += int((~torch.isin(own_query[1], own_support[1])).sum())
        g_c, v_c = grad(lambda v, q, ctx=ctx, s=own_support: proto_loss(ctx, v, s, q), w[c], own_query)
        assert values[c].item() == pytest.approx(v_c, rel=1e-5, abs=1e-6)
        assert torch.allclose(g[c], g_c, atol=1e-5)
    assert left_out > 0  # the case of a query class absent from the support set was exercised


def test_the_automatic_layout_keeps_the_proto_transform_one_by_one():
    """Proto stacks when asked; the layout chosen automatically does not stack it (not timed on the CPU)."""
    from fedsweep.layout import auto_layout

    for algorithm in ({"name": "pavg"}, {"name": "pfldyn", "transform": "proto"}):
        assert "vectorize_clients" not in auto_layout({"model": {"name": "mlp"}, "algorithm": algorithm}, 2)["resources"]
    assert auto_layout({"model": {"name": "mlp"}, "algorithm": {"name": "pfldyn", "transform": "maml"}}, 2)["resources"]["vectorize_clients"]
