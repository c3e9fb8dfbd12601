"""The CUDA paths (skipped without a GPU; run on the device machine, docs/benchmarks.md "On a GPU").

Each test runs the same work on the CPU and on CUDA and compares, or bounds what CUDA allocates:
no compression equals stock transformers there too, the repeat pass takes the masked kernel with a
blocked log-sum-exp (no ``(H_q, q, N)`` probabilities, issue 33) and the recommended pipeline
keeps what it keeps on the CPU.
"""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext
from kvfold.methods.core import repeat
from kvfold.runtime import attention
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer, make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


def _pair(family: str = "llama", **overrides):
    cpu = kvfold.enable(make_tiny_model(family, **overrides))
    gpu = kvfold.enable(make_tiny_model(family, **overrides).cuda())
    return cpu, gpu


def test_no_compression_equals_stock_transformers_on_cuda(tiny_family):
    stock = make_tiny_model(tiny_family).cuda()
    ours = kvfold.enable(make_tiny_model(tiny_family).cuda())
    ids = torch.randint(1, 90, (2, 60), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = stock(ids).logits
        pre = kvfold.prefill(ours, CharTokenizer(), ["x" * 60, "y" * 60], use_chat_template=False)
        got = ours(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert pre.cache.nbytes() == pre.cache.full_nbytes()


def test_masked_path_with_blocked_log_sum_exp_on_cuda(monkeypatch):
    monkeypatch.setattr(attention, "LSE_BLOCK_ELEMENTS", 4096)
    gen = torch.Generator().manual_seed(1)
    b, h_kv, groups, q_len, n, d = 2, 2, 4, 33, 300, 32
    keys = torch.randn(b, h_kv, n, d, generator=gen)
    values = torch.randn(b, h_kv, n, d, generator=gen)
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen)
    out, lse = attention._attend_after_cache(query.cuda(), keys.cuda(), values.cuda(), 0.2, with_lse=True)
    ref_out, ref_lse = attention._attend_after_cache(query, keys, values, 0.2, with_lse=True)  # fused CPU
    torch.testing.assert_close(out.cpu(), ref_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=0, atol=2e-5)


def test_repeat_pass_on_cuda_equals_the_cpu_and_holds_no_probabilities():
    """Scores and queries as on the CPU; the pass allocates less than one layer's ``(H_q, q, N)``
    float32 probabilities would (the path it replaced)."""
    cpu, gpu = _pair("llama", num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)
    tok = CharTokenizer()
    text = TEXT * 6  # ~2,300 tokens
    runs = {}
    for name, model in (("cpu", cpu), ("cuda", gpu)):
        pre = kvfold.prefill(model, tok, text, use_chat_template=False)
        ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.1), tokenizer=tok)
        if name == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        runs[name] = repeat.repeat_pass(ctx, chunk=2048, forward_chunk=2048)
        if name == "cuda":
            extra = torch.cuda.max_memory_allocated() - base
            n = pre.input_ids.shape[1]
            probabilities = 8 * 2048 * n * 4  # one layer's (H_q, q, N) float32 matrix
            assert extra < probabilities / 2, (extra, probabilities)
    for i in runs["cpu"].scores:
        torch.testing.assert_close(runs["cuda"].scores[i].cpu(), runs["cpu"].scores[i], rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(runs["cuda"].queries[i].cpu(), runs["cpu"].queries[i], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["kvzip", "kvzip+am_fit", "am_highest_fast", "snapkv"])
def test_a_compressed_cache_on_cuda_answers_as_on_the_cpu(method):
    """The same entries, lengths, keys and β as on the CPU, and the same next-token logits after a
    probe. Attention Matching's fitted values are compared through the logits only: its ridge
    solve of near-singular normal equations differs between devices in directions the attention
    barely reads (values up to 0.14 apart on the H200 for logits that agree)."""
    cpu, gpu = _pair("qwen2")
    tok = CharTokenizer()
    outs, probes = {}, {}
    for name, model in (("cpu", cpu), ("cuda", gpu)):
        pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
        outs[name] = compressed = pre.compress(method, 0.25)
        cache = compressed.cache.copy()
        n = cache.get_seq_length()
        ids = torch.tensor([[5, 7, 9]], device=model.device)
        positions = torch.arange(n, n + 3, device=ids.device)[None]
        with torch.no_grad():
            probes[name] = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits
    assert outs["cuda"].cache.nbytes() == outs["cpu"].cache.nbytes()
    for (_, a), (_, b) in zip(outs["cpu"].cache.folded_layers, outs["cuda"].cache.folded_layers, strict=True):
        ka, va, ba, la = a.padded()
        kb, vb, bb, lb = b.padded()
        assert torch.equal(lb.cpu(), la)
        torch.testing.assert_close(kb.cpu(), ka, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(bb.cpu(), ba, rtol=1e-3, atol=1e-3)
        if "am_" not in method:
            torch.testing.assert_close(vb.cpu(), va, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(probes["cuda"].cpu(), probes["cpu"], rtol=0, atol=1e-2)


def test_chunked_prefill_on_cuda_equals_one_prefill():
    _, gpu = _pair("llama")
    tok = CharTokenizer()
    whole = kvfold.prefill(gpu, tok, TEXT, use_chat_template=False)
    from kvfold.pipeline.chunked import prefill_chunked

    chunked = prefill_chunked(gpu, tok, whole.input_ids, "full", 1.0, 64)
    for (_, a), (_, b) in zip(whole.cache.folded_layers, chunked.cache.folded_layers, strict=True):
        torch.testing.assert_close(b.padded()[0], a.padded()[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(b.padded()[1], a.padded()[1], rtol=0, atol=1e-4)


def test_bench_peak_reads_the_cuda_allocator():
    from kvfold.evaluate.bench.process import PeakOver

    peak = PeakOver("cuda").start()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    assert 63 <= peak.stop() <= 80
