"""FoldedCache (with the kvfold attention): β exactness, per-head lengths, memory accounting, copies,
scratch passes and batch edits."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from kvfold.runtime.attention import kvfold_attention
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.rows import FloatRows

B, HKV, G, D = 2, 3, 2, 8


def _module() -> SimpleNamespace:
    return SimpleNamespace(layer_idx=0, num_key_value_groups=G, is_causal=True)


def _filled_cache(keys: torch.Tensor, values: torch.Tensor) -> FoldedCache:
    cache = FoldedCache(num_layers=1)
    cache.layers[0].update(keys, values)
    return cache


def _decode(cache: FoldedCache, query: torch.Tensor) -> torch.Tensor:
    """One decode step: append a new entry (k = v = 0 so it changes nothing but mass) and attend."""
    layer = cache.layers[0]
    new_k = torch.zeros(query.shape[0], HKV, 1, D, dtype=query.dtype)
    k, v = layer.update(new_k, new_k.clone())
    out, _ = kvfold_attention(_module(), query, k, v, None, scaling=D**-0.5, kvfold_cache=cache)
    return out


def _reference(query, keys, values, log_mass, valid):
    """Plain per-(b, head) softmax attention with an explicit mask: the obviously-correct version."""
    b, hq, _, d = query.shape
    out = torch.zeros(b, 1, hq, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // G
            idx = valid[bi, kv].nonzero().flatten()
            logits = (keys[bi, kv, idx].double() @ query[bi, h, 0].double()) * d**-0.5 + log_mass[bi, kv, idx].double()
            w = torch.softmax(logits, 0)
            out[bi, 0, h] = w @ values[bi, kv, idx].double()
    return out


def test_repeated_token_equals_one_copy_with_log_count():
    torch.manual_seed(0)
    k = torch.randn(B, HKV, 5, D, dtype=torch.float64)
    v = torch.randn(B, HKV, 5, D, dtype=torch.float64)
    copies = 4
    # cache A: entry 2 occurs `copies` times
    k_rep = torch.cat([k, k[:, :, 2:3].expand(-1, -1, copies - 1, -1)], dim=2)
    v_rep = torch.cat([v, v[:, :, 2:3].expand(-1, -1, copies - 1, -1)], dim=2)
    a = _filled_cache(k_rep, v_rep)
    # cache B: one copy with β = log(copies)
    b = _filled_cache(k, v)
    beta = torch.zeros(B, HKV, 5)
    beta[:, :, 2] = math.log(copies)
    b.layers[0].replace(k, v, beta)
    q = torch.randn(B, HKV * G, 1, D, dtype=torch.float64)
    # β is stored in float32 (log 4 to ~1e-7), so the match is to float32 precision
    torch.testing.assert_close(_decode(a, q), _decode(b, q), rtol=1e-6, atol=1e-7)


def test_per_head_lengths_are_stored_ragged_and_match_masked_reference():
    torch.manual_seed(1)
    n = 40
    k = torch.randn(B, HKV, n, D, dtype=torch.float64)
    v = torch.randn(B, HKV, n, D, dtype=torch.float64)
    cache = _filled_cache(k, v)
    layer = cache.layers[0]
    lengths = torch.tensor([[3, 40, 17], [25, 1, 9]])
    beta = torch.randn(B, HKV, n) * 0.5
    layer.replace(k, v, beta, lengths=lengths)
    assert isinstance(layer.stored, FloatRows)
    assert torch.equal(layer.row_lengths(), lengths)
    q = torch.randn(B, HKV * G, 1, D, dtype=torch.float64)
    out = _decode(cache, q)
    # reference: the kept entries plus the zero entry appended by _decode
    valid = torch.arange(n + 1)[None, None, :] < lengths[..., None]
    valid[..., n] = True
    keys_ref = torch.cat([k, torch.zeros(B, HKV, 1, D, dtype=k.dtype)], 2)
    values_ref = torch.cat([v, torch.zeros(B, HKV, 1, D, dtype=v.dtype)], 2)
    beta_ref = torch.cat([beta, torch.zeros(B, HKV, 1)], 2)
    torch.testing.assert_close(out.double(), _reference(q, keys_ref, values_ref, beta_ref, valid), rtol=1e-6, atol=1e-7)


def test_ragged_rows_keep_working_across_many_decode_steps():
    torch.manual_seed(2)
    k = torch.randn(1, HKV, 30, D, dtype=torch.float64)
    v = torch.randn(1, HKV, 30, D, dtype=torch.float64)
    cache = _filled_cache(k, v)
    lengths = torch.tensor([[5, 30, 12]])
    cache.layers[0].replace(k, v, None, lengths=lengths)
    reference = _filled_cache(k, v)
    mask_beta = torch.where(torch.arange(30)[None, None] < lengths[..., None], 0.0, float("-inf"))
    reference.layers[0].replace(k, v, mask_beta)  # dense, −inf masked: a full-size reference
    assert reference.layers[0].stored is None
    for step in range(35):
        q = torch.randn(1, HKV * G, 1, D, dtype=torch.float64)
        torch.testing.assert_close(_decode(cache, q), _decode(reference, q), rtol=1e-6, atol=1e-7, msg=f"step {step}")
    assert torch.equal(cache.layers[0].row_lengths(), lengths + 35)
    assert cache.layers[0].stored.width == 30  # the stored rows as they were: decoding writes the tail


def test_memory_accounting_matches_tensors_held():
    torch.manual_seed(3)
    n = 64
    k = torch.randn(1, HKV, n, D)
    cache = _filled_cache(k, k.clone())
    layer = cache.layers[0]
    assert layer.nbytes() == 2 * k.numel() * 4  # no β buffer when every β is 0
    assert cache.full_nbytes() == 2 * k.numel() * 4
    layer.replace(k[:, :, :10], k[:, :, :10].clone())
    assert layer.nbytes() == 2 * HKV * 10 * D * 4
    k2 = torch.randn(1, HKV, 2 * n, D)
    lengths = torch.tensor([[2, 2 * n, 2]])
    layer_b = _filled_cache(k2, k2.clone()).layers[0]
    layer_b.replace(k2, k2.clone(), lengths=lengths)
    held = sum(t.untyped_storage().nbytes() for t in layer_b.stored.tensors().values())
    assert layer_b.nbytes() == held
    dense_equivalent = 2 * HKV * 2 * n * D * 4  # rows × longest row, as a mask would hold
    assert layer_b.nbytes() < 0.5 * dense_equivalent  # per-head budgets really free memory


def test_copy_is_independent():
    k = torch.randn(1, HKV, 8, D)
    cache = _filled_cache(k, k.clone())
    clone = cache.copy()
    clone.layers[0].replace(k[:, :, :2], k[:, :, :2].clone())
    assert cache.layers[0].physical_length == 8
    assert clone.layers[0].physical_length == 2


def test_batch_select_keeps_ragged_rows():
    k = torch.randn(2, HKV, 20, D)
    cache = _filled_cache(k, k.clone())
    lengths = torch.tensor([[3, 20, 5], [20, 2, 7]])
    cache.layers[0].replace(k, k.clone(), lengths=lengths)
    cache.batch_select_indices(torch.tensor([1]))
    assert torch.equal(cache.layers[0].row_lengths(), lengths[1:])


def test_a_scratch_gives_back_what_its_forwards_append():
    """:meth:`FoldedCache.scratch`: forwards inside append after the entries; on exit (also after an
    error) the layers hold exactly what they held, with their logical length, capacity, captured
    queries, policy and capture window; layers with stored rows are refused."""
    import kvfold
    from tests.conftest import make_tiny_model

    model = kvfold.enable(make_tiny_model("llama"))
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(0))
    cache = FoldedCache(model.config)
    cache.capture_window = 4
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    layer = cache.folded_layers[0][1]
    before = (layer.keys.clone(), layer.values.clone(), layer.logical_length, layer.nbytes(), layer.captured_queries)
    sentinel = object()
    cache.policy = sentinel
    for fail in (False, True):
        expected = pytest.raises(RuntimeError) if fail else contextlib.nullcontext()
        with expected, cache.scratch(reserve=12) as work:
            assert work is cache and cache.policy is None and cache.capture_window == 0
            with torch.no_grad():
                model(input_ids=ids[:, :12], past_key_values=cache, use_cache=True)
            assert layer.physical_length == 52 and layer.logical_length == 52
            if fail:
                raise RuntimeError("a forward failed")
        assert torch.equal(layer.keys, before[0]) and torch.equal(layer.values, before[1])
        assert (layer.logical_length, layer.nbytes()) == before[2:4] and layer.captured_queries is before[4]
        assert cache.policy is sentinel and cache.capture_window == 4
    keys, values, log_mass, _ = layer.padded()
    layer.replace(keys, values, log_mass, torch.tensor([[40] + [1] * (layer.num_heads - 1)]))
    assert layer.stored is not None and not cache.supports_scratch()
    with pytest.raises(ValueError, match="use copy"), cache.scratch():
        pass


def test_a_batch_edit_keeps_statistics_aligned_with_the_slots():
    """Rows picked from ragged stored rows may be shorter than the longest before: a statistic keeps
    one value a slot of :meth:`FoldedLayer.padded`, the padding no picked row uses dropped."""
    k = torch.randn(2, HKV, 40, D)
    cache = _filled_cache(k, k.clone())
    layer = cache.layers[0]
    layer.replace(k, k.clone(), lengths=torch.tensor([[3, 40, 5], [4, 2, 7]]))
    assert isinstance(layer.stored, FloatRows)
    stat = torch.arange(2 * HKV * 40.0).view(2, HKV, 40)
    layer.entry_stats = {"s": stat}
    cache.batch_select_indices(torch.tensor([1]))
    assert layer.physical_length == 7 and torch.equal(layer.entry_stats["s"], stat[1:, :, :7])
