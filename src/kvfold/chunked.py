"""Bounded-memory prefill: feed a long context chunk by chunk and compress whenever the cache
passes its budget, so peak memory follows budget + chunk, not the context length.

Methods opt in with ``supports_chunked_prefill = True`` (their scores must make sense on a cache
that already holds compressed entries followed by the newest chunk, e.g. StreamingLLM's recency,
SnapKV's window of the newest chunk, key norms).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.budget import Budget
from kvfold.cache import FoldedCache
from kvfold.methods.base import ComposedMethod, CompressionContext, build_method
from kvfold.pipeline import DEFAULT_SNAPSHOT_WINDOW, CompressedContext, PrefilledContext, check_length


def supports_chunked_prefill(method: ComposedMethod) -> bool:
    """Whether every part of a method can compress between chunks."""
    return all(getattr(part, "supports_chunked_prefill", False) for part in method.parts)


def chunked_methods() -> list[str]:
    """Names of the registered methods that support chunked prefill."""
    from kvfold.methods import available_methods

    return [c.name for c in available_methods() if getattr(c, "supports_chunked_prefill", False)]


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
        method: a method spec that supports chunked prefill.
        budget: fraction of the whole context or a token count; the cache holds at most this many
            entries per head plus one chunk.
        chunk_size: tokens per forward pass.

    Returns:
        A :class:`CompressedContext` (its ``source.cache`` is the compressed cache itself: no full
        cache is ever held).

    Raises:
        ValueError: the method cannot compress between chunks, or bad sizes.
    """
    composed = build_method(method) if isinstance(method, str) else method
    if chunk_size < 1:
        raise ValueError(f"prefill chunk must be ≥ 1 token; got {chunk_size}")
    if not composed.is_identity and not supports_chunked_prefill(composed):
        raise ValueError(
            f"{composed.spec} cannot compress during a chunked prefill; methods that can: "
            f"{', '.join(chunked_methods())}"
        )
    batch, length = input_ids.shape
    check_length(model, length + 1)
    parsed = Budget.parse(budget)
    keep = parsed.count(length)
    cache = FoldedCache(model.config)
    cache.capture_window = max(DEFAULT_SNAPSHOT_WINDOW, composed.query_window)
    attention_mask = torch.ones_like(input_ids)
    prefill_seconds = compress_seconds = 0.0
    out = None
    for start in range(0, length, chunk_size):
        end = min(length, start + chunk_size)
        positions = torch.arange(start, end, device=input_ids.device).expand(batch, -1)
        t0 = time.perf_counter()
        out = model(
            input_ids=input_ids[:, start:end],
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        prefill_seconds += time.perf_counter() - t0
        over = any(layer.physical_length > keep for _, layer in cache.folded_layers)
        if over and not composed.is_identity:
            ctx = CompressionContext(
                model=model,
                cache=cache,
                input_ids=input_ids[:, :end],
                attention_mask=attention_mask[:, :end],
                budget=Budget(tokens=keep) if keep > 1 else Budget(fraction=1.0 / end),
                seed=seed,
                tokenizer=tokenizer,
            )
            t0 = time.perf_counter()
            composed.compress(ctx)
            compress_seconds += time.perf_counter() - t0
    cache.capture_window = 0
    source = PrefilledContext(
        model=model,
        tokenizer=tokenizer,
        cache=cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        prefill_seconds=prefill_seconds,
        last_logits=out.logits[:, -1],
    )
    final_ctx = CompressionContext(
        model=model,
        cache=cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        budget=Budget(tokens=keep) if keep > 1 else Budget(fraction=1.0 / length),
        seed=seed,
        tokenizer=tokenizer,
    )
    policy = None if composed.is_identity else composed.online_policy(final_ctx)
    return CompressedContext(
        source=source,
        method=composed,
        budget=parsed,
        cache=cache,
        policy=policy,
        compress_seconds=compress_seconds,
        report=final_ctx.report,
    )
