"""Reference queries for Attention Matching (Zweiger et al. 2026, §3.1, App. C.3–C.4, App. D).

A compaction is fitted on reference queries ``Q_ref``: a proxy for the queries the model will
send to the compacted context. Sources (combine them with ``+``):

* ``context`` — context-prefill: the post-RoPE queries of the context's own prefill (H2O's
  choice). Read from ``layer.captured_queries`` when the prefill kept enough of them
  (``kvfold.prefill(methods=[...])`` asks for the method's ``query_window``); otherwise one extra
  forward pass of the context records them.
* ``repeat`` — repeat-prefill (KVzip's idea, §3.1): ``"{C} Repeat the previous context exactly.
  {C}"`` with the chat template; the model reads the instruction and the context again over a
  **copy** of the prefilled cache and the queries from the instruction through the second ``C``
  are recorded. This is KVzip's repeat pass (:mod:`kvfold.methods.core.repeat`, its prompt and
  its 2K chunks), run once per prefilled context for every method that needs it.
* ``selfstudy`` — self-study (§3.1, App. C.4): a few fixed prompts are appended to a copy of the
  cache, answers are sampled (seeded) and the queries of prompts and answers are recorded.
* ``random`` — ``q ~ N(0, I_d)`` per KV head (App. D, "random-vectors-no-qnorm").

GQA (App. B.3): the queries of all query heads of a group are reference queries of their KV head,
so one token gives ``G`` queries per KV head. By default every query is kept (the authors cap at
10k per KV head, 50k with self-study: all of them at 2K–8K tokens); a cap keeps a seeded uniform
random subset per KV head.

Self-study passes over copies of the cache run ``chunk`` tokens per forward (bounded attention
masks). The repeat pass and self-study are computed once per prefilled context
(:meth:`CompressionContext.shared_result`): every budget and method reuses them.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import prefill_again
from kvfold.methods.core.repeat import REPEAT_CHUNK, repeat_pass, shared_repeat_pass
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.prompts import context_text_ids, turn_ids

Tensor = torch.Tensor

__all__ = [
    "SELF_STUDY_PROMPTS",
    "SOURCES",
    "QueryOptions",
    "QueryRecorder",
    "captured_reference_queries",
    "ReferenceQueries",
    "extract_reference_queries",
    "group_by_chunk",
    "parse_sources",
    "pool_gqa_queries",
]

SOURCES = ("context", "repeat", "selfstudy", "random")
SELF_STUDY_PROMPTS = (
    "Summarize the context above.",
    "Structure the information in the context above as JSON.",
    "Aggregate all key facts mentioned in the context.",
    "Write 3 different questions separated by newlines that test understanding of the context.",
)
"""App. C.4 / Table 6: summarize, structure_json, aggregate and the 3-question seed prompt."""


@dataclass
class ReferenceQueries:
    """Reference queries of one layer, per KV head.

    Attributes:
        queries: ``(B, H_kv, n, D)`` post-RoPE queries: the repeat pass's in the model's dtype, pooled and
            random ones in float32 (float64 for float64 models); the fits read them in float32 or wider.
        valid: ``(B, H_kv, n)`` bool; rows of a batch may hold different numbers of queries.
        chunk: ``(B, H_kv, n)`` long, the repeat chunk a repeat-prefill query was recorded in
            (:attr:`kvfold.methods.core.repeat.RepeatPass.query_chunks`), −1 for the queries of
            other sources, which read the whole context; None: no query has a chunk.
        context_lse: ``(B, H_kv, n)`` each repeat-prefill query's log-sum-exp over the context
            entries, as the repeat pass's attention gave it
            (:attr:`kvfold.methods.core.repeat.RepeatPass.query_context_lse`); NaN for queries of
            other sources; None when no query has it.
    """

    queries: Tensor
    valid: Tensor
    chunk: Tensor | None = None
    context_lse: Tensor | None = None

    @property
    def counts(self) -> Tensor:
        """Valid queries per ``(B, H_kv)``."""
        return self.valid.sum(-1)

    def chunks_or_none(self) -> Tensor:
        """:attr:`chunk`, −1 everywhere when None."""
        return self.chunk if self.chunk is not None else torch.full_like(self.valid, -1, dtype=torch.long)

    def on(self, device: torch.device) -> ReferenceQueries:
        """These queries on ``device`` (themselves when already there): a repeat pass on an
        accelerator holds its queries in host memory (:func:`kvfold.methods.core.repeat.queries_on_host`)
        and a fit brings one layer's back while it runs."""
        if self.queries.device == device:
            return self
        move = {"device": device, "non_blocking": True}
        chunk = None if self.chunk is None else self.chunk.to(**move)
        lse = None if self.context_lse is None else self.context_lse.to(**move)
        return ReferenceQueries(self.queries.to(**move), self.valid.to(**move), chunk, lse)

    def cat(self, other: ReferenceQueries) -> ReferenceQueries:
        chunk = None
        if self.chunk is not None or other.chunk is not None:
            chunk = torch.cat([self.chunks_or_none(), other.chunks_or_none().to(self.valid.device)], dim=2)
        dtype = torch.promote_types(self.queries.dtype, other.queries.dtype)  # repeat (model dtype) + pooled (float32)
        lse = None
        if self.context_lse is not None or other.context_lse is not None:
            lse = torch.cat([self._lse_or_nan(), other._lse_or_nan().to(self.valid.device)], dim=2)
        return ReferenceQueries(
            torch.cat([self.queries.to(dtype), other.queries.to(device=self.queries.device, dtype=dtype)], dim=2),
            torch.cat([self.valid, other.valid], dim=2),
            chunk,
            lse,
        )

    def _lse_or_nan(self) -> Tensor:
        """:attr:`context_lse`, NaN (not known) everywhere when None."""
        if self.context_lse is not None:
            return self.context_lse
        return torch.full(self.valid.shape, math.nan, dtype=torch.float32, device=self.valid.device)

    def subsample(self, cap: int, generator: torch.Generator) -> ReferenceQueries:
        """At most ``cap`` valid queries per KV head, a uniform random subset (seeded)."""
        if self.queries.shape[2] <= cap:
            return self
        rand = torch.rand(self.valid.shape, generator=generator).to(self.valid.device)
        rand = rand.masked_fill(~self.valid, math.inf)
        keep = rand.topk(cap, dim=-1, largest=False).indices.sort(dim=-1).values
        queries = self.queries.gather(2, keep[..., None].expand(-1, -1, -1, self.queries.shape[-1]))
        chunk = None if self.chunk is None else self.chunk.gather(2, keep)
        lse = None if self.context_lse is None else self.context_lse.gather(2, keep)
        return ReferenceQueries(queries, self.valid.gather(2, keep), chunk, lse)

    def share_across_chunks(self, count: int) -> ReferenceQueries:
        """These queries with ``count`` of the repeat-chunk queries of each ``(B, H_kv)``, evenly
        spaced in recording order (so over the whole context), moved to no chunk: :meth:`by_chunk`
        then gives them to every chunk's fit, as it gives the queries of other sources. All of
        them when ``count`` is at least their number; themselves when ``count`` is 0."""
        if count <= 0 or self.chunk is None:
            return self
        member = self.valid & (self.chunk >= 0)
        rank = member.long().cumsum(-1) - 1
        total = member.sum(-1, keepdim=True).clamp_min(1)
        # rank r is taken when ⌊(r + 1)·count / total⌋ steps past ⌊r·count / total⌋: min(count, total) of them
        taken = member & (((rank + 1) * count) // total > (rank * count) // total)
        return ReferenceQueries(self.queries, self.valid, self.chunk.masked_fill(taken, -1), self.context_lse)

    def chunk_index(self, chunks: int) -> tuple[Tensor, Tensor]:
        """Where :meth:`by_chunk` takes each chunk's queries from: ``(B, H_kv, C, n_c)`` positions
        along the query axis and their validity; chunk ``c`` holds the queries recorded while its
        span was repeated (in their order), then the queries of no chunk (other sources), which
        every chunk shares."""
        own, own_ok = group_by_chunk(self.chunks_or_none(), self.valid, chunks)
        shared = self.valid & (self.chunks_or_none() < 0)
        common, common_ok = group_by_chunk(torch.zeros_like(shared, dtype=torch.long), shared, 1)
        if common.shape[-1]:
            own = torch.cat([own, common.expand(-1, -1, chunks, -1)], dim=-1)
            own_ok = torch.cat([own_ok, common_ok.expand(-1, -1, chunks, -1)], dim=-1)
        return own, own_ok

    def by_chunk(self, chunks: int) -> tuple[Tensor, Tensor]:
        """The reference queries of each of ``chunks`` repeat chunks: ``(B, H_kv, C, n_c, D)`` and
        their validity ``(B, H_kv, C, n_c)``, as :meth:`chunk_index` places them. Cost and memory
        follow the queries, not the chunks times the queries."""
        own, own_ok = self.chunk_index(chunks)
        batch, heads, _, dim = self.queries.shape
        flat = own.flatten(2)
        queries = self.queries.gather(2, flat[..., None].expand(-1, -1, -1, dim))
        return queries.reshape(batch, heads, chunks, -1, dim), own_ok


def group_by_chunk(ids: Tensor, valid: Tensor, chunks: int) -> tuple[Tensor, Tensor]:
    """Positions along the last axis grouped by chunk: for ``ids`` ``(..., n)`` in ``[0, chunks)``
    (others, and invalid positions, belong to no chunk), ``(index (..., C, w), ok (..., C, w))``
    with chunk ``c``'s positions first, ascending, then unused slots (index 0, ok False); ``w`` is
    the most positions of one chunk."""
    member = valid & (ids >= 0) & (ids < chunks)
    key = torch.where(member, ids, torch.full_like(ids, chunks))
    order = torch.sort(key, dim=-1, stable=True).indices
    counts = torch.zeros(*key.shape[:-1], chunks + 1, dtype=torch.long, device=key.device)
    counts.scatter_add_(-1, key, torch.ones_like(key))
    counts = counts[..., :chunks]
    width = int(counts.max()) if counts.numel() else 0
    offsets = counts.cumsum(-1) - counts
    j = torch.arange(width, device=key.device)
    ok = j < counts[..., None]
    at = torch.where(ok, offsets[..., None] + j, torch.zeros_like(ok, dtype=torch.long))
    index = order.gather(-1, at.flatten(-2)).view_as(at)
    return torch.where(ok, index, torch.zeros_like(index)), ok


def pool_gqa_queries(query: Tensor, num_kv_heads: int) -> Tensor:
    """``(B, H_q, q, D)`` → ``(B, H_kv, G·q, D)``: query head ``h`` serves KV head ``h // G``."""
    batch, heads, length, dim = query.shape
    if num_kv_heads <= 0 or heads % num_kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({num_kv_heads})")
    return query.reshape(batch, num_kv_heads, (heads // num_kv_heads) * length, dim)


def _compute_dtype(dtype: torch.dtype | None) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _StopForward(Exception):
    """Raised by :class:`QueryRecorder` once the last needed layer has been recorded."""


@dataclass(eq=False)
class QueryRecorder:
    """An online-policy hook (see :class:`kvfold.runtime.attention.OnlinePolicy`) that records queries.

    Each forward of a folded layer hands its post-RoPE queries ``(B, H_q, q, D)`` to
    :meth:`after_forward`; they are pooled per KV head and kept in a streaming reservoir of at
    most ``cap`` per KV head (each query gets a seeded uniform key; the ``cap`` smallest stay).

    Args:
        layers: the layer indices to record.
        cap: queries kept per KV head.
        generator: seeded generator for the reservoir keys.
        stop_after: raise :class:`_StopForward` after recording this layer (None = never).
        dtype: storage dtype.
    """

    needs_attention: ClassVar[bool] = False

    layers: set[int]
    cap: int
    generator: torch.Generator
    stop_after: int | None = None
    dtype: torch.dtype = torch.float32
    _queries: dict[int, Tensor] = field(init=False, default_factory=dict, repr=False)
    _keys: dict[int, Tensor] = field(init=False, default_factory=dict, repr=False)

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        if layer_idx in self.layers:
            pooled = pool_gqa_queries(query.detach().to(self.dtype), layer.num_heads)
            keys = torch.rand(pooled.shape[:3], generator=self.generator).to(pooled.device)
            if layer_idx in self._queries:
                pooled = torch.cat([self._queries[layer_idx], pooled], dim=2)
                keys = torch.cat([self._keys[layer_idx], keys], dim=2)
            if pooled.shape[2] > self.cap:
                keep = keys.topk(self.cap, dim=-1, largest=False).indices.sort(dim=-1).values
                pooled = pooled.gather(2, keep[..., None].expand(-1, -1, -1, pooled.shape[-1]))
                keys = keys.gather(2, keep)
            self._queries[layer_idx] = pooled
            self._keys[layer_idx] = keys
        if self.stop_after is not None and layer_idx >= self.stop_after:
            raise _StopForward

    def result(self, layer_idx: int) -> Tensor | None:
        """Recorded queries ``(B, H_kv, n, D)`` of a layer, or None."""
        return self._queries.get(layer_idx)


@dataclass(frozen=True)
class QueryOptions:
    """What :func:`extract_reference_queries` builds.

    Attributes:
        sources: a subset of :data:`SOURCES`.
        max_queries: cap of reference queries per KV head (per layer), uniform random subset
            (``sys.maxsize``: all).
        repeat_span: context tokens repeated per chunk of the repeat pass (KVzip's 2K).
        context_window: context-prefill: the last this-many context tokens' queries.
        repeat_chunk: tokens per forward of the self-study passes.
        selfstudy_tokens: tokens sampled per self-study answer.
        selfstudy_temperature: sampling temperature of the answers (0 = greedy).
        random_queries: queries per KV head of the ``random`` source.
    """

    sources: tuple[str, ...] = ("repeat",)
    max_queries: int = sys.maxsize
    repeat_span: int = REPEAT_CHUNK
    context_window: int = 8192
    repeat_chunk: int = 1024
    selfstudy_tokens: int = 64
    selfstudy_temperature: float = 0.7
    random_queries: int = 1024


def parse_sources(text: str, owner: str) -> tuple[str, ...]:
    """``"repeat+selfstudy"`` → ``("repeat", "selfstudy")``; unknown names are a ``SpecError``."""
    names = tuple(dict.fromkeys(s.strip().lower() for s in text.split("+") if s.strip()))
    bad = [s for s in names if s not in SOURCES]
    if not names or bad:
        raise SpecError(f"{owner}: queries must be sources joined by '+' from {', '.join(SOURCES)}; got {text!r}")
    return names


# ---------------------------------------------------------------------------- sources


def _row_lengths(ctx: CompressionContext) -> tuple[list[int], list[int]]:
    """Per batch row: valid tokens and left padding."""
    width = ctx.input_ids.shape[1]
    lengths = ctx.context_lengths.tolist()
    return lengths, [width - n for n in lengths]


def _row_cache(cache: FoldedCache, row: int, batch: int) -> FoldedCache:
    copy = cache.copy()
    copy.capture_window = 0
    if batch > 1:
        copy.batch_select_indices(torch.tensor([row], device=_cache_device(cache)))
    return copy


def _cache_device(cache: FoldedCache) -> torch.device:
    for _, layer in cache.folded_layers:
        if layer.device is not None:
            return layer.device
    return torch.device("cpu")


def _feed(model, cache: FoldedCache, ids: list[int], start: int, chunk: int) -> Tensor | None:
    """Run ``ids`` after ``cache`` at positions ``start…``, ``chunk`` tokens per forward.

    Returns the logits of the last token, or None when the recorder stopped the forward early.
    """
    device = model.device
    logits = None
    for lo in range(0, len(ids), chunk):
        piece = ids[lo : lo + chunk]
        positions = torch.arange(start + lo, start + lo + len(piece), device=device)[None]
        try:
            out = model(
                input_ids=torch.tensor([piece], device=device),
                past_key_values=cache,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
        except _StopForward:
            logits = None
    return logits


def _stack_rows(rows: list[Tensor | None], heads: int, dim: int, dtype: torch.dtype, device) -> ReferenceQueries:
    """Rows ``(1, H, n_b, D)`` of different lengths → padded ``(B, H, n, D)`` with validity."""
    n = max((r.shape[2] for r in rows if r is not None), default=0)
    queries = torch.zeros(len(rows), heads, n, dim, dtype=dtype, device=device)
    valid = torch.zeros(len(rows), heads, n, dtype=torch.bool, device=device)
    for b, r in enumerate(rows):
        if r is not None:
            queries[b, :, : r.shape[2]] = r[0].to(device)
            valid[b, :, : r.shape[2]] = True
    return ReferenceQueries(queries, valid)


def _model_pass_queries(
    ctx: CompressionContext,
    cache: FoldedCache,
    layers: list[int],
    options: QueryOptions,
    source: str,
    stop_after: int | None,
) -> dict[int, ReferenceQueries]:
    """Self-study queries over copies of ``cache``, one batch row at a time."""
    model = ctx.model
    batch, width = ctx.input_ids.shape
    lengths, pads = _row_lengths(ctx)
    layer_map = dict(cache.folded_layers)
    any_layer = layer_map[layers[0]]
    dtype = _compute_dtype(any_layer.dtype)
    logical = any_layer.logical_length  # positions seen (a folded layer: sliding layers count differently)
    per_row: list[QueryRecorder] = []
    for b in range(batch):
        generator = torch.Generator().manual_seed(ctx.seed * 7919 + b * 104729 + SOURCES.index(source))
        recorder = QueryRecorder(set(layers), options.max_queries, generator, stop_after, dtype)
        row_ids = ctx.input_ids[b, width - lengths[b] :].tolist()
        start = logical - pads[b]  # positions continue where the row's context ended
        base = _row_cache(cache, b, batch)
        if ctx.tokenizer is None:
            raise UserError("self-study reference queries need the tokenizer (to write the prompts)")
        recorder.stop_after = None  # answers are sampled: every layer runs
        _, templated = context_text_ids(ctx.tokenizer, row_ids)
        for prompt in SELF_STUDY_PROMPTS:
            work = base.copy()
            work.policy = recorder
            ids = turn_ids(ctx.tokenizer, prompt, templated)
            logits = _feed(model, work, ids, start, options.repeat_chunk)
            _sample_answer(model, work, logits, start + len(ids), options, generator, ctx.tokenizer)
        per_row.append(recorder)
    out = {}
    for layer_idx in layers:
        layer = layer_map[layer_idx]
        rows = [r.result(layer_idx) for r in per_row]
        out[layer_idx] = _stack_rows(rows, layer.num_heads, layer.head_dim, dtype, layer.device)
    return out


def _sample_answer(
    model,
    cache: FoldedCache,
    logits: Tensor | None,
    position: int,
    options: QueryOptions,
    generator: torch.Generator,
    tokenizer: Any,
) -> None:
    """Sample an answer token by token (its queries are recorded by the cache's policy)."""
    eos = {getattr(tokenizer, "eos_token_id", None), getattr(model.config, "eos_token_id", None)}
    device = model.device
    for step in range(options.selfstudy_tokens):
        if logits is None:
            return
        if options.selfstudy_temperature > 0:
            probs = torch.softmax(logits[0].float() / options.selfstudy_temperature, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits[0].argmax())
        if token in eos:
            return
        out = model(
            input_ids=torch.tensor([[token]], device=device),
            past_key_values=cache,
            position_ids=torch.tensor([[position + step]], device=device),
            use_cache=True,
        )
        logits = out.logits[:, -1]


def _context_pass(ctx: CompressionContext, window: int) -> dict[int, Tensor]:
    """Captured queries ``(B, H_q, W, D)`` of one extra forward of the context (cached in memo)."""
    memo = ctx.memo.get("am_context_pass")
    if memo is not None and memo[0] >= window:
        return memo[1]
    model = ctx.model
    scratch = FoldedCache(model.config)
    scratch.capture_window = window
    prefill_again(ctx, scratch)
    captured = {i: layer.captured_queries for i, layer in scratch.folded_layers}
    ctx.memo["am_context_pass"] = (window, captured)
    ctx.report.setdefault("am", {})["context_queries"] = "recomputed with an extra prefill pass"
    return captured


def captured_reference_queries(layer: FoldedLayer, captured: Tensor, mask: Tensor) -> ReferenceQueries:
    """Queries ``(B, H_q, W, D)`` of the last ``W`` context tokens, pooled per KV head; queries of
    left-padding positions (``mask`` ``(B, N)`` = 0 there) are not valid."""
    width = captured.shape[2]
    pooled = pool_gqa_queries(captured.to(_compute_dtype(layer.dtype)), layer.num_heads)
    groups = captured.shape[1] // layer.num_heads
    token_valid = mask[:, -width:].bool().to(pooled.device)
    valid = token_valid[:, None, None, :].expand(-1, layer.num_heads, groups, -1)
    return ReferenceQueries(pooled, valid.reshape(pooled.shape[:3]))


def _context_queries(ctx: CompressionContext, layers: list[int], window: int) -> dict[int, ReferenceQueries]:
    """Context-prefill queries: the last ``window`` context tokens' queries, pooled per KV head."""
    layer_map = dict(ctx.cache.folded_layers)
    width = ctx.input_ids.shape[1]
    need = min(window, width)
    fresh = all(layer_map[i].logical_length == layer_map[i].physical_length for i in layers)
    captured = {i: layer_map[i].captured_queries for i in layers}
    short = any(c is None or c.shape[2] < need for c in captured.values())
    if short and fresh:
        captured = _context_pass(ctx, need)
    mask = ctx.attention_mask if ctx.attention_mask is not None else torch.ones_like(ctx.input_ids)
    out = {}
    for i in layers:
        layer = layer_map[i]
        q = captured.get(i)
        if q is None:
            raise UserError(
                "context reference queries: this compressed cache kept no prefill queries; prefill with "
                "kvfold.prefill(..., methods=[...]) or use queries=repeat or random"
            )
        out[i] = captured_reference_queries(layer, q[:, :, -min(q.shape[2], need) :], mask)
    return out


def _random_queries(ctx: CompressionContext, layers: list[int], count: int) -> dict[int, ReferenceQueries]:
    layer_map = dict(ctx.cache.folded_layers)
    out = {}
    for i in layers:
        layer = layer_map[i]
        generator = torch.Generator().manual_seed(ctx.seed * 1_000_003 + 7 * i + 3)
        shape = (layer.batch_size, layer.num_heads, count, layer.head_dim)
        q = torch.randn(shape, generator=generator, dtype=_compute_dtype(layer.dtype)).to(layer.device)
        out[i] = ReferenceQueries(q, torch.ones(shape[:3], dtype=torch.bool, device=layer.device))
    return out


def _repeat_queries(
    ctx: CompressionContext, cache: FoldedCache, layers: list[int], shared: bool, span: int = REPEAT_CHUNK
) -> dict[int, ReferenceQueries]:
    """Repeat-prefill queries from the repeat pass (``span`` context tokens per chunk), each with
    its repeat chunk: the shared pass over the prefilled cache, or a pass of their own over another
    cache (on-policy extraction)."""
    if shared:
        hit = ctx.shared.get(("repeat_pass", span))
        if hit is not None and "queries" in hit[0].recorded:
            ctx.report.setdefault("am", {})["queries_reused"] = True
        found = shared_repeat_pass(ctx, span, frozenset({"queries"}))
    else:
        found = repeat_pass(ctx, chunk=span, cache=cache, scores=False)
    return {
        i: ReferenceQueries(
            found.queries[i], found.query_valid[i], found.query_chunks[i], found.query_context_lse.get(i)
        )
        for i in layers
    }


def extract_reference_queries(
    ctx: CompressionContext,
    options: QueryOptions,
    layers: list[int] | None = None,
    cache: FoldedCache | None = None,
    stop_early: bool = True,
    shared: bool | None = None,
) -> dict[int, ReferenceQueries]:
    """Reference queries of the folded layers, from every source in ``options.sources``.

    Args:
        ctx: the compression context (model, tokenizer, context tokens, seed).
        options: sources, cap and pass settings.
        layers: layer indices (default every folded layer).
        cache: the cache that repeat / self-study passes run over (copies of it; default
            ``ctx.cache``). On-policy extraction passes a partially compacted cache.
        stop_early: stop self-study prompt passes after the last requested layer.
        shared: use (and fill) the passes shared by every compression of the prefilled context;
            default: when ``cache`` is ``ctx.cache`` (False once ``ctx.cache`` has been edited,
            as on-policy extraction does).

    The repeat pass and self-study over ``ctx.cache`` are computed once per prefilled context and
    shared by every method and budget compressed from it (:meth:`CompressionContext.shared_result`).

    Returns:
        ``{layer_idx: ReferenceQueries}`` with at most ``options.max_queries`` valid queries per
        KV head.
    """
    cache = ctx.cache if cache is None else cache
    shared = cache is ctx.cache if shared is None else shared
    layers = [i for i, _ in cache.folded_layers] if layers is None else list(layers)
    stop_after = max(layers) if stop_early else None
    found: dict[int, ReferenceQueries] = {}
    for source in options.sources:
        if source == "context":
            part = _context_queries(ctx, layers, options.context_window)
        elif source == "random":
            part = _random_queries(ctx, layers, options.random_queries)
        elif source == "repeat":
            part = _repeat_queries(ctx, cache, layers, shared, options.repeat_span)
        elif shared:  # self-study: sampled once per context, seed and options
            every = [i for i, _ in cache.folded_layers]
            run = functools.partial(_model_pass_queries, ctx, cache, every, options, source, None)
            part = ctx.shared_result(("am_selfstudy", ctx.seed, options), run)
        else:
            part = _model_pass_queries(ctx, cache, layers, options, source, stop_after)
        for i in layers:
            q = part[i]
            found[i] = q if i not in found else found[i].cat(q)
    out = {}
    for i in layers:
        generator = torch.Generator().manual_seed(ctx.seed * 999_983 + i)
        out[i] = found[i].subsample(options.max_queries, generator)
    return out
