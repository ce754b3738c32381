"""PFLScaf (Acar et al., 2021, Algorithm 2): SCAFFOLD's control variates on the MAML or Proto transform.

The update rules are SCAFFOLD's (:mod:`fedsweep.algorithms.scaffold`) with ∇f_i(T_i(w; D); D′) in place
of ∇f_i(w; D); two vectors travel each way, so a client costs two transmissions per round.
Reads: β, τ (K), r (P/m), α (the transform's η).
"""

from __future__ import annotations

from fedsweep.algorithms.base import register
from fedsweep.algorithms.pfl import TransformedAlgorithm, TransformMixin
from fedsweep.algorithms.scaffold import Scaffold, ScaffoldParams


class PFLScafParams(TransformMixin, ScaffoldParams):
    """SCAFFOLD's hyperparameters and the transform's."""


@register("pflscaf")
class PFLScaf(TransformedAlgorithm, Scaffold):
    Params = PFLScafParams
