"""The repeat pass: the model reads "repeat the previous context" and the context again over a copy
of the prefilled cache (KVzip's context reconstruction, Kim et al. 2025 §3; Attention Matching's
repeat-prefill reference queries, Zweiger et al. 2026 §3.1).

One pass serves every consumer: :func:`repeat_pass` records, in the same forwards, the maximum
attention each context entry receives (KVzip's scores) and the post-RoPE queries of the repeat
input (AM's and ``am_fit``'s reference queries). :func:`shared_repeat_pass` caches the result on
the prefilled context (:meth:`CompressionContext.shared_result`), so ``kvzip``, ``am_*`` and
``kvzip+am_fit`` at any number of budgets pay for one pass per context.

Memory: the repeat input runs ``forward_chunk`` tokens per forward, so the attention
probabilities held at once are ``H_q × forward_chunk × (N + chunk)``, whatever the context length;
a prefilled row runs over its own cache and gives the chunk's entries back afterwards
(:func:`scratch_cache`), so the cache is held once, plus one chunk. On an accelerator the recorded
queries go to host memory as they are computed (:func:`queries_on_host`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.kvzip_plus import HiddenNorms, weighted_received
from kvfold.runtime.attention import ACCELERATOR_BLOCK_ELEMENTS
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.key_scores import max_shifted_logits
from kvfold.runtime.prompts import encode, template_parts
from kvfold.runtime.timing import device_clock

Tensor = torch.Tensor

REPEAT_FIRST = "Repeat the previous context exactly."
REPEAT_NEXT = "Repeat the part of the previous context exactly, starting with"
REPEAT_CHUNK = 2048
"""Context tokens repeated per chunk (KVzip's 2K chunks)."""
FORWARD_CHUNK = 512
"""Repeat-input tokens per forward (bounds the attention probabilities held at once)."""
ACCELERATOR_FORWARD_CHUNK = 2048
"""Repeat-input tokens per forward on an accelerator over a fresh prefill, whose attention gives each
query's log-sum-exp and holds no probabilities (:mod:`kvfold.runtime.attention`): a quarter of the
forwards, each a few hundred launches (about 140 operators a layer at Llama-3.1-8B's shape)."""


def forward_tokens(device: torch.device, fresh: bool) -> int:
    """Repeat-input tokens per forward: :data:`ACCELERATOR_FORWARD_CHUNK` off the CPU over a fresh
    prefill (``fresh``), else :data:`FORWARD_CHUNK` (a compacted cache's attention materialises
    ``H_q × tokens × N`` probabilities)."""
    return ACCELERATOR_FORWARD_CHUNK if fresh and device.type != "cpu" else FORWARD_CHUNK


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

    def text_start(self, row_ids: list[int]) -> int:
        """Where the repeated text starts in a context row: after the template ``prefix`` when the
        row begins with it (and holds more than it), else at 0."""
        start = len(self.prefix) if self.prefix and row_ids[: len(self.prefix)] == self.prefix else 0
        return start if row_ids[start:] else 0

    def chunk_inputs(self, row_ids: list[int], chunk: int, overlap: int = 8) -> list[list[int]]:
        """The repeat inputs of one context row, chunk by chunk: chunk ``i`` repeats the row's
        tokens ``text_start + i·chunk`` to ``text_start + (i + 1)·chunk``."""
        text = row_ids[self.text_start(row_ids) :]
        pieces = [text[lo : lo + chunk] for lo in range(0, len(text), chunk)]
        inputs = []
        for i, piece in enumerate(pieces):
            prompt = self.first if i == 0 else self.next + pieces[i - 1][-overlap:]
            inputs.append(prompt + self.tail + piece)
        return inputs


def queries_on_host(device: torch.device) -> bool:
    """Whether a repeat pass computed on ``device`` records its queries in host memory: on an
    accelerator. The queries of every layer are held until the global selection is done (twice the
    cache's bytes for Llama-3.1-8B: 32 query heads of 8 KV heads, in the model's dtype), and a fit
    reads one layer's at a time: held on the host, they leave the device's peak at the cache, one
    chunk's scratch and one layer's fit (:meth:`ReferenceQueries.on
    <kvfold.methods.compaction.attention_matching.queries.ReferenceQueries.on>` brings them back)."""
    return device.type != "cpu"


def query_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """The buffer one layer's repeat queries are written into: on ``device``, or in host memory
    (:func:`queries_on_host`), page-locked on CUDA so that each forward's copy runs without the host
    waiting for it."""
    if not queries_on_host(device):
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


SCORE_FIELDS = ("scores", "plus_scores", "span_scores", "span_plus_scores")
"""The scores a repeat pass can record (:class:`RepeatPass`)."""
RECORDS = frozenset({*SCORE_FIELDS, "queries"})
"""Everything a repeat pass can record: the scores and the queries."""
UNPLANNED = frozenset({"scores", "queries"})
"""What the first pass of a prefilled context records besides what its compression needs, when no
method was announced at its prefill (later methods then reuse it: KVzip's scores and AM's queries)."""


@dataclass
class RepeatPass:
    """What one repeat pass recorded, per folded layer.

    Attributes:
        scores: ``(B, H_kv, N)`` KVzip's importance: the maximum attention each context slot
            received from the repeat input's queries, max over the GQA group (−inf on padding); empty when
            the pass did not record it.
        queries: ``(B, H_kv, n, D)`` the repeat input's post-RoPE queries, the ``G`` query heads
            of a KV head pooled (query head ``h`` serves KV head ``h // G``; App. B.3), in the dtype the
            model computed them in (stored as they are: the fits read them in float32 or wider, a layer
            group at a time, so a bfloat16 model's queries hold half the bytes of a float32 copy at no loss);
            rows of a batch padded to the longest; empty when not recorded.
        query_valid: ``(B, H_kv, n)`` bool.
        query_chunks: ``(B, H_kv, n)`` long, the repeat chunk each query was recorded in (its
            input repeats the context span :func:`token_chunks` assigns to that chunk; −1 on
            padding), when queries were recorded.
        query_context_lse: ``(B, H_kv, n)`` float32 (float64 for a float64 model), each query's
            log-sum-exp over the context entries, ``log Σ_{j < N} exp(s·q·k_j + β_j)`` (the cache
            before the pass; the repeat input's own entries apart), per layer where the attention
            gave it (the fused path over an uncompressed cache: :class:`RepeatRecorder`); a layer
            whose forwards took another path is absent. Attention Matching's chunked fit weighs
            each query by the share of this mass on the chunk it fits
            (:mod:`kvfold.methods.compaction.attention_matching.fit_chunks`).
        plus_scores: ``(B, H_kv, N)`` KVzip+'s scores (:mod:`kvfold.methods.core.kvzip_plus`: each
            attention row divided by ``‖x_t‖``, each column multiplied by ``‖W_Oʰ v‖``, then the
            max), when the pass recorded them; empty otherwise.
        span_scores, span_plus_scores: the same scores with each entry scored by the queries of
            the one repeat chunk that repeats it (the authors' release; ``kvzip[scope=chunk]``),
            when recorded.
        recorded: the fields this pass holds (:data:`RECORDS`).
    """

    scores: dict[int, Tensor]
    queries: dict[int, Tensor]
    query_valid: dict[int, Tensor]
    query_chunks: dict[int, Tensor] = field(default_factory=dict)
    query_context_lse: dict[int, Tensor] = field(default_factory=dict)
    plus_scores: dict[int, Tensor] = field(default_factory=dict)
    span_scores: dict[int, Tensor] = field(default_factory=dict)
    span_plus_scores: dict[int, Tensor] = field(default_factory=dict)
    recorded: frozenset[str] = frozenset()

    def merged(self, other: RepeatPass) -> RepeatPass:
        """This pass with what ``other`` recorded and this one did not."""
        changes = {name: getattr(other, name) for name in SCORE_FIELDS if name in other.recorded - self.recorded}
        if "queries" in other.recorded - self.recorded:
            changes.update(queries=other.queries, query_valid=other.query_valid, query_chunks=other.query_chunks)
            changes.update(query_context_lse=other.query_context_lse)
        return dataclasses.replace(self, **changes, recorded=self.recorded | other.recorded)


class RepeatRecorder:
    """Online-policy hook (see :class:`kvfold.runtime.attention.OnlinePolicy`) of one row's repeat pass:
    per layer, the max attention each of the layer's ``context_slots[layer]`` entries (the cache
    before the pass) receives and the pooled queries.

    Where the attention can give each query's log-sum-exp (the fused CPU kernel over an
    uncompressed cache, ``accepts_log_sum_exp``), the probabilities of the context entries are
    computed from it, ``exp(q·k·s − lse)`` (:func:`max_received`), instead of the attention
    materialising every probability with an additive mask: the same scores up to rounding
    (KVzip's max attention received, Kim et al. 2025 §3.2), at a fraction of the cost.

    ``records`` names the scores to record (:data:`SCORE_FIELDS`) and ``"queries"``. KVzip+'s
    (``plus_scores``) need the hidden-state norms the pass records (``plus``). The ``span_*`` scores
    read only the entries of :attr:`span`, the slots the chunk being repeated stands for (set
    before each chunk): a chunk's scoring then costs its span, not the context.

    With the queries it records each one's log-sum-exp over the context entries
    (:attr:`RepeatPass.query_context_lse`), which the fused attention gives apart when asked
    (:meth:`context_entries`) at no more products than the pass's own attention.
    """

    needs_attention = True
    accepts_log_sum_exp = True

    def __init__(self, context_slots: dict[int, int], records: frozenset[str], plus: HiddenNorms | None = None) -> None:
        unknown = set(records) - RECORDS
        if unknown:
            raise ValueError(f"a repeat pass records {sorted(RECORDS)}; not {sorted(unknown)}")
        if plus is None and records & {"plus_scores", "span_plus_scores"}:
            raise ValueError("KVzip+'s scores need the hidden-state norms (plus)")
        self.context_slots = context_slots
        self.records = frozenset(records)
        self.record_queries = "queries" in records
        self.needs_attention = bool(self.records & set(SCORE_FIELDS))
        self.plus = plus
        self.span: tuple[int, int] | None = None  # the slots of the chunk being repeated (span scores)
        self.found: dict[str, dict[int, Tensor]] = {name: {} for name in SCORE_FIELDS}
        self.queries: dict[int, Tensor] = {}  # per layer (B, H_kv, G, tokens, D), filled forward by forward
        self.filled: dict[int, int] = {}
        self.context_lse: dict[int, Tensor] = {}  # per layer (B, H_kv, G, tokens), beside the queries
        self.lse_missing: set[int] = set()  # layers where a forward did not give it
        self.tokens = 0  # repeat-input tokens of the row (set before the pass): the queries' buffer length
        self.value_norms: dict[int, Tensor] = {}  # ‖W_Oʰ v‖ of the row's context entries, per layer

    @property
    def scores(self) -> dict[int, Tensor]:
        return self.found["scores"]

    def context_entries(self, layer_idx: int) -> int | None:
        """The context entries whose log-sum-exp the attention gives apart
        (:class:`kvfold.runtime.attention.OnlinePolicy`): the cache before the pass, when the
        queries are recorded."""
        return self.context_slots[layer_idx] if self.record_queries else None

    @property
    def plus_scores(self) -> dict[int, Tensor]:
        return self.found["plus_scores"]

    def after_forward(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: Tensor,
        probs: Tensor | None,
        logits: Tensor | None = None,
        log_sum_exp: Tensor | None = None,
        scaling: float | None = None,
        context_log_sum_exp: Tensor | None = None,
    ) -> None:
        for whole, within in (("scores", "span_scores"), ("plus_scores", "span_plus_scores")):
            want_whole, want_span = whole in self.records, within in self.records
            if not (want_whole or want_span):
                continue
            slots = self.context_slots[layer_idx]
            if want_span and self.span is None:
                raise RuntimeError("span scores need the slots of the chunk being repeated (RepeatRecorder.span)")
            lo, hi = (0, slots) if want_whole else self.span
            plus = whole == "plus_scores"
            received = self.received(layer_idx, layer, query, probs, log_sum_exp, scaling, lo, hi, plus)
            if want_whole:
                self._keep_max(whole, layer_idx, received, 0, slots, slots)
            if want_span:
                a, b = self.span
                self._keep_max(within, layer_idx, received[..., a - lo : b - lo], a, b, slots)
        if self.record_queries:
            dtype = query.dtype  # exact: a float32 copy of bfloat16 queries held twice the bytes for nothing
            batch, heads_q, length, dim = query.shape
            groups = heads_q // layer.num_heads
            grouped = query.detach().reshape(batch, layer.num_heads, groups, length, dim)
            if layer_idx not in self.queries:  # one buffer, written in place: the queries are held once
                shape = (batch, layer.num_heads, groups, max(self.tokens, length), dim)
                self.queries[layer_idx] = query_buffer(shape, dtype, query.device)
                self.filled[layer_idx] = 0
            lo = self.filled[layer_idx]
            if lo + length > self.queries[layer_idx].shape[3]:  # more tokens than announced: grow (a copy)
                held = self.queries[layer_idx]
                self.queries[layer_idx] = torch.cat([held, held.new_empty(*held.shape[:3], length, dim)], dim=3)
            self.queries[layer_idx][:, :, :, lo : lo + length].copy_(grouped, non_blocking=True)
            self.filled[layer_idx] = lo + length
            self._keep_context_lse(layer_idx, context_log_sum_exp, lo, groups)

    def _keep_context_lse(self, layer_idx: int, lse: Tensor | None, lo: int, groups: int) -> None:
        """Writes this forward's queries' log-sum-exp over the context ``(B, H_q, q)`` beside their
        queries (from token ``lo``); a forward without it leaves the layer without any."""
        if lse is None or layer_idx in self.lse_missing:
            self.lse_missing.add(layer_idx)
            self.context_lse.pop(layer_idx, None)
            return
        held = self.queries[layer_idx]
        if layer_idx not in self.context_lse or self.context_lse[layer_idx].shape[3] != held.shape[3]:
            grown = query_buffer(held.shape[:4], lse.dtype, lse.device)
            if layer_idx in self.context_lse:  # the queries' buffer grew: the values so far come along
                grown[:, :, :, :lo].copy_(self.context_lse[layer_idx][:, :, :, :lo])
            self.context_lse[layer_idx] = grown
        batch, heads_q, length = lse.shape
        grouped = lse.reshape(batch, heads_q // groups, groups, length)
        self.context_lse[layer_idx][:, :, :, lo : lo + length].copy_(grouped, non_blocking=True)

    def _keep_max(self, name: str, layer_idx: int, received: Tensor, lo: int, hi: int, slots: int) -> None:
        """Slots ``lo:hi`` of the recorded ``name`` scores become the max of what they held and ``received``."""
        held = self.found[name].get(layer_idx)
        if held is None and (lo, hi) == (0, slots):
            self.found[name][layer_idx] = received
            return
        if held is None:
            held = self.found[name][layer_idx] = received.new_full((*received.shape[:2], slots), float("-inf"))
        held[..., lo:hi] = torch.maximum(held[..., lo:hi], received)

    def received(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: Tensor,
        probs: Tensor | None,
        log_sum_exp: Tensor | None,
        scaling: float | None,
        lo: int,
        hi: int,
        plus: bool,
    ) -> Tensor:
        """This forward's score of slots ``lo:hi``, ``(B, H_kv, hi − lo)``: the max over its queries
        and the GQA group of the attention probability (KVzip), or of ``a / ‖x_t‖ · ‖W_Oʰ v‖``
        (KVzip+, ``plus``: the row normalization before the max)."""
        rows = columns = None
        if plus:
            if layer_idx not in self.value_norms:  # the context entries are the same in every chunk's pass
                slots = self.context_slots[layer_idx]
                self.value_norms[layer_idx] = self.plus.output_value_norms(layer_idx, layer.values[:, :, :slots])
            rows, columns = self.plus.norms[layer_idx], self.value_norms[layer_idx][..., lo:hi]
        if log_sum_exp is not None and scaling is not None:
            return max_received(query, layer.keys[:, :, lo:hi], log_sum_exp, scaling, rows, columns)
        if probs is None:
            raise RuntimeError("the repeat pass needs attention probabilities from a filled dense cache")
        if plus:
            return weighted_received(probs[..., lo:hi], rows, columns, layer.num_heads)
        received = probs[..., lo:hi].amax(dim=2)  # max over queries, (B, H_q, hi − lo)
        batch, heads_q, n = received.shape
        return received.reshape(batch, layer.num_heads, heads_q // layer.num_heads, n).amax(dim=2)


BLOCK_ELEMENTS = 1 << 18
"""Logits per KV head in one block of :func:`max_received`: ``(rows, N)`` stays in cache (128
query rows at 2K context entries, 32 at 8K; at 8K the scores took 77 ms per layer and forward
with 32 rows against 88 ms with 128)."""


def score_block_rows(device: torch.device, entries: int, head_dim: int, heads: int = 1) -> int:
    """Query rows in one block of :func:`max_received` (over ``heads`` KV heads at once). On the CPU,
    blocks whose ``(rows, N)`` logits stay in cache (:data:`BLOCK_ELEMENTS`); elsewhere at least
    ``4·D`` rows, and as many as :data:`~kvfold.runtime.attention.ACCELERATOR_BLOCK_ELEMENTS`
    logits hold: on the H200 the CPU's 16-row blocks at 32K entries made KVzip's scores launch-bound
    (Llama-3.1-8B's shape: 61 s of compression for a 4 s repeat pass), and a chunk's span of 2K
    entries takes a forward's 8,192 rows in one block where ``4·D`` rows took 16."""
    if device.type == "cpu":
        return min(128, max(16, BLOCK_ELEMENTS // max(1, entries)))
    return max(16, 4 * head_dim, ACCELERATOR_BLOCK_ELEMENTS // max(1, entries * heads))


def max_received(
    query: Tensor,
    keys: Tensor,
    log_sum_exp: Tensor,
    scaling: float,
    row_norms: Tensor | None = None,
    column_weights: Tensor | None = None,
) -> Tensor:
    """The largest attention probability each key receives from ``query``, max over the queries
    and the GQA group (KVzip's score, Kim et al. 2025 §3.2), from each query's log-sum-exp over
    the whole cache: ``max_q exp(s·q·k − lse_q)``.

    The max of ``s·q·k − lse_q`` runs first and the exponential is taken once per key after it
    (``exp`` is monotone): no probability matrix is materialised. The max is
    :func:`kvfold.runtime.key_scores.max_shifted_logits`: one ``baddbmm`` per block of queries in
    float32 (float64 for float64 queries), or on a GPU, for 16-bit queries, one Triton kernel that
    writes no logit.

    With ``row_norms`` and ``column_weights`` it gives KVzip+'s score instead
    (:mod:`kvfold.methods.core.kvzip_plus`): ``max_h max_q exp(s·q·k − lse_q − log ‖x_q‖) · w_{h,i}``,
    each row divided by its norm inside the exponent (before the max over the queries), the
    column weight applied per query head before the max over the group.

    Args:
        query: ``(B, H_q, q, D)`` this forward's queries.
        keys: ``(B, H_kv, N, D)`` the keys scored (the context entries).
        log_sum_exp: ``(B, H_q, q)`` each query's log-sum-exp over every entry it attends.
        scaling: the logit scale.
        row_norms: ``(B, q)`` ``‖x_q‖`` of each query token (KVzip+), or None.
        column_weights: ``(B, H_q, N)`` ``‖W_Oʰ v_i‖`` (KVzip+), with ``row_norms``.

    Returns:
        ``(B, H_kv, N)`` float32 (float64 for float64 queries).
    """
    b, h_q, q_len, d = query.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    rows = (h_q // h_kv) * q_len  # the G query heads of a KV head on one axis
    lse = log_sum_exp.to(acc)
    if row_norms is not None:  # a / ‖x_q‖ = exp(s·q·k − lse_q − log ‖x_q‖)
        lse = lse + row_norms.to(acc).log()[:, None, :]
    shift = lse.reshape(b * h_kv, rows).neg()
    groups = h_q // h_kv if column_weights is not None else 1  # KVzip+: each query head's max apart
    block = score_block_rows(query.device, n, d, b * h_kv)
    folded, keys = query.reshape(b * h_kv, rows, d), keys.reshape(b * h_kv, n, d)
    best = max_shifted_logits(folded, keys, shift, scaling, groups, block)  # (B·H_kv, groups, N)
    if column_weights is not None:
        weighted = best.exp_().reshape(b, h_kv, groups, n) * column_weights.to(best.dtype).reshape(b, h_kv, -1, n)
        return weighted.amax(dim=2)
    return best.exp_().reshape(b, h_kv, n)


def repeat_pass(
    ctx: CompressionContext,
    chunk: int = REPEAT_CHUNK,
    cache: FoldedCache | None = None,
    scores: bool = True,
    queries: bool = True,
    forward_chunk: int | None = None,
    plus: bool = False,
    records: frozenset[str] | None = None,
) -> RepeatPass:
    """Run the repeat pass over ``cache`` (default ``ctx.cache``; unchanged afterwards), one batch
    row and one context chunk at a time, each chunk's entries given back before the next (KVzip
    repeats each chunk over a fresh copy; :func:`scratch_cache` undoes the appends instead).

    Args:
        ctx: the compression context (model, tokenizer, context tokens).
        chunk: context tokens repeated per chunk.
        cache: the cache the pass runs over (on-policy AM passes a partially compacted one).
        scores: record KVzip's scores (needs the attention probabilities).
        queries: record the repeat input's queries.
        forward_chunk: repeat-input tokens per forward (None: :func:`forward_tokens`).
        plus: record KVzip+'s scores (``plus_scores``; the attention inputs' norms are read by
            forward pre-hooks on the attention modules while the pass runs).
        records: what to record, instead of ``scores``, ``queries`` and ``plus``: a subset of
            :data:`RECORDS`. The ``span_*`` scores need the cache of a fresh prefill (a slot per
            column of ``ctx.input_ids``: :func:`token_chunks` says which slots a chunk repeats).

    Raises:
        ValueError: span scores asked of a cache whose slots are not the context's tokens.
    """
    if records is None:
        asked = (("scores", scores), ("queries", queries), ("plus_scores", plus))
        records = frozenset(name for name, on in asked if on)
    cache = ctx.cache if cache is None else cache
    prompt = RepeatPrompt.build(ctx.tokenizer)
    batch, width = ctx.input_ids.shape
    lengths = ctx.context_lengths.tolist()
    device = ctx.input_ids.device
    if forward_chunk is None:
        forward_chunk = forward_tokens(device, ctx.is_fresh_prefill(cache))
    slots = {i: layer.physical_length for i, layer in cache.folded_layers}
    logical = next(layer.logical_length for _, layer in cache.folded_layers)  # positions seen
    spans = _chunk_spans(ctx, chunk, cache) if records & {"span_scores", "span_plus_scores"} else None
    recorders: list[RepeatRecorder] = []
    chunk_of_token: list[Tensor] = []  # per row: the repeat chunk of each repeat-input token
    norms = HiddenNorms(ctx) if records & {"plus_scores", "span_plus_scores"} else None
    with nullcontext() if norms is None else norms:
        for b in range(batch):  # rows differ in length: their repeat inputs differ
            row_cache = cache
            if batch > 1:
                row_cache = cache.copy()
                row_cache.batch_select_indices(torch.tensor([b], device=device))
            row_ids = ctx.input_ids[b, width - lengths[b] :].tolist()
            recorder = RepeatRecorder(slots, records, plus=norms)
            start = logical - (width - lengths[b])  # the row's positions continue where its context ended
            inputs = prompt.chunk_inputs(row_ids, chunk)
            recorder.tokens = sum(len(ids) for ids in inputs)
            chunk_of_token.append(torch.tensor([c for c, ids in enumerate(inputs) for _ in ids], dtype=torch.long))
            for c, ids in enumerate(inputs):
                recorder.span = None if spans is None else spans[b][c]
                with scratch_cache(row_cache, len(ids)) as work:
                    work.policy = recorder
                    _repeat_forwards(ctx, work, ids, start, forward_chunk)
            recorders.append(recorder)
    if "queries" in records and queries_on_host(device):  # the host reads them next: every copy must have landed
        torch.accelerator.synchronize(device)
    return _collect(cache, recorders, chunk_of_token, records)


def _chunk_spans(ctx: CompressionContext, chunk: int, cache: FoldedCache) -> list[list[tuple[int, int]]]:
    """Per row, per repeat chunk, the slots ``(lo, hi)`` of the tokens that chunk repeats
    (:func:`token_chunks`), in a cache holding one slot per column of ``ctx.input_ids``."""
    if not ctx.is_fresh_prefill(cache):
        raise UserError(
            "kvzip[scope=chunk] scores each entry by the repeat chunk that repeats its token and needs the cache of "
            "a fresh prefill (one entry per token); on a compacted cache use scope=all"
        )
    owners = token_chunks(ctx, chunk)
    spans = []
    for row in owners:
        found: dict[int, list[int]] = {}
        for column, owner in enumerate(row.tolist()):
            if owner >= 0:
                found.setdefault(owner, []).append(column)
        spans.append([(columns[0], columns[-1] + 1) for _, columns in sorted(found.items())])
    return spans


@contextmanager
def scratch_cache(cache: FoldedCache, tokens: int) -> Iterator[FoldedCache]:
    """The cache one repeat chunk's ``tokens`` run over, their entries gone afterwards: ``cache``
    itself where its appends can be undone (:meth:`FoldedCache.scratch`: a prefilled row holds its
    entries once, plus the chunk's), else a fresh copy (KVzip's per-chunk copy; paged or batched
    layouts, sliding-window layers). Both give the same attention, hence the same recordings."""
    if cache.supports_scratch():
        with cache.scratch(reserve=tokens) as work:
            yield work
        return
    work = cache.copy()
    work.capture_window = 0
    yield work


def _repeat_forwards(
    ctx: CompressionContext, work: FoldedCache, ids: list[int], start: int, forward_chunk: int
) -> None:
    """One chunk's repeat input through the model over ``work``, ``forward_chunk`` tokens per forward
    (causal: the same as one forward), positions from ``start``."""
    device = ctx.input_ids.device
    for lo in range(0, len(ids), forward_chunk):
        piece = ids[lo : lo + forward_chunk]
        positions = torch.arange(start + lo, start + lo + len(piece), device=device)
        with torch.no_grad():
            ctx.model(
                input_ids=torch.tensor([piece], device=device),
                past_key_values=work,
                position_ids=positions[None],
                use_cache=True,
                logits_to_keep=1,
            )


def _collect(
    cache: FoldedCache, recorders: list[RepeatRecorder], chunk_of_token: list[Tensor], records: frozenset[str]
) -> RepeatPass:
    """The rows' recordings as one :class:`RepeatPass` (scores −inf on padding, queries padded)."""
    out = RepeatPass({}, {}, {}, {}, recorded=frozenset(records))
    for layer_idx, layer in cache.folded_layers:
        for name in SCORE_FIELDS:
            if name in records:
                stacked = torch.cat([r.found[name][layer_idx] for r in recorders])
                getattr(out, name)[layer_idx] = stacked.masked_fill(~layer.valid_mask(), float("-inf"))
        if "queries" in records:
            filled = [r.queries[layer_idx][:, :, :, : r.filled[layer_idx]] for r in recorders]
            found = _padded_queries(filled, chunk_of_token)
            out.queries[layer_idx], out.query_valid[layer_idx], out.query_chunks[layer_idx] = found
            if all(layer_idx in r.context_lse for r in recorders):
                rows = [r.context_lse[layer_idx][:, :, :, : r.filled[layer_idx]].flatten(2, 3) for r in recorders]
                out.query_context_lse[layer_idx] = _padded_rows(rows, found[1].shape[2])
    return out


def _padded_rows(rows: list[Tensor], n: int) -> Tensor:
    """Rows ``(1, H, n_b)`` as one ``(B, H, n)`` tensor, −inf after each row's own (one row: itself)."""
    if len(rows) == 1:
        return rows[0]
    out = rows[0].new_full((len(rows), rows[0].shape[1], n), float("-inf"))
    for b, row in enumerate(rows):
        out[b, :, : row.shape[2]] = row[0]
    return out


def _padded_queries(recorded: list[Tensor], chunk_of_token: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """One layer's queries of every row ``(B, H_kv, n, D)``, their validity and their repeat chunks
    (one row: its buffer itself, no copy)."""
    batch = len(recorded)
    rows = [parts.flatten(2, 3) for parts in recorded]  # (1, H_kv, G·tokens, D), as one forward
    n = max(row.shape[2] for row in rows)
    first = rows[0]
    q = first if batch == 1 else first.new_zeros(batch, first.shape[1], n, first.shape[3])
    valid = torch.zeros(batch, first.shape[1], n, dtype=torch.bool, device=first.device)
    chunks = torch.full((batch, first.shape[1], n), -1, dtype=torch.long, device=first.device)
    for b, row in enumerate(rows):
        if batch > 1:
            q[b, :, : row.shape[2]] = row[0]
        valid[b, :, : row.shape[2]] = True
        groups = row.shape[2] // max(1, chunk_of_token[b].numel())  # query g·tokens + i: token i
        chunks[b, :, : row.shape[2]] = chunk_of_token[b].repeat(groups).to(first.device)
    return q, valid, chunks


def token_chunks(ctx: CompressionContext, chunk: int = REPEAT_CHUNK) -> Tensor:
    """``(B, W)`` long: for each column of ``ctx.input_ids``, the repeat chunk of :func:`repeat_pass`
    whose input repeats that token (``chunk`` tokens per chunk from the row's text start); the
    template before the text counts in chunk 0, left padding is −1."""
    prompt = RepeatPrompt.build(ctx.tokenizer)
    batch, width = ctx.input_ids.shape
    out = torch.full((batch, width), -1, dtype=torch.long)
    for b, length in enumerate(ctx.context_lengths.tolist()):
        row_ids = ctx.input_ids[b, width - length :].tolist()
        start = prompt.text_start(row_ids)
        last = max(0, -(-(length - start) // chunk) - 1)
        position = torch.arange(length) - start
        out[b, width - length :] = position.clamp_min(0).div(chunk, rounding_mode="floor").clamp_max(last)
    return out


def shared_repeat_pass(
    ctx: CompressionContext, chunk: int = REPEAT_CHUNK, needs: frozenset[str] = UNPLANNED
) -> RepeatPass:
    """The repeat pass of ``ctx``'s prefilled context, with at least ``needs`` recorded
    (:data:`RECORDS`), computed once per prefilled context: every method and budget compressed from
    it reuses it.

    The first pass records what the methods that will read it need, as far as they are known: the
    compressing method's parts (:meth:`kvfold.methods.core.base.Method.repeat_records`, in
    ``ctx.memo["repeat_records"]``) and the methods announced at the prefill
    (``ctx.shared[PLANNED_RECORDS]``, which a prefilled context sets: the methods announced by
    :func:`kvfold.pipeline.context.prefill`'s ``methods``, else :data:`UNPLANNED`, KVzip's scores
    and the queries, so that methods compressed later reuse it). A context with no plan (a chunked
    prefill, a chat, a saved cache's recompaction, a bench compressing in place) records what its
    compression needs and nothing more. A method that needs what the pass did not record runs a pass
    for the rest once, and the context keeps both (:meth:`RepeatPass.merged`). So ``kvzip`` alone
    keeps no queries (memory) and ``am_highest_fast`` alone computes no scores (time).
    """
    key = ("repeat_pass", chunk)
    hit = ctx.shared.get(key)
    have = frozenset() if hit is None else hit[0].recorded
    if needs <= have:
        return ctx.shared_result(key, lambda: hit[0])
    planned = ctx.memo.get("repeat_records", frozenset()) | ctx.shared.get(PLANNED_RECORDS, (frozenset(), 0.0))[0]
    start = device_clock(getattr(ctx.model, "device", None))
    found = repeat_pass(ctx, chunk, records=(needs | planned) - have)
    merged = found if hit is None else hit[0].merged(found)
    ctx.extend_shared(key, merged, device_clock(getattr(ctx.model, "device", None)) - start)
    return merged


PLANNED_RECORDS = ("repeat_records",)
"""The ``ctx.shared`` key of what the methods announced at a context's prefill read from its repeat
pass: ``(records, 0.0)``."""
