"""FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): federated learning on non-IID features via local batch normalization.

The model's parameters are split by :class:`~fedsweep.models.ParamLayout` into its normalization layers (the
``norm`` group: each batch-norm layer's scale γ and shift β) and the rest. Round t (paper, Algorithm 1): a sampled
client i receives the non-normalization parameters w_t, trains the whole model (w, γ_i, β_i) by τ SGD steps from
(w_t, γ_i, β_i),

    (w, γ, β) ← (w, γ, β) − lr ∇f_i((w, γ, β); D)

keeps (γ_i, β_i) ← (γ, β) and its batch-norm running statistics (mean and variance, updated by every training
batch), and sends w. The server averages, w_{t+1} = Σ_{i∈S} p_i w_i (p_i ∝ n_i or uniform: the paper's Algorithm 1
weights by sample count). A client is scored with (w_t, γ_i, β_i) and its own statistics, so there is no global
model. Floats: |w| = P − |norm| each way per sampled client; the statistics never travel.

This is FedPer (:mod:`.fedper`) with the normalization layers as the personal ones. On a model without
normalization layers (``model.norm: none``) nothing is personal and FedBN is FedAvg, as the paper notes; use
``model.norm: batch`` (MLP or CNN) for the method itself. The authors' code (github ``med-air/FedBN``,
``federated/fed_digits.py``, ``communication``) averages every state-dict entry whose key has no ``bn``, which is
the same split. Reads: β (``local_lr``), τ, r, and α at evaluation as FedAvg.
"""

from __future__ import annotations

from typing import ClassVar

from fedsweep.algorithms.base import register
from fedsweep.algorithms.fedavg import FedAvgParams
from fedsweep.algorithms.fedper import FedPer
from fedsweep.models import ParamLayout


class FedBNParams(FedAvgParams):
    pass


@register("fedbn")
class FedBN(FedPer):
    Params = FedBNParams
    #: On the conformance suite's model (no normalization layers) FedBN is FedAvg as it stands.
    fedavg_reduction: ClassVar[dict] = {}

    def split(self) -> ParamLayout:
        """``head`` = the normalization layers' parameters (kept on the client), ``body`` = the rest (shared)."""
        layout = self.model.layout
        return layout.regroup(head=list(layout.groups["norm"]))
