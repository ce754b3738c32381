"""P-Avg (Acar et al., 2021, Sec. 5): FedAvg trained and evaluated through the Proto transform.

Client: τ steps w ← w − β ∇_w CE(−‖r_w(x) − c_k(w; D)‖², y; D′); server: the FedAvg average;
evaluation: nearest class centroid of the client's training data. Reads: β, τ, r.

``transform: maml`` trains FedAvg through the MAML transform instead, w ← w − β ∇f_i(T(w; D); D′) with
T = ``maml_steps`` steps of α (through them with ``maml_order: 2``): what the PFL authors' code runs as its
Per-FedAvg (``train_Meta_FedAvg_MAML`` → ``train_meta_model_MAML`` in github.com/alpemreacar/PFL, read at
``0ba7929``: 5 inner steps of 0.01 differentiated through by Higher, the gradient clipped at 10, weight decay
1e-3: ``clip_norm``, ``weight_decay``), which is not Per-FedAvg's Algorithm 1 (three batches, one inner step).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedsweep.algorithms import transforms
from fedsweep.algorithms.base import AggregationMixin, ClientContext, State, register
from fedsweep.algorithms.fedavg import FedAvg
from fedsweep.algorithms.pfl import TransformedAlgorithm, TransformMixin
from fedsweep.schema import aliases


class PAvgParams(AggregationMixin, TransformMixin):
    local_lr: float = Field(0.05, gt=0, validation_alias=aliases("local_lr", "beta", "β"), description="β: local learning rate.")
    transform: Literal["maml", "proto"] = Field("proto", description="Proto (P-Avg as the paper runs it), or MAML (the "
                                                "PFL authors' code's Per-FedAvg).")


@register("pavg")
class PAvg(TransformedAlgorithm, transforms.TransformHooks, FedAvg):
    Params = PAvgParams

    def client_update(self, ctx: ClientContext, payload: State, state: State) -> tuple[State, State, dict[str, float]]:
        w, loss = self.local_sgd(ctx, payload["params"], self.hp.local_lr, self.hp.local_steps, self.hp.batch_size)
        return {"params": w}, state, {"local_train_loss": loss}
