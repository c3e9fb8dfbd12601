"""Ada-KV: a layer's budget spread over its heads by score (with a safeguard share per head).

Feng et al. 2024, *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference*. Per-head lengths are stored paged, so the memory is really freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Wrapper, register
from kvfold.methods.core.budgets import adakv_head_budgets
from kvfold.methods.core.spec import SpecError

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- wrappers


@register
@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550, §3–4, Algorithm 1): the layer's budget is
    spread over its KV heads by choosing the top entries of all heads jointly, with the α
    safeguard (each head first gets ``α`` of its uniform share). Rows of different lengths are
    stored paged, so the memory held follows the per-head budgets (nothing is masked).

    Parameters:
        alpha: safeguard fraction (0.2 in the paper; 1 = uniform budgets).
    """

    name: ClassVar[str] = "adakv"
    description: ClassVar[str] = "per-head budgets across the heads of a layer (alpha safeguard 0.2), real lengths"
    paper: ClassVar[str] = (
        "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient "
        "LLM Inference"
    )
    alpha: float = 0.2

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"adakv: alpha must be in [0, 1]; got {self.alpha}")

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        valid = layer.valid_mask()
        return adakv_head_budgets(scores, counts, alpha=self.alpha, protected=protected, valid=valid)
