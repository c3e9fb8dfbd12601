"""The repeat pass (:mod:`kvfold.methods.core.repeat`): one per prefilled context, shared by KVzip's
scores and Attention Matching's and ``am_fit``'s reference queries, the same in pieces as in one
forward.
"""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext, build_method
from kvfold.methods.core import repeat
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer, make_tiny_model

F64 = torch.float64
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps "


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def model64(family: str = "llama"):
    return kvfold.enable(make_tiny_model(family).to(F64))


def count_forwards(model) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(1), with_kwargs=True)
    return calls


def test_one_repeat_pass_per_context_for_every_method_and_budget():
    tok = CharTokenizer()
    model = model64("llama")
    alone = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(
        model, alone.cache, alone.input_ids, alone.attention_mask, Budget.parse(0.5), tokenizer=tok
    )
    calls = count_forwards(model)
    repeat.repeat_pass(ctx)  # the forwards of one pass
    one_pass = len(calls)
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    calls.clear()
    specs = ["kvzip", "am_highest_fast", "kvzip+am_fit", "knorm[online=false]+am_fit", "kvzip+am_fit[beta_min=-3]"]
    sweep = [pre.compress(spec, budget) for spec in specs for budget in (0.5, 0.3)]
    assert len(calls) == one_pass
    kvfold.prefill(model, tok, TEXT, use_chat_template=False).compress("am_highest_fast", 0.3)
    assert len(calls) == one_pass + 1 + one_pass  # another context: its prefill and its own pass
    assert "reused_seconds" not in sweep[0].report and all(c.report["reused_seconds"] > 0 for c in sweep[1:])


def test_the_repeat_pass_in_pieces_equals_one_forward():
    tok = CharTokenizer()
    model = model64("qwen2")
    pre = kvfold.prefill(model, tok, [TEXT, TEXT[:40]], use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    whole = repeat.repeat_pass(ctx, chunk=2048, forward_chunk=4096)
    pieces = repeat.repeat_pass(ctx, chunk=2048, forward_chunk=7)
    for i in whole.scores:
        torch.testing.assert_close(pieces.scores[i], whole.scores[i], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(pieces.queries[i], whole.queries[i], rtol=1e-10, atol=1e-12)
        assert torch.equal(pieces.query_valid[i], whole.query_valid[i])
    short = int(pre.attention_mask[1].sum())
    (ids,) = repeat.RepeatPrompt.build(tok).chunk_inputs(pre.input_ids[1, -short:].tolist(), 2048)
    assert int(whole.query_valid[0][1, 0].sum()) == 3 * len(ids)  # G = 3 query heads per KV head


def test_max_received_equals_the_float64_softmax_over_the_whole_cache():
    """KVzip's score from each query's log-sum-exp (the fused attention's) equals the max over
    queries and the GQA group of the eager float64 probabilities (Kim et al. 2025 §3.2)."""
    from kvfold.runtime.attention import _attend_after_cache

    torch.manual_seed(0)
    b, h_kv, groups, q_len, context, d = 2, 2, 3, 150, 70, 16  # 3 × 150 rows: blocks of 128 and a rest
    scaling = d**-0.5
    query = torch.randn(b, h_kv * groups, q_len, d)
    keys = torch.randn(b, h_kv, context + q_len, d) * 2
    values = torch.randn(b, h_kv, context + q_len, d)
    _, lse = _attend_after_cache(query, keys, values, scaling, with_lse=True)
    fast = repeat.max_received(query, keys[:, :, :context], lse, scaling)

    logits = query.to(F64) @ keys.to(F64).repeat_interleave(groups, dim=1).transpose(-1, -2) * scaling
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    allowed = torch.cat([torch.ones(q_len, context, dtype=torch.bool), causal], dim=1)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)[..., :context]
    reference = probs.amax(dim=2).reshape(b, h_kv, groups, context).amax(dim=2)
    assert fast.dtype == torch.float32 and fast.shape == (b, h_kv, context)
    torch.testing.assert_close(fast.to(F64), reference, rtol=2e-5, atol=1e-9)


def test_the_fused_repeat_pass_scores_equal_the_eager_ones(monkeypatch):
    """A float32 model takes the fused path (the log-sum-exp, no probability matrix); its scores and
    queries equal the eager path's and, to float32 rounding, a float64 model's."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    calls = []
    real = repeat.max_received
    monkeypatch.setattr(repeat, "max_received", lambda *args: calls.append(1) or real(*args))
    fused = repeat.repeat_pass(ctx, forward_chunk=64)
    assert calls  # the fused path ran
    monkeypatch.setattr(repeat.RepeatRecorder, "accepts_log_sum_exp", False)
    calls.clear()
    eager = repeat.repeat_pass(ctx, forward_chunk=64)
    assert not calls
    model64_ = kvfold.enable(make_tiny_model("llama").to(F64))
    pre64 = kvfold.prefill(model64_, tok, TEXT * 3, use_chat_template=False)
    ctx64 = CompressionContext(
        model64_, pre64.cache, pre64.input_ids, pre64.attention_mask, Budget.parse(0.5), tokenizer=tok
    )
    exact = repeat.repeat_pass(ctx64, forward_chunk=64)
    for i in fused.scores:
        torch.testing.assert_close(fused.scores[i], eager.scores[i], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(fused.scores[i].to(F64), exact.scores[i], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(fused.queries[i], eager.queries[i], rtol=1e-5, atol=1e-6)
        assert torch.equal(fused.query_valid[i], eager.query_valid[i])


def context_lse_reference(ctx, found) -> dict[int, torch.Tensor]:
    """Each recorded query's float64 log-sum-exp over the context's keys (β = 0 on a fresh prefill)."""
    from kvfold.runtime.attention import attention_scalings

    scalings = attention_scalings(ctx.model)
    out = {}
    for i, layer in ctx.cache.folded_layers:
        keys = layer.keys[:, :, : layer.physical_length].to(F64)
        out[i] = torch.logsumexp(found.queries[i].to(F64) @ keys.transpose(-1, -2) * scalings[i], dim=-1)
    return out


def test_the_pass_records_each_querys_log_sum_exp_over_the_context(monkeypatch):
    """Beside each repeat query the pass records its log-sum-exp over the context entries alone (the
    repeat input's own entries apart), from the attention's own kernel: equal to float64, chunk after
    chunk and forward after forward, on the fused CPU path and on the blocked path other devices
    take; where the attention gives no log-sum-exp (a float64 model) no layer has it."""
    from kvfold.runtime import attention

    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    fused = repeat.repeat_pass(ctx, chunk=64, forward_chunk=16, scores=False)  # 3 chunks, several forwards each
    reference = context_lse_reference(ctx, fused)
    assert set(fused.query_context_lse) == set(reference)
    for i, lse in fused.query_context_lse.items():
        assert lse.shape == fused.query_valid[i].shape and lse.dtype == torch.float32
        torch.testing.assert_close(lse.to(F64), reference[i], rtol=0, atol=2e-5)
    monkeypatch.setattr(attention, "_is_cpu", lambda device: False)
    monkeypatch.setattr(attention, "_cpu_flash", lambda query: False)
    blocked = repeat.repeat_pass(ctx, chunk=64, forward_chunk=16, scores=False)
    for i, lse in blocked.query_context_lse.items():
        torch.testing.assert_close(lse.to(F64), reference[i], rtol=0, atol=2e-5)
    monkeypatch.undo()
    tiny64 = model64("llama")
    pre64 = kvfold.prefill(tiny64, tok, TEXT * 3, use_chat_template=False)
    ctx64 = CompressionContext(
        tiny64, pre64.cache, pre64.input_ids, pre64.attention_mask, Budget.parse(0.5), tokenizer=tok
    )
    assert repeat.repeat_pass(ctx64, chunk=64, forward_chunk=16).query_context_lse == {}


def test_each_repeat_query_knows_its_chunk_and_each_token_the_chunk_that_repeats_it():
    """Fits by repeat chunk (long contexts) pair a chunk's context entries with the queries recorded while
    that chunk was repeated: the queries' chunks follow the repeat inputs (G query heads per KV head,
    head-major), and the tokens :func:`token_chunks` gives chunk ``c`` are the ones its input repeats."""
    tok = CharTokenizer()
    model = model64("llama")
    pre = kvfold.prefill(model, tok, [TEXT, TEXT[:40]], use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    found = repeat.repeat_pass(ctx, chunk=24, scores=False)
    owner = repeat.token_chunks(ctx, 24)
    prompt = repeat.RepeatPrompt.build(tok)
    width = pre.input_ids.shape[1]
    for b in range(2):
        length = int(pre.attention_mask[b].sum())
        row = pre.input_ids[b, width - length :].tolist()
        inputs = prompt.chunk_inputs(row, 24)
        expected = [c for c, ids in enumerate(inputs) for _ in ids] * 3  # G = 3
        for chunks in found.query_chunks.values():
            assert chunks[b, 0, : len(expected)].tolist() == expected
            assert bool((chunks[b, :, len(expected) :] == -1).all())
        assert bool((owner[b, : width - length] == -1).all())
        mine = owner[b, width - length :]
        start = prompt.text_start(row)
        assert bool((mine[:start] == 0).all()) and mine.tolist() == sorted(mine.tolist())
        for c, ids in enumerate(inputs):
            repeated = [t for t, o in zip(row[start:], mine[start:].tolist(), strict=True) if o == c]
            assert ids[-len(repeated) :] == repeated and len(repeated) <= 24


# ---------------------------------------------------------------------------- memory: no copy


def _layer_state(cache) -> list[tuple]:
    return [
        (layer.keys.clone(), layer.values.clone(), layer.logical_length, layer.physical_length, layer.nbytes())
        for _, layer in cache.folded_layers
    ]


def test_the_repeat_pass_over_a_prefilled_row_equals_the_pass_over_copies(monkeypatch):
    """A prefilled row is repeated over its own cache, each chunk's entries given back afterwards
    (:meth:`FoldedCache.scratch`): the same scores and queries as over a fresh copy per chunk (KVzip's
    way), bit for bit, and the cache after is the cache before (entries, lengths, bytes, policy)."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    before, window = _layer_state(pre.cache), pre.cache.capture_window
    scratched = []
    real = repeat.scratch_cache

    def spy(cache, tokens):
        scratched.append(cache.supports_scratch())
        return real(cache, tokens)

    monkeypatch.setattr(repeat, "scratch_cache", spy)
    own = repeat.repeat_pass(ctx, chunk=64, forward_chunk=32)
    assert scratched and all(scratched)  # every chunk ran over the cache itself
    after = _layer_state(pre.cache)
    for (k0, v0, *rest0), (k1, v1, *rest1) in zip(before, after, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1) and rest0 == rest1
    assert pre.cache.capture_window == window and pre.cache.policy is None
    monkeypatch.setattr(type(pre.cache), "supports_scratch", lambda self: False)
    copied = repeat.repeat_pass(ctx, chunk=64, forward_chunk=32)
    for i in own.scores:
        assert torch.equal(own.scores[i], copied.scores[i]) and torch.equal(own.queries[i], copied.queries[i])


def test_the_repeat_pass_holds_the_cache_once(monkeypatch):
    """The pass over a prefilled row allocates the chunk's entries, not a second cache: its peak
    bytes beyond the prefilled process stay below the cache's bytes (the chunk's entries and the
    tiny model's activations), and a copy per chunk holds about one cache more (scores and queries
    not recorded, so only the pass's own memory counts)."""
    from tests.live_bytes import peak_live_bytes

    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=4096))
    text = (TEXT * 40)[:1500]
    pre = kvfold.prefill(model, tok, text, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    cache_bytes = pre.cache.nbytes()

    def run():
        return repeat.repeat_pass(ctx, chunk=256, scores=False, queries=False, forward_chunk=64)

    own = peak_live_bytes(run)
    monkeypatch.setattr(type(pre.cache), "supports_scratch", lambda self: False)
    copied = peak_live_bytes(run)
    assert own < cache_bytes and own + 0.9 * cache_bytes < copied  # measured: 0.78× and 2.39× the cache


# ---------------------------------------------------------------------------- what a pass records


def test_a_pass_records_what_the_announced_methods_read_and_nothing_more(monkeypatch):
    """Methods announced at the prefill decide the first pass's records: ``kvzip`` alone keeps no
    queries, ``am_highest_fast`` alone scores nothing; a sweep of both (and of KVzip's chunk scope
    and ``am_fit``) runs one pass that records all of it. Unannounced, the first pass records
    KVzip's scores and the queries, and a method needing more runs a pass for the rest only."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    scored = []
    real = repeat.max_received
    monkeypatch.setattr(repeat, "max_received", lambda *args: scored.append(1) or real(*args))
    calls = count_forwards(model)

    def passes(methods, compressions):
        pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False, methods=methods)
        calls.clear()
        for spec in compressions:
            pre.compress(spec, 0.3)
        return pre.shared[("repeat_pass", repeat.REPEAT_CHUNK)][0], len(calls)

    alone, one_pass = passes(["kvzip"], ["kvzip"])
    assert alone.recorded == {"scores"} and not alone.queries
    scored.clear()
    fast, forwards = passes(["am_highest_fast"], ["am_highest_fast"])
    assert fast.recorded == {"queries"} and not fast.scores and not scored and forwards == one_pass
    sweep = ["kvzip", "am_highest_fast", "kvzip[scope=chunk]+am_fit", "kvzip[plus=true]"]
    both, forwards = passes(sweep, sweep)
    assert both.recorded == {"scores", "queries", "span_scores", "plus_scores"} and forwards == one_pass
    unplanned, forwards = passes(None, ["kvzip", "am_highest_fast", "kvzip[scope=chunk]"])
    assert unplanned.recorded == {"scores", "queries", "span_scores"} and forwards == 2 * one_pass


def test_a_context_with_no_plan_records_what_its_compression_reads(monkeypatch):
    """A compression context that no prefill planned (a chunked prefill, a chat, a bench compressing
    in place) records what its method reads and nothing more: ``kvzip`` keeps no queries there."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    recorded = []
    real = repeat.repeat_pass
    monkeypatch.setattr(repeat, "repeat_pass", lambda *a, **k: recorded.append(k["records"]) or real(*a, **k))
    ctx = pre.compression_context(pre.cache.copy(), Budget.parse(0.3))  # its own shared results: no plan
    build_method("kvzip").compress(ctx)
    assert recorded == [{"scores"}]
    planned = pre.compression_context(pre.cache.copy(), Budget.parse(0.3), shared=pre.shared)
    build_method("kvzip").compress(planned)  # the prefilled context's plan: the queries too, for later methods
    assert recorded[1] == repeat.UNPLANNED


def _chunk_reference(ctx, chunk: int) -> dict[int, torch.Tensor]:
    """Per layer, each entry's max attention from the queries of the one chunk that repeats it:
    every chunk's pass alone (all entries scored), its own span read off."""
    prompt = repeat.RepeatPrompt.build(ctx.tokenizer)
    row = ctx.input_ids[0].tolist()
    owners = repeat.token_chunks(ctx, chunk)[0]
    out: dict[int, torch.Tensor] = {}
    slots = {i: layer.physical_length for i, layer in ctx.cache.folded_layers}
    logical = ctx.cache.get_seq_length()
    for c, ids in enumerate(prompt.chunk_inputs(row, chunk)):
        recorder = repeat.RepeatRecorder(slots, frozenset({"scores"}))
        work = ctx.cache.copy()
        work.policy = recorder
        repeat._repeat_forwards(ctx, work, ids, logical, 4096)
        for i, scores in recorder.scores.items():
            held = out.setdefault(i, torch.full_like(scores, float("-inf")))
            held[..., owners == c] = scores[..., owners == c]
    return out


def test_chunk_scope_scores_each_entry_by_its_own_chunk_only(monkeypatch):
    """``span_scores`` (``kvzip[scope=chunk]``): each entry's max attention over the queries of the
    chunk that repeats it (a per-chunk reference), read against that span's keys only (the scoring
    cost follows the chunk); never above the whole-context scores, and equal to them on a context
    of one chunk."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    widths = []
    real = repeat.max_received
    monkeypatch.setattr(repeat, "max_received", lambda q, keys, *a: widths.append(keys.shape[2]) or real(q, keys, *a))
    found = repeat.repeat_pass(ctx, chunk=60, records=frozenset({"scores", "span_scores"}), forward_chunk=4096)
    widths.clear()
    alone = repeat.repeat_pass(ctx, chunk=60, records=frozenset({"span_scores"}), forward_chunk=4096)
    spans = torch.bincount(repeat.token_chunks(ctx, 60)[0]).tolist()
    assert len(spans) > 2 and sorted(set(widths)) == sorted(set(spans))  # each chunk's own keys
    reference = _chunk_reference(ctx, 60)
    for i in found.scores:
        assert torch.equal(found.span_scores[i], alone.span_scores[i])
        torch.testing.assert_close(found.span_scores[i], reference[i], rtol=1e-5, atol=1e-7)
        assert bool((found.span_scores[i] <= found.scores[i]).all())
        assert not torch.equal(found.span_scores[i], found.scores[i])
    one = repeat.repeat_pass(ctx, chunk=4096, records=frozenset({"scores", "span_scores"}))
    assert all(torch.equal(one.span_scores[i], one.scores[i]) for i in one.scores)
    compacted = pre.compress("kvzip", 0.5)
    ctx2 = CompressionContext(
        model, compacted.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok
    )
    with pytest.raises(ValueError, match="fresh prefill"):
        repeat.repeat_pass(ctx2, chunk=60, records=frozenset({"span_scores"}))


def test_the_queries_are_held_once(monkeypatch):
    """The pass writes each forward's queries into one buffer per layer, and a one-row pass hands
    that buffer over as it is: when the pass collects them, the bytes alive beyond those before the
    pass are the queries once (concatenating the forwards' pieces, then padding the rows, held
    them three times)."""
    from kvfold.runtime.live_bytes import LiveBytes

    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=4096))
    pre = kvfold.prefill(model, tok, (TEXT * 40)[:1500], use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    counter = LiveBytes()
    real = repeat._padded_queries
    alive = []

    def padded(*args):  # the bytes alive while the recorder's buffers and the collected queries are
        found = real(*args)
        alive.append(counter.live)
        return found

    monkeypatch.setattr(repeat, "_padded_queries", padded)
    with torch.inference_mode(), counter:
        found = repeat.repeat_pass(ctx, chunk=256, scores=False)
    held = sum(q.untyped_storage().nbytes() for q in found.queries.values())
    assert all(q.is_contiguous() for q in found.queries.values())
    assert held < max(alive) < 1.3 * held  # measured 1.14 (validity, chunks); copying the buffer: 2.15


def test_a_prefill_for_a_repeat_pass_method_leaves_room_for_the_pass():
    """Announced a repeat-pass method, the prefill allocates a chunk and its prompt of spare
    capacity with the cache (``FoldedCache.set_spare_capacity``): the pass then writes in place (the
    buffers it runs over are the prefill's), where growing them allocated the whole cache again; the
    compressed cache is the same as without the room."""
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=4096))
    text = (TEXT * 40)[:1500]
    roomy = kvfold.prefill(model, tok, text, use_chat_template=False, methods=["kvzip[chunk=256]"])
    plain = kvfold.prefill(model, tok, text, use_chat_template=False)
    layer = roomy.cache.folded_layers[0][1]
    assert layer.keys.untyped_storage().nbytes() > plain.cache.folded_layers[0][1].keys.untyped_storage().nbytes()
    before = [layer.keys.data_ptr() for _, layer in roomy.cache.folded_layers]
    ctx = CompressionContext(
        model, roomy.cache, roomy.input_ids, roomy.attention_mask, Budget.parse(0.5), tokenizer=tok
    )
    with torch.inference_mode():  # as compressions run (the prefill's buffers are inference tensors)
        repeat.repeat_pass(ctx, chunk=256)
    assert [layer.keys.data_ptr() for _, layer in roomy.cache.folded_layers] == before
    repeat.repeat_pass(ctx, chunk=256)  # outside it the pass first copies them into normal tensors
    a, b = roomy.compress("kvzip[chunk=256]", 0.3).cache, plain.compress("kvzip[chunk=256]", 0.3).cache
    for (_, x), (_, y) in zip(a.folded_layers, b.folded_layers, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(x.padded(), y.padded(), strict=True))


def test_the_device_path_scores_equal_the_fused_cpu_ones(monkeypatch):
    """Off the CPU the repeat pass gets each query's log-sum-exp from the masked kernel and a
    blocked log-sum-exp (long contexts: no ``(H_q, q, N)`` probabilities on CUDA). Run here on the CPU,
    in blocks of a few rows, it gives the fused CPU kernel's scores and queries."""
    from kvfold.runtime import attention

    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT * 3, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    fused = repeat.repeat_pass(ctx, forward_chunk=64)
    blocks = []
    real = attention.log_sum_exp_parts
    monkeypatch.setattr(attention, "log_sum_exp_parts", lambda *a: blocks.append(1) or real(*a))
    monkeypatch.setattr(attention, "_is_cpu", lambda device: False)
    monkeypatch.setattr(attention, "_cpu_flash", lambda query: False)
    monkeypatch.setattr(attention, "ACCELERATOR_LSE_BLOCK_ELEMENTS", 500)  # the device path's blocks
    device_path = repeat.repeat_pass(ctx, forward_chunk=64)
    assert blocks  # the device path ran
    for i in fused.scores:
        torch.testing.assert_close(device_path.scores[i], fused.scores[i], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(device_path.queries[i], fused.queries[i], rtol=1e-5, atol=1e-6)


def test_score_blocks_are_cache_sized_on_the_cpu_and_large_elsewhere():
    """CPU blocks keep their logits in cache (fewer rows as N grows); on a GPU a block is at least 4·D
    rows and up to 512 MB of logits, so the scores at 32K entries are a few launches a layer, not
    hundreds, and a chunk's span of 2K entries (8 KV heads) takes a forward's 8,192 rows at once."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert repeat.score_block_rows(cpu, 2048, 64) == 128 and repeat.score_block_rows(cpu, 32768, 64) == 16
    assert repeat.score_block_rows(gpu, 32768, 128, heads=8) == 512
    assert repeat.score_block_rows(gpu, 2048, 128, heads=8) == 8192


def test_a_bfloat16_models_queries_are_held_as_computed_and_fit_as_in_float32():
    """The repeat pass holds a bfloat16 model's queries in bfloat16 (half the bytes of the float32 copy
    it held, the compression's peak), and the fits read them as before: the compressed cache equals the
    one fitted on float32 copies of the same queries, bit for bit."""
    model = kvfold.enable(make_tiny_model("llama").to(torch.bfloat16))
    prefilled = kvfold.prefill(model, CharTokenizer(), TEXT * 4, use_chat_template=False)
    held = prefilled.compress("kvzip+am_fit", 0.25)
    (found, _), *_ = [v for k, v in prefilled.shared.items() if isinstance(k, tuple) and k[0] == "repeat_pass"]
    assert found.queries and all(q.dtype == torch.bfloat16 for q in found.queries.values())
    for layer_idx, q in list(found.queries.items()):
        found.queries[layer_idx] = q.float()  # what the pass held before: a float32 copy
    widened = prefilled.compress("kvzip+am_fit", 0.25)
    for (_, a), (_, b) in zip(held.cache.folded_layers, widened.cache.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            assert torch.equal(x, y)


def test_queries_are_recorded_on_the_cpu_there_and_on_the_host_from_an_accelerator():
    """A CPU pass keeps its queries where it computes them; from an accelerator they go to host memory
    (every layer's queries are held until the selection: twice the cache's bytes at Llama-3.1-8B's shape)."""
    assert not repeat.queries_on_host(torch.device("cpu"))
    assert repeat.queries_on_host(torch.device("cuda")) and repeat.queries_on_host(torch.device("mps"))
    buffer = repeat.query_buffer((1, 2, 3, 4, 5), torch.bfloat16, torch.device("cpu"))
    assert buffer.device.type == "cpu" and buffer.dtype == torch.bfloat16 and buffer.shape == (1, 2, 3, 4, 5)


def test_an_accelerator_repeats_a_fresh_prefill_in_longer_forwards(monkeypatch):
    """Over a fresh prefill off the CPU the attention holds no probabilities, so a forward takes 2,048
    repeat tokens (a quarter of the launches); a compacted cache, or the CPU, keeps 512. The pass asks
    with its device and whether the cache is a fresh prefill."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert repeat.forward_tokens(cuda, fresh=True) == repeat.ACCELERATOR_FORWARD_CHUNK == 2048
    assert repeat.forward_tokens(cuda, fresh=False) == repeat.forward_tokens(cpu, fresh=True) == 512
    tok = CharTokenizer()
    model = kvfold.enable(make_tiny_model("llama"))
    pre = kvfold.prefill(model, tok, TEXT, use_chat_template=False)
    ctx = CompressionContext(model, pre.cache, pre.input_ids, pre.attention_mask, Budget.parse(0.5), tokenizer=tok)
    asked = []
    monkeypatch.setattr(repeat, "forward_tokens", lambda device, fresh: asked.append((device.type, fresh)) or 16)
    pieces = repeat.repeat_pass(ctx, scores=True, queries=True)
    whole = repeat.repeat_pass(ctx, forward_chunk=4096)
    assert asked == [("cpu", True)]
    for i in whole.scores:
        torch.testing.assert_close(pieces.scores[i], whole.scores[i], rtol=1e-4, atol=1e-7)
