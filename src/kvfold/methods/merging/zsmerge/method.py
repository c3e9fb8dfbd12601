"""The registered ``zsmerge`` and ``zeromerge`` standalones (α = 1 and α = 0.6). See
:mod:`kvfold.methods.merging.zsmerge`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.methods.core.base import Standalone, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import fresh_window_queries
from kvfold.methods.core.spec import SpecError
from kvfold.methods.merging.zsmerge.merge import (
    SLOT_METRICS,
    BudgetSplit,
    Residuals,
    fold_layers,
    prefill_scores,
    split_budget,
)
from kvfold.methods.merging.zsmerge.online import ZSMergeOnline
from kvfold.runtime.attention import attention_scalings
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- registered methods


@register
@dataclass
class ZSMerge(Standalone):
    """ZSMerge (``papers/zsmerge.md`` §3): proximity + context + residual slots with compensated
    attention β = α·log w; one-shot after prefill and online at every decoding step.

    Parameters:
        alpha: α of eq. 8 in [0, 1] (1 in ZSMerge; 0 = merged slots without compensation).
        residual: ``B_r``: a fraction (< 1) of ``B − B_p`` (App. C.2 recommends 0.02; at least one
            slot when > 0) or a slot count (≥ 1). 0 = pure eviction with the same scores.
        proximity: ``B_p``: a fraction (< 1) of the budget (App. C.2 recommends 0.5) or a count.
        decay: λ of eq. 5 (0.98).
        window: prefill queries that initialise the scores (App. B: 8).
        kernel: max-pooling kernel of the prefill scores, odd (the authors' code: 5; 1 = none).
        prefill: ``merge`` (Algorithm 1 over the prompt, the paper) or ``pool`` (evicted tokens
            mean-pooled into ``B_r`` contiguous groups, the authors' code).
        online: keep the budget during decoding (Algorithm 1 at every step).
        slot_metric: how an evicted token picks its residual slot: ``dot`` (eq. 6, the largest
            ``k_r·k_t``, the paper) or ``l2`` (the nearest slot key, an option of the authors' code).
    """

    name: ClassVar[str] = "zsmerge"
    description: ClassVar[str] = (
        "recent + top decayed-attention tokens; evicted ones merged into residual slots, β = α·log w (α=1); online"
    )
    supports_chunked_prefill: ClassVar[bool] = True
    chunked_prefill_online: ClassVar[bool] = True  # Algorithm 1 runs on, token by token, over the chunks
    paper: ClassVar[str] = (
        "Liu, Liu and Tang 2025, ZSMerge: Zero-Shot KV Cache Compression for Memory-Efficient Long-Context LLMs"
    )
    alpha: float = 1.0
    residual: float = 0.02
    proximity: float = 0.5
    decay: float = 0.98
    window: int = 8
    kernel: int = 5
    prefill: str = "merge"
    online: bool = True
    slot_metric: str = "dot"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        name = self.name
        if not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"{name}: alpha must be in [0, 1] (Theorem 1 needs α ≤ 1); got {self.alpha}")
        if not 0.0 <= self.decay <= 1.0:
            raise SpecError(f"{name}: decay must be in [0, 1]; got {self.decay}")
        for option in ("residual", "proximity"):
            value = getattr(self, option)
            if value < 0 or math.isnan(value) or (value >= 1 and value != int(value)):
                raise SpecError(f"{name}: {option} must be a fraction in [0, 1) or a whole count ≥ 1; got {value}")
        if self.window < 1:
            raise SpecError(f"{name}: window must be ≥ 1; got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise SpecError(f"{name}: kernel must be an odd positive integer; got {self.kernel}")
        if self.slot_metric not in SLOT_METRICS:
            raise SpecError(f"{name}: slot_metric must be one of {', '.join(SLOT_METRICS)}; got {self.slot_metric!r}")
        if self.prefill not in ("merge", "pool"):
            raise SpecError(f"{name}: prefill must be 'merge' or 'pool'; got {self.prefill!r}")

    def split(self, budgets: Tensor) -> BudgetSplit:
        """``B_p``, ``B_c``, ``B_r`` for per-row budgets ``(B,)``."""
        return split_budget(budgets, self.proximity, self.residual)

    def compress(self, ctx: CompressionContext) -> None:
        layers = ctx.cache.folded_layers
        scalings = ctx.memo.setdefault("zsmerge_scalings", attention_scalings(ctx.model))
        scores = []
        for layer_idx, layer in layers:
            scores.append(self._scores(layer, scalings.get(layer_idx)))
        split = self.split(ctx.row_budgets)
        indices = [layer_idx for layer_idx, _ in layers]

        def record(i: int, keep: Tensor, lengths: Tensor, res: Residuals) -> None:
            """Merge map: kept slots; each later victim absorbed by the token that opened its slot."""
            if res.founders is None:  # pool mode: groups have no carrier token
                return
            ctx.record_kept(indices[i], keep, lengths)
            founder = F.pad(res.founders, (0, 1), value=-1)
            carrier = founder.gather(2, torch.where(res.merged_slot >= 0, res.merged_slot, founder.shape[-1] - 1))
            ctx.record_merges(indices[i], torch.where(res.merged >= 0, carrier, -1), res.merged)

        recorder = record if ctx.merge_recorder is not None else None
        fold_layers(
            [layer for _, layer in layers], scores, split, self.alpha, self.prefill, record=recorder,
            slot_metric=self.slot_metric,
        )  # fmt: skip

    def online_policy(self, ctx: CompressionContext) -> ZSMergeOnline | None:
        if not self.online:
            return None
        budgets = ctx.row_budgets
        scalings = attention_scalings(ctx.model)
        layers = {i: scalings.get(i) for i, _ in ctx.cache.folded_layers}
        return ZSMergeOnline(
            budgets, self.split(budgets), layers, self.alpha, self.decay, self.window, self.kernel, self.prefill,
            self.slot_metric,
        )  # fmt: skip

    def _scores(self, layer: FoldedLayer, scaling: float | None) -> Tensor:
        queries = fresh_window_queries(layer, self.window, self.name)
        keys, _, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        scale = scaling if scaling is not None else layer.head_dim**-0.5
        return prefill_scores(queries, keys, scale, self.decay, self.kernel, beta, valid)


@register
@dataclass
class ZeroMerge(ZSMerge):
    """ZeroMerge (``papers/zeromerge.md`` §3, §4.4): the earlier version of ZSMerge, α = 0.6.

    Same parameters as :class:`ZSMerge`.
    """

    name: ClassVar[str] = "zeromerge"
    description: ClassVar[str] = "ZSMerge with the ZeroMerge paper's compensation α = 0.6; online"
    paper: ClassVar[str] = (
        "Liu, Liu and Tang 2025, ZeroMerge: Parameter-Free KV Cache Compression for Memory-Efficient Long-Context LLMs"
    )
    alpha: float = 0.6
