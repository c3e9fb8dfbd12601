"""Chunked prefill: exact without compression, bounded with it."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.chunked import prefill_chunked
from kvfold.methods.base import ComposedMethod
from kvfold.methods.plumbing import StreamingLLM
from tests.conftest import make_tiny_model


def _ids(batch: int = 1, length: int = 64) -> torch.Tensor:
    return torch.randint(1, 97, (batch, length), generator=torch.Generator().manual_seed(3))


def test_chunked_full_equals_one_pass():
    model = kvfold.enable(make_tiny_model("llama"))
    ids = _ids(2)
    whole = model(ids, past_key_values=kvfold.FoldedCache(model.config)).logits[:, -1]
    chunked = prefill_chunked(model, None, ids, "full", 1.0, chunk_size=10)
    torch.testing.assert_close(chunked.source.last_logits, whole, rtol=0, atol=1e-5)
    assert chunked.cache.get_seq_length() == 64


def test_chunked_streamingllm_holds_budget_plus_one_chunk():
    model = kvfold.enable(make_tiny_model("qwen2"))
    seen = []
    original = model.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        cache = kwargs["past_key_values"]
        seen.append(max(layer.physical_length for _, layer in cache.folded_layers))
        return out

    model.forward = spy
    compressed = prefill_chunked(model, None, _ids(), "streamingllm", 16, chunk_size=8)
    assert max(seen) <= 16 + 8
    assert all(layer.physical_length == 16 for _, layer in compressed.cache.folded_layers)
    assert compressed.kv_bytes <= compressed.kv_bytes_full * 16 / 64 + 1


class _NoChunks(StreamingLLM):
    supports_chunked_prefill = False


def test_unsupported_method_names_the_supported_ones():
    model = kvfold.enable(make_tiny_model("llama"))
    method = ComposedMethod(spec="nochunks", wrappers=(), selector=_NoChunks(), folder=None)
    with pytest.raises(ValueError, match="cannot compress during a chunked prefill; methods that can: .*streamingllm"):
        prefill_chunked(model, None, _ids(), method, 0.5, chunk_size=8)
