"""Stacked clients' gradients of a plain model without autograd's graph, bit for bit autograd's.

For a plain model (:attr:`fedsweep.models.FlatModel.plain`: linear layers and stateless activations) the gradient
of the stacked loss (:meth:`~fedsweep.algorithms.stacked.StackedContext.loss`, each client's mean cross-entropy
f_c(w_c; D_c) over its own unpadded samples) is the chain of products autograd would run, here called directly:
with h_0 = x, h_l = a_l(h_{l-1} W_lᵀ + b_l) and p = log_softmax(h_L),

    ∂f_c/∂p[c, b, k] = −[y_cb = k] / n_c                       (``nll_loss_backward``; padding rows 0)
    g_L = ∂f/∂p − exp(p) Σ_k ∂f/∂p                              (``_log_softmax_backward_data``)
    ∇b_l = Σ_b g_l,   ∇W_l = (h_{l-1}ᵀ g_l)ᵀ,   g_{l-1} = a'(g_l W_l)   (``bmm``, the activation's backward)

with the very kernels, operands, strides and order of autograd's formulas for ``matmul`` (``bmm``), the bias's
broadcast (a sum over the batch), the activations, ``log_softmax`` and ``nll_loss``, so the values are the same to
the last bit (``tests/test_stacked.py`` compares them for every shape and activation tried; but each weight's
gradient, below, on an AMD CPU with MKL's own branch: the last bits of some shapes differ there) — without recording
the graph and running its engine, and with each weight's gradient written in the vector's own layout: 0.91 → 0.54
ms a stacked step of the MNIST MLP's ten clients, 0.33 → 0.23 ms of the 60-input MLP's (issue 35's peer workloads,
one thread; docs/performance.md, "Fifty-first session").
"""

from __future__ import annotations

import torch
from torch import nn

from fedsweep.models import FlatModel

#: Label of a padding row (:data:`fedsweep.algorithms.stacked.PAD`): its loss and gradient are zero.
PAD = -100

_aten = torch.ops.aten


def _activation_backward(layer: nn.Module, grad: torch.Tensor, inputs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The backward autograd records for the activation module ``layer`` (``ReluBackward0``, ``TanhBackward0``,
    ``EluBackward0``)."""
    if type(layer) is nn.ReLU:
        return _aten.threshold_backward(grad, out, 0)
    if type(layer) is nn.Tanh:
        return _aten.tanh_backward(grad, out)
    return _aten.elu_backward(grad, layer.alpha, 1, 1, False, inputs)


def supported(model: FlatModel, x: torch.Tensor) -> bool:
    """Whether :func:`stacked_cross_entropy` computes this model's gradient on inputs ``x``: a plain model whose
    layers each appear once (a layer used twice sums two gradients, in the engine's order), stacked inputs
    [C, B, features]."""
    layers = model.plain
    return (layers is not None and x.dim() == 3 and len({id(m) for _, m in layers}) == len(layers)
            and all(type(m) in (nn.Linear, nn.ReLU, nn.Tanh, nn.ELU) for _, m in layers))


@torch.no_grad()
def stacked_cross_entropy(model: FlatModel, matrix: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∇, f): every client's gradient [C, P] and loss [C] of its mean cross-entropy on its own samples (labels
    ``PAD`` ignored), for the rows of ``matrix`` [C, P]; :func:`supported` must hold."""
    params = model.unflatten(matrix)
    tape: list[tuple] = []
    h = x
    for name, layer in model.plain:
        if isinstance(layer, nn.Linear):
            prefix = f"{name}." if name else ""
            weight_t = params[prefix + "weight"].transpose(1, 2)
            bias = params.get(prefix + "bias")
            out = torch.matmul(h, weight_t)
            if bias is not None:
                out = out + bias.unsqueeze(1)
            tape.append((layer, prefix, h, weight_t, bias is not None))
        else:
            out = layer(h)
            tape.append((layer, h, out))
        h = out
    clients, rows, classes = h.shape
    log_p = torch.log_softmax(h.flatten(0, 1), 1)
    labels = y.flatten()
    per_sample, total_weight = _aten.nll_loss_forward(log_p, labels, None, 0, PAD)  # reduction "none"
    count = (y != PAD).sum(1).clamp(min=1)
    value = per_sample.view(y.shape).sum(1) / count
    # backward: the sum over clients, the division by n_c, the sum over rows, nll_loss, log_softmax
    g = (torch.ones_like(value) / count).unsqueeze(1).expand(y.shape).reshape(-1)
    g = _aten.nll_loss_backward(g, log_p, labels, None, 0, PAD, total_weight)
    g = _aten._log_softmax_backward_data(g, log_p, 1, log_p.dtype).view(clients, rows, classes)
    flat = matrix.new_empty(matrix.shape)
    parts = model.unflatten(flat)  # each parameter's gradient written in place, in the vector's layout
    for entry in reversed(tape):
        if isinstance(entry[0], nn.Linear):
            _, prefix, inputs, weight_t, has_bias = entry
            if has_bias:
                parts[prefix + "bias"].copy_(g.sum(1, keepdim=True).squeeze(1))
            # autograd's (inputsᵀ g)ᵀ, computed as gᵀ inputs straight into the vector's [out, in] layout: the
            # same products and sums (equal in every shape tried, k up to 3,000, on AVX-512 and AVX2, on an Intel
            # CPU; on an AMD one in tests/test_stacked.py's 144 cases with MKL's COMPATIBLE branch, not with its
            # own branch, which sums the two operand orders apart in the last bits), without copying the
            # transposed result: autograd's order with that copy made the MNIST MLP's stacked step 1.29× as long on
            # the AMD EPYC (2026-12-06)
            torch.bmm(g.transpose(1, 2), inputs, out=parts[prefix + "weight"])
            if inputs is not x:
                g = g.bmm(weight_t.transpose(1, 2))
        else:
            layer, inputs, out = entry
            g = _activation_backward(layer, g, inputs, out)
    return flat, value
