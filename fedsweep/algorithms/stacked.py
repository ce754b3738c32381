"""Vectorized local training: several clients' local updates as one batched computation.

The clients packed in one actor (``resources.clients_per_actor``) share a model architecture. With
``resources.vectorize_clients`` their parameter vectors are stacked into a matrix W ∈ R^{C×P} (row c is
client c's w) and an algorithm's :meth:`~fedsweep.algorithms.base.Algorithm.client_update` runs once on
a :class:`StackedContext` instead of C times on a :class:`~fedsweep.algorithms.base.ClientContext`:

- ``loss(W, batch)`` is the vector (f_1(w_1; D_1), …, f_C(w_C; D_C)); the model is applied row by row
  (:meth:`~fedsweep.models.FlatModel.rows`: :func:`torch.func.vmap`, or for a plain model the batched products
  vmap computes). Since f_c depends on row c only, ∇_W Σ_c f_c has ∇f_c(w_c; D_c) in
  row c, so :func:`~fedsweep.algorithms.base.grad` returns every client's own gradient at once (and a
  Hessian-vector product of the sum is block-diagonal, client by client, likewise); ``grad(W, batch)`` is that
  result, for a plain model computed without autograd's graph (:mod:`.plain_grad`, bit for bit).
- ``batch`` draws each client's minibatch with that client's own generator, in the same order as the
  one-client path, so the same samples are seen; batches of unequal size (a client with fewer samples
  than the batch size uses them all) are padded with ignored labels, and each client's loss is the
  mean over its own samples.

This is exact for algorithms whose client step is elementwise in w apart from f_i, and for the Proto
transform, whose class centroids the stacked step computes per client from that client's own support
samples (``transforms._stacked_scores``); results match the one-by-one path up to floating-point summation
order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedsweep.algorithms import plain_grad
from fedsweep.algorithms.base import Batch, ClientContext, State, grad
from fedsweep.algorithms.plain_grad import PAD  # the label of a padding row: cross-entropy ignores it


def pad_stack(batches: list[Batch]) -> Batch:
    """[(x_c, y_c)] of unequal lengths → (X [C, B, …], Y [C, B]) with B the largest length; padding has label PAD."""
    size = max(int(y.shape[0]) for _, y in batches)
    if all(int(y.shape[0]) == size for _, y in batches):  # nothing to pad (every client drew a whole batch)
        return torch.stack([x for x, _ in batches]), torch.stack([y for _, y in batches])
    x0, y0 = batches[0]
    xs = x0.new_zeros((len(batches), size, *x0.shape[1:]))
    ys = torch.full((len(batches), size), PAD, dtype=y0.dtype, device=y0.device)
    for c, (x, y) in enumerate(batches):
        xs[c, : y.shape[0]] = x
        ys[c, : y.shape[0]] = y
    return xs, ys


@dataclass
class StackedContext:
    """C clients seen as one: their contexts (model, data, generator), a loss per client."""

    contexts: list[ClientContext]

    @property
    def model(self):
        return self.contexts[0].model

    def loss(self, params: torch.Tensor, batch: Batch) -> torch.Tensor:
        """(f_c(w_c; D_c))_c: each client's mean cross-entropy on its own (unpadded) samples."""
        x, y = batch
        logits = self.model.rows(params, x)
        per_sample = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD, reduction="none")
        return per_sample.view(y.shape).sum(1) / (y != PAD).sum(1).clamp(min=1)

    def grad(self, params: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every client's gradient of :meth:`loss` in its row, and its loss: :func:`~.base.grad`'s result, for a
        plain model without autograd's graph (:mod:`.plain_grad`, the same numbers bit for bit)."""
        if plain_grad.supported(self.model, batch[0]):
            return plain_grad.stacked_cross_entropy(self.model, params.detach(), *batch)
        return grad(self.loss, params, batch)

    def batch(self, batch_size: int | None) -> Batch:
        return pad_stack([c.batch(batch_size) for c in self.contexts])

    def train_data(self) -> Batch:
        return pad_stack([c.train_data() for c in self.contexts])


def stack_states(states: list[State]) -> State | None:
    """Row-stacked client states, or None when the clients' states do not have the same entries."""
    keys = set(states[0])
    if any(set(s) != keys for s in states):
        return None
    return {k: torch.stack([s[k] for s in states]) for k in states[0]}


def row(values: State, c: int) -> State:
    return {k: v[c].clone() for k, v in values.items()}


def stat_of(value, c: int) -> float:
    """Client c's entry of a statistic (a vector over the stacked clients, or one number for all)."""
    return float(value[c]) if isinstance(value, torch.Tensor) and value.ndim > 0 else float(value)
