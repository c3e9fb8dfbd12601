"""KVzip: query-agnostic importance from a repeat pass, the attention each entry receives while the
model repeats the context.

Kim et al. 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction* (§3,
Appendix). The repeat prompt comes from :mod:`kvfold.prompts`; budgets are allocated over all
layers and heads at once (:func:`kvfold.methods.core.budgets.global_head_budgets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfold.cache import FoldedLayer
from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.budgets import global_head_budgets
from kvfold.methods.core.scoring import (
    pool_gqa,
)
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.prompts import encode, template_parts

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- KVzip

REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_NEXT = "Repeat the part of the previous context exactly, starting with"


@dataclass
class RepeatPrompt:
    """Token ids of KVzip's reconstruction prompt (Kim et al. 2025, §3.1 and Appendix).

    The repeat input of chunk ``i`` is ``first`` (i = 0) or ``next`` + the last ``overlap`` tokens
    of chunk ``i − 1``, then ``tail`` (end of the user turn, assistant header), then the chunk.
    ``prefix`` holds the ids of the template that precedes the context text (not repeated).
    """

    first: list[int]
    next: list[int]
    tail: list[int]
    prefix: list[int]

    @classmethod
    def build(cls, tokenizer: Any) -> RepeatPrompt:
        """From the tokenizer (chat template when it has one); all empty without a tokenizer."""
        if tokenizer is None:
            return cls([], [], [], [])
        head, first, tail = template_parts(tokenizer, REPEAT_FIRST)
        _, following, _ = template_parts(tokenizer, REPEAT_NEXT)
        return cls(
            first=encode(tokenizer, first, special=False),
            next=encode(tokenizer, following, special=False),
            tail=encode(tokenizer, tail, special=False) if tail else [],
            prefix=encode(tokenizer, head, special=True),
        )

    def chunk_inputs(self, row_ids: list[int], chunk: int, overlap: int = 8) -> list[list[int]]:
        """The repeat inputs of one context row, chunk by chunk."""
        start = len(self.prefix) if self.prefix and row_ids[: len(self.prefix)] == self.prefix else 0
        text = row_ids[start:] or row_ids
        pieces = [text[lo : lo + chunk] for lo in range(0, len(text), chunk)]
        inputs = []
        for i, piece in enumerate(pieces):
            prompt = self.first if i == 0 else self.next + pieces[i - 1][-overlap:]
            inputs.append(prompt + self.tail + piece)
        return inputs


class RepeatAttentionRecorder:
    """Online-policy hook for KVzip's repeat pass: per layer, the max attention each context entry
    receives from the repeat input's queries, max over the GQA group (Kim et al. 2025, §3)."""

    needs_attention = True

    def __init__(self, context_slots: int) -> None:
        self.context_slots = context_slots
        self.scores: dict[int, Tensor] = {}

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        if probs is None:
            raise RuntimeError("KVzip's repeat pass needs attention probabilities from a filled dense cache")
        received = probs[..., : self.context_slots].amax(dim=2)  # max over queries, (B, H_q, N)
        received = pool_gqa(received, layer.num_heads, "max")  # max over the GQA group
        previous = self.scores.get(layer_idx)
        self.scores[layer_idx] = received if previous is None else torch.maximum(previous, received)


def kvzip_scores(ctx: CompressionContext, chunk: int) -> dict[int, Tensor]:
    """KVzip importance ``(B, H_kv, N)`` of every folded layer from repeat passes over copies of
    ``ctx.cache`` (one batch row and one chunk at a time, so memory stays bounded)."""
    prompt = RepeatPrompt.build(ctx.tokenizer)
    batch, width = ctx.input_ids.shape
    lengths = ctx.context_lengths.tolist()
    per_row: list[dict[int, Tensor]] = []
    for b in range(batch):  # rows differ in length: their repeat inputs differ
        row_cache = ctx.cache  # never modified: every chunk runs on its own copy
        if batch > 1:
            row_cache = ctx.cache.copy()
            row_cache.batch_select_indices(torch.tensor([b], device=ctx.input_ids.device))
        row_ids = ctx.input_ids[b, width - lengths[b] :].tolist()
        recorder = RepeatAttentionRecorder(width)
        for ids in prompt.chunk_inputs(row_ids, chunk):
            work = row_cache.copy()
            work.policy = recorder
            positions = torch.arange(lengths[b], lengths[b] + len(ids), device=ctx.input_ids.device)
            with torch.no_grad():
                ctx.model(
                    input_ids=torch.tensor([ids], device=ctx.input_ids.device),
                    past_key_values=work,
                    position_ids=positions[None],
                    use_cache=True,
                    logits_to_keep=1,
                )
        per_row.append(recorder.scores)
    scores = {}
    for layer_idx, layer in ctx.cache.folded_layers:
        stacked = torch.cat([row[layer_idx] for row in per_row])
        scores[layer_idx] = stacked.masked_fill(~layer.valid_mask(), float("-inf"))
    return scores


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
    heads). The first ``sinks`` tokens are kept.

    Differences from the release: the scores use the attention over the whole context (the
    release restricts the softmax to the chunk's own entries and the sinks, for speed), and a
    chunk's queries score every entry (max over chunks). Cost: about two extra prefills.

    Parameters:
        chunk: tokens of context repeated per pass (2048).
        sinks: first tokens always kept (4).
        layerwise: same budget in every layer instead of one ranking over all layers.
    """

    name: ClassVar[str] = "kvzip"
    description: ClassVar[str] = "query-agnostic: max attention received while the model repeats the context"
    paper: ClassVar[str] = "Kim et al. 2025, KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
    comparable_scores: ClassVar[bool] = True  # max attention probabilities (§3.2 ranks them over all layers)
    chunk: int = 2048
    sinks: int = 4
    layerwise: bool = False

    def validate(self) -> None:
        if self.chunk < 1 or self.sinks < 0:
            raise SpecError(f"kvzip: chunk must be ≥ 1 and sinks ≥ 0; got chunk={self.chunk}, sinks={self.sinks}")

    def prepare(self, ctx: CompressionContext) -> None:
        # one repeat pass per prefilled context, whatever the budget (copies: later steps edit scores)
        shared = ctx.shared_result(("kvzip_scores", self.chunk), lambda: kvzip_scores(ctx, self.chunk))
        scores = {layer_idx: s.clone() for layer_idx, s in shared.items()}
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
