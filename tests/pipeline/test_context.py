"""The Python API on the embedded SmolLM2: exactness against stock transformers and memory."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvfold
from kvfold.evaluate.data.logbook import FACTS, build_logbook
from kvfold.pipeline.context import build_prompt, encode

pytestmark = pytest.mark.model


def test_full_equals_stock_greedy_on_smollm2(smollm2):
    model, tokenizer = smollm2
    context = build_logbook(tokenizer, target_tokens=300)
    question = FACTS[0][1]
    prefilled = kvfold.prefill(model, tokenizer, context)
    answer = prefilled.compress("full").generate(question, max_new_tokens=12)[0]
    parts = build_prompt(tokenizer, context, question)
    ids = encode(tokenizer, parts.context, special=True) + encode(tokenizer, parts.suffix, special=False)
    ids_t = torch.tensor([ids])
    model.set_attn_implementation("sdpa")
    try:
        stock_logits = model(ids_t, past_key_values=DynamicCache(config=model.config)).logits[:, -1]
        stock = model.generate(ids_t, max_new_tokens=12, do_sample=False)
    finally:
        model.set_attn_implementation("kvfold")
    stock_tokens = [t for t in stock[0, len(ids) :].tolist() if t not in (2,)]
    assert answer.token_ids == stock_tokens[: len(answer.token_ids)]
    assert len(answer.token_ids) == len(stock_tokens) or stock_tokens[len(answer.token_ids)] in {2}
    cache = kvfold.FoldedCache(model.config)
    ours_logits = model(ids_t, past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(ours_logits, stock_logits, rtol=0, atol=1e-5)


def test_one_compressed_context_answers_several_questions(smollm2):
    model, tokenizer = smollm2
    context = build_logbook(tokenizer, target_tokens=600)
    compressed = kvfold.prefill(model, tokenizer, context).compress("streamingllm", 0.1)
    first = compressed.answer(FACTS[0][1], max_new_tokens=5)
    again = compressed.answer(FACTS[0][1], max_new_tokens=5)
    assert first == again  # answering does not modify the compressed cache
    assert compressed.kv_bytes <= 0.11 * compressed.kv_bytes_full
    assert compressed.cache.get_seq_length() == compressed.source.context_tokens


def test_prefill_ids_equals_prefill_of_the_same_tokens(smollm2):
    model, tokenizer = smollm2
    context = build_logbook(tokenizer, target_tokens=120)
    from_text = kvfold.prefill(model, tokenizer, context, methods="snapkv")
    from_ids = kvfold.pipeline.context.prefill_ids(model, tokenizer, from_text.input_ids, methods="snapkv")
    torch.testing.assert_close(from_ids.last_logits, from_text.last_logits, rtol=0, atol=0)
    assert torch.equal(from_ids.attention_mask, from_text.attention_mask)
    for (_, a), (_, b) in zip(from_ids.cache.folded_layers, from_text.cache.folded_layers, strict=True):
        assert torch.equal(a.dense_buffers()[0], b.dense_buffers()[0])
        assert torch.equal(a.captured_queries, b.captured_queries)


def test_kvzip_repeat_pass_runs_once_per_prefilled_context(monkeypatch):
    """A sweep over budgets pays for KVzip's repeat pass once; caches and reported cost are unchanged."""
    from kvfold.methods.core import repeat
    from kvfold.pipeline.context import prefill
    from tests.conftest import CharTokenizer, make_tiny_model

    model = kvfold.enable(make_tiny_model("llama"))
    tok = CharTokenizer()
    calls = []
    real = repeat.repeat_pass
    monkeypatch.setattr(repeat, "repeat_pass", lambda ctx, chunk, **kw: calls.append(chunk) or real(ctx, chunk, **kw))
    text = "the quick brown fox jumps over the lazy dog; " * 3
    shared = prefill(model, tok, text, use_chat_template=False)
    budgets = (0.5, 0.3, 0.2)
    reused = [shared.compress("kvzip", b) for b in budgets]
    assert calls == [2048]
    assert reused[1].report["reused_seconds"] > 0 and "reused_seconds" not in reused[0].report
    assert reused[1].compress_seconds >= reused[1].report["reused_seconds"]  # the cost when run alone
    for budget, compressed in zip(budgets, reused, strict=True):  # the same caches as without sharing
        alone = prefill(model, tok, text, use_chat_template=False).compress("kvzip", budget)
        for (_, a), (_, b) in zip(alone.cache.folded_layers, compressed.cache.folded_layers, strict=True):
            torch.testing.assert_close(a.padded()[0], b.padded()[0], rtol=0, atol=0)
    assert len(calls) == 1 + len(budgets)
    shared.compress("kvzip[chunk=16]", 0.3)  # other options: another pass
    assert calls[-1] == 16
