"""The CUDA paths (skipped without a GPU; run on the device machine, docs/benchmarks.md "On a GPU").

Each CUDA test runs the same work on the CPU and on CUDA and compares, or bounds what CUDA allocates:
no compression equals stock transformers there too, the repeat pass takes the masked kernel with a
blocked log-sum-exp (no ``(H_q, q, N)`` probabilities at long contexts) and the recommended pipeline keeps
what it keeps on the CPU. A compressed cache is compared by what attention reads
(:mod:`tests.runtime.cache_reads`): exactly for selections, against the CPU's own float32 accuracy
(float64 as the reference) for Attention Matching's fits, whose β is poorly determined. The float32
against float64 half of that comparison needs no GPU and runs everywhere.
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
from tests.runtime.cache_reads import assert_same_selection, compress, largest_difference, reads

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6


def _pair(family: str = "llama", **overrides):
    cpu = kvfold.enable(make_tiny_model(family, **overrides))
    gpu = kvfold.enable(make_tiny_model(family, **overrides).cuda())
    return cpu, gpu


@needs_cuda
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


@needs_cuda
def test_masked_path_with_blocked_log_sum_exp_on_cuda(monkeypatch):
    monkeypatch.setattr(attention, "ACCELERATOR_LSE_BLOCK_ELEMENTS", 4096)
    gen = torch.Generator().manual_seed(1)
    b, h_kv, groups, q_len, n, d = 2, 2, 4, 33, 300, 32
    keys = torch.randn(b, h_kv, n, d, generator=gen)
    values = torch.randn(b, h_kv, n, d, generator=gen)
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen)
    out, lse = attention._attend_after_cache(query.cuda(), keys.cuda(), values.cuda(), 0.2, with_lse=True)
    ref_out, ref_lse = attention._attend_after_cache(query, keys, values, 0.2, with_lse=True)  # fused CPU
    torch.testing.assert_close(out.cpu(), ref_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.cpu(), ref_lse, rtol=0, atol=2e-5)


@needs_cuda
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


FITTED = ["kvzip+am_fit", "am_highest_fast"]
"""Methods that fit β and values (Attention Matching) on a selection made before the fit: compared by
what attention reads (``am_omp`` selects by its fit, so float32 and float64 keep different entries)."""
SELECTED = ["kvzip", "snapkv"]
"""Methods that keep entries as they are (β = 0): compared exactly."""
NOISE = 1e-6
"""Below this, a difference is float32 rounding of any computation (a floor for the ratios)."""
WORSE = 4.0
"""How many times the CPU's own float32 error (against float64) a CUDA fit may be off: different
kernels round differently; a bug moves what attention reads by the approximation's size instead."""


@pytest.mark.parametrize("method", SELECTED)
def test_a_selection_reads_the_same_in_float32_and_float64(method):
    """Selections fit nothing: the same entries, β exactly equal (0 kept, −inf empty), and what
    attention reads equal within float32 rounding."""
    low, high = reads(*compress(method)), reads(*compress(method, dtype=torch.float64))
    assert_same_selection(low, high)
    assert all(torch.equal(a, b) for a, b in zip(low.betas, high.betas, strict=True))
    assert max(largest_difference(low, high).values()) < 1e-5


@pytest.mark.parametrize("method", FITTED)
def test_a_fit_in_float32_reads_as_in_float64_though_its_beta_moves(method):
    """Attention Matching's fit in float32 against float64 on the CPU (what CI can run of the CUDA
    comparison): the same entries kept, next-token logits and each row's attention output within 1e-2,
    its mass within 0.5 nats (a fit matches the mass on its reference queries, not on the probe's), while
    β may move by whole units: the normal equations are near-singular, so β is poorly determined in
    directions attention barely reads. The spread measured here is what the CUDA test allows."""
    low, high = reads(*compress(method)), reads(*compress(method, dtype=torch.float64))
    assert_same_selection(low, high, values=False)
    spread = largest_difference(low, high)
    assert spread["logits"] < 1e-2 and spread["outputs"] < 1e-2 and spread["masses"] < 0.5, spread


@needs_cuda
@pytest.mark.parametrize("method", SELECTED + FITTED)
def test_a_compressed_cache_on_cuda_answers_as_on_the_cpu(method):
    """The same entries, lengths and keys as on the CPU; then what attention reads, first the next-token
    logits after a probe, then each row's attention output and mass on the probe's queries. A selection
    keeps β exactly and reads within float32 rounding. A fit is held to the CPU's own float32 accuracy:
    its distance to the float64 fit at most :data:`WORSE` times the CPU float32 fit's (β is not compared:
    on the H200 it moved by up to 1.6 where the CPU's float32 and float64 fits differ by up to 5)."""
    cpu, gpu = reads(*compress(method)), reads(*compress(method, device="cuda"))
    fitted = method in FITTED
    assert_same_selection(cpu, gpu, values=not fitted)
    if not fitted:
        assert all(torch.equal(a, b) for a, b in zip(cpu.betas, gpu.betas, strict=True))
        torch.testing.assert_close(gpu.logits, cpu.logits, rtol=0, atol=1e-4)
        assert max(largest_difference(cpu, gpu).values()) < 1e-4
        return
    exact = reads(*compress(method, dtype=torch.float64))
    on_cpu, on_cuda = largest_difference(cpu, exact), largest_difference(gpu, exact)
    for read in ("logits", "outputs", "masses"):  # the logits first: what the model answers
        assert on_cuda[read] <= WORSE * on_cpu[read] + NOISE, (read, on_cuda, on_cpu)


@needs_cuda
def test_chunked_prefill_on_cuda_equals_one_prefill():
    _, gpu = _pair("llama")
    tok = CharTokenizer()
    whole = kvfold.prefill(gpu, tok, TEXT, use_chat_template=False)
    from kvfold.pipeline.chunked import prefill_chunked

    chunked = prefill_chunked(gpu, tok, whole.input_ids, "full", 1.0, 64)
    for (_, a), (_, b) in zip(whole.cache.folded_layers, chunked.cache.folded_layers, strict=True):
        torch.testing.assert_close(b.padded()[0], a.padded()[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(b.padded()[1], a.padded()[1], rtol=0, atol=1e-4)


@needs_cuda
def test_bench_peak_reads_the_cuda_allocator():
    from kvfold.evaluate.bench.process import PeakOver

    peak = PeakOver("cuda").start()
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del block
    assert 63 <= peak.stop() <= 80


@needs_cuda
@pytest.mark.parametrize("kind", ["full", "rows", "int4", "int3"])
def test_a_compiled_decode_on_cuda_answers_as_the_eager_one(kind, monkeypatch):
    """CUDA graphs over fixed tails (``reduce-overhead``), stored rows read by the Triton kernel: the eager
    decode's logits, step after step, one graph for every step."""
    from torch._dynamo.utils import counters

    from kvfold.pipeline.compiled_decode import CompiledDecode
    from tests.pipeline.test_compiled_decode import TOKENS, _cache, _eager_logits

    torch._dynamo.reset()
    counters.clear()
    model, cache = _cache(kind)
    model.cuda()
    cache = _on_cuda(cache)
    want = _eager_logits(model, cache.copy(), TOKENS)
    with torch.no_grad(), CompiledDecode(model, cache, len(TOKENS)) as step:  # reduce-overhead on CUDA
        got = [step.step(torch.tensor([token], device="cuda")) for token in TOKENS]
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {index}")


def _on_cuda(cache):
    """A CPU-built cache moved to CUDA, every tensor (the stored rows' as they are)."""
    for _, layer in cache.folded_layers:
        layer.device = torch.device("cuda")
        layer.prefetch()
    torch.cuda.synchronize()
    return cache


@needs_cuda
def test_repeat_queries_wait_on_the_host_and_fit_as_on_the_device(monkeypatch):
    """On CUDA the repeat pass writes its queries to page-locked host memory (the device then holds the
    cache, a chunk's scratch and one layer's fit, not every layer's queries); a fit brings one layer's
    back and compresses to the cache it gives with the queries kept on the device."""
    _, gpu = _pair("llama")
    tok = CharTokenizer()
    pre = kvfold.prefill(gpu, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(gpu, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.25), tokenizer=tok)
    found = repeat.repeat_pass(ctx, scores=False)
    assert all(q.device.type == "cpu" and q.is_pinned() for q in found.queries.values())
    on_host = kvfold.prefill(gpu, tok, TEXT, use_chat_template=False).compress("kvzip+am_fit", 0.25)
    monkeypatch.setattr(repeat, "queries_on_host", lambda device: False)
    on_device = kvfold.prefill(gpu, tok, TEXT, use_chat_template=False).compress("kvzip+am_fit", 0.25)
    for (_, a), (_, b) in zip(on_host.cache.folded_layers, on_device.cache.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@needs_cuda
def test_the_repeat_pass_attention_on_cuda_takes_the_flash_kernel_in_16_bits():
    """In bfloat16 on CUDA the attention over a cache and its log-sum-exp come from the flash kernel
    (checked once a device), equal to the blocked float32 products within bfloat16 rounding."""
    gen = torch.Generator().manual_seed(2)
    b, h_kv, groups, q_len, n, d = 1, 2, 4, 65, 700, 64
    parts = [torch.randn(b, h, m, d, generator=gen) for h, m in ((h_kv * groups, q_len), (h_kv, n), (h_kv, n))]
    query, keys, values = (t.to("cuda", torch.bfloat16) for t in parts)
    assert attention.device_flash(query) is attention.DEVICE_FLASH_KERNEL
    assert attention.DEVICE_FLASH_STATUS[f"{query.device} {query.dtype}"] == "fused"
    out, lse = attention._attend_after_cache(query, keys, values, 0.125, with_lse=True)
    ref_out, ref_lse = attention._attend_after_cache_split(query, keys, values, 0.125, with_lse=True)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse.float(), ref_lse.float(), rtol=0, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("plus", [False, True])
def test_kvzips_scores_on_cuda_take_the_triton_kernel_in_16_bits(plus):
    """In bfloat16 on CUDA KVzip's scores (and KVzip+'s, a max per query head) come from the Triton kernel
    (checked once a device), equal to the blocked float32 products up to the order of the sums; float32
    queries keep the products."""
    from kvfold.runtime import key_scores

    gen = torch.Generator().manual_seed(3)
    b, h_kv, g, q_len, n, d = 1, 8, 4, 300, 5000, 128
    query = torch.randn(b, h_kv * g, q_len, d, generator=gen).to("cuda", torch.bfloat16)
    cache = torch.randn(b, h_kv, n + 100, d, generator=gen).to("cuda", torch.bfloat16)
    keys = cache[:, :, :n]  # a layer's context entries: a view of a longer cache
    lse = (12 + torch.rand(b, h_kv * g, q_len, generator=gen)).cuda()
    extra = ()
    if plus:
        extra = ((1 + torch.rand(b, q_len, generator=gen)).cuda(), torch.rand(b, h_kv * g, n, generator=gen).cuda())
    assert key_scores.fused_applies(query, keys)
    assert key_scores.FUSED_STATUS[f"{query.device} {query.dtype}"] == "fused"
    assert key_scores.scores_path(query.device, query.dtype) == "fused (Triton)"
    got = repeat.max_received(query, keys, lse, d**-0.5, *extra)
    shift = -lse.reshape(b * h_kv, g * q_len)
    if plus:
        shift = shift - extra[0].log().repeat(1, g)  # each head's rows (g, t) less log ‖x_t‖ (batch 1)
    groups = g if plus else 1
    folded, flat = query.reshape(b * h_kv, g * q_len, d), keys.reshape(b * h_kv, n, d)
    best = key_scores.blocked_max_logits(folded, flat, shift, d**-0.5, groups, 512).exp()
    if plus:
        best = (best.reshape(b, h_kv, g, n) * extra[1].reshape(b, h_kv, g, n)).amax(dim=2)
    torch.testing.assert_close(got, best.reshape(b, h_kv, n), rtol=1e-4, atol=0)
    assert not key_scores.fused_applies(query.float(), keys.float())


SUMS_ORDER = {"logits": 3e-2, "outputs": 2e-3, "masses": 1e-2}
"""How far two bfloat16 fits whose logits differ by the order of float32 sums may read apart. On the CPU, with
the logits summed in float64 and rounded (a stand-in for another order), they read 0.0039 apart in the logits
(one bfloat16 step), 1.3e-4 in each row's output and 8.8e-4 in its mass; with the keys' columns permuted,
7.1e-3 and 0.048."""


@needs_cuda
def test_a_fit_on_cuda_multiplies_16_bit_queries_and_keys_with_float32_sums(monkeypatch):
    """In bfloat16 on CUDA Attention Matching's logits take CUDA's 16-bit product with float32 sums (checked
    once a device), and the cache reads as the one fitted on float32 upcasts: the same entries kept, and what
    attention reads within :data:`SUMS_ORDER`."""
    from kvfold.runtime import exact_products

    operands = []
    product = exact_products.float32_bmm
    monkeypatch.setattr(exact_products, "float32_bmm", lambda a, b: operands.append(a.device.type) or product(a, b))
    monkeypatch.setattr(exact_products, "FORCED", False)
    upcast = reads(*compress("kvzip+am_fit", device="cuda", dtype=torch.bfloat16))
    assert not operands
    monkeypatch.setattr(exact_products, "FORCED", None)
    sixteen = reads(*compress("kvzip+am_fit", device="cuda", dtype=torch.bfloat16))
    assert operands and set(operands) == {"cuda"}
    assert exact_products.STATUS["cuda:0 torch.bfloat16"] == "exact"
    assert exact_products.products_path(torch.device("cuda:0"), torch.bfloat16) == "16-bit operands, float32 sums"
    assert_same_selection(upcast, sixteen, values=False)
    apart = largest_difference(upcast, sixteen)
    assert all(apart[read] <= bound for read, bound in SUMS_ORDER.items()), apart
