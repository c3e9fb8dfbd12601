"""CriticalKV: scores reweighted by the output each entry's value produces (‖W_o v‖₁), two-stage
selection.

Feng et al. 2025, *Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Wrapper, register
from kvfold.methods.core.model import o_proj_weight
from kvfold.methods.core.scoring import (
    critical_reweight,
)
from kvfold.methods.core.selection import critical_two_stage_select
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import layer_content
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor


@register
@dataclass
class CriticalKV(Wrapper):
    """CriticalKV (Feng et al. 2025, arXiv:2502.03805, §3–4): output-aware selection.

    Scores are reweighted by the size of what the entry writes to the layer output,
    ``(a + ε)·‖W_oʰ v‖₁`` (:func:`kvfold.methods.core.scoring.critical_reweight`), and selection is
    two-stage: the first ``first_stage`` share of each head's budget by the inner scorer's
    attention scores, the rest by the reweighted scores. Needs non-negative attention-like
    scores from the inner scorer (not knorm, random or streamingllm).

    Parameters:
        first_stage: share of the budget chosen by attention scores (0.5 in the paper).
        epsilon: ``ε`` added to the attention score.
    """

    name: ClassVar[str] = "criticalkv"
    description: ClassVar[str] = "reweight scores by ||W_o v||_1 (output-aware), two-stage selection (0.5)"
    paper: ClassVar[str] = (
        "Feng et al. 2025, Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
    )
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def validate(self) -> None:
        if not 0.0 <= self.first_stage <= 1.0 or self.epsilon < 0:
            raise SpecError("criticalkv: first_stage must be in [0, 1] and epsilon ≥ 0")

    def rescore(self, layer_idx: int, layer: FoldedLayer, scores: Tensor, ctx: CompressionContext) -> Tensor:
        _, values, _, valid = layer_content(layer)
        if bool((scores[valid] < 0).any()):
            raise ValueError(
                "criticalkv reweights attention scores (≥ 0); the inner method gives negative scores "
                "(use an attention-based scorer such as snapkv, h2o, tova, kvzip or expected_attention)"
            )
        weight = o_proj_weight(ctx, layer_idx)
        return critical_reweight(
            scores, values, weight, layer.num_heads, layer.head_dim, epsilon=self.epsilon, valid=valid
        )

    def select(self, layer_idx, layer, received, scores, counts, protected, valid, ctx):
        return critical_two_stage_select(received, scores, counts, self.first_stage, protected, valid)
