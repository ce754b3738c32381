"""PFLDyn (Acar et al., 2021, Algorithm 1): FedDyn's dynamic regularizer on the MAML or Proto transform.

The update rules are FedDyn's (:mod:`fedsweep.algorithms.feddyn`) with ∇f_i(T_i(w; D); D′) in place of
∇f_i(w; D). Reads: β, λ (the paper's α), τ (K), r (P/m), α (the transform's η).
"""

from __future__ import annotations

from fedsweep.algorithms.base import register
from fedsweep.algorithms.feddyn import FedDyn, FedDynParams
from fedsweep.algorithms.pfl import TransformedAlgorithm, TransformMixin


class PFLDynParams(TransformMixin, FedDynParams):
    """FedDyn's hyperparameters and the transform's."""


@register("pfldyn")
class PFLDyn(TransformedAlgorithm, FedDyn):
    Params = PFLDynParams
