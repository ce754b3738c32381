"""FedAvg (McMahan et al., 2017), with the "FedAvg + update" evaluation of Per-FedAvg.

Client i, from the broadcast w_k, takes τ SGD steps on fresh minibatches D:

    w ← w − β ∇f_i(w; D)

Server: w_{k+1} = Σ_{i∈A_k} p_i w_i with p_i ∝ n_i (``aggregation: weighted``) or
p_i = 1/|A_k| (``uniform``).

Evaluation (Fallah et al. 2020, Sec. 5, "FedAvg + update"): each client scores
w_K after ``personalization_steps`` full-batch gradient steps of size α on its
own training data; α = 0 scores the global model itself.

``evaluation: test_data_step`` (FedAvg only) is the update as Sec. 5 words it, "one step of stochastic gradient
descent with respect to the test data": one step of size α on a minibatch T (of ``batch_size``) of the
client's *test* data, w' = w_K − α ∇f_i(w_K; T), scored on that test data. It LEAKS TEST DATA, is never the
default, and its runs carry the MLflow tag ``fedsweep.evaluation`` and their own, marked table row.

Reads: β (``local_lr``), τ, r, and α (``personalization_lr``) at evaluation.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedsweep.algorithms.base import (
    AggregationMixin,
    Algorithm,
    ClientContext,
    ClientMessage,
    State,
    grad,
    register,
    sgd,
    weighted_average,
)
from fedsweep.schema import aliases


class PersonalizationMixin(AggregationMixin):
    """α: fine-tuning of the received model on the client's own training data before it is scored."""

    personalization_lr: float = Field(
        0.0,
        ge=0,
        validation_alias=aliases("personalization_lr", "alpha", "α"),
        description="α: step size of the evaluation-time update (0 = score the global model).",
    )
    personalization_steps: int = Field(1, ge=0, description="Number of full-batch steps of size α at evaluation.")


class FedAvgParams(PersonalizationMixin):
    local_lr: float = Field(
        0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate."
    )


class FedAvgOwnParams(FedAvgParams):
    """FedAvg's own: the methods built on it share :class:`FedAvgParams`, not the leaking evaluation."""

    evaluation: Literal["train", "test_data_step"] = Field(
        "train",
        description="train: personalization_steps full-batch steps of α on the client's training data. test_data_step: "
        "LEAKS TEST DATA — one step of α on a minibatch of the client's test data (Per-FedAvg's Sec. 5 wording of "
        "'FedAvg + update'); for checking that paper's figures only.",
    )

    @property
    def leaks_test_data(self) -> bool:
        return self.evaluation != "train"


def test_data_step(ctx: ClientContext, params: torch.Tensor, lr: float, batch_size: int | None) -> torch.Tensor:
    """One step of size ``lr`` on a minibatch of the client's *test* data: a leaking evaluation, for the runs
    marked so only."""
    g, _ = grad(ctx.loss, params, ctx.test_batch(batch_size))
    return params - lr * g


def fine_tune(ctx: ClientContext, params: torch.Tensor, lr: float, steps: int) -> torch.Tensor:
    """``steps`` full-batch gradient steps of size α on the client's train data (identity if α·steps = 0)."""
    if lr == 0 or steps == 0:
        return params
    w, _ = sgd(ctx, params, lr, steps, batch_size=None)
    return w


@register("fedavg")
class FedAvg(Algorithm):
    Params = FedAvgOwnParams
    hp: FedAvgParams

    def can_vectorize(self) -> bool:
        return True

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        w, loss = sgd(ctx, payload["params"], self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"params": w}, state, {"local_train_loss": loss}

    def server_update(
        self, global_params: torch.Tensor, messages: list[ClientMessage], server_state: State, num_clients: int
    ) -> tuple[torch.Tensor, State]:
        vectors = [m.payload["params"] for m in messages]
        return weighted_average(vectors, self.aggregation_weights(messages)), server_state

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        if self.hp.leaks_test_data:  # FedAvg's own test_data_step (the methods built on it never leak)
            return test_data_step(ctx, payload["params"], self.hp.personalization_lr, self.hp.batch_size)
        return fine_tune(ctx, payload["params"], self.hp.personalization_lr, self.hp.personalization_steps)
