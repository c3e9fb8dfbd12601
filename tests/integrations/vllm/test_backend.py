"""kvfold's attention backend in one step that mixes plain requests and a request on a file: ``CPU_ATTN``
attends the plain requests alone (no placeholder slot of a file is ever attended), the pool kernel is
called once a layer for the requests on files, and every row equals what stock ``CPU_ATTN`` (plain) and
the per-chunk path (files) give."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

from kvfold.integrations.vllm import backend
from kvfold.runtime import native, pool_attention
from kvfold.runtime.pool_attention import EngineCaches, StepRequest, attend_request_per_chunk, pooled_file
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.row_pool import pack_pool

D, KV_HEADS, Q_HEADS, LAYERS, BLOCK, NUM_BLOCKS = 64, 3, 9, 2, 32, 40
pytestmark = pytest.mark.skipif(native.attend_pool_kernel() is None, reason=f"no pool kernel: {native.pool_status()}")


@pytest.fixture
def impl(monkeypatch):
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)
    made = backend.KvfoldAttentionImpl(
        num_heads=Q_HEADS, head_size=D, scale=D**-0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
        sliding_window=None, kv_cache_dtype="auto",
    )  # fmt: skip
    monkeypatch.setattr(backend._Shared, "step", None)
    monkeypatch.setattr(backend._Shared, "engine", None)
    return made


def _metadata(query_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> CPUAttentionMetadata:
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    seqs = torch.tensor(seq_lens, dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=D, seq_lens=seqs,
        dtype=torch.float32, query_start_loc=starts, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False,
    )  # fmt: skip
    return CPUAttentionMetadata(
        num_actual_tokens=sum(query_lens), max_query_len=max(query_lens), query_start_loc=starts,
        max_seq_len=max(seq_lens), seq_lens=seqs, block_table=table, slot_mapping=torch.zeros(0, dtype=torch.long),
        scheduler_metadata=scheduler,
    )  # fmt: skip


def test_plain_requests_alone_in_cpu_attn_and_one_kernel_call_a_layer_for_the_files(impl, monkeypatch):
    g = torch.Generator().manual_seed(0)
    caches = [torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * D) for _ in range(LAYERS)]
    lengths = [torch.tensor([300, 41, 97]), torch.tensor([5, 260, 64])]
    rows = [
        QuantizedRows.from_padded(torch.randn(KV_HEADS, int(n.max()), D, generator=g),
                                  torch.randn(KV_HEADS, int(n.max()), D, generator=g),
                                  torch.randn(KV_HEADS, int(n.max()), generator=g), n, QuantConfig.parse("int4"))
        for n in lengths
    ]  # fmt: skip
    plan, chunks = pack_pool(rows, KV_HEADS * BLOCK * 2 * D * 4)
    placeholders = math.ceil(plan.num_chunks / LAYERS) * BLOCK
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    served = SimpleNamespace(kernel_file=pooled_file(plan, placeholders, 700, inv_freq))
    # requests: plain (decode, 40 tokens), on the file (decode, 6 own tokens), plain (first step, 5 tokens)
    query_lens, seq_lens = [1, 1, 5], [40, placeholders + 6, 5]
    table = torch.zeros(3, 12, dtype=torch.int32)
    firsts = [0, 10, 30]
    for r, first in enumerate(firsts):
        table[r, : math.ceil(seq_lens[r] / BLOCK)] = torch.arange(first, first + math.ceil(seq_lens[r] / BLOCK))
    for c in range(plan.num_chunks):  # the file's chunks in the file request's first blocks
        caches[c % LAYERS][int(table[1, c // LAYERS])].view(-1).view(torch.uint8).copy_(chunks[c])
    for layer in range(LAYERS):  # every request's own tokens, by CPU_ATTN's own cache write
        kv = caches[layer].view(NUM_BLOCKS, KV_HEADS, 2 * BLOCK, D)
        key_cache, value_cache = kv.chunk(2, dim=2)
        for r, (count, first_slot) in enumerate([(40, 0), (6, placeholders), (5, 0)]):
            slots = torch.tensor(
                [int(table[r, s // BLOCK]) * BLOCK + s % BLOCK for s in range(first_slot, first_slot + count)]
            )
            keys, values = torch.randn(count, KV_HEADS, D, generator=g), torch.randn(count, KV_HEADS, D, generator=g)
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec", k_scale=1.0,
                                           v_scale=1.0, kv_cache_dtype="auto")  # fmt: skip
    metadata = _metadata(query_lens, seq_lens, table)
    query = torch.randn(sum(query_lens), Q_HEADS, D, generator=g)
    file_blocks = tuple(table[1, : placeholders // BLOCK].tolist())
    monkeypatch.setattr(backend, "_active_pools", lambda: {file_blocks: served})
    monkeypatch.setattr(backend, "layer_caches", lambda: caches)
    seen, calls = [], []
    original = CPUAttentionBackendImpl.forward

    def spy(self, layer, q, k, v, kv_cache, attn_metadata, output, *rest):
        seen.append(attn_metadata.seq_lens.tolist())
        return original(self, layer, q, k, v, kv_cache, attn_metadata, output, *rest)

    kernel = native.attend_pool_kernel()

    class Counting:
        openmp, debug = kernel.openmp, kernel.debug
        workspace_floats = staticmethod(kernel.workspace_floats)

        def attend(self, *args):
            calls.append(args[3])
            return kernel.attend(*args)

    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", spy)
    monkeypatch.setattr(pool_attention, "attend_pool_kernel", lambda: Counting())
    engine = EngineCaches(caches, Q_HEADS, D**-0.5)
    for layer in range(LAYERS):
        attention = SimpleNamespace(
            isa="vec", layer_name=f"model.layers.{layer}.self_attn.attn", _k_scale_float=1.0, _v_scale_float=1.0
        )
        impl._layer_index = None
        output = torch.full_like(query, float("nan"))
        impl.forward(attention, query, None, None, caches[layer], metadata, output)
        stock = torch.zeros_like(query)
        original(impl, attention, query, None, None, caches[layer], metadata, stock)
        for rows_ in (slice(0, 1), slice(2, 7)):  # the plain requests: as stock CPU_ATTN
            torch.testing.assert_close(output[rows_], stock[rows_], rtol=1e-5, atol=1e-5)
        request = StepRequest(1, 1, seq_lens[1], served.kernel_file, table[1])
        expected = attend_request_per_chunk(engine, request, layer, query[1:2])
        torch.testing.assert_close(output[1:2], expected, rtol=2e-5, atol=2e-5)
    assert seen == [[40, 5]] * LAYERS  # CPU_ATTN never saw the request on the file
    assert calls == list(range(LAYERS))  # one kernel call a layer


def test_requests_are_found_by_all_the_blocks_that_hold_their_file():
    """Requests that share a file's first block (the prefix cache) are told apart by the rest: one whose
    second block no load of its file wrote is not active, and is not read as the file."""
    table = torch.tensor([[7, 8, 30], [7, 9, 31], [5, 6, 32], [7, 8, 33]], dtype=torch.int32)
    pool = object()
    found, stray = backend.requests_on_files({(7, 8): pool}, table)
    assert found == [(0, pool), (3, pool)]
    assert stray == [9]  # the second request's own block: it ends, and the one sharing block 7 goes on
    assert backend.requests_on_files({}, table) == ([], [])


def test_a_request_on_a_file_left_out_of_the_step_is_reported_not_answered_as_plain(impl, monkeypatch):
    """Rows that begin with an active file's first block but not with all its blocks are requests on a
    file that are not read as one: their first differing blocks are reported, so that vLLM ends them."""
    table = torch.tensor([[0, 2, 9], [0, 3, 10]], dtype=torch.int32)
    metadata = _metadata([1, 1], [40, 40], table)
    monkeypatch.setattr(backend, "_active_pools", lambda: {(0, 1): object()})
    reported = []
    monkeypatch.setattr(backend, "_report_refused", reported.append)
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", lambda self, *args: args[6])
    attention = SimpleNamespace(isa="vec", layer_name="model.layers.0.self_attn.attn")
    query = torch.zeros(2, Q_HEADS, D)
    impl.forward(attention, query, None, None, torch.zeros(12, KV_HEADS, BLOCK, 2 * D), metadata, query.clone())
    assert reported == [[2, 3]]


def test_a_request_whose_blocks_do_not_hold_its_file_fails_and_the_step_goes_on(impl, monkeypatch):
    """Two requests on one file, the second's blocks not holding it (a load that failed): the forward does
    not raise, the first is answered as alone, and the second's last file block is reported once, so
    that vLLM ends it."""
    g = torch.Generator().manual_seed(1)
    caches = [torch.zeros(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * D) for _ in range(LAYERS)]
    lengths = torch.tensor([700, 7, 330])
    n = int(lengths.max())
    rows = [
        QuantizedRows.from_padded(torch.randn(KV_HEADS, n, D, generator=g), torch.randn(KV_HEADS, n, D, generator=g),
                                  torch.randn(KV_HEADS, n, generator=g), lengths, QuantConfig.parse("int4"))
        for _ in range(LAYERS)
    ]  # fmt: skip
    plan, chunks = pack_pool(rows, KV_HEADS * BLOCK * 2 * D * 4)
    file_blocks = math.ceil(plan.num_chunks / LAYERS)
    assert file_blocks >= 2  # its first and last file blocks differ
    placeholders = file_blocks * BLOCK
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    served = SimpleNamespace(kernel_file=pooled_file(plan, placeholders, 500, inv_freq))
    table = torch.zeros(2, 6, dtype=torch.int32)
    table[0, : file_blocks + 1] = torch.arange(0, file_blocks + 1)
    table[1, : file_blocks + 1] = torch.arange(20, 21 + file_blocks)
    for c in range(plan.num_chunks):  # the first request's blocks hold the file; the second's do not
        caches[c % LAYERS][int(table[0, c // LAYERS])].view(-1).view(torch.uint8).copy_(chunks[c])
    for layer in range(LAYERS):
        caches[layer][int(table[0, file_blocks])] = torch.randn(KV_HEADS, BLOCK, 2 * D, generator=g)
        caches[layer][int(table[1, file_blocks])] = torch.randn(KV_HEADS, BLOCK, 2 * D, generator=g)
    seq_lens = [placeholders + 3, placeholders + 3]
    metadata = _metadata([1, 1], seq_lens, table)
    query = torch.randn(2, Q_HEADS, D, generator=g)
    active = {tuple(table[r, :file_blocks].tolist()): served for r in range(2)}
    monkeypatch.setattr(backend, "_active_pools", lambda: active)
    monkeypatch.setattr(backend, "layer_caches", lambda: caches)
    reported = []
    monkeypatch.setattr(backend, "_report_refused", reported.append)
    engine = EngineCaches(caches, Q_HEADS, D**-0.5)
    for layer in range(LAYERS):
        attention = SimpleNamespace(isa="vec", layer_name=f"model.layers.{layer}.self_attn.attn")
        impl._layer_index = None
        output = torch.full_like(query, float("nan"))
        impl.forward(attention, query, None, None, caches[layer], metadata, output)
        request = StepRequest(0, 1, seq_lens[0], served.kernel_file, table[0])
        expected = attend_request_per_chunk(engine, request, layer, query[0:1])
        torch.testing.assert_close(output[0:1], expected, rtol=2e-5, atol=2e-5)
        assert not output[1].any()  # zeroed, in every layer
    assert reported == [[int(table[1, file_blocks - 1])]]  # its last file block, once


def test_a_step_without_requests_on_files_is_cpu_attn_as_it_is(impl, monkeypatch):
    table = torch.arange(4, dtype=torch.int32).view(2, 2)
    metadata = _metadata([1, 1], [40, 20], table)
    monkeypatch.setattr(backend, "_active_pools", lambda: {})
    calls = []
    monkeypatch.setattr(CPUAttentionBackendImpl, "forward", lambda self, *args: calls.append(args[5]) or args[6])
    attention = SimpleNamespace(isa="vec", layer_name="model.layers.0.self_attn.attn")
    query = torch.zeros(2, Q_HEADS, D)
    impl.forward(attention, query, None, None, torch.zeros(4, KV_HEADS, BLOCK, 2 * D), metadata, query.clone())
    assert calls == [metadata]  # the step's own metadata, untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_attn_needs_a_block_that_held_a_file_scrubbed(dtype):
    """Why the connector zeroes a block that held a file's bytes before a request without a file gets it:
    ``CPU_ATTN`` reads a request's last block whole, and one NaN past the request's length (a file's
    codes read as floats) makes its output NaN; zeroed, the output is a clean cache's."""
    g = torch.Generator().manual_seed(1)
    length = 40  # the second block holds 8 of the request's tokens, then 24 slots it never wrote
    keys, values = torch.randn(length, KV_HEADS, D, generator=g), torch.randn(length, KV_HEADS, D, generator=g)
    query = torch.randn(1, Q_HEADS, D, generator=g).to(dtype)

    def attend(cache: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = cache.view(4, KV_HEADS, 2 * BLOCK, D).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys.to(dtype), values.to(dtype), key_cache, value_cache,
                                       torch.arange(length), "vec", k_scale=1.0, v_scale=1.0,
                                       kv_cache_dtype="auto")  # fmt: skip
        metadata = _metadata([1], [length], torch.tensor([[0, 1]], dtype=torch.int32))
        scheduler = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=D, seq_lens=metadata.seq_lens,
            dtype=dtype, query_start_loc=metadata.query_start_loc, causal=True, sliding_window_size=-1,
            isa="vec", enable_kv_split=False,
        )  # fmt: skip
        out = torch.zeros_like(query)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=metadata.query_start_loc, seq_lens=metadata.seq_lens, scale=D**-0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=metadata.block_table, softcap=0,
            scheduler_metadata=scheduler, s_aux=None,
        )  # fmt: skip
        return out

    clean = attend(torch.zeros(4, KV_HEADS, BLOCK, 2 * D, dtype=dtype))
    held = torch.full((4, KV_HEADS, BLOCK, 2 * D), float("nan"), dtype=dtype)
    assert bool(attend(held.clone()).isnan().all())  # unscrubbed: every output NaN
    scrubbed = held.index_fill_(0, torch.tensor([0, 1]), 0)  # what the connector's scrub does
    torch.testing.assert_close(attend(scrubbed), clean, rtol=0, atol=0)
    assert bool(clean.isfinite().all())
