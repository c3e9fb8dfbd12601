"""The compression context (:class:`kvfold.methods.core.base.CompressionContext`): whether its cache is
still a fresh prefill's, the one check KVzip's chunk scope, the chunked repeat pass and Attention
Matching's fit chunks all read."""

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
