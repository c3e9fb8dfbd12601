"""Chunked prefill: exact without compression, bounded with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvfold
from kvfold.methods.core.base import ComposedMethod
from kvfold.methods.eviction.plumbing import StreamingLLM
from kvfold.methods.merging.keepkv.online import LayerPolicies
from kvfold.methods.merging.zsmerge.online import ZSMergeOnline
from kvfold.pipeline.chunked import prefill_chunked
from kvfold.pipeline.context import greedy_decode
from kvfold.runtime.attention import attention_modules
from kvfold.runtime.folded_layer import FoldedLayer
from tests.conftest import CharTokenizer, make_tiny_model


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


# ---------------------------------------------------------------------------- online methods (h2o, zsmerge, keepkv)

ONLINE_SPECS = ["h2o", "h2o[sinks=2]", "zsmerge", "zeromerge", "keepkv", "h2o+keepkv"]


def _limits(policy, cache) -> dict[int, int]:
    """Each layer's budget as the online policy keeps it."""
    if isinstance(policy, LayerPolicies):
        return {i: p.limits[i] for i, p in policy.policies.items()}
    if isinstance(policy, ZSMergeOnline):
        return {i: policy.limit for i, _ in cache.folded_layers}
    return dict(policy.limits)


@pytest.mark.parametrize("spec", ONLINE_SPECS)
@pytest.mark.parametrize("chunk", [8, 24])
def test_online_methods_hold_budget_plus_one_chunk_and_keep_decoding(spec, chunk, monkeypatch):
    model = kvfold.enable(make_tiny_model("llama"))
    peaks: dict[int, int] = {}
    update = FoldedLayer.update

    def spy(self, key_states, value_states, *args, **kwargs):
        out = update(self, key_states, value_states, *args, **kwargs)
        peaks[id(self)] = max(peaks.get(id(self), 0), self.physical_length)  # after the append, before eviction
        return out

    monkeypatch.setattr(FoldedLayer, "update", spy)
    compressed = prefill_chunked(model, CharTokenizer(), _ids(), spec, 16, chunk_size=chunk)
    monkeypatch.setattr(FoldedLayer, "update", update)
    limits = _limits(compressed.policy, compressed.cache)
    for layer_idx, layer in compressed.cache.folded_layers:
        # never the whole context: until the first compression a layer fills to the (mean) budget
        assert peaks[id(layer)] <= max(limits[layer_idx], 16) + chunk
        assert layer.physical_length == limits[layer_idx]  # at budget
        assert layer.logical_length == 64
    # decoding continues: with the live policy (as the bench does) ...
    cache = compressed.cache.copy()
    cache.policy = compressed.policy
    answer = greedy_decode(model, CharTokenizer(), cache, [5, 6], 4, stop_at_eos=False)
    assert answer.new_tokens == 4
    assert all(layer.physical_length == limits[i] for i, layer in cache.folded_layers)
    # ... and with a fresh policy per answer, from the state the policy exported into the cache
    assert compressed.generate("q?", max_new_tokens=3)[0].token_ids


def test_h2o_one_chunk_equals_one_shot():
    model = kvfold.enable(make_tiny_model("qwen2"))
    context = kvfold.prefill(model, CharTokenizer(), "the heavy hitters of a short context " * 2, methods="h2o")
    one_shot = context.compress("h2o", 16)
    length = context.input_ids.shape[1]
    chunked = prefill_chunked(model, None, context.input_ids, "h2o", 16, chunk_size=length)
    for (_, a), (_, b) in zip(one_shot.cache.folded_layers, chunked.cache.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        torch.testing.assert_close(a.entry_stats["h2o"], b.entry_stats["h2o"])
    torch.testing.assert_close(chunked.source.last_logits, context.last_logits, rtol=0, atol=1e-5)


@torch.no_grad()
def _reference_h2o(model, ids: torch.Tensor, budget: int, chunk: int, recent: int, sinks: int) -> kvfold.FoldedCache:
    """H2O chunk by chunk, written out: each chunk's causal softmax attention on the evolving cache
    is added to every entry's score (summed over the GQA group); then each head keeps the
    ``recent`` newest tokens, the ``sinks`` first ones and the highest scores."""
    cache = kvfold.FoldedCache(model.config)
    cache.capture_window = chunk
    scaling = {i: m.scaling for i, m in attention_modules(model).items()}
    scores: dict[int, torch.Tensor] = {}
    positions: dict[int, torch.Tensor] = {}
    length = ids.shape[1]
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        new = torch.arange(start, end)
        model(input_ids=ids[:, start:end], position_ids=new[None], past_key_values=cache, use_cache=True)
        for i, layer in cache.folded_layers:
            keys, values, _, _ = layer.padded()  # (1, H_kv, n, D)
            heads, n = keys.shape[1], keys.shape[2]
            queries = layer.captured_queries[:, :, -(end - start) :]  # (1, H_q, c, D)
            groups = queries.shape[1] // heads
            pos = torch.cat(
                [positions.get(i, torch.empty(1, heads, 0, dtype=torch.long)), new.expand(1, heads, -1)], -1
            )
            logits = queries.double() @ keys.repeat_interleave(groups, 1).double().transpose(-1, -2) * scaling[i]
            future = pos.repeat_interleave(groups, 1)[:, :, None, :] > new[None, None, :, None]
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)  # (1, H_q, c, n)
            received = probs.sum(2).view(1, heads, groups, n).sum(2)
            previous = scores.get(i, torch.zeros(1, heads, 0, dtype=torch.float64))
            acc = F.pad(previous, (0, end - start)) + received  # new entries start from 0
            if n > budget:
                priority = acc.masked_fill((pos >= end - recent) | (pos < sinks), float("inf"))
                keep = priority.topk(budget, dim=-1).indices.sort(-1).values
                idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
                layer.replace(keys.gather(2, idx), values.gather(2, idx))
                acc, pos = acc.gather(2, keep), pos.gather(2, keep)
            scores[i], positions[i] = acc, pos
    return cache


@pytest.mark.parametrize("spec,recent,sinks", [("h2o", 8, 0), ("h2o[sinks=2,recent_ratio=0.25]", 4, 2)])
@pytest.mark.parametrize("chunk", [12, 24])
def test_h2o_chunks_accumulate_attention_over_every_query(spec, recent, sinks, chunk):
    model = kvfold.enable(make_tiny_model("llama"))
    ids = _ids()
    compressed = prefill_chunked(model, None, ids, spec, 16, chunk_size=chunk)
    reference = _reference_h2o(model, ids, 16, chunk, recent, sinks)
    for (_, layer), (_, ref) in zip(compressed.cache.folded_layers, reference.folded_layers, strict=True):
        keys, ref_keys = layer.padded()[0][0], ref.padded()[0][0]  # (H_kv, budget, D); slots in any order
        distance = torch.cdist(ref_keys, keys)
        match = distance.argmin(-1)  # each kept token of the reference is kept here too, once
        assert bool((distance.amin(-1) < 1e-4).all())
        assert all(len(set(row.tolist())) == keys.shape[1] for row in match)


def test_zsmerge_residual_slots_carry_over_chunks():
    model = kvfold.enable(make_tiny_model("qwen2"))
    compressed = prefill_chunked(model, None, _ids(), "zsmerge[residual=2]", 16, chunk_size=8)
    policy = compressed.policy
    for i, layer in compressed.cache.folded_layers:
        view = policy.slots(i, layer)
        # every token seen is a kept token or inside a residual slot's count: none was lost between chunks
        torch.testing.assert_close(view["count"].sum(-1), torch.full((1, 2), 64.0))
        assert int((view["slot_id"] >= 0).sum(-1).max()) <= 2
        assert float(view["residual_counts"].max()) > 8  # slots grew over several chunks
        # the exported statistics are those a fresh policy resumes from
        assert torch.equal(layer.entry_stats["zsmerge.count"], view["count"])


def test_zsmerge_one_chunk_equals_one_shot():
    model = kvfold.enable(make_tiny_model("llama"))
    context = kvfold.prefill(model, CharTokenizer(), "residual slots absorb what leaves the context " * 2)
    one_shot = context.compress("zsmerge", 20)
    chunked = prefill_chunked(model, None, context.input_ids, "zsmerge", 20, chunk_size=context.input_ids.shape[1])
    for (_, a), (_, b) in zip(one_shot.cache.folded_layers, chunked.cache.folded_layers, strict=True):
        for x, y in zip(a.padded(), b.padded(), strict=True):
            torch.testing.assert_close(x, y)


def test_keepkv_merges_chunk_victims_and_conserves_votes():
    model = kvfold.enable(make_tiny_model("llama"))
    compressed = prefill_chunked(model, None, _ids(), "keepkv[threshold=-1]", 16, chunk_size=8)
    folder = compressed.policy.folder
    assert folder.merged > 0 and folder.evicted == 0  # merged, not dropped
    for _, layer in compressed.cache.folded_layers:
        votes = layer.padded()[2].exp().sum(-1)  # Σ p = tokens seen (eq. 6: β = log p)
        torch.testing.assert_close(votes, torch.full_like(votes, 64.0), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("spec", ["h2o[online=false]", "snapkv+keepkv"])
def test_online_methods_without_a_policy_are_refused(spec):
    model = kvfold.enable(make_tiny_model("llama"))
    with pytest.raises(ValueError, match="online"):
        prefill_chunked(model, None, _ids(), spec, 16, chunk_size=8)


def test_chunked_online_prefill_releases_the_chunk_capacity():
    """After an online method's chunked prefill the cache holds about the budget, not budget + chunk."""
    model = kvfold.enable(make_tiny_model("llama"))
    compressed = prefill_chunked(model, None, _ids(), "h2o", 16, chunk_size=24)
    for _, layer in compressed.cache.folded_layers:
        assert layer.physical_length <= 16
        assert layer.nbytes() <= layer.batch_size * layer.num_heads * (16 + 16) * (2 * layer.head_dim * 4 + 4)
    cache = compressed.cache
    cache.policy = compressed.policy
    answer = greedy_decode(model, CharTokenizer(), cache, [5, 6], 4, stop_at_eos=False)
    assert answer.new_tokens == 4
    assert all(layer.physical_length <= 16 for _, layer in cache.folded_layers)  # the policy still holds it
