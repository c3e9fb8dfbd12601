"""Bounded-memory prefill: feed a long context chunk by chunk and compress whenever the cache
passes its budget, so peak memory follows budget + chunk, not the context length.

Methods opt in with ``supports_chunked_prefill = True``. Two ways to stay within the budget:

* **one-shot between chunks** (default): after every forward that leaves the cache over budget,
  the method compresses it as after a prefill. Its scores must make sense on a cache that already
  holds compressed entries followed by the newest chunk (StreamingLLM's recency, SnapKV's window
  of the newest chunk, key norms).
* **online** (methods that also set ``chunked_prefill_online = True``: H2O, ZSMerge, KeepKV): the
  scores accumulate over every query seen, so the method's decode-time policy
  (``method.online_policy``) runs inside each chunk's forward and brings every layer back to its
  budget right after that layer's attention, with the chunk's attention probabilities
  ``(B, H_q, chunk, budget + chunk)``: H2O sums the attention of all queries (its Algorithm 1),
  ZSMerge runs Algorithm 1 for each new token and keeps its residual slots, KeepKV updates its
  scores and merges the victims. The first chunk is compressed one-shot (as a prefill) when it
  alone passes the budget, or taken over by a policy that brings a fresh prefill to its budget
  itself (``policy.adopt(cache)``: ZSMerge, whose residual slots are part of that budget); then
  the policy runs. At the end the policy writes its state into the cache's statistics
  (``export_state``), so decoding continues from it: with the same policy object
  (``CompressedContext.policy``) or a fresh one per answer.
* **streaming** (a selector scored by the repeat pass: ``kvzip``, ``kvzip+am_fit``, the
  query-agnostic pipeline): after every chunk's forward, the repeat pass replays that chunk
  against the cache and the chunk's entries are compressed to its share of the budget (selected
  and fitted alone), the entries kept from earlier chunks staying as they are
  (:mod:`kvfold.pipeline.recompact`). A context of one chunk is compressed exactly as without chunks.

Memory: a layer holds at most ``max(its budget, budget) + chunk`` entries (its own budget differs
from the requested one with per-layer budgets such as ``h2o_cosine``'s; until the cache first
passes the requested budget nothing is compressed). Streaming: what earlier chunks kept (at most
the budget) plus one chunk, and the repeat pass of one chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.methods.core.base import ComposedMethod, build_method
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.pipeline.context import DEFAULT_SNAPSHOT_WINDOW, CompressedContext, PrefilledContext, check_length
from kvfold.pipeline.recompact import recompacts_by_repeat_pass, streaming_step
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.timing import device_clock


def supports_chunked_prefill(method: ComposedMethod) -> bool:
    """Whether every part of a method can compress between chunks (one-shot or online)."""
    return all(getattr(part, "supports_chunked_prefill", False) for part in method.parts)


def streams_chunks(method: ComposedMethod) -> bool:
    """Whether a chunked prefill compresses with ``method`` by streaming (see the module docstring)."""
    return not method.is_identity and not supports_chunked_prefill(method) and recompacts_by_repeat_pass(method)


def runs_online_between_chunks(method: ComposedMethod) -> bool:
    """Whether a method keeps its budget between chunks with its online policy (see the module docstring)."""
    return any(getattr(part, "chunked_prefill_online", False) for part in method.parts)


def chunked_methods() -> list[str]:
    """Names of the registered methods that support chunked prefill (streaming: the selectors
    scored by the repeat pass)."""
    from kvfold.methods import available_methods

    return [
        c.name
        for c in available_methods()
        if getattr(c, "supports_chunked_prefill", False) or (c.role == "selector" and c.uses_repeat_pass is True)
    ]


@torch.inference_mode()
def prefill_chunked(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    input_ids: torch.Tensor,
    method: str | ComposedMethod,
    budget: float | int | str | Budget,
    chunk_size: int,
    *,
    seed: int = 0,
) -> CompressedContext:
    """Prefill ``input_ids`` ``(B, N)`` (equal lengths) in chunks, compressing as it goes.

    Args:
        model: an enabled model.
        tokenizer: its tokenizer (used by methods that build prompts; may be None).
        input_ids: the context tokens.
        method: a method spec that supports chunked prefill (streaming: ``kvzip``, ``kvzip+am_fit``).
        budget: fraction of the whole context or a token count; the cache holds at most this many
            entries per head plus one chunk (per-layer budgets: see the module docstring).
        chunk_size: tokens per forward pass.

    Returns:
        A :class:`CompressedContext` (its ``source.cache`` is the compressed cache itself: no full
        cache is ever held). For online methods ``compress_seconds`` counts the one-shot part only;
        the policy's work inside the forwards is part of ``source.prefill_seconds``.

    Raises:
        ValueError: the method cannot compress between chunks (or, for an online one, has no online
            policy: ``h2o[online=false]``, ``snapkv+keepkv``), or bad sizes.
    """
    composed = _chunked_method(method, chunk_size)
    batch, length = input_ids.shape
    check_length(model, length)
    parsed = Budget.parse(budget)
    keep = parsed.count(length)
    cache = FoldedCache(model.config)
    cache.capture_window = max(DEFAULT_SNAPSHOT_WINDOW, composed.query_window)
    cache.prefill_observers = [] if composed.is_identity else composed.prefill_observers()  # H2O: first chunk
    attention_mask = torch.ones_like(input_ids)
    report: dict = {}

    def context(end: int) -> CompressionContext:
        return CompressionContext(
            model=model,
            cache=cache,
            input_ids=input_ids[:, :end],
            attention_mask=attention_mask[:, :end],
            budget=Budget(tokens=keep) if keep > 1 else Budget(fraction=1.0 / end),
            seed=seed,
            report=report,
            tokenizer=tokenizer,
        )

    final_ctx = context(length)
    streaming = streams_chunks(composed)
    online = not composed.is_identity and not streaming and runs_online_between_chunks(composed)
    policy = _policy_between_chunks(composed, final_ctx) if online else None
    after_chunk = (
        streaming_step(model, tokenizer, cache, composed, input_ids, keep, seed=seed, report=report)
        if streaming
        else None
    )
    out, prefill_seconds, compress_seconds = _feed_chunks(
        model, input_ids, cache, composed, keep, chunk_size, context, policy, after_chunk
    )
    cache.capture_window = 0
    cache.policy = None
    if online:
        policy.export_state(cache)
    cache.shrink_to_fit()  # an online policy evicts in place: release the last chunk's capacity
    source = PrefilledContext(
        model, tokenizer, cache, input_ids, attention_mask, prefill_seconds, last_logits=out.logits[:, -1]
    )
    if not online:
        policy = None if composed.is_identity else composed.online_policy(final_ctx)
    return CompressedContext(source, composed, parsed, cache, policy, compress_seconds, report)


def _chunked_method(method: str | ComposedMethod, chunk_size: int) -> ComposedMethod:
    """The built method, refused when it cannot compress between chunks (or the chunk is empty)."""
    composed = build_method(method) if isinstance(method, str) else method
    if chunk_size < 1:
        raise UserError(f"prefill chunk must be ≥ 1 token; got {chunk_size}")
    if not composed.is_identity and not supports_chunked_prefill(composed) and not streams_chunks(composed):
        raise UserError(
            f"{composed.spec} cannot compress during a chunked prefill; methods that can: "
            f"{', '.join(chunked_methods())}"
        )
    return composed


def _policy_between_chunks(composed: ComposedMethod, ctx: CompressionContext) -> Any:
    """The online policy that keeps the budget inside every chunk's forward (module docstring).

    Raises:
        ValueError: the method has none here (``online=false``, or KeepKV after a one-shot selector).
    """
    policy = composed.online_policy(ctx)
    if policy is None:
        raise UserError(
            f"{composed.spec} keeps its budget between chunks with its online (decode-time) policy, and has "
            "none here: leave online=true, and pair keepkv with a selector that runs online "
            "(h2o, h2o_cosine, streamingllm, tova, knorm)"
        )
    return policy


def _feed_chunks(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    cache: FoldedCache,
    composed: ComposedMethod,
    keep: int,
    chunk_size: int,
    context: Callable[[int], CompressionContext],
    policy: Any,
    after_chunk: Callable[[int, int], None] | None = None,
) -> tuple[Any, float, float]:
    """Forward the chunks into ``cache``, keeping it at ``keep`` entries (module docstring).

    Without ``policy`` the method compresses one-shot after every forward that leaves a layer over
    ``keep``; with one, the first chunk is compressed (or adopted by the policy) and the policy
    then runs inside every later forward; with ``after_chunk`` (streaming), ``after_chunk(start,
    end)`` compresses after every forward instead.

    Returns:
        The last forward's output, the seconds of the forwards, and the seconds of the one-shot
        compressions.
    """
    batch, length = input_ids.shape
    prefill_seconds = compress_seconds = 0.0
    out = None
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        positions = torch.arange(start, end, device=input_ids.device).expand(batch, -1)
        t0 = device_clock(model.device)
        out = model(
            input_ids=input_ids[:, start:end],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        prefill_seconds += device_clock(model.device) - t0
        cache.prefill_observers = []  # they see the first chunk only (a fresh prefill)
        if cache.policy is not None:
            continue  # the policy brought every layer back to its budget inside the forward
        t0 = device_clock(model.device)
        if after_chunk is not None:
            after_chunk(start, end)
        elif policy is not None and hasattr(policy, "adopt"):
            policy.adopt(cache)  # the policy brings the first chunk to its budget (ZSMerge)
        elif not composed.is_identity and any(layer.physical_length > keep for _, layer in cache.folded_layers):
            composed.compress(context(end))
        compress_seconds += device_clock(model.device) - t0
        if policy is not None:
            cache.policy = policy  # from the second chunk on: scores accumulate over every query
    return out, prefill_seconds, compress_seconds
