"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, AAAI 2022, "FedProto: Federated Prototype Learning across
Heterogeneous Clients"), Algorithm 1. Equation numbers are the AAAI version's.

Clients exchange class prototypes instead of parameters. With r_w(x) the representation (the model's input to its
last layer) and D_{i,j} client i's training samples of class j, client i's local prototype of class j is

    C_i^(j) = (1/|D_{i,j}|) Σ_{(x,y)∈D_{i,j}} r_{w_i}(x),                  (Eq. 3)

and the server's global prototype averages the prototypes of the clients N_j that hold class j, weighted by their
counts (``prototype_weighting: counts``, the paper's aggregation rule):

    C̄^(j) = Σ_{i∈N_j} |D_{i,j}| C_i^(j) / Σ_{i∈N_j} |D_{i,j}|.      (Eq. 6, Alg. 1 server line 6; as printed,
                                                        Eq. 6 also divides by |N_j|)

A sampled client takes τ SGD steps on its own model w_i (from where it left it; nothing of it is ever sent) with the
local objective, cross-entropy plus λ times the distance of each representation to the global prototype of its label,

    w_i ← w_i − β ∇[ CE(w_i; D) + λ · (1/(|D|·d)) Σ_{(x,y)∈D, y∈N} ‖r_{w_i}(x) − C̄^(y)‖² ],
                                      (Eq. 7; Alg. 1 LocalUpdate lines 3-5; Eq. 8's L_R taken per sample)

(d the representation's width; the normalisation is the authors' ``nn.MSELoss`` over the batch, in which samples of
classes without a global prototype count with distance 0), then computes its prototypes with the trained model on
its whole training set and sends them with their class counts. Before the first aggregation there is no global
prototype and the objective is the cross-entropy alone (the code's ``loss2 = 0*loss1``).

Floats per sampled client and round: up C·d prototypes + C counts; down the same (global prototypes and counts).
The model w_i stays on the client; there is no global model (the global metrics are absent).

Evaluation (``evaluation: prototypes``, the default): a test point gets the class of its nearest global prototype
(Eq. 4), score −‖r_{w_i}(x) − C̄^(j)‖²/d, among the classes that have a global prototype and occur in the client's
training data; the other classes score −100 (the authors' ``test_inference_new_het_lt``, "with protos": a distance
matrix initialised to 100 and filled for the client's classes). A client none of whose classes has a global
prototype yet uses its own classifier. ``evaluation: classifier`` scores the local model's own classifier (the code's
"w/o protos").

Ambiguities, and the authors' code followed (github yuetan031/fedproto, ``lib/update.py``,
``LocalUpdate.update_weights_het``; ``lib/utils.py``, ``agg_func`` and ``proto_aggregation``): the regularizer's
normalisation is the code's ``nn.MSELoss``; the code averages the clients' prototypes of a class *uniformly*
(``proto_aggregation``), which ``prototype_weighting: clients`` selects instead of the paper's count weights; the code
collects the local prototypes from the batches of its last local epoch, while we take the paper's definition (the
trained model on the whole training set, without changing batch-norm statistics). The global prototypes of a round
are rebuilt from that round's uploads (as ``proto_aggregation`` does; the authors train every client every round).
Local training is plain SGD (the code: SGD with momentum 0.5).

With λ = 0 every client trains alone (:mod:`.local`). Reads: β (``local_lr``), λ (``coupling``), τ, r.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, ClientMessage, State, register, sgd
from fedsweep.algorithms.local import Local, LocalParams
from fedsweep.models import FlatModel
from fedsweep.schema import aliases

#: Distance given to the classes a client cannot predict by prototype (the authors' ``a_large_num``).
FAR = 100.0


def head_shape(model: FlatModel) -> tuple[int, int]:
    """(number of classes C, representation width d): the shape of the last layer's weight."""
    shapes = dict(zip(model.names, model.shapes))
    c, d = shapes[model.layout.groups["head"][0]]
    return int(c), int(d)


def head_logits(model: FlatModel, w: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The last layer (a linear one in every model here) of the parameters ``w`` applied to ``features``."""
    params = model.unflatten(w)
    return F.linear(features, *(params[n] for n in model.layout.groups["head"]))


@contextmanager
def inference(model: FlatModel) -> Iterator[None]:
    """Calls in the block use (and leave unchanged) the model's normalization statistics, as at evaluation."""
    before = model.training
    model.training = False
    try:
        yield
    finally:
        model.training = before


@torch.no_grad()
def features_of(model: FlatModel, w: torch.Tensor, x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """r_w(x) for a whole data set, in chunks, without a graph and without touching normalization statistics."""
    with inference(model):
        return torch.cat([model.features(w, x[i : i + chunk]) for i in range(0, x.shape[0], chunk)])


def class_prototypes(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(C_j)_j, the mean representation of each class (zeros for an absent class), and the class counts |D_j|."""
    counts = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    sums = features.new_zeros(num_classes, features.shape[1]).index_add(0, labels, features)
    return sums / counts.clamp(min=1).unsqueeze(1), counts


def aggregate_prototypes(
    protos: list[torch.Tensor], counts: list[torch.Tensor], weighting: str = "counts"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per class, the average of the prototypes of the clients that hold it: weighted by their counts
    (``counts``) or uniform over those clients (``clients``); in the given (client-id) order. Returns the
    global prototypes (zeros for a class no client holds) and the summed counts (0 = no global prototype)."""
    total = torch.zeros_like(counts[0])
    sums = torch.zeros_like(protos[0])
    weight = torch.zeros_like(counts[0])
    for p, n in zip(protos, counts):
        w = n if weighting == "counts" else (n > 0).to(n.dtype)
        sums += w.unsqueeze(1) * p
        weight += w
        total += n
    return sums / weight.clamp(min=1e-12).unsqueeze(1) * (weight > 0).unsqueeze(1), total


def alignment(features: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
    """(1/(B·d)) Σ_b ‖r_b − T_{y_b}‖² over the samples whose class has a target (the others count with 0): the
    authors' ``nn.MSELoss`` between the representations and the same matrix with known rows replaced by targets."""
    keep = known[labels].unsqueeze(1)
    diff = torch.where(keep, features - targets[labels], torch.zeros_like(features))
    return diff.pow(2).mean()


def regularized_gradient(
    ctx: ClientContext, w: torch.Tensor, batch_size: int | None, reg: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
) -> tuple[torch.Tensor, float]:
    """∇_w [CE(w; D) + reg(r_w(x), y)] on a fresh batch D; returns it and the cross-entropy."""
    x, y = ctx.batch(batch_size)
    v = w.detach().requires_grad_(True)
    feats = ctx.model.features(v, x)
    ce = F.cross_entropy(head_logits(ctx.model, v, feats), y)
    total = ce if reg is None else ce + reg(feats, y)
    (g,) = torch.autograd.grad(total, v)
    return g, float(ce.detach())


class FedProtoParams(LocalParams):
    coupling: float = Field(
        1.0, ge=0, validation_alias=aliases("coupling", "lambda", "λ", "ld"),
        description="λ: weight of the distance of the representations to their global prototypes (the code's ld).",
    )
    prototype_weighting: Literal["counts", "clients"] = Field(
        "counts", description="Server average of a class's prototypes: 'counts' weights each client by its samples of "
        "the class (the paper); 'clients' is uniform over the clients that hold it (the authors' code).",
    )
    evaluation: Literal["prototypes", "classifier"] = Field(
        "prototypes", description="'prototypes': nearest global prototype among the client's classes (the paper's "
        "inference); 'classifier': the local model's own last layer.",
    )

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr":
            return "FedProto's prototypes are representations: use a model with a hidden layer (mlp or cnn), not mlr"
        return None


@register("fedproto")
class FedProto(Local):
    """Local models (:class:`Local`'s state, no global model) tied together by class prototypes."""

    Params = FedProtoParams
    hp: FedProtoParams

    def can_vectorize(self) -> bool:
        return False  # prototypes are per-client, per-class structures

    def init_server_state(self, global_params: torch.Tensor, num_clients: int) -> State:
        c, d = head_shape(self.model)
        return {"protos": global_params.new_zeros(c, d), "proto_counts": global_params.new_zeros(c)}

    def server_payload(self, global_params: torch.Tensor, server_state: State) -> State:
        return {"protos": server_state["protos"], "proto_counts": server_state["proto_counts"]}

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        hp = self.hp
        protos, known = payload["protos"], payload["proto_counts"] > 0
        reg = None
        if hp.coupling > 0 and bool(known.any()):
            reg = lambda feats, y: hp.coupling * alignment(feats, y, protos, known)
        step = lambda v: regularized_gradient(ctx, v, hp.batch_size, reg)
        w, loss = sgd(ctx, state["params"], hp.local_lr, hp.local_steps, hp.batch_size, gradient=step)
        x, y = ctx.train_data()
        local, counts = class_prototypes(features_of(ctx.model, w, x), y, ctx.model.num_classes)
        return {"protos": local, "proto_counts": counts}, {"params": w}, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        protos, counts = aggregate_prototypes([m.payload["protos"] for m in messages],
                                              [m.payload["proto_counts"] for m in messages], self.hp.prototype_weighting)
        return global_params, {"protos": protos, "proto_counts": counts}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        """The local model; for prototype evaluation followed by the global prototypes and counts (read back by
        :meth:`predictor`)."""
        if self.hp.evaluation == "classifier":
            return state["params"]
        return torch.cat([state["params"], payload["protos"].flatten(), payload["proto_counts"]])

    def predictor(self, ctx: ClientContext, personalized: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        model = ctx.model
        w = personalized[: model.numel]
        if personalized.numel() == model.numel:
            return lambda x: model(w, x)
        c, d = head_shape(model)
        protos = personalized[model.numel : model.numel + c * d].view(c, d)
        counts = personalized[model.numel + c * d :]
        _, y_train = ctx.train_data()
        allowed = (counts > 0) & (torch.bincount(y_train, minlength=c) > 0)
        if not bool(allowed.any()):
            return lambda x: model(w, x)

        def scores(x: torch.Tensor) -> torch.Tensor:
            feats = model.features(w, x)
            dist = (feats.pow(2).sum(1, keepdim=True) - 2 * feats @ protos.T + protos.pow(2).sum(1)).clamp(min=0) / d
            return -torch.where(allowed, dist, torch.full_like(dist, FAR))

        return scores
