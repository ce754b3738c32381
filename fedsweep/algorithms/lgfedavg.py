"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency, 2020): "Think locally, act globally:
federated learning with local and global representations" (arXiv 2001.01523).

The model's parameters are split into *local representation* layers θ^l_i (lower layers, kept on each client) and
*global* layers θ^g (the top layers, shared). Round t (paper, Algorithm 1): the server sends θ^g_t; a sampled client
i trains its whole model end to end from (θ^l_i, θ^g_t) by τ SGD steps,

    (θ^l, θ^g) ← (θ^l, θ^g) − β ∇f_i((θ^l, θ^g); D)

keeps θ^l_i ← θ^l and sends θ^g. The server averages θ^g_{t+1} = Σ_{i∈S} p_i θ^g_i (p_i ∝ n_i, or uniform as the
authors' code, github ``pliang279/LG-FedAvg``, ``main_lg.py``: ``aggregation: uniform``). A client is scored with
(θ^l_i, θ^g_t). Only θ^g travels: |θ^g| floats each way per sampled client; no global model (a classifier without a
shared representation) unless nothing is local.

This is FedPer (:mod:`.fedper`) with the groups swapped: the local part is the representation, the shared part the
classifier. ``local_layers`` names the local layers; null = every layer but the last (the model's ``body``); [] =
none, which is FedAvg. The authors' experiments start LG-FedAvg from a FedAvg-trained model (``main_lg.py``,
``--load_fed``) and keep the top ``num_layers_keep`` layers global; here training starts from the seeded
initialization (run FedAvg for the warm start's comparison). Reads: β (``local_lr``), τ, r, and α at evaluation as
FedAvg; own setting ``local_layers``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from fedsweep.algorithms.base import register
from fedsweep.algorithms.fedavg import FedAvgParams
from fedsweep.algorithms.fedper import FedPer
from fedsweep.models import ParamLayout


class LGFedAvgParams(FedAvgParams):
    local_layers: list[str] | None = Field(
        None,
        description="Layers kept on each client: the local representation (names of the model's modules, e.g. ['0'] "
        "for an MLP's first layer); null = every layer but the last; [] = none (FedAvg).",
    )

    def model_problem(self, model_name: str) -> str | None:
        if model_name == "mlr" and self.local_layers is None:
            return "LG-FedAvg keeps a local representation below a global classifier: use a model with a hidden layer (mlp, cnn)"
        return None


@register("lgfedavg")
class LGFedAvg(FedPer):
    Params = LGFedAvgParams
    hp: LGFedAvgParams
    fedavg_reduction: ClassVar[dict] = {"local_layers": []}

    def split(self) -> ParamLayout:
        """FedPer's split with ``head`` = the local layers (kept on the client) and ``body`` = the global ones (sent)."""
        layout = self.model.layout
        if self.hp.local_layers is not None:
            return layout.regroup(head=self.hp.local_layers)
        return layout.regroup(head=list(layout.groups["body"]), body=list(layout.groups["head"]))
