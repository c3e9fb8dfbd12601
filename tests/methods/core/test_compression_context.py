"""The compression context (:class:`kvfold.methods.core.compression_context.CompressionContext`): whether its
cache is still a fresh prefill's, the one check KVzip's chunk scope, the chunked repeat pass and
Attention Matching's fit chunks all read, and results shared between compressions, counted once."""

from __future__ import annotations

import torch

import kvfold
from kvfold.methods import CompressionContext, build_method
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer, make_tiny_model

TEXT = "the quick brown fox jumps over the lazy dog " * 3


def context(model, tok, texts) -> CompressionContext:
    pre = kvfold.prefill(model, tok, texts, use_chat_template=False)
    return CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)


def test_a_prefilled_cache_holds_one_slot_per_token_and_a_compressed_one_does_not():
    torch.manual_seed(0)
    model, tok = make_tiny_model("llama"), CharTokenizer()
    ctx = context(model, tok, TEXT)
    assert ctx.is_fresh_prefill()
    assert all(ctx.slots_are_tokens(layer) for _, layer in ctx.cache.folded_layers)

    copy = ctx.cache.copy()
    with torch.no_grad():
        build_method("streamingllm").compress(ctx)
    assert not ctx.is_fresh_prefill()
    assert not any(ctx.slots_are_tokens(layer) for _, layer in ctx.cache.folded_layers)
    assert ctx.is_fresh_prefill(copy), "the cache argument is the one read"


def test_left_padded_rows_are_still_a_fresh_prefill():
    model, tok = make_tiny_model("llama"), CharTokenizer()
    ctx = context(model, tok, [TEXT, TEXT[:40]])
    assert ctx.attention_mask is not None and not bool(ctx.attention_mask.all())
    assert ctx.is_fresh_prefill()


def test_a_cache_with_tokens_appended_is_not_a_fresh_prefill():
    model, tok = make_tiny_model("llama"), CharTokenizer()
    ctx = context(model, tok, TEXT)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=ctx.cache, use_cache=True)
    assert not ctx.is_fresh_prefill()


def test_a_shared_result_is_computed_once_and_its_cost_charged_once_a_compression():
    """:meth:`CompressionContext.shared_result`: a second compression of the same prefilled context
    reuses the value and adds the seconds it cost to its report once, however often it reads it;
    :meth:`~CompressionContext.extend_shared` adds its own seconds to the stored cost."""
    model, tok = make_tiny_model("llama"), CharTokenizer()
    first = context(model, tok, TEXT)
    calls = []
    assert first.shared_result("scores", lambda: calls.append(1) or "value") == "value"
    assert "reused_seconds" not in first.report  # the compression that computed it pays it as its own
    second = CompressionContext(first.model, first.cache, first.input_ids, None, first.budget, shared=first.shared)
    for _ in range(2):
        assert second.shared_result("scores", lambda: calls.append(1) or "other") == "value"
    cost = first.shared["scores"][1]
    assert calls == [1] and second.report["reused_seconds"] == cost
    second.extend_shared("scores", "longer", 2.0)
    assert second.shared["scores"] == ("longer", cost + 2.0) and second.report["reused_seconds"] == cost
    third = CompressionContext(first.model, first.cache, first.input_ids, None, first.budget, shared=first.shared)
    third.extend_shared("scores", "longest", 1.0)
    assert third.report["reused_seconds"] == cost + 2.0 and third.shared["scores"][1] == cost + 3.0
