"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020, "Tackling the objective inconsistency problem in
heterogeneous federated optimization"): normalized averaging for clients that do unequal local work.

Client i takes τ_i local SGD steps from x (heavy-ball momentum ρ optional, buffer restarted every round),

    g ← ρ g + ∇f_i(y; D),    y ← y − β g,

so that x − y_i = β G_i a_i: the s-th gradient (column of G_i) weighs a_{i,s} = (1 − ρ^{τ_i − s + 1})/(1 − ρ), and
(the paper's Δ_i = −η G_i a_i, and its a_i for vanilla and for momentum SGD, Sec. 4.1)

    ‖a_i‖₁ = τ_i (ρ = 0),    ‖a_i‖₁ = [τ_i − ρ(1 − ρ^{τ_i})/(1 − ρ)] / (1 − ρ) (momentum),

and sends the normalized update d_i = (x − y_i)/‖a_i‖₁ with ‖a_i‖₁ (P + 1 floats up, P down). The server (normalized
averaging, the paper's FedNova update: its general rule, Eq. 4, with w_i = p_i, Sec. 5; τ_eff the value Eq. 6
implies for the client's a_i):

    τ_eff = Σ_{i∈S} p_i ‖a_i‖₁,    x ← x − τ_eff Σ_{i∈S} p_i d_i,

p_i ∝ n_i over the aggregated clients (or uniform), as the authors' ``FedNova.average`` (JYWa/FedNova,
distoptim/FedNova.py) weighs by each client's data ratio; its ``step`` counts ‖a_i‖₁ as above.

Unequal local work: with ``local_epochs`` E, client i takes τ_i = E ⌈n_i / B⌉ steps (B = ``batch_size``; one step per
epoch for full batches), the steps of E passes over its data: the paper's motivating case (Sec. 1: E epochs of batch
B give τ_i = ⌊E n_i / B⌋, which varies with n_i) and its experiments, counted as the authors' train_LocalSGD.py counts
them (``tau_i = local_epochs * len(train_loader)``, i.e. ⌈n_i / B⌉ batches per epoch, never 0); minibatches are
drawn as in every fedsweep method. With ``local_epochs: null`` every client takes τ steps: then ‖a_i‖₁ = τ for all,
τ_eff = τ and (without momentum) x − τ Σ p_i (x − y_i)/τ = Σ p_i y_i, FedAvg. Nothing stays on the client; the global
model is x. Reads: β (``local_lr``), τ (when ``local_epochs`` is null), r, α at evaluation as FedAvg; its own E
(``local_epochs``) and ρ (``local_momentum``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, ClientMessage, State, grad, register, sgd, weighted_average
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.schema import aliases


class FedNovaParams(FedAvgParams):
    local_epochs: int | None = Field(
        None, ge=1,
        description="E: client i takes E*ceil(n_i/batch_size) steps (unequal local work, in proportion to its data); "
        "null = every client takes local_steps (τ) steps.",
    )
    local_momentum: float = Field(
        0.0, ge=0, lt=1, validation_alias=aliases("local_momentum", "rho", "ρ"), description="ρ: heavy-ball momentum of the local SGD."
    )


def normalizer(steps: int, rho: float) -> float:
    """‖a_i‖₁ = Σ_{s=1..τ_i} (1 − ρ^{τ_i − s + 1})/(1 − ρ): τ_i for plain SGD."""
    if rho == 0:
        return float(steps)
    return (steps - rho * (1 - rho**steps) / (1 - rho)) / (1 - rho)


@register("fednova")
class FedNova(FedAvg):
    Params = FedNovaParams
    hp: FedNovaParams
    fedavg_reduction: ClassVar[dict] = {"local_epochs": None}

    def can_vectorize(self) -> bool:
        return self.hp.local_epochs is None  # equal step counts: the same loop for every row

    def steps_of(self, ctx: ClientContext) -> int:
        """τ_i: τ, or E ⌈n_i / B⌉ local steps."""
        hp = self.hp
        if hp.local_epochs is None:
            return hp.local_steps
        num_train = int(ctx.train_data()[1].shape[0])
        return hp.local_epochs * (1 if hp.batch_size is None else max(math.ceil(num_train / hp.batch_size), 1))

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, x = self.hp, payload["params"]
        steps = self.steps_of(ctx)
        buffer: list[torch.Tensor] = []

        def heavy_ball(w: torch.Tensor) -> tuple[torch.Tensor, float]:
            g, value = grad(ctx.loss, w, ctx.batch(hp.batch_size))
            buffer[:] = [g if not buffer else hp.local_momentum * buffer[0] + g]
            return buffer[0], value

        y, loss = sgd(ctx, x, hp.local_lr, steps, hp.batch_size, gradient=heavy_ball)
        a = normalizer(steps, hp.local_momentum)
        return {"update": (x - y) / a, "a": x.new_full((*x.shape[:-1], 1), a)}, state, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        weights = self.aggregation_weights(messages)
        total = float(sum(weights))
        tau_eff = sum(w / total * float(m.payload["a"][0]) for w, m in zip(weights, messages))
        direction = weighted_average([m.payload["update"] for m in messages], weights)
        return global_params - tau_eff * direction, server_state
