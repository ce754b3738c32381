"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, NeurIPS 2021, "Federated Multi-Task Learning under a Mixture of
Distributions", Algorithm 1).

M shared component models w_1..w_M; client i's data is a mixture of them with its own weights π_i (M values, 1/M
at first, kept on the client). Round t: the server sends all components (M·P floats down); a sampled client runs (Alg. 1)

    E-step:   q(z = m | x, y) = π_im exp(−ℓ(w_m; x, y)) / Σ_k π_ik exp(−ℓ(w_k; x, y))   for every training sample
    M-step:   π_im ← mean over its samples of q(z = m | ·)
              each w_m: τ SGD steps  w_m ← w_m − β ∇ (1/|D|) Σ_{(x,y)∈D} q(m | x, y) ℓ(w_m; x, y)

(ℓ the cross-entropy), and sends the M trained components (M·P floats up); the server averages each component,
w_m = Σ_{i∈S} p_i w_{i,m} (p_i ∝ n_i, or uniform). Following the authors' code (omarfoq/FedEM): the E-step runs once
per round over the whole training set, in evaluation mode (learners/learner.py ``gather_losses``), with the received
components and the old π (client.py ``MixtureClient.update_sample_weights``, then ``update_learners_weights``); each
component draws its own minibatches and its loss is the responsibility-weighted sum divided by the batch size
(learners/learner.py ``fit_batch``);
component m is initialized independently (utils/utils.py ``get_learners_ensemble``: seed + m; here component 0 is
the run's seeded initialization and component m the model's initialization under a seed derived from it, plus m).

A client is scored with its mixture p(y | x) = Σ_m π_im p_m(y | x) (learners_ensemble.py ``evaluate_iterator``): the
predictor returns log p(y | x), so the scored cross-entropy is the mixture's negative log-likelihood. A held-out
client (``unseen_fraction``: never trained) has no π of its own; FedEM's step for a new client is to learn it with the
components fixed (the authors' code, aggregator.py ``Aggregator.update_test_clients``: at each evaluation the
test clients take the current components, then one E-step and π ← mean q on their training data, π kept from the
evaluation before). Here it is fitted at each evaluation from 1/M by those same two steps repeated to their fixed
point (the π maximizing the training data's likelihood under the components received; :func:`mixture_weights`),
so that the score does not depend on how often a run evaluates. There is no
global model, except with M = 1, when FedEM is FedAvg (q = 1, π = 1) and the server's vector is the one component.
Reads: β (``local_lr``), τ, r; its own M (``components``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsweep.algorithms.base import (
    AggregationMixin,
    Algorithm,
    ClientContext,
    ClientMessage,
    State,
    register,
    sgd,
    weighted_average,
)
from fedsweep.algorithms.moon import statistics
from fedsweep.schema import aliases


class FedEMParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    components: int = Field(3, ge=1, le=32, validation_alias=aliases("components", "M"), description="M: number of shared component models.")


def per_sample_loss(ctx: ClientContext, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ(w; x_j, y_j) for every sample j."""
    return F.cross_entropy(ctx.model(w, x), y, reduction="none")


def sample_losses(ctx: ClientContext, components: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """ℓ(w_m; x_j, y_j), an M × n matrix, as constants in evaluation mode (the authors' ``gather_losses``)."""
    with statistics(ctx.model, ctx.model.stats, False), torch.no_grad():
        return torch.stack([per_sample_loss(ctx, w, x, y) for w in components])


def mixture_weights(losses: torch.Tensor, iterations: int = 10_000, tol: float = 1e-10) -> torch.Tensor:
    """π maximizing Σ_j log Σ_m π_m exp(−ℓ_mj), for the M × n losses ``losses`` of fixed components: from 1/M, the
    E-step q(m | j) ∝ π_m exp(−ℓ_mj) and π ← mean_j q(m | j), in float64, until no π_m moves by more than ``tol``
    (EM: the likelihood is concave in π and rises at every step; its steps shrink slowly near the maximum, hence the
    small ``tol``). In ``losses``' dtype."""
    ell = losses.double()
    pi = ell.new_full((ell.shape[0],), 1.0 / ell.shape[0])
    for _ in range(iterations):
        new = torch.softmax(pi.log().unsqueeze(1) - ell, dim=0).mean(dim=1)
        pi, moved = new, float((new - pi).abs().max())
        if moved <= tol:
            break
    return pi.to(losses.dtype)


@register("fedem")
class FedEM(Algorithm):
    Params = FedEMParams
    hp: FedEMParams
    fedavg_reduction: ClassVar[dict] = {"components": 1}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        digest = hashlib.sha256(global_params.detach().cpu().numpy().tobytes()).digest()
        seed = int.from_bytes(digest[:6], "little")
        others = [self.model.initial_vector(seed + m).to(global_params) for m in range(1, self.hp.components)]
        return {"components": torch.stack([global_params, *others])}

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"weights": initial_params.new_full((self.hp.components,), 1.0 / self.hp.components)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"components": server_state["components"]}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp, received = self.hp, payload["components"]
        x, y = ctx.train_data()
        joint = state["weights"].log().unsqueeze(1) - sample_losses(ctx, received, x, y)  # log π_m p_m(y_j | x_j)
        q = torch.softmax(joint, dim=0)  # E-step: q(z = m | x_j, y_j)
        n = int(y.shape[0])
        trained = []
        for m, w0 in enumerate(received):
            def weighted(w: torch.Tensor, m: int = m) -> tuple[torch.Tensor, float]:
                idx = self.draw(ctx, n, y.device)
                xb, yb, qb = (x, y, q[m]) if idx is None else (x[idx], y[idx], q[m, idx])
                w = w.detach().requires_grad_(True)
                value = (per_sample_loss(ctx, w, xb, yb) * qb).sum() / yb.shape[0]
                (g,) = torch.autograd.grad(value, w)
                return g, float(value.detach())

            trained.append(sgd(ctx, w0, hp.local_lr, hp.local_steps, hp.batch_size, gradient=weighted)[0])
        nll = -torch.logsumexp(joint, dim=0).mean()  # the mixture's negative log-likelihood before the M-step
        return {"components": torch.stack(trained)}, {"weights": q.mean(dim=1)}, {"local_train_loss": float(nll)}

    def draw(self, ctx: ClientContext, n: int, device: torch.device) -> torch.Tensor | None:
        """A minibatch's indices, drawn without replacement with the client's generator (None: the whole set)."""
        if self.hp.batch_size is None or self.hp.batch_size >= n:
            return None
        return torch.randperm(n, generator=ctx.generator)[: self.hp.batch_size].to(device)

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        components = weighted_average([m.payload["components"] for m in messages], self.aggregation_weights(messages))
        return components[0].clone(), {"components": components}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return global_params if self.hp.components == 1 else None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """π_i followed by the M components, flattened: what :meth:`predictor` mixes; a held-out client's π fitted to
        its training data with the components received (:func:`mixture_weights`)."""
        components, weights = payload["components"], state["weights"]
        if ctx.held_out:
            x, y = ctx.train_data()
            weights = mixture_weights(sample_losses(ctx, components, x, y))
        return torch.cat([weights, components.flatten()])

    def predictor(self, ctx: ClientContext, personalized: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        m = self.hp.components
        log_pi, components = personalized[:m].log(), personalized[m:].view(m, -1)

        def mixture(x: torch.Tensor) -> torch.Tensor:
            """log Σ_m π_m p_m(y | x) for every class y."""
            return torch.logsumexp(torch.stack([lp + F.log_softmax(ctx.model(w, x), dim=-1) for lp, w in zip(log_pi, components)]), dim=0)

        return mixture
