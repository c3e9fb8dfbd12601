"""``global:``: one ranking of the entries of every layer and head, for any selector.

KVzip's allocation (Kim et al. 2025, *KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction*, §3.2) offered to every scorer: the cache's total budget goes to the
highest-scored entries wherever they are, so a layer or head whose scores stand out keeps more
entries and a flat one keeps fewer. Per-head lengths are stored paged: the memory is really freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import ComposedMethod, Wrapper, register
from kvfold.methods.core.budgets import global_head_budgets
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.scoring import zscore
from kvfold.methods.core.spec import SpecError

Tensor = torch.Tensor

NORMALIZATIONS = ("auto", "none", "zscore")


@register
@dataclass
class GlobalBudget(Wrapper):
    """Global budgets: the entries of all layers and KV heads ranked together (KVzip's
    non-uniform allocation, Kim et al. 2025, arXiv:2505.23416, §3.2), for any selector
    (``global:snapkv``, ``global:leverage+am_fit``).

    Each batch row keeps the same total as the selector's own layer budgets (``budget · H · L``
    for uniform ones): protected entries first (the selector's window or sinks), then each head's
    ``minimum`` best, then the highest scores of the whole cache. It replaces the selector's
    layer and head split (as ``adakv:`` replaces the head split within a layer).

    Scales: scores are compared across layers, so they must share one. Attention probabilities
    (selectors with ``comparable_scores``: SnapKV, PyramidKV, KVzip, H2O, TOVA) are compared as they
    are, as KVzip compares its max-attention scores. Other scores (key norms, leverage, expected
    attention × ‖v‖, …) are standardised per layer first (``zscore``: mean 0, std 1 over the
    layer's unprotected valid entries of each batch row), so a layer gets entries for how far its
    best entries stand above its own average, not for the units of its scores.

    Parameters:
        normalize: ``auto`` (as above), ``none`` (raw scores) or ``zscore`` (per layer).
        minimum: least entries each (layer, head) keeps (1: no head is left empty).
    """

    name: ClassVar[str] = "global"
    description: ClassVar[str] = "one ranking over all layers and heads (KVzip's allocation) for any selector"
    paper: ClassVar[str] = "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
    normalize: str = "auto"
    minimum: int = 1

    def validate(self) -> None:
        if self.normalize not in NORMALIZATIONS:
            raise SpecError(f"global: normalize must be one of {', '.join(NORMALIZATIONS)}; got {self.normalize!r}")
        if self.minimum < 0:
            raise SpecError(f"global: minimum must be ≥ 0; got {self.minimum}")

    def standardises(self, method: ComposedMethod) -> bool:
        """Whether scores are z-scored per layer before the ranking."""
        if self.normalize == "auto":
            return not getattr(method.selector, "comparable_scores", False)
        return self.normalize == "zscore"

    def plan(self, method: ComposedMethod, budgets: list[Tensor], ctx: CompressionContext) -> list[Tensor]:
        standardise = self.standardises(method)
        order, scores, protected, valid = [], [], [], []
        totals = torch.zeros_like(ctx.row_budgets)
        for layer_idx, layer in ctx.cache.folded_layers:
            score, _ = method.layer_scores(layer_idx, layer, ctx)
            ok = layer.valid_mask()
            prot = method.selector.protected(layer_idx, layer, ctx)
            if standardise:
                score = zscore(score, ok if prot is None else ok & ~prot.bool())
            order.append(layer_idx)
            scores.append(score)
            protected.append(prot)
            valid.append(ok)
            layer_budget = budgets[layer_idx].cpu()  # (B,) per head, or (B, H)
            totals += layer_budget * layer.num_heads if layer_budget.dim() == 1 else layer_budget.sum(-1)
        counts = global_head_budgets(scores, totals, protected, valid, minimum=self.minimum)
        planned = dict(zip(order, counts, strict=True))
        ctx.memo["global_counts"] = planned
        return [planned[i].cpu() if i in planned else b for i, b in enumerate(budgets)]

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        return ctx.memo["global_counts"][layer_idx].to(counts.device)
