"""Re-compaction with the repeat pass: the recommended pipeline (``kvzip``, ``kvzip+am_fit``) on a cache
that already holds compacted entries — a conversation past its cap, and the streaming prefill of a
context whose full cache does not fit.

KVzip (Kim et al. 2025, §3) scores an entry by the most attention it receives while the model
repeats the context; ``am_fit`` (Attention Matching, Zweiger et al. 2026, §3.2) refits the kept
entries' β and values on the queries of that repeat (:mod:`kvfold.methods.core.repeat`). On a
compacted cache the repeat pass runs over the entries as they are, β included, at the positions
that follow the cache's logical length (architecture invariant 4): an entry's score is the most
attention it receives, compacted or new, and the fit matches the current cache's attention.

* **A conversation** (:func:`kvfold.pipeline.chat.compact_history`): the repeat input is every
  token the cache stands for (the chat keeps them), replayed against the current cache.
  :func:`limit_head_entries` keeps KVzip's ranking over all layers and heads from giving one KV
  head more entries than the chat's cap leaves room for (a padded layout holds every head at the
  longest one's length once the next turn is fed).
* **Streaming** (:func:`streaming_step`, used by :func:`kvfold.pipeline.chunked.prefill_chunked`):
  after each prefill chunk, the repeat pass replays that chunk against the cache (what was kept of
  the earlier chunks, then the chunk); the chunk's own entries are then compressed to its share of
  the budget (:func:`compress_newest`: selected and fitted alone, on those repeat queries), and the
  entries kept from earlier chunks stay as they are. The cache never holds more than the budget
  plus one chunk, and the repeat pass's working set follows the chunk, so peak memory does not
  depend on the context's length. Departures from the non-streaming pipeline: each chunk is
  repeated as a context of its own (KVzip's first repeat prompt, not "starting with" the previous
  chunk's last tokens), later chunks protect no sinks (the context's first tokens are in the first
  chunk), and the scores of a chunk do not compete with those of earlier chunks (each keeps its
  share). A context of one chunk is compressed exactly as without streaming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.methods import ComposedMethod, CompressionContext, Method, Selector
from kvfold.methods.core.repeat import REPEAT_CHUNK, RepeatPass, shared_repeat_pass
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor
Entries = tuple[Tensor, Tensor, Tensor]
"""Padded keys ``(B, H, N, D)``, values and β ``(B, H, N)`` (−inf on empty slots)."""


def recompacts_by_repeat_pass(method: ComposedMethod) -> bool:
    """Whether ``method`` compacts a cache that holds compacted entries through the repeat pass.

    True for a selector scored by the repeat pass (KVzip) whose other parts either read the same
    pass (``am_fit``) or compress between the chunks of a chunked prefill (see
    :func:`kvfold.pipeline.chunked.supports_chunked_prefill`); wrappers that need a fresh prefill
    (``adakv:``, ``global:``) make it False.
    """
    selector = method.selector
    if not isinstance(selector, Selector) or selector.uses_repeat_pass is not True:
        return False
    if getattr(selector, "scope", None) == "chunk":
        return False  # kvzip[scope=chunk] maps entries to the tokens of a fresh prefill
    return all(part.uses_repeat_pass or getattr(part, "supports_chunked_prefill", False) for part in method.parts)


def repeat_chunks(method: ComposedMethod) -> list[int]:
    """The repeat chunk sizes the method's parts read their pass with: KVzip's ``chunk``, a fit
    chunk of N tokens (``am_fit[fit_chunk=N]``), else 2,048."""
    sizes = set()
    for part in method.parts:
        if part.uses_repeat_pass:
            size, fit_chunk = getattr(part, "chunk", None), str(getattr(part, "fit_chunk", "")).strip()
            sizes.add(size if isinstance(size, int) else int(fit_chunk) if fit_chunk.isdigit() else REPEAT_CHUNK)
    return sorted(sizes)


def run_repeat_passes(ctx: CompressionContext, method: ComposedMethod) -> None:
    """Run the repeat pass(es) the method reads, over ``ctx.cache``, into ``ctx.shared``, recording
    what its parts read (:meth:`ComposedMethod.repeat_records`: KVzip's or KVzip+'s scores, the queries)."""
    ctx.memo["repeat_records"] = method.repeat_records(ctx)
    for size in repeat_chunks(method):
        shared_repeat_pass(ctx, size, method.repeat_records(ctx))


def map_repeat_scores(shared: dict[Any, tuple[Any, float]], fn: Callable[[int, Tensor], Tensor]) -> dict:
    """``shared`` with the scores of every repeat pass in it (each ``…scores`` field: KVzip's, and
    KVzip+'s where recorded) replaced by ``fn(layer_idx, scores)``."""
    out = {}
    for key, (value, seconds) in shared.items():
        if isinstance(value, RepeatPass):
            changes = {
                f.name: {i: fn(i, s) for i, s in getattr(value, f.name).items()}
                for f in dataclasses.fields(value)
                if f.name.endswith("scores") and isinstance(getattr(value, f.name), dict)
            }
            value = dataclasses.replace(value, **changes)
        out[key] = (value, seconds)
    return out


# ---------------------------------------------------------------------------- a conversation


def limit_head_entries(ctx: CompressionContext, method: ComposedMethod, limit: int) -> None:
    """Run the method's repeat pass over ``ctx.cache`` and rank every KV head's entries after its
    ``limit`` best below all others (their scores set to −1, under every attention probability),
    so that a ranking over all layers and heads gives no head more than ``limit`` entries while the
    budget leaves room elsewhere. The selector's protected entries (KVzip's sinks) rank first.
    """
    run_repeat_passes(ctx, method)
    layers = dict(ctx.cache.folded_layers)

    def capped(layer_idx: int, scores: Tensor) -> Tensor:
        if scores.shape[-1] <= limit:
            return scores
        protected = method.selector.protected(layer_idx, layers[layer_idx], ctx)
        ranking = scores if protected is None else scores.masked_fill(protected.to(scores.device), float("inf"))
        rank = ranking.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        below = (rank >= limit) & torch.isfinite(scores)
        return scores.masked_fill(below, -1.0)

    ctx.shared.update(map_repeat_scores(ctx.shared, capped))


def pin_entries(ctx: CompressionContext, method: ComposedMethod, pinned: dict[int, Tensor]) -> None:
    """Run the method's repeat pass over ``ctx.cache`` and rank the first ``pinned[layer][b, h]``
    valid entries of every row above every other (scores +inf): a selector ranking by the pass
    keeps them, and the budget beyond them goes to the rest (a conversation's compressed document,
    :class:`kvfold.pipeline.chat.ChatSession`'s ``pin_context``)."""
    run_repeat_passes(ctx, method)
    layers = dict(ctx.cache.folded_layers)

    def pin(layer_idx: int, scores: Tensor) -> Tensor:
        valid = layers[layer_idx].valid_mask().to(scores.device)
        first = valid & (valid.long().cumsum(-1) <= pinned[layer_idx].to(scores.device)[..., None])
        return scores.masked_fill(first, float("inf"))

    ctx.shared.update(map_repeat_scores(ctx.shared, pin))


# ---------------------------------------------------------------------------- streaming


class _NoForward:
    """The model as a method compressing the newest chunk alone sees it: every attribute, but no
    forward pass (its repeat pass already ran over the whole cache; one over the chunk alone would
    miss the entries kept before it)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "streaming compression reads the repeat pass only (KVzip's scores, am_fit's repeat queries); "
            "this method runs another model pass (self-study or context queries): prefill without chunks"
        )


def without_sinks(method: ComposedMethod) -> ComposedMethod:
    """The method with ``sinks=0`` in every part that has the option: for the chunks after the first
    (the context's first tokens, the attention sinks, are in the first chunk)."""

    def strip(part: Method) -> Method:
        names = {f.name for f in dataclasses.fields(part)} if dataclasses.is_dataclass(part) else set()
        return dataclasses.replace(part, sinks=0) if "sinks" in names and part.sinks else part

    folder = None if method.folder is None else strip(method.folder)
    return ComposedMethod(method.spec, tuple(strip(w) for w in method.wrappers), strip(method.selector), folder)


def split_newest(layer: FoldedLayer, count: int) -> tuple[Entries, Tensor]:
    """Take the older entries out of ``layer``, leaving its newest ``count`` slots of every row.

    Returns:
        The older entries (clones, padded) and the slot index ``(B, H, count)`` the newest entries
        had in the layer's padded layout (to read the repeat pass's scores of them).
    """
    keys, values, log_mass, _ = layer.padded()
    slots = layer.row_ends()
    index = slots[..., None] - count + torch.arange(count, device=slots.device)
    width = int((slots - count).max())
    older = torch.arange(width, device=slots.device) < (slots - count)[..., None]
    head = (
        keys[:, :, :width].clone(),
        values[:, :, :width].clone(),
        log_mass[:, :, :width].masked_fill(~older, float("-inf")),
    )
    newest = [torch.gather(t, 2, index[..., None].expand(-1, -1, -1, t.shape[-1])) for t in (keys, values)]
    layer.replace(*newest, torch.gather(log_mass, 2, index))
    return head, index


def join_rows(head: Entries, tail: Entries) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every row's valid ``head`` entries, then its valid ``tail`` entries, padded; with the lengths."""
    valid_head, valid_tail = torch.isfinite(head[2]), torch.isfinite(tail[2])
    first = valid_head.sum(-1)
    lengths = first + valid_tail.sum(-1)
    b, h = lengths.shape
    width = max(1, int(lengths.max()))
    keys = head[0].new_zeros(b, h, width, head[0].shape[-1])
    values = head[1].new_zeros(b, h, width, head[1].shape[-1])
    log_mass = torch.full((b, h, width), float("-inf"), dtype=torch.float32, device=keys.device)
    for (k, v, lm), valid, offset in ((head, valid_head, torch.zeros_like(first)), (tail, valid_tail, first)):
        slot = valid.long().cumsum(-1) - 1 + offset[..., None]  # rank among the row's valid entries
        bi, hi, si = valid.nonzero(as_tuple=True)
        to = slot[bi, hi, si]
        keys[bi, hi, to], values[bi, hi, to], log_mass[bi, hi, to] = k[bi, hi, si], v[bi, hi, si], lm[bi, hi, si]
    return keys, values, log_mass, lengths


def compress_newest(ctx: CompressionContext, method: ComposedMethod, count: int) -> None:
    """Compress the newest ``count`` entries of every row of ``ctx.cache`` to ``ctx.budget``, in
    place, leaving the older entries as they are (module docstring: streaming).

    The method's repeat pass runs first over the whole cache, with ``ctx.input_ids`` (the newest
    tokens) as the repeat input; the method then compresses the newest entries alone, reading that
    pass (KVzip's scores of the newest entries, ``am_fit``'s queries): the fit matches the newest
    entries' share of the attention (the attention over the older entries is unchanged on both
    sides). The older entries are then put back before the compressed ones.
    """
    run_repeat_passes(ctx, method)
    heads, index = {}, {}
    for layer_idx, layer in ctx.cache.folded_layers:
        heads[layer_idx], index[layer_idx] = split_newest(layer, count)
    shared = map_repeat_scores(ctx.shared, lambda i, s: torch.gather(s, 2, index[i].to(s.device)))
    newest = dataclasses.replace(
        ctx,
        model=_NoForward(ctx.model),
        memo={},
        shared={key: (value, 0.0) for key, (value, _) in shared.items()},  # its seconds count once, here
    )
    method.compress(newest)
    for layer_idx, layer in ctx.cache.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        layer.replace(*join_rows(heads[layer_idx], (keys, values, log_mass)))


def streaming_step(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    cache: FoldedCache,
    method: ComposedMethod,
    input_ids: torch.Tensor,
    keep: int,
    *,
    seed: int = 0,
    report: dict | None = None,
) -> Callable[[int, int], None]:
    """What a streaming prefill does after the forward of ``input_ids[:, start:end]``: compress the
    tokens not compressed yet (that chunk) to their share of ``keep`` (the budget of the whole
    context, per KV head on average).

    After the chunk that ends at token ``e`` the cache holds ``⌈keep · e / N⌉`` entries per KV head
    on average (``N`` the context length), so a chunk's share is the difference; a chunk that fits
    its share is kept whole, and one whose share is not a whole entry (chunks shorter than
    ``N / keep`` tokens) waits for the next, with which it is compressed.

    Returns:
        ``step(start, end)``, to call after each chunk's forward, in order.
    """
    length = input_ids.shape[1]
    later = without_sinks(method)
    mask = torch.ones_like(input_ids)
    report = {} if report is None else report
    pending = 0  # the first token not compressed yet

    def target(end: int) -> int:
        return -(-keep * end // length)

    def step(start: int, end: int) -> None:
        nonlocal pending
        share = target(end) - target(pending)
        if share < 1 and end < length:
            return  # not one entry's worth yet: these tokens wait for the next chunk
        first, pending = pending, end
        share = max(1, share)
        if end - first <= share:
            return
        ctx = CompressionContext(
            model=model,
            cache=cache,
            input_ids=input_ids[:, first:end],
            attention_mask=mask[:, first:end],
            budget=Budget(tokens=share) if share > 1 else Budget(fraction=1.0 / (end - first)),
            seed=seed,
            report=report,
            tokenizer=tokenizer,
        )
        compress_newest(ctx, method if first == 0 else later, end - first)

    return step
