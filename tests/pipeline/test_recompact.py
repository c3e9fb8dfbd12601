"""Re-compaction with the repeat pass: streaming compression of a chunked prefill with the recommended
pipeline (its chat: tests/pipeline/test_chat.py)."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.methods.core import repeat
from kvfold.pipeline.chunked import prefill_chunked
from kvfold.pipeline.context import prefill_ids
from kvfold.pipeline.recompact import join_rows, without_sinks
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer, make_tiny_model
from tests.live_bytes import peak_live_bytes

STREAMED = ["kvzip", "kvzip+am_fit"]


def _model(**overrides):
    return kvfold.enable(make_tiny_model("llama", **overrides))


def _ids(length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(2, 97, (batch, length), generator=torch.Generator().manual_seed(5))


def _entries(cache) -> list[tuple[torch.Tensor, ...]]:
    """Every layer's padded entries, empty slots zeroed (a layout may leave anything there)."""
    out = []
    for _, layer in cache.folded_layers:
        keys, values, log_mass, lengths = layer.padded()
        empty = ~torch.isfinite(log_mass)
        out.append((keys.masked_fill(empty[..., None], 0), values.masked_fill(empty[..., None], 0), log_mass, lengths))
    return out


@pytest.mark.parametrize("method", STREAMED)
def test_a_context_of_one_chunk_is_compressed_as_without_chunks(method):
    model, tokenizer, ids = _model(), CharTokenizer(), _ids(96)
    streamed = prefill_chunked(model, tokenizer, ids, method, 0.25, chunk_size=96)
    whole = prefill_ids(model, tokenizer, ids).compress(method, 0.25)
    for (k, v, lm, n), (k2, v2, lm2, n2) in zip(_entries(streamed.cache), _entries(whole.cache), strict=True):
        assert torch.equal(n, n2) and torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(lm, lm2)
    assert streamed.cache.get_seq_length() == 96


@pytest.mark.parametrize("method", STREAMED)
def test_streaming_keeps_every_entry_the_first_chunk_alone_keeps_and_each_chunk_its_share(method, monkeypatch):
    model, tokenizer, ids = _model(), CharTokenizer(), _ids(160)
    chunk, keep = 40, 40  # 10 entries per KV head and layer for each chunk of 40 tokens
    passes = []
    real = repeat.repeat_pass

    def counted(ctx, *args, **kwargs):
        passes.append((ctx.input_ids.shape[1], next(layer.physical_length for _, layer in ctx.cache.folded_layers)))
        return real(ctx, *args, **kwargs)

    monkeypatch.setattr(repeat, "repeat_pass", counted)
    streamed = prefill_chunked(model, tokenizer, ids, method, keep, chunk_size=chunk)
    # one repeat pass a chunk, over that chunk's tokens, against what the earlier chunks kept plus the chunk
    assert [p[0] for p in passes] == [chunk] * 4
    assert passes[0][1] == chunk and all(chunk < p[1] < 2 * chunk + keep for p in passes[1:])
    monkeypatch.setattr(repeat, "repeat_pass", real)
    alone = prefill_ids(model, tokenizer, ids[:, :chunk]).compress(method, Budget(tokens=keep * chunk // 160))
    total = 0
    for (k, v, lm, n), (k1, v1, lm1, n1) in zip(_entries(streamed.cache), _entries(alone.cache), strict=True):
        total += int(n.sum())
        for h in range(k.shape[1]):  # the first chunk's entries come first, as that chunk alone kept them
            first = int(n1[0, h])
            assert torch.equal(k[0, h, :first], k1[0, h, :first]) and torch.equal(v[0, h, :first], v1[0, h, :first])
            assert torch.equal(lm[0, h, :first], lm1[0, h, :first])
    layers = len(streamed.cache.folded_layers)
    assert total == keep * layers * 2  # the budget on average over the 2 KV heads of every layer
    assert streamed.cache.get_seq_length() == 160


def test_a_budget_that_holds_every_chunk_keeps_the_context_whole():
    model, tokenizer, ids = _model(), CharTokenizer(), _ids(120)
    streamed = prefill_chunked(model, tokenizer, ids, "kvzip+am_fit", 1.0, chunk_size=40)
    whole = prefill_ids(model, tokenizer, ids)
    for (k, v, _, n), (k2, v2, _, _) in zip(_entries(streamed.cache), _entries(whole.cache), strict=True):
        assert bool((n == 120).all())  # chunked forwards: the same entries up to rounding
        torch.testing.assert_close(k, k2, rtol=0, atol=1e-5)
        torch.testing.assert_close(v, v2, rtol=0, atol=1e-5)


def test_chunks_shorter_than_one_entrys_share_wait_for_the_next():
    model, tokenizer, ids = _model(), CharTokenizer(), _ids(60)
    streamed = prefill_chunked(model, tokenizer, ids, "kvzip", 0.25, chunk_size=1)  # 15 entries: one per 4 tokens
    for _, layer in streamed.cache.folded_layers:
        assert float(layer.row_lengths().float().mean()) <= 16


def test_a_streamed_cache_answers_and_sinks_are_the_first_chunks_only():
    model, tokenizer, ids = _model(), CharTokenizer(), _ids(120)
    streamed = prefill_chunked(model, tokenizer, ids, "kvzip+am_fit", 0.2, chunk_size=40)
    assert isinstance(streamed.answer("question?", max_new_tokens=3), str)
    later = without_sinks(kvfold.build_method("kvzip[sinks=4]+am_fit[sinks=2]"))
    assert later.selector.sinks == 0 and later.folder.sinks == 0 and later.folder.sources == ("repeat",)


def test_rows_are_joined_in_order_without_their_empty_slots():
    inf = float("-inf")
    head = (
        torch.arange(4.0).view(1, 2, 2, 1),
        torch.arange(4.0).view(1, 2, 2, 1),
        torch.tensor([[[0.5, inf], [1.0, 2.0]]]),
    )
    tail = (torch.tensor([[[[7.0]], [[8.0]]]]), torch.tensor([[[[7.0]], [[8.0]]]]), torch.tensor([[[0.0], [0.0]]]))
    keys, _, log_mass, lengths = join_rows(head, tail)
    assert lengths.tolist() == [[2, 3]]
    assert keys[0, 0, :2, 0].tolist() == [0.0, 7.0] and keys[0, 1, :, 0].tolist() == [2.0, 3.0, 8.0]
    assert log_mass[0, 0].tolist() == [0.5, 0.0, inf] and log_mass[0, 1].tolist() == [1.0, 2.0, 0.0]


def test_streaming_refuses_methods_whose_other_parts_need_a_fresh_prefill():
    with pytest.raises(ValueError, match="cannot compress during a chunked prefill; methods that can: .*kvzip"):
        prefill_chunked(_model(), CharTokenizer(), _ids(64), "adakv:kvzip", 0.25, chunk_size=16)


# ---------------------------------------------------------------------------- memory


def test_the_peak_bytes_of_streaming_follow_the_chunk_not_the_length():
    """Token budget 32, chunks of 64 tokens: every tensor streaming allocates (the cache included)
    peaks at 1,024 tokens within 10% of its peak at 256 (the kept entries grow from 3/4 of the
    budget to all of it); compressing the context after one prefill holds more than twice that."""
    model, tokenizer = _model(max_position_embeddings=2048), CharTokenizer()
    streaming = {}
    for length in (256, 1024):
        ids = _ids(length)
        run = lambda ids=ids: prefill_chunked(model, tokenizer, ids, "kvzip+am_fit", 32, 64)  # noqa: E731
        streaming[length] = peak_live_bytes(run)
    whole = peak_live_bytes(lambda: prefill_ids(model, tokenizer, ids).compress("kvzip+am_fit", 32))
    assert streaming[256] > 0 and streaming[1024] <= 1.1 * streaming[256]
    assert whole > 2 * streaming[1024]
