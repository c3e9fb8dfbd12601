"""SnapKV and PyramidKV: attention of the last context queries, pooled; the window is kept.

Li et al. 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*; Cai et al. 2024,
*PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling* (layer budgets
decreasing with depth). Query-agnostic protocol: the window is the context's last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.budgets import pyramid_layer_budgets
from kvfold.methods.core.model import module_scaling
from kvfold.methods.core.scoring import (
    snapkv_scores,
)
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import captured_window, layer_content
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- SnapKV, PyramidKV


@register
@dataclass
class SnapKV(Selector):
    """SnapKV (Li et al. 2024, arXiv:2404.14469, §4 and Algorithm 1).

    Each entry's score is the attention it receives from the last ``window`` prompt queries (the
    observation window), pooled along tokens (``kernel``, ``pooling``), averaged over a GQA group;
    the top entries plus the window itself are kept. In the query-agnostic protocol the window is
    the end of the context, not the question (so it may miss what a later question needs).

    Parameters:
        window: observation window (32 in the paper).
        kernel: pooling kernel, odd (SnapKV uses 5 or 7; 1 = no pooling).
        pooling: ``max`` (the paper's clustering) or ``avg``.
    """

    name: ClassVar[str] = "snapkv"
    description: ClassVar[str] = "attention of the last 32 context queries, max-pooled; keeps the window"
    paper: ClassVar[str] = "Li et al. 2024, SnapKV: LLM Knows What You Are Looking for Before Generation"
    supports_chunked_prefill: ClassVar[bool] = True  # the window of the newest chunk scores the rest
    comparable_scores: ClassVar[bool] = True  # attention probabilities, one scale in every layer
    window: int = 32
    kernel: int = 5
    pooling: str = "max"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        if self.window < 1:
            raise SpecError(f"{self.name}: window must be ≥ 1; got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise SpecError(f"{self.name}: kernel must be an odd positive integer; got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise SpecError(f"{self.name}: pooling must be 'max' or 'avg'; got {self.pooling!r}")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, beta, valid = layer_content(layer)
        queries = captured_window(layer, self.window, self.name)
        scaling = module_scaling(ctx, layer_idx, layer)
        return snapkv_scores(
            queries, keys, scaling, self.window, self.kernel, self.pooling, log_mass=beta, valid=valid
        )

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=self.window, valid=valid)


@register
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069, §3): SnapKV scores with budgets that decrease
    with depth (an arithmetic sequence; the top layer gets ``1/β`` of the average outside the
    window, see :func:`kvfold.methods.core.budgets.pyramid_layer_budgets`).

    Budgets are computed per batch row (rows may hold contexts of different lengths); the mean
    over layers equals the requested budget.

    Parameters:
        window, kernel, pooling: as SnapKV.
        beta: ``β`` of the pyramid (20 in the paper).
    """

    name: ClassVar[str] = "pyramidkv"
    description: ClassVar[str] = "SnapKV scores, layer budgets decreasing with depth (pyramid, beta=20)"
    paper: ClassVar[str] = (
        "Cai et al. 2024, PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling"
    )
    supports_chunked_prefill: ClassVar[bool] = False  # layer 0 holds more than the budget
    beta: float = 20.0

    def validate(self) -> None:
        super().validate()
        if self.beta <= 0:
            raise SpecError(f"{self.name}: beta must be > 0; got {self.beta}")

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        folded = [i for i, _ in ctx.cache.folded_layers]
        budgets = [ctx.row_budgets.clone() for _ in range(ctx.num_layers)]
        rows = zip(ctx.row_budgets.tolist(), ctx.context_lengths.tolist(), strict=True)
        per_row = [  # one schedule per batch row, (L_folded,) each
            pyramid_layer_budgets(avg, len(folded), self.beta, self.window, context_tokens=n) for avg, n in rows
        ]
        table = torch.tensor(per_row, dtype=torch.long).T  # (L_folded, B)
        for j, layer_idx in enumerate(folded):
            budgets[layer_idx] = table[j].clone()
        return budgets
