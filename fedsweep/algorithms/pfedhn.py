"""pFedHN (Shamsian, Navon, Fetaya, Chechik, ICML 2021, "Personalized Federated Learning using Hypernetworks"),
Algorithm 1.

The server holds a hypernetwork h(v; φ): an MLP from a learned client embedding v_i ∈ R^e to a full parameter vector
of the client's model (P outputs). Round t, for each sampled client i:

    θ_i = h(v_i; φ)                                  sent to client i (P floats down)
    θ̃ ← θ̃ − β ∇f_i(θ̃; D),  τ steps from θ̃ = θ_i   (the client's local SGD)
    Δθ_i = θ̃ − θ_i                                   sent back (P floats up)

and the server moves φ and v_i by the chain rule through θ_i = h(v_i; φ) (Alg. 1, the hypernetwork update):

    φ   ← φ   + η   (1/|S|) Σ_{i∈S} (∂θ_i/∂φ)ᵀ Δθ_i
    v_i ← v_i + η_v (∂θ_i/∂v_i)ᵀ Δθ_i

i.e. a gradient step on the surrogate ⟨θ_i, θ_i − θ̃⟩ whose gradient in θ_i is the client's displacement. The sign
follows the authors' code (github AvivSham/pFedHN, ``experiments/pfedhn/trainer.py``, ``train``: ``delta_theta =
inner_state − final_state`` is back-propagated through the hypernetwork and φ takes an optimizer *descent* step),
which moves θ_i towards θ̃. Algorithm 1 samples one client per step; with several clients in a round φ takes the
mean of their surrogate gradients (each embedding its own), which is Algorithm 1 when one client is sampled.

Hypernetwork (authors' ``experiments/pfedhn/models.py``, ``CNNHyper``): embeddings v_i (an ``nn.Embedding``, N(0, 1)),
then Linear(e, H), ``hidden_layers`` × [ReLU, Linear(H, H)], then one linear output layer H → P. Its parameters φ
live flattened in the server state (``hypernet``), the embeddings beside them (``embeddings``, n × e). They are
initialized deterministically: Linear layers as PyTorch's default (uniform ±1/√fan_in), embeddings N(0, 1), from a
generator seeded with a checksum of the seeded initial model θ_0. Departing from the authors' default init, the output
layer starts at weight 0 and bias θ_0, so every client's first model is θ_0 as in every other method here (a
default-initialized output layer would give every layer entries of scale 1/√H whatever its fan-in). The authors'
optimizer (SGD with momentum 0.9, weight decay, gradient clipping at 50) is replaced by the plain steps of
Algorithm 1. The output layer has H·P weights: keep ``hidden_width`` modest for large models.

No global model (each client's model is h(v_i; φ)); a client is scored with h(v_i; φ) as the server has it now.
Nothing stays on the client. Reads: β (``local_lr``), τ, r; its own settings η (``server_lr``), η_v
(``embedding_lr``), e (``embedding_dim``), H (``hidden_width``), ``hidden_layers``.
"""

from __future__ import annotations

import math
import zlib

import torch
from pydantic import Field

from fedsweep.algorithms.base import Algorithm, ClientContext, ClientMessage, HyperParameters, State, register, sgd
from fedsweep.schema import aliases


class PFedHNParams(HyperParameters):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: the client's local learning rate.")
    server_lr: float = Field(
        1.0, gt=0, validation_alias=aliases("server_lr", "eta", "η"), description="η: step of the hypernetwork's parameters φ."
    )
    embedding_lr: float | None = Field(None, gt=0, description="η_v: step of the client embeddings; null = server_lr.")
    embedding_dim: int | None = Field(None, ge=1, description="e: embedding size; null = 1 + n/4 (the authors' default), n counting every client, held-out ones included.")
    hidden_width: int = Field(32, ge=1, description="H: width of the hypernetwork's hidden layers (the output layer has H·P weights).")
    hidden_layers: int = Field(1, ge=0, description="Hidden H×H layers after the first (the authors' n_hidden).")


class Hypernetwork:
    """h(v; φ) on a flat φ: the shapes of its layers and the forward pass on rows of embeddings."""

    def __init__(self, embedding_dim: int, width: int, hidden_layers: int, outputs: int):
        self.shapes = [(width, embedding_dim), (width,)] + [(width, width), (width,)] * hidden_layers + [(outputs, width), (outputs,)]
        self.sizes = [math.prod(s) for s in self.shapes]

    def unflatten(self, phi: torch.Tensor) -> list[torch.Tensor]:
        return [p.view(s) for p, s in zip(torch.split(phi, self.sizes), self.shapes)]

    def __call__(self, phi: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """θ = h(v; φ) for each row of ``v`` [m, e]: [m, P]."""
        layers = self.unflatten(phi)
        x = v
        for k in range(0, len(layers), 2):
            if 0 < k < len(layers) - 2:  # between hidden layers; none before the output layer (authors' CNNHyper)
                x = torch.relu(x)
            x = x @ layers[k].T + layers[k + 1]
        return x

    def initial(self, theta0: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Linear layers uniform ±1/√fan_in; the output layer weight 0 and bias θ_0."""
        parts = []
        for k in range(0, len(self.shapes) - 2, 2):
            bound = 1.0 / math.sqrt(self.shapes[k][1])
            parts += [(torch.rand(n, generator=gen) * 2 - 1) * bound for n in self.sizes[k : k + 2]]
        parts += [torch.zeros(self.sizes[-2]), theta0.detach().cpu().flatten()]
        return torch.cat(parts).to(theta0.dtype)


@register("pfedhn")
class PFedHN(Algorithm):
    Params = PFedHNParams
    hp: PFedHNParams

    def can_vectorize(self) -> bool:
        return True

    def hypernetwork(self, server_state: State) -> Hypernetwork:
        """The layers of the state's φ: P is what its size leaves for the output layer (H·P weights, P biases)."""
        e = server_state["embeddings"].shape[1]
        width, layers = self.hp.hidden_width, self.hp.hidden_layers
        hidden = width * e + width + layers * (width * width + width)
        return Hypernetwork(e, width, layers, (server_state["hypernet"].numel() - hidden) // (width + 1))

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        e = self.hp.embedding_dim or int(1 + num_clients / 4)
        net = Hypernetwork(e, self.hp.hidden_width, self.hp.hidden_layers, global_params.numel())
        gen = torch.Generator().manual_seed(zlib.crc32(global_params.detach().cpu().numpy().tobytes()))
        embeddings = torch.randn(num_clients, e, generator=gen).to(global_params.dtype)
        return {"hypernet": net.initial(global_params, gen), "embeddings": embeddings}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {}

    def client_payload(self, client_id: int, global_params: torch.Tensor, server_state: State) -> State:
        with torch.no_grad():
            theta = self.hypernetwork(server_state)(server_state["hypernet"], server_state["embeddings"][client_id : client_id + 1])
        return {"params": theta[0]}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        theta = payload["params"]
        w, loss = sgd(ctx, theta, self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"delta": w - theta}, state, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        phi = server_state["hypernet"].detach().clone().requires_grad_(True)
        emb = server_state["embeddings"].detach().clone().requires_grad_(True)
        ids = torch.tensor([m.client_id for m in messages])
        delta = torch.stack([m.payload["delta"] for m in messages]).to(phi.dtype)
        theta = self.hypernetwork(server_state)(phi, emb[ids])
        g_phi, g_emb = torch.autograd.grad((theta * delta).sum(), (phi, emb))
        eta_v = self.hp.embedding_lr or self.hp.server_lr
        with torch.no_grad():
            new_phi = phi + (self.hp.server_lr / len(messages)) * g_phi
            new_emb = emb + eta_v * g_emb
        return global_params, {"hypernet": new_phi.detach(), "embeddings": new_emb.detach()}

    def global_model(self, global_params: torch.Tensor, server_state: State) -> torch.Tensor | None:
        return None

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        return payload["params"]
