"""FedDBE (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan, NeurIPS 2023, "Eliminating Domain Bias for Federated Learning
in Representation Space"), Algorithm 1: FedAvg with domain bias eliminators (DBE) on the client.

Why FedDBE rather than pFedLA (Ma et al., CVPR 2022): FedDBE is FedAvg plus two small client-side terms on the
model's own representation r_w(x) (its input to the last layer) and one d-vector on the server; pFedLA needs a
hypernetwork and a stored model per client on the server and layer-wise mixtures of all clients' models, a larger
construction whose server training our interface could hold but at many times the size.

Client i keeps a personalized representation bias r̄_i ∈ R^d (the PRBM, zeros at first) and scores
x ↦ h_w(r_w(x) + r̄_i) (h the last layer). A sampled client receives the global model w and the global mean z̄ and
takes τ SGD steps on fresh batches D, training w and r̄_i together with the mean regularization (MR)

    z̄_i ← (1 − μ) z̄_i + μ mean_{x∈D} r_w(x)          (a running mean, restarted at 0 each round; the gradient
                                                     flows through this batch's mean only)
    L = CE(h_w(r_w(x) + r̄_i), y) + κ · mean_d ½ (z̄_i − z̄)²
    w ← w − β ∇_w L,   r̄_i ← r̄_i − β_r ∇_{r̄_i} L

and sends w (P floats; r̄_i stays local). The server averages as FedAvg, w ← Σ_i p_i w_i. z̄ is fixed once, in an
initialization period: the clients of the first round train plain FedAvg steps (CE on h_w(r_w(x)), no PRBM) from
the initial model, send only their running mean z̄_i (d floats), and the server sets z̄ = Σ_i n_i z̄_i / Σ_i n_i,
leaving the model as it was (the authors' clients train once before round 0 and their models are then overwritten
by the global one). With κ = 0 z̄ is not needed and there is no initialization period. Floats per sampled client:
down P + d (w and z̄; d only while κ > 0), up P. A client is scored with the current global w and its own r̄_i
(h_w(r + r̄_i) = W r + (b + W r̄_i): the bias folded into the last layer's); the global model is w.

From the authors' code (github TsingZ0/DBE, ``system/flcore/clients/clientDBE.py``, ``clientDBE.train``;
``system/flcore/servers/serverDBE.py``, ``FedDBE.__init__``): the running mean's momentum and restart, the
detached running mean between steps, ``torch.mean(0.5 * (running_mean - global_mean)**2)``, r̄_i stepped by SGD at
the local learning rate (``memory_lr: null``), z̄ weighted by training samples and never updated. Differences: the
initialization period uses the first round's sampled clients (the code: every client) and costs that round; z̄ is
sent every round (the code: once); the code's default κ is 0 (``kl_weight``), ours 1.

With κ = 0 and β_r = 0, r̄_i stays 0 and FedDBE is FedAvg. Reads: β (``local_lr``), λ (``coupling``, the paper's κ),
τ, r; its own μ (``momentum``) and β_r (``memory_lr``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsweep.algorithms.base import AggregationMixin, ClientContext, ClientMessage, State, register, weighted_average
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.fedproto import head_logits, head_shape
from fedsweep.schema import aliases


class FedDBEParams(AggregationMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    coupling: float = Field(1.0, ge=0, validation_alias=aliases("coupling", "lambda", "λ", "kappa", "κ"),
                            description="λ (the paper's κ, the code's kl_weight): weight of the mean regularization.")
    momentum: float = Field(0.1, gt=0, le=1, validation_alias=aliases("momentum", "mu", "μ"),
                            description="μ: momentum of the running mean of the representations.")
    memory_lr: float | None = Field(None, ge=0, description="β_r: step of the personalized bias r̄_i; null = local_lr.")

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "FedDBE works on a representation: use a model with a hidden layer (mlp or cnn), not mlr"
        return None


@register("feddbe")
class FedDBE(FedAvg):
    """FedAvg's server and global model; each client's bias r̄_i and the fixed global mean z̄."""

    Params = FedDBEParams
    hp: FedDBEParams
    fedavg_reduction: ClassVar[dict] = {"coupling": 0.0, "memory_lr": 0.0}

    def can_vectorize(self) -> bool:
        return False

    def init_client_state(self, initial_params: torch.Tensor) -> State:
        return {"memory": initial_params.new_zeros(head_shape(self.model)[1])}

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        ready = 1.0 if self.hp.coupling == 0 else 0.0
        return {"global_mean": global_params.new_zeros(head_shape(self.model)[1]), "mean_ready": global_params.new_full((), ready)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        if self.hp.coupling > 0 and bool(server_state["mean_ready"] > 0):
            return {"params": global_params, "global_mean": server_state["global_mean"]}
        return {"params": global_params}

    def train(self, ctx: ClientContext, w: torch.Tensor, memory: torch.Tensor | None, target: torch.Tensor | None):
        """τ steps on CE(h(r + r̄)) + κ MR (``memory`` None: no PRBM; ``target`` None: no MR); returns
        (w, r̄, running mean, mean cross-entropy)."""
        hp = self.hp
        memory_lr = hp.local_lr if hp.memory_lr is None else hp.memory_lr
        running = w.new_zeros(head_shape(ctx.model)[1])
        w, total = w.detach().clone(), 0.0
        for _ in range(hp.local_steps):
            x, y = ctx.batch(hp.batch_size)
            v = w.detach().requires_grad_(True)
            leaves = [v] if memory is None else [v, memory.detach().requires_grad_(True)]
            rep = ctx.model.features(v, x)
            running = (1 - hp.momentum) * running + hp.momentum * rep.mean(0)
            ce = F.cross_entropy(head_logits(ctx.model, v, rep if memory is None else rep + leaves[1]), y)
            loss = ce if target is None else ce + hp.coupling * (0.5 * (running - target) ** 2).mean()
            grads = torch.autograd.grad(loss, leaves)
            w = w - hp.local_lr * grads[0]
            if memory is not None:
                memory = memory - memory_lr * grads[1]
            running = running.detach()
            total += float(ce.detach())
        return w, memory, running, total / max(hp.local_steps, 1)

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        if self.hp.coupling > 0 and "global_mean" not in payload:  # the initialization period: z̄_i only
            _, _, running, loss = self.train(ctx, payload["params"], None, None)
            return {"running_mean": running}, state, {"local_train_loss": loss}
        target = payload["global_mean"] if self.hp.coupling > 0 else None
        w, memory, _, loss = self.train(ctx, payload["params"], state["memory"], target)
        return {"params": w}, {"memory": memory.detach()}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        if "running_mean" in messages[0].payload:
            mean = weighted_average([m.payload["running_mean"] for m in messages], [float(m.num_samples) for m in messages])
            return global_params, {"global_mean": mean, "mean_ready": torch.ones_like(server_state["mean_ready"])}
        return super().server_update(global_params, messages, server_state, num_clients)

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """The global model with r̄_i folded into the last layer's bias: b + W r̄_i."""
        model = ctx.model
        weight_name, bias_name = model.layout.groups["head"]
        w = payload["params"].clone()
        weight = model.unflatten(w)[weight_name]
        w[model.layout.slices[bias_name]] += weight @ state["memory"]
        return w
