"""SnapKV and PyramidKV: attention of the last context queries, pooled; the window is kept.

Li et al. 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*; Cai et al. 2024,
*PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling* (layer budgets
decreasing with depth). Query-agnostic protocol: the window is the context's last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.budgets import apportion, check_layer_budgets
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.scoring import GqaReduce, mask_invalid, pool_gqa, pool_tokens, window_attention
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import captured_window, layer_content
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


def snapkv_scores(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    window: int = 32,
    kernel: int = 5,
    pooling: Literal["max", "avg"] = "max",
    gqa_reduce: GqaReduce = "mean",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """SnapKV scores (Li et al. 2024, "SnapKV: LLM Knows What You Are Looking
    for Before Generation", arXiv:2404.14469).

    ``C = Σ_{window queries} softmax(q·Kᵀ·scaling + β) / W``, pooled along tokens with
    ``kernel`` (each query head separately), then reduced over the GQA group.

    The observation window's own tokens get their (finite) window-attention scores; pooling
    does not cross the prefix/window boundary (SnapKV pools the prefix only). SnapKV always
    keeps the window: pass ``protected_mask(..., recent=window)`` to :func:`~kvfold.methods.core.selection.topk_keep`.

    Args:
        queries: ``(B, H_q, Q, D)`` post-RoPE queries of the last ``Q`` context tokens; the last
            ``min(window, Q)`` are used.
        keys: ``(B, H_kv, N, D)``.
        scaling: logit scale (``1/√D``).
        window: observation window ``W`` (32 in SnapKV).
        kernel: odd pooling kernel (5 or 7 in SnapKV; 1 = none).
        pooling: ``"max"`` (SnapKV's default) or ``"avg"``.
        gqa_reduce: how the ``G`` query heads of a KV head combine (``"mean"`` as AdaKV/kvpress).
        log_mass, valid: see :mod:`kvfold.methods.core.scoring`.

    Returns:
        ``(B, H_kv, N)`` scores, ``-inf`` on padding.
    """
    width = min(window, queries.shape[2], keys.shape[2])
    if width < 1:
        raise ValueError(f"window must be ≥ 1 and queries non-empty; got window={window}")
    probs = window_attention(queries[:, :, -width:], keys, scaling, log_mass=log_mass, valid=valid)
    votes = probs.sum(dim=2) / width  # (B, H_q, N): mean attention over the window queries
    split = keys.shape[2] - width
    pooled = torch.cat(
        [pool_tokens(votes[..., :split], kernel, pooling), pool_tokens(votes[..., split:], kernel, pooling)],
        dim=-1,
    )
    return mask_invalid(pool_gqa(pooled, keys.shape[1], gqa_reduce), valid)


def pyramid_layer_budgets(
    avg_budget: int,
    num_layers: int,
    beta: float = 20.0,
    window: int = 32,
    context_tokens: int | None = None,
    min_budget: int = 1,
) -> list[int]:
    """PyramidKV layer budgets (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
    Pyramidal Information Funneling", arXiv:2406.02069): an arithmetic sequence decreasing with depth.

    With ``b = avg_budget − window`` entries per layer outside the window on average, the top layer
    gets ``b_min = b / β`` and layer 0 gets ``b_max = 2b − b_min`` (so the mean is ``b``), linearly
    in between; every layer also keeps its ``window``. When ``b_max`` exceeds the context
    (``context_tokens − window``), layer 0 is capped there and ``b_min = 2b − cap`` (as in the
    release). Rounded by largest remainder so the total is exactly ``num_layers · avg_budget``.

    Args:
        avg_budget: mean entries per layer (per KV head), an int (see :meth:`kvfold.runtime.budget.Budget.count`).
        num_layers: ``L``.
        beta: ``β`` (20 in the paper).
        window: the observation window kept in every layer.
        context_tokens: ``N``; no layer gets more than ``N``. ``avg_budget ≥ N`` keeps everything.
        min_budget: least entries per layer (≥ 1).

    Returns:
        ``L`` ints, non-increasing with depth, summing to ``L · min(avg_budget, N)``.
    """
    check_layer_budgets(avg_budget, num_layers, min_budget)
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    cap = context_tokens if context_tokens is not None else None
    if cap is not None and avg_budget >= cap:
        return [int(cap)] * num_layers
    outside = avg_budget - window
    if num_layers == 1 or outside <= 0:
        return [int(avg_budget)] * num_layers
    smallest = outside / beta
    largest = 2 * outside - smallest
    if cap is not None and largest > cap - window:
        largest = cap - window
        smallest = 2 * outside - largest
    step = (largest - smallest) / (num_layers - 1)
    real = [window + largest - layer * step for layer in range(num_layers)]
    return apportion(real, avg_budget * num_layers, minimum=min(min_budget, avg_budget), maximum=cap)


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
        scaling = layer_scaling(ctx, layer_idx, layer, require_module=True)
        return snapkv_scores(queries, keys, scaling, self.window, self.kernel, self.pooling, log_mass=beta, valid=valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=self.window, valid=valid)


@register
@dataclass
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024, arXiv:2406.02069, §3): SnapKV scores with budgets that decrease
    with depth (an arithmetic sequence; the top layer gets ``1/β`` of the average outside the
    window, see :func:`pyramid_layer_budgets`).

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
