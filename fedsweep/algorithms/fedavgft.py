"""FedAvg-FT: FedAvg whose clients fine-tune the received global model before they are scored, the "FT" rows of
pFL-Bench (Chen, Gao, Kuang, Li, Ding, "pFL-Bench: A Comprehensive Benchmark for Personalized Federated Learning",
NeurIPS 2022 Datasets and Benchmarks).

Training is FedAvg's exactly (McMahan et al. 2017): τ SGD steps w ← w − β ∇f_i(w; D) from w_t, w_{t+1} = Σ p_i w_i;
P floats each way; the global model is w_t, the same as FedAvg's under the same settings. Evaluation: each client
takes ``personalization_steps`` minibatch SGD steps of size α from w_t on its own training data,

    v ← v − α ∇f_i(v; D),  v_0 = w_t,

and is scored with v (the fine-tuned model is not kept and never travels). This is FederatedScope's protocol for the
FT rows (alibaba/FederatedScope, the versions released with pFL-Bench: ``trainer.finetune.before_eval``, run by
``GeneralTorchTrainer.finetune`` under federatedscope/core/trainers: ``trainer.finetune.steps`` minibatches of the
training loader at ``trainer.finetune.lr``); the defaults are its values, 5 steps at α = 0.01 (its
federatedscope/core/configs/cfg_training.py, and benchmark/pFL-Bench/yaml_best_runs_example/FedAvg-FT_FEMNIST-s02.yaml),
on minibatches of the training batch size.
FedAvg's own α (full-batch steps, Fallah et al.'s "FedAvg + update") differs only in the batches.
Reads: β (``local_lr``), τ, r, α (``personalization_lr``); its own ``personalization_steps``, ``personalization_batch_size``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedsweep.algorithms.base import ClientContext, State, register, sgd
from fedsweep.algorithms.fedavg import FedAvg, FedAvgParams
from fedsweep.schema import aliases


class FedAvgFTParams(FedAvgParams):
    personalization_lr: float = Field(
        0.01, gt=0, validation_alias=aliases("personalization_lr", "alpha", "α"), description="α: step size of the fine-tuning before evaluation."
    )
    personalization_steps: int = Field(5, ge=1, description="Number of fine-tuning steps before evaluation.")
    personalization_batch_size: int | None = Field(
        None, ge=1, description="Minibatch size of a fine-tuning step; null = batch_size (the training minibatch)."
    )


@register("fedavgft")
class FedAvgFT(FedAvg):
    Params = FedAvgFTParams
    hp: FedAvgFTParams
    fedavg_reduction: ClassVar[dict] = {}

    def personalize(self, ctx: ClientContext, payload: State, state: State) -> torch.Tensor:
        hp = self.hp
        batch_size = hp.personalization_batch_size or hp.batch_size
        return sgd(ctx, payload["params"], hp.personalization_lr, hp.personalization_steps, batch_size)[0]
