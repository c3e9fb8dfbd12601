"""KVzip: query-agnostic importance from a repeat pass, the attention each entry receives while the
model repeats the context.

Kim et al. 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction* (§3,
Appendix). The repeat pass itself (:mod:`kvfold.methods.core.repeat`) is shared with Attention
Matching's reference queries: one pass per prefilled context. Budgets are allocated over all
layers and heads at once (:func:`kvfold.methods.core.budgets.global_head_budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.budgets import global_head_budgets
from kvfold.methods.core.repeat import RepeatPrompt, shared_repeat_pass
from kvfold.methods.core.scoring import pool_tokens
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- KVzip

__all__ = ["KVzip", "RepeatPrompt"]


@register
@dataclass
class KVzip(Selector):
    """KVzip (Kim et al. 2025, arXiv:2505.23416, §3): query-agnostic scores from context
    reconstruction.

    The model reads "repeat the previous context" and the context again on a **copy** of the
    prefilled cache; an entry's score is the maximum attention it receives from the repeat
    input's queries (max over queries and over the GQA group). The repeat runs ``chunk`` tokens
    at a time (the paper's 2K chunks, each with the "starting with …" prompt and the last 8
    tokens of the previous chunk). By default entries are ranked across all layers and heads at
    once (the paper's non-uniform allocation: the cache total matches the budget); with
    ``layerwise=true`` every layer keeps the same budget (then ``adakv:kvzip`` spreads it over
    heads). The first ``sinks`` tokens are kept. ``pool`` > 1 max-pools the scores over that
    many neighbouring tokens before ranking (SnapKV's clustering, Li et al. 2024 §4.3; not in
    KVzip): a multi-token fact is then kept or dropped as a whole.

    Differences from the release: the scores use the attention over the whole context (the
    release restricts the softmax to the chunk's own entries and the sinks, for speed), and a
    chunk's queries score every entry (max over chunks). Cost: about two extra prefills.

    Parameters:
        chunk: tokens of context repeated per pass (2048).
        sinks: first tokens always kept (4).
        layerwise: same budget in every layer instead of one ranking over all layers.
        pool: odd max-pooling kernel over neighbouring tokens' scores (1 = none, the paper).
    """

    name: ClassVar[str] = "kvzip"
    query_agnostic: ClassVar[bool] = True
    uses_repeat_pass: ClassVar[bool] = True
    description: ClassVar[str] = "query-agnostic: max attention received while the model repeats the context"
    paper: ClassVar[str] = "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
    comparable_scores: ClassVar[bool] = True  # max attention probabilities (§3.2 ranks them over all layers)
    chunk: int = 2048
    sinks: int = 4
    layerwise: bool = False
    pool: int = 1

    def validate(self) -> None:
        if self.chunk < 1 or self.sinks < 0:
            raise SpecError(f"kvzip: chunk must be ≥ 1 and sinks ≥ 0; got chunk={self.chunk}, sinks={self.sinks}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise SpecError(f"kvzip: pool must be an odd kernel ≥ 1 (1 = no pooling); got {self.pool}")

    def prepare(self, ctx: CompressionContext) -> None:
        # one repeat pass per prefilled context, whatever the method and budget (copies: later steps
        # edit scores); the same pass gives Attention Matching its reference queries
        shared = shared_repeat_pass(ctx, self.chunk).scores
        scores = {layer_idx: pool_tokens(s, self.pool).clone() for layer_idx, s in shared.items()}
        ctx.memo["kvzip_scores"] = scores
        if not self.layerwise:
            layers = dict(ctx.cache.folded_layers)
            order = list(scores)
            totals = ctx.row_budgets * sum(layers[i].num_heads for i in order)  # budget · H · L per row
            counts = global_head_budgets(
                [scores[i] for i in order],
                totals,
                protected=[self.protected(i, layers[i], ctx) for i in order],
                valid=[layers[i].valid_mask() for i in order],
            )
            ctx.memo["kvzip_counts"] = dict(zip(order, counts, strict=True))

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return ctx.memo["kvzip_scores"][layer_idx]

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return first_valid(layer.valid_mask(), self.sinks)

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        budgets = super().layer_budgets(ctx)
        for layer_idx, counts in ctx.memo.get("kvzip_counts", {}).items():
            budgets[layer_idx] = counts.cpu()  # (B, H): per head, so a layer is skipped only if no head evicts
        return budgets

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        global_counts = ctx.memo.get("kvzip_counts")
        return counts if global_counts is None else global_counts[layer_idx].to(counts.device)
