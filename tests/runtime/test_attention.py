"""The kvfold attention on real model code: exactness, positions, batches, plain generate()."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

import kvfold
from kvfold.pipeline.context import greedy_decode
from kvfold.runtime import attention
from kvfold.runtime.attention import kvfold_attention
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.live_bytes import LiveBytes
from kvfold.runtime.rows import FloatRows
from tests.conftest import CharTokenizer as _CharTokenizer
from tests.conftest import make_tiny_model


def test_import_changes_nothing():
    model = make_tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"


def test_no_compression_equals_stock_transformers(tiny_family):
    model = make_tiny_model(tiny_family)
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    stock_cache = DynamicCache(config=model.config)
    stock_prefill = model(ids, past_key_values=stock_cache).logits
    stock_text = model.generate(ids, max_new_tokens=12, do_sample=False)
    kvfold.enable(model)
    cache = FoldedCache(model.config)
    ours_prefill = model(ids, past_key_values=cache).logits
    torch.testing.assert_close(ours_prefill, stock_prefill, rtol=0, atol=1e-5)
    nxt = torch.tensor([[5, 7, 11]])
    model.set_attn_implementation("sdpa")
    stock_more = model(nxt, past_key_values=stock_cache).logits
    model.set_attn_implementation("kvfold")
    ours_more = model(nxt, past_key_values=cache).logits
    torch.testing.assert_close(ours_more, stock_more, rtol=0, atol=1e-5)
    ours_text = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=FoldedCache(model.config))
    assert torch.equal(ours_text, stock_text)


def test_evicted_entries_keep_logical_positions():
    """Evict entries after prefill; new tokens must see RoPE positions as if nothing was evicted.

    Reference: stock transformers with the full cache and a 4-D mask hiding the same entries
    from the new query only.
    """
    model = make_tiny_model("llama")
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    keep = torch.tensor([0, 1, 2, 3, 10, 11, 12, 20, 25, 28, 29])
    stock_cache = DynamicCache(config=model.config)
    model(ids, past_key_values=stock_cache)
    mask = torch.full((1, 1, 1, 31), float("-inf"))
    mask[..., keep] = 0.0
    mask[..., 30] = 0.0
    nxt = torch.tensor([[42]])
    stock = model(nxt, past_key_values=stock_cache, attention_mask=mask, position_ids=torch.tensor([[30]])).logits
    kvfold.enable(model)
    cache = FoldedCache(model.config)
    model(ids, past_key_values=cache)
    for _, layer in cache.folded_layers:
        k, v, _, _ = layer.padded()
        layer.replace(k[:, :, keep], v[:, :, keep])
    assert cache.get_seq_length() == 30
    ours = model(nxt, past_key_values=cache).logits  # positions come from the logical length
    torch.testing.assert_close(ours, stock, rtol=0, atol=1e-5)


def test_left_padded_batch_equals_each_context_alone():
    model = kvfold.enable(make_tiny_model("qwen2"))
    tok = _CharTokenizer()
    contexts = ["the quick brown fox jumps over the lazy dog " * 2, "a short one"]
    batch = kvfold.prefill(model, tok, contexts, use_chat_template=False)
    for method, budget in (("full", 1.0), ("streamingllm", 0.5)):
        together = batch.compress(method, budget).generate("why?", max_new_tokens=6, use_chat_template=False)
        for row, text in enumerate(contexts):
            alone = kvfold.prefill(model, tok, text, use_chat_template=False).compress(method, budget)
            single = alone.generate("why?", max_new_tokens=6, use_chat_template=False)[0]
            assert together[row].token_ids == single.token_ids, (method, row)


def test_plain_generate_runs_on_a_compressed_cache():
    model = kvfold.enable(make_tiny_model("llama"))
    tok = _CharTokenizer()
    prefilled = kvfold.prefill(model, tok, "abcdefghij" * 6, use_chat_template=False)
    compressed = prefilled.compress("streamingllm[online=false]", 0.25)
    question = tok("?!", add_special_tokens=False).input_ids
    ours = greedy_decode(model, tok, compressed.cache.copy(), question, 8, stop_at_eos=False)
    full_ids = torch.cat([prefilled.input_ids, torch.tensor([question])], dim=1)
    out = model.generate(
        full_ids, past_key_values=compressed.cache.copy(), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )
    assert out[0, full_ids.shape[1] :].tolist() == ours.token_ids


def test_gemma3_folds_global_layers_only():
    model = kvfold.enable(make_tiny_model("gemma3"))
    tok = _CharTokenizer()
    compressed = kvfold.prefill(model, tok, "abcdefgh" * 5, use_chat_template=False).compress("streamingllm", 0.25)
    kinds = [type(layer).__name__ for layer in compressed.cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "FoldedLayer", "DynamicSlidingWindowLayer", "FoldedLayer"]
    assert all(layer.physical_length == 11 for _, layer in compressed.cache.folded_layers)
    answer = compressed.generate("ok?", max_new_tokens=5, use_chat_template=False)[0]
    assert answer.new_tokens >= 1


def test_online_streamingllm_never_exceeds_budget():
    model = kvfold.enable(make_tiny_model("mistral"))
    tok = _CharTokenizer()
    prefilled = kvfold.prefill(model, tok, "xyz" * 30, use_chat_template=False)
    compressed = prefilled.compress("streamingllm", 0.2)
    limit = compressed.cache.layers[0].physical_length
    cache = compressed.cache.copy()
    cache.policy = compressed.policy
    seen = []
    for token in range(40):
        model(torch.tensor([[token % 90 + 1]]), past_key_values=cache)
        seen.append(max(layer.physical_length for _, layer in cache.folded_layers))
    assert max(seen) <= limit
    assert cache.get_seq_length() == prefilled.input_ids.shape[1] + 40
    first = cache.layers[0].padded()[0]
    assert torch.equal(first[:, :, :4], prefilled.cache.layers[0].padded()[0][:, :, :4])  # sinks survive


@pytest.mark.parametrize("budget", ["0", "-1", "1.5", "abc", "0.0"])
def test_bad_budgets_are_clear_errors(budget):
    with pytest.raises(ValueError, match=r"budget must be a fraction in \(0, 1\] or a positive token count"):
        kvfold.Budget.parse(budget)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_tokens_after_an_uncompressed_cache_match_one_masked_attention(dtype):
    """The split path (old entries unmasked, the new block causal, merged by log-sum-exp) equals
    one masked attention computed in float64, GQA included, on views into a larger capacity."""
    from kvfold.runtime.attention import _attend_after_cache

    gen = torch.Generator().manual_seed(3)
    b, h_kv, groups, q_len, n, d = 2, 3, 3, 7, 40, 16
    capacity_keys = torch.randn(b, h_kv, 64, d, generator=gen)
    capacity_values = torch.randn(b, h_kv, 64, d, generator=gen)
    keys, values = capacity_keys[:, :, :n].to(dtype), capacity_values[:, :, :n].to(dtype)
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen).to(dtype)
    ours = _attend_after_cache(query, keys, values, 0.25)
    allowed = torch.ones(q_len, n, dtype=torch.bool)
    allowed[:, n - q_len :] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        keys.double().repeat_interleave(groups, 1),
        values.double().repeat_interleave(groups, 1),
        attn_mask=allowed,
        scale=0.25,
    )
    assert ours.shape == ref.shape and ours.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_masked_path_and_its_blocked_log_sum_exp_equal_float64(dtype, monkeypatch):
    """The path other devices take (long contexts: on CUDA no mask, no ``(H_q, q, N)`` matrix): the old
    entries unmasked with the query heads folded, the new block causal, merged by each part's
    log-sum-exp computed in blocks of a few query rows; output and log-sum-exp equal a float64
    reference, GQA included, and so does a block with no old entries."""

    monkeypatch.setattr(attention, "LSE_BLOCK_ELEMENTS", 3 * 41)  # blocks of ~1 row a KV head
    gen = torch.Generator().manual_seed(5)
    b, h_kv, groups, q_len, n, d = 2, 3, 2, 9, 41, 8
    keys = torch.randn(b, h_kv, n, d, generator=gen).to(dtype)
    values = torch.randn(b, h_kv, n, d, generator=gen).to(dtype)
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen).to(dtype)
    out, lse = attention._attend_after_cache_split(query, keys, values, 0.3, with_lse=True)
    allowed = torch.ones(q_len, n, dtype=torch.bool)
    allowed[:, n - q_len :] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    logits = query.double() @ keys.double().repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    logits = logits.masked_fill(~allowed, float("-inf"))
    ref_out = logits.softmax(-1) @ values.double().repeat_interleave(groups, 1)
    assert out.shape == ref_out.shape and lse.shape == (b, h_kv * groups, q_len)
    assert lse.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(out.double(), ref_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
    new_keys, new_values = keys[:, :, -q_len:], values[:, :, -q_len:]
    only_new, lse_new = attention._attend_after_cache_split(query, new_keys, new_values, 0.3, True)
    ref_new = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        keys[:, :, -q_len:].double().repeat_interleave(groups, 1),
        values[:, :, -q_len:].double().repeat_interleave(groups, 1),
        is_causal=True,
        scale=0.3,
    )
    torch.testing.assert_close(only_new.double(), ref_new, rtol=0, atol=1e-5)
    assert torch.isfinite(lse_new).all()


@pytest.mark.parametrize("path", ["fused", "blocked"])
@pytest.mark.parametrize("split", [0, 13, 32])
def test_the_log_sum_exp_over_the_first_entries_comes_apart_and_changes_nothing_else(path, split, monkeypatch):
    """Asked for the log-sum-exp over the first ``split`` old entries (the context before a repeat
    pass), both paths give it equal to float64 (−inf for none), with the output and the whole
    log-sum-exp of the call without it; on the fused path the old entries then take two calls."""
    if path == "blocked":
        monkeypatch.setattr(attention, "_cpu_flash", lambda query: False)
        monkeypatch.setattr(attention, "LSE_BLOCK_ELEMENTS", 3 * 41)
    gen = torch.Generator().manual_seed(6)
    b, h_kv, groups, q_len, n, d = 2, 3, 2, 9, 41, 8  # 32 old entries
    keys, values = (torch.randn(b, h_kv, n, d, generator=gen) for _ in range(2))
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen)
    out, lse = attention._attend_after_cache(query, keys, values, 0.3, with_lse=True)
    out_s, lse_s, head = attention._attend_after_cache(query, keys, values, 0.3, with_lse=True, split=split)
    torch.testing.assert_close(out_s, out, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse_s, lse, rtol=0, atol=1e-6)
    logits = query.double() @ keys[:, :, :split].double().repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    assert head.shape == lse.shape and head.dtype == torch.float32
    torch.testing.assert_close(head.double(), torch.logsumexp(logits, -1), rtol=0, atol=1e-5)
    assert attention._attend_after_cache(query, keys, values, 0.3, split=split).shape == out.shape


def test_a_ragged_layer_attends_through_its_stored_part_and_equals_float64(monkeypatch):
    """Per-head lengths (stored rows at full precision, β included): a 3-token question, then decode
    steps, each through the stored rows' part merged with the dense tail by log-sum-exp (the tail
    causal among the new tokens), against a float64 softmax over each row's entries."""
    b, h_kv, groups, d, n = 2, 3, 2, 8, 24
    g = torch.Generator().manual_seed(7)
    keys, values = torch.randn(b, h_kv, n, d, generator=g), torch.randn(b, h_kv, n, d, generator=g)
    beta = torch.randn(b, h_kv, n, generator=g)
    lengths = torch.tensor([[3, 24, 0], [11, 1, 6]])
    cache = FoldedCache(num_layers=1)
    layer = cache.layers[0]
    layer.update(keys, values)
    layer.replace(keys, values, beta, lengths)
    assert isinstance(layer.stored, FloatRows)
    calls = []
    real = attention.stored_part
    monkeypatch.setattr(attention, "stored_part", lambda *a: calls.append(1) or real(*a))
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=groups, is_causal=True)
    rows = [[(keys[i, j, :m], values[i, j, :m], beta[i, j, :m]) for j, m in enumerate(row)]
            for i, row in enumerate(lengths.tolist())]  # fmt: skip
    for step, q_len in enumerate((3, 1, 1)):
        new_k, new_v = torch.randn(b, h_kv, q_len, d, generator=g), torch.randn(b, h_kv, q_len, d, generator=g)
        query = torch.randn(b, h_kv * groups, q_len, d, generator=g)
        k, v = layer.update(new_k, new_v)
        out, _ = kvfold_attention(module, query, k, v, None, scaling=d**-0.5, kvfold_cache=cache)
        want = torch.empty(b, q_len, h_kv * groups, d, dtype=torch.float64)
        for i in range(b):
            for j in range(h_kv):
                rk, rv, rb = rows[i][j]
                for t in range(q_len):  # token t sees the entries before it and itself
                    ks = torch.cat([rk, new_k[i, j, : t + 1]]).double()
                    vs = torch.cat([rv, new_v[i, j, : t + 1]]).double()
                    bs = torch.cat([rb, torch.zeros(t + 1)]).double()
                    for head in range(j * groups, (j + 1) * groups):
                        weights = torch.softmax(ks @ query[i, head, t].double() * d**-0.5 + bs, 0)
                        want[i, t, head] = weights @ vs
                grown = ((rk, new_k[i, j]), (rv, new_v[i, j]), (rb, torch.zeros(q_len)))
                rows[i][j] = tuple(torch.cat(pair) for pair in grown)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6, msg=f"step {step}")
    assert len(calls) == 3 and isinstance(layer.stored, FloatRows) and layer.stored.width == 24


@pytest.mark.parametrize("kv_format", [None, "int4", "int4[outliers=1]", "int3", "fp8", "int4[value_group=8]"])
def test_a_decode_step_over_stored_rows_reads_nothing_back_to_the_host(kv_format, monkeypatch):
    """Rows of very different lengths (stored ragged, at full precision or quantized and read by the
    PyTorch path, what a GPU runs): after the first read, which builds each storage's page index, a
    whole decode step through the model makes no host-reading call in kvfold's code (on CUDA, no
    synchronisation), and its logits equal the step's on a copy of the same cache read densely."""
    from kvfold.runtime import quantized_attention
    from kvfold.runtime.host_syncs import HostSyncCounter
    from kvfold.runtime.quant_config import QuantConfig

    monkeypatch.setattr(quantized_attention, "native_applies", lambda *a: False)  # the GPU's path, here
    model = kvfold.enable(make_tiny_model("llama", num_key_value_heads=3, num_attention_heads=6))
    prefilled = kvfold.prefill(
        model, _CharTokenizer(), "the quick brown fox jumps over it " * 3, use_chat_template=False
    )
    cache = prefilled.cache
    n = cache.get_seq_length()
    for i, layer in cache.folded_layers:
        keys, values, _, _ = layer.padded()
        lengths = torch.tensor([[n, 3 + i, n // 3]])
        layer.replace(keys, values, torch.randn(1, 3, n, generator=torch.Generator().manual_seed(i)), lengths)
        assert isinstance(layer.stored, FloatRows)
    cache.quantize(QuantConfig.parse(kv_format) if kv_format else None)
    dense = cache.copy()
    for _, layer in dense.folded_layers:  # the same entries (dequantized) in the dense tail, β = −inf past a row
        keys, values, log_mass, _ = layer.padded()
        layer.stored = None
        layer._store_dense_padded(keys, values, log_mass)  # noqa: SLF001 - the test builds the dense reference
    token = torch.tensor([[5]])
    with torch.no_grad():
        for step in range(3):
            position = torch.tensor([[n + step]])
            with HostSyncCounter() as syncs:
                got = model(input_ids=token, position_ids=position, past_key_values=cache).logits
            want = model(input_ids=token, position_ids=position, past_key_values=dense).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            if step:
                assert not syncs.kvfold, syncs.summary()


def test_the_device_kernel_is_taken_only_where_it_gives_the_blocked_paths_attention(monkeypatch):
    """Off the CPU a fused kernel's log-sum-exp replaces float32 products over the whole cache, once a
    check on a small GQA problem finds it gives the blocked path's output and log-sum-exp; a kernel that
    is off, or missing, leaves the blocked path, and the status says why. (The CPU's fused kernel stands
    in for CUDA's here.)"""
    cpu = torch.device("cpu")
    monkeypatch.setattr(attention, "DEVICE_FLASH_KERNEL", attention.FLASH_WITH_LSE)
    assert attention._check_device_flash(cpu, torch.bfloat16) == "fused"

    def off(*args, **kwargs):
        out, lse = attention.FLASH_WITH_LSE(*args, **kwargs)
        return out, lse + 0.2

    monkeypatch.setattr(attention, "DEVICE_FLASH_KERNEL", off)
    assert attention._check_device_flash(cpu, torch.bfloat16).startswith("blocked log-sum-exp (the fused kernel is off")

    def missing(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(attention, "DEVICE_FLASH_KERNEL", missing)
    assert attention._check_device_flash(cpu, torch.bfloat16) == (
        "blocked log-sum-exp (no kernel image is available for execution on the device)"
    )
    query = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    assert attention.device_flash(query) is None  # a CPU query: the CPU's own kernel, not this one


def test_the_log_sum_exp_path_is_named_for_the_records():
    """What `kvfold bench` records as `repeat_attention`: the CPU's fused kernel in float32 and
    bfloat16, float32 products elsewhere with the reason, CUDA's status once checked."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    fused_cpu = "fused (CPU kernel)" if attention.FLASH_WITH_LSE is not None else None
    if fused_cpu:
        assert attention.log_sum_exp_path(cpu, torch.bfloat16) == fused_cpu
    assert attention.log_sum_exp_path(cpu, torch.float64).startswith("blocked log-sum-exp (torch.float64")
    assert attention.log_sum_exp_path(cuda, torch.float32).startswith("blocked log-sum-exp (torch.float32 on cuda")
    key = f"{cuda} {torch.bfloat16}"
    if key not in attention.DEVICE_FLASH_STATUS:
        assert attention.log_sum_exp_path(cuda, torch.bfloat16).startswith("blocked log-sum-exp (not checked")


def test_the_blocked_log_sum_exp_takes_larger_blocks_off_the_cpu(monkeypatch):
    """Off the CPU a block of the log-sum-exp holds up to :data:`attention.ACCELERATOR_LSE_BLOCK_ELEMENTS`
    logits (each block is a few launches there), on the CPU :data:`attention.LSE_BLOCK_ELEMENTS`; the
    result is the same."""
    gen = torch.Generator().manual_seed(4)
    b, h_kv, groups, q_len, n, d = 1, 2, 2, 6, 30, 8  # 12 folded rows a KV head
    query = torch.randn(b, h_kv * groups, q_len, d, generator=gen)
    keys = torch.randn(b, h_kv, n, d, generator=gen)
    products = []
    real = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a: products.append(1) or real(*a))
    monkeypatch.setattr(attention, "LSE_BLOCK_ELEMENTS", b * h_kv * n * 3)  # 3 rows a block: 4 blocks
    monkeypatch.setattr(attention, "ACCELERATOR_LSE_BLOCK_ELEMENTS", b * h_kv * n * 12)  # 1 block
    on_cpu = attention.log_sum_exp_parts(query, keys, 0.3)
    cpu_blocks, products[:] = len(products), []
    monkeypatch.setattr(attention, "_is_cpu", lambda device: False)
    off_cpu = attention.log_sum_exp_parts(query, keys, 0.3)
    assert (cpu_blocks, len(products)) == (4, 1)
    for a, c in zip(on_cpu, off_cpu, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-6)


def test_the_log_sum_exp_parts_hold_one_block_of_logits_at_a_time():
    """The previous block's logits are freed before the next block's are made: one block held, not two."""
    gen = torch.Generator().manual_seed(0)
    query, keys = torch.randn(1, 4, 16, 4, generator=gen), torch.randn(1, 1, 4096, 4, generator=gen)
    rows = 4 * 4  # 4·D rows a block: 4 blocks of 16 rows over 4,096 keys
    with torch.inference_mode(), LiveBytes() as ledger:
        attention.log_sum_exp_parts(query, keys, 0.5)
    assert ledger.peak < 1.5 * rows * 4096 * 4  # 1.01 blocks; 2.01 with the last block kept
