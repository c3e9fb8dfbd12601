"""KVzip: query-agnostic importance from a repeat pass, the attention each entry receives while the
model repeats the context.

Kim et al. 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction* (§3,
Appendix). The repeat pass itself (:mod:`kvfold.methods.core.repeat`) is shared with Attention
Matching's reference queries: one pass per prefilled context. Budgets are allocated over all
layers and heads at once (:func:`kvfold.methods.core.budgets.global_head_budgets`).
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.budgets import global_head_budgets
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.head_schedule import HeadSchedule
from kvfold.methods.core.repeat import RepeatPrompt, shared_repeat_pass
from kvfold.methods.core.scoring import pool_tokens
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor
SCOPES = ("all", "chunk", "auto")
"""``kvzip[scope=…]``: which entries a repeat chunk's queries score (``auto``: see :meth:`KVzip.resolved_scope`)."""
SCOPE_CHUNK_FROM = 4096
"""``scope=auto`` scores by chunk from this many context tokens on (with a fresh prefill's cache)."""


def scheduled_counts(
    schedule: HeadSchedule, protected: dict[int, Tensor], layers: dict[int, FoldedLayer], per_row: Tensor
) -> dict[int, Tensor]:
    """Entries per ``(B, H)`` of each layer under a head-budget schedule: each head's protected
    entries, plus its share (:meth:`HeadSchedule.counts`) of what the budget leaves after every
    head's protected ones; the total is the budget's ``per_row · heads · layers`` (up to rounding).

    Args:
        schedule: the shares.
        protected: per layer ``(B, H, N)`` bool, the entries kept whatever their score (sinks).
        layers: the folded layers by index.
        per_row: ``(B,)`` entries per KV head and layer on average (the budget).
    """
    kept = {i: p.sum(-1) for i, p in protected.items()}
    heads = sum(layers[i].num_heads for i in protected)
    left = (per_row.to(torch.float64) * heads - sum(k.sum(-1).cpu().double() for k in kept.values())).clamp_min(0)
    free = {i: layers[i].valid_mask().sum(-1) - kept[i] for i in protected}
    shared = schedule.counts(left / heads, free)
    return {i: shared[i].to(kept[i].device) + kept[i] for i in protected}


# ---------------------------------------------------------------------------- KVzip

__all__ = ["KVzip", "RepeatPrompt", "is_structure_text", "scheduled_counts", "structure_mask", "structure_tokens"]


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

    Two successors' options (both off by default):

    * ``plus=true``: KVzip+ (Jégou & Jeblick 2026, *KVzap*, arXiv:2601.07891; kvpress
      ``KVzipPress(kvzip_plus_normalization=True)``): each attention row of the repeat pass is
      divided by ``‖x_t‖``, the norm of the hidden state entering the layer's attention (after the
      input layernorm), and each column multiplied by ``‖W_Oʰ v_i‖``, the entry's value through
      query head ``h``'s columns of ``o_proj``; the max then runs over the queries and the GQA
      group (:mod:`kvfold.methods.core.kvzip_plus`). Same pass, same global ranking.
    * ``demote=f`` < 1: structure demotion (NVIDIA/kvpress#288, open): the final score of every
      *structure* token is multiplied by ``f``. A token is structure when its decoded text is made
      only of whitespace, punctuation and symbols (:func:`is_structure_text`), its id occurs at
      least ``demote_repeats`` times in the repeated text, and it is not glued between two
      alphanumeric characters (the ``-`` of a UUID, the ``.`` of 3.14; :func:`structure_tokens`).
      Applied after ``pool``; needs the tokenizer and the cache of a fresh prefill (one slot per
      context token).

    ``scope=chunk`` scores each entry by the queries of the one repeat chunk that repeats its token
    (the authors' release scores a chunk's own entries): the scoring then costs each chunk's span,
    linear in the length, where ``scope=all`` reads every entry against every repeat query.
    Identical on contexts of one chunk; needs the cache of a fresh prefill. ``scope=auto`` (the
    default) is ``chunk`` on a fresh prefill of at least :data:`SCOPE_CHUNK_FROM` tokens, else
    ``all``: shorter contexts and compacted caches (a chat) are scored as the paper scores them.

    ``schedule=path.json`` takes each head's count from an Attention Matching head-budget schedule
    (Zweiger et al. 2026, §3.4, Appendix E; :mod:`kvfold.methods.core.head_schedule`) instead of
    KVzip's one ranking over every layer and head: each head keeps its sinks and its share of the
    rest of the budget, filled with its own highest scores.

    Differences from the release: the scores use the attention over the whole context (the
    release restricts the softmax to the chunk's own entries and the sinks, for speed), and below
    4,096 tokens a chunk's queries score every entry (max over chunks; ``scope=chunk`` scores its own).
    Cost: about two extra prefills.

    Parameters:
        chunk: tokens of context repeated per pass (2048).
        sinks: first tokens always kept (4).
        layerwise: same budget in every layer instead of one ranking over all layers.
        pool: odd max-pooling kernel over neighbouring tokens' scores (1 = none, the paper).
        plus: KVzip+'s normalized scores instead of KVzip's.
        demote: factor in [0, 1] on the scores of structure tokens (1 = none, the paper; NVIDIA/kvpress#288 uses 0.25).
        demote_repeats: occurrences of a token id in the context that make it structure (NVIDIA/kvpress#288's 4).
        scope: ``all`` (every entry scored by every repeat chunk's queries), ``chunk`` (by its own
            chunk's only; the release's cost) or ``auto`` (:meth:`resolved_scope`).
        schedule: a head-budget schedule JSON file for this model (per-head counts), or None (one
            ranking over every layer and head).
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
    plus: bool = False
    demote: float = 1.0
    demote_repeats: int = 4
    scope: str = "auto"
    schedule: str | None = None

    def validate(self) -> None:
        if self.chunk < 1 or self.sinks < 0:
            raise SpecError(f"kvzip: chunk must be ≥ 1 and sinks ≥ 0; got chunk={self.chunk}, sinks={self.sinks}")
        if self.pool < 1 or self.pool % 2 == 0:
            raise SpecError(f"kvzip: pool must be an odd kernel ≥ 1 (1 = no pooling); got {self.pool}")
        if self.schedule and self.layerwise:
            raise SpecError("kvzip: schedule and layerwise each set the per-head budgets; use one of them")
        if self.scope not in SCOPES:
            raise SpecError(f"kvzip: scope must be one of {', '.join(SCOPES)}; got {self.scope!r}")
        if not 0.0 <= self.demote <= 1.0 or self.demote_repeats < 1:
            raise SpecError(
                f"kvzip: demote must be in [0, 1] and demote_repeats ≥ 1; got {self.demote}, {self.demote_repeats}"
            )

    def resolved_scope(self, ctx: CompressionContext | None) -> str:
        """``all`` or ``chunk`` on ``ctx``: ``auto`` scores by chunk on a fresh prefill's cache of at
        least :data:`SCOPE_CHUNK_FROM` context tokens (the chunks' own scoring is then linear in the
        length), else every entry by every query; without a context, ``auto`` is ``all``."""
        if self.scope != "auto":
            return self.scope
        if ctx is None or not ctx.context_lengths.numel() or int(ctx.context_lengths.max()) < SCOPE_CHUNK_FROM:
            return "all"
        return "chunk" if ctx.is_fresh_prefill() else "all"

    def score_field(self, ctx: CompressionContext | None = None) -> str:
        """The repeat pass's scores this selector ranks by on ``ctx``
        (:data:`kvfold.methods.core.repeat.SCORE_FIELDS`)."""
        scoped = "span_" if self.resolved_scope(ctx) == "chunk" else ""
        return scoped + ("plus_scores" if self.plus else "scores")

    def repeat_records(self, ctx: CompressionContext | None = None) -> frozenset[str]:
        return frozenset({self.score_field(ctx)})

    def prepare(self, ctx: CompressionContext) -> None:
        # one repeat pass per prefilled context, whatever the method and budget (copies: later steps
        # edit scores); the same pass gives Attention Matching its reference queries
        field = self.score_field(ctx)
        found = shared_repeat_pass(ctx, self.chunk, frozenset({field}))
        shared = getattr(found, field)
        scores = {layer_idx: pool_tokens(s, self.pool).clone() for layer_idx, s in shared.items()}
        if self.demote != 1.0:
            self.demote_structure(scores, ctx)
        ctx.memo["kvzip_scores"] = scores
        if not self.layerwise:
            layers = dict(ctx.cache.folded_layers)
            order = list(scores)
            heads = sum(layers[i].num_heads for i in order)
            protected = [self.protected(i, layers[i], ctx) for i in order]
            valid = [layers[i].valid_mask() for i in order]

            schedule = HeadSchedule.load(self.schedule, ctx.model) if self.schedule else None

            def allocation(per_row: Tensor) -> dict[int, Tensor]:  # budget · H · L per row, one ranking
                if schedule is not None:
                    return scheduled_counts(schedule, dict(zip(order, protected, strict=True)), layers, per_row)
                counts = global_head_budgets([scores[i] for i in order], per_row * heads, protected, valid)
                return dict(zip(order, counts, strict=True))

            ctx.memo["kvzip_counts"] = allocation(ctx.row_budgets)
            if ctx.selection_scale != 1.0:  # a pre-selection: KVzip's own allocation at the budget too
                ctx.memo["kvzip_target_counts"] = allocation(ctx.target_row_budgets)

    def demote_structure(self, scores: dict[int, Tensor], ctx: CompressionContext) -> None:
        """Multiply the scores of the structure tokens (:func:`structure_mask`) by ``demote``, in
        place of ``scores``; every other score stays as it is (NVIDIA/kvpress#288)."""
        mask = structure_mask(ctx, self.demote_repeats)
        for layer_idx, s in scores.items():
            if s.shape[-1] != mask.shape[1]:
                raise UserError(
                    f"kvzip[demote]: layer {layer_idx} holds {s.shape[-1]} entries for {mask.shape[1]} context "
                    "tokens; structure demotion needs the cache of a fresh prefill (one entry per token)"
                )
            demoted = mask.to(s.device)[:, None, :]
            scores[layer_idx] = torch.where(demoted, s * self.demote, s)
        ctx.report["kvzip_demoted"] = mask.sum(-1).tolist()

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

    def target_counts(self, layer_idx, layer, selected, ctx) -> Tensor:
        """After a pre-selection, KVzip's own global allocation at the budget (each head's share
        of one ranking of every entry, §3.2), not the pre-selection's shape scaled."""
        targets = ctx.memo.get("kvzip_target_counts")
        if targets is None:
            return super().target_counts(layer_idx, layer, selected, ctx)
        return torch.minimum(targets[layer_idx].to(selected.device), selected)


# ---------------------------------------------------------------------------- structure demotion


def is_structure_text(text: str) -> bool:
    """Whether a decoded token is structure: at least one character, every one whitespace,
    punctuation or a symbol (Unicode categories ``P*`` and ``S*``). ``U+FFFD`` (what byte-level
    BPE decodes a piece of a multi-byte character to) is content."""
    return bool(text) and all(c.isspace() or (c != "\ufffd" and unicodedata.category(c)[0] in "PS") for c in text)


def structure_tokens(tokenizer: Any, row_ids: list[int], start: int, min_repeats: int) -> list[int]:
    """Positions ``j ≥ start`` of ``row_ids`` that structure demotion lowers (NVIDIA/kvpress#288).

    Token ``j`` is demoted when (1) its text ``tokenizer.decode([id])`` is structure
    (:func:`is_structure_text`); (2) its id occurs at least ``min_repeats`` times in
    ``row_ids[start:]`` (the repeated text, the template before it not counted); and (3) it is not
    a joiner: a token without whitespace whose previous token's text ends with an alphanumeric
    character and whose next token's text starts with one (``3.14``, ``8f-4a``, ``snake_case``).
    """
    counts = Counter(row_ids[start:])
    texts = {token: tokenizer.decode([token]) for token in counts}
    out = []
    for j in range(start, len(row_ids)):
        text = texts[row_ids[j]]
        if counts[row_ids[j]] < min_repeats or not is_structure_text(text):
            continue
        joiner = start < j < len(row_ids) - 1 and not any(c.isspace() for c in text)
        if joiner and texts[row_ids[j - 1]][-1:].isalnum() and texts[row_ids[j + 1]][:1].isalnum():
            continue
        out.append(j)
    return out


def structure_mask(ctx: CompressionContext, min_repeats: int) -> Tensor:
    """``(B, W)`` bool over the columns of ``ctx.input_ids``: the structure tokens of each row's
    repeated text (:func:`structure_tokens`; the text starts where the repeat pass starts it).

    Raises:
        ValueError: no tokenizer (the tokens must be decoded).
    """
    if ctx.tokenizer is None:
        raise UserError("kvzip[demote]: structure demotion decodes the context tokens and needs the tokenizer")
    prompt = RepeatPrompt.build(ctx.tokenizer)
    batch, width = ctx.input_ids.shape
    mask = torch.zeros(batch, width, dtype=torch.bool)
    for b, length in enumerate(ctx.context_lengths.tolist()):
        row = ctx.input_ids[b, width - length :].tolist()
        for j in structure_tokens(ctx.tokenizer, row, prompt.text_start(row), min_repeats):
            mask[b, width - length + j] = True
    return mask
