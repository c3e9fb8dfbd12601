"""Leverage and Compactor (Chari & Van Durme 2025, arXiv:2507.08143) against float64 references.

The exact leverage of a matrix is the squared row norm of ``U`` in its thin SVD; the sketched
leverage must equal it when the sketch keeps the keys' column space and approximate it otherwise.
Pre-RoPE keys are compared with the keys the model projects (captured by a hook), and the
selectors' kept entries with a reference ranking built here.
"""

from __future__ import annotations

import pytest
import torch

from kvfold.methods import SpecError, build_method
from kvfold.methods.core.model import pre_rope_keys
from kvfold.methods.eviction.compactor import CompactorAttentionObserver, noncausal_chunk_attention
from kvfold.methods.eviction.leverage import leverage_scores
from tests.methods.eviction.test_eviction import (
    compress,
    kept_positions,
    model64,
    prefill_cache,
    random_ids,
    ref_top,
)

F64 = torch.float64


def exact_leverage(keys: torch.Tensor) -> torch.Tensor:
    """Leverage of the centred rows of ``keys`` ``(n, D)``: ``‖U_i‖²`` of the thin SVD (float64)."""
    centred = keys.to(F64) - keys.to(F64).mean(0)
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum())
    return (u[:, :rank] ** 2).sum(-1)


def projected_keys(model, ids, mask=None) -> dict[int, torch.Tensor]:
    """Pre-RoPE keys ``(B, H_kv, N, D)`` per layer, captured at the output of k_norm (or k_proj, or the keys
    of Phi-3's fused qkv_proj)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    for layer_idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        source = getattr(attn, "k_norm", None) or getattr(attn, "k_proj", None) or attn.qkv_proj

        def hook(module, args, output, layer_idx=layer_idx, attn=attn):
            heads = model.config.num_key_value_heads
            if module is getattr(attn, "qkv_proj", None):  # Phi-3: queries, keys, values in one projection
                start = model.config.num_attention_heads * attn.head_dim
                output = output[..., start : start + heads * attn.head_dim]
            if output.dim() == 4 and output.shape[1] == heads:  # Gemma3's k_norm: (B, H, N, D)
                captured[layer_idx] = output.detach()
                return
            b, n = output.shape[0], output.shape[1]  # k_proj: (B, N, H·D); Qwen3's k_norm: (B, N, H, D)
            captured[layer_idx] = output.reshape(b, n, -1, attn.head_dim).transpose(1, 2).detach()

        hooks.append(source.register_forward_hook(hook))
    try:
        positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions)
    finally:
        for h in hooks:
            h.remove()
    return captured


# ---------------------------------------------------------------------------- the scores


def test_exact_leverage_matches_the_svd_reference_and_sums_to_the_rank():
    keys = torch.randn(2, 3, 50, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    keys[0, 1] = keys[0, 1] @ (
        torch.eye(8, dtype=F64) + torch.randn(8, 8, dtype=F64, generator=torch.Generator().manual_seed(2)).tril()
    )  # correlated columns
    for sketch in (0, 8, 16):  # no sketch, or a sketch that keeps the column space: exact
        got = leverage_scores(keys, sketch=sketch, ridge=0.0, generator=torch.Generator().manual_seed(1))
        for b in range(2):
            for h in range(3):
                torch.testing.assert_close(got[b, h], exact_leverage(keys[b, h]), rtol=1e-7, atol=1e-8)
    # Σ ℓ = rank(K̄) = D here; padding is left out of the mean and the matrix
    valid = torch.ones(2, 3, 50, dtype=torch.bool)
    valid[1, :, :12] = False
    got = leverage_scores(keys, sketch=0, ridge=0.0, valid=valid)
    torch.testing.assert_close(got[1, 2, 12:], exact_leverage(keys[1, 2, 12:]), rtol=1e-7, atol=1e-8)
    assert bool(torch.isneginf(got[1, :, :12]).all())
    torch.testing.assert_close(got[0].sum(-1), torch.full((3,), 8.0, dtype=F64))


def test_sketched_leverage_approximates_the_exact_one_and_finds_the_outlier():
    gen = torch.Generator().manual_seed(3)
    # keys near a 4-dimensional subspace of R^64, plus one key far outside it (a geometric outlier)
    basis = torch.randn(4, 64, dtype=F64, generator=gen)
    keys = torch.randn(1, 2, 300, 4, dtype=F64, generator=gen) @ basis
    keys = keys + 0.05 * torch.randn(1, 2, 300, 64, dtype=F64, generator=gen)
    keys[0, :, 137] += 3.0 * torch.randn(64, dtype=F64, generator=gen)
    got = leverage_scores(keys, sketch=48, generator=torch.Generator().manual_seed(0))
    for h in range(2):
        exact = exact_leverage(keys[0, h])
        assert int(got[0, h].argmax()) == 137 == int(exact.argmax())
        corr = torch.corrcoef(torch.stack([got[0, h], exact]))[0, 1]
        assert corr > 0.9
    unridged = leverage_scores(keys, sketch=48, ridge=0.0, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(unridged.sum(-1), torch.full((1, 2), 48.0, dtype=F64))  # Σ ℓ = rank of the sketch
    again = leverage_scores(keys, sketch=48, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got, again)  # the seed fixes the sketch


def test_noncausal_chunk_attention_matches_loops():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 11, 8, dtype=F64, generator=gen)
    k = torch.randn(2, 2, 11, 8, dtype=F64, generator=gen)
    valid = torch.ones(2, 2, 11, dtype=torch.bool)
    valid[1, :, :3] = False  # row 1: 8 tokens, left-padded
    got = noncausal_chunk_attention(q, k, chunk=4, scaling=0.5, valid=valid)
    for b, start in ((0, 0), (1, 3)):
        ref = torch.zeros(2, 11, dtype=F64)
        for lo in range(start, 11, 4):
            hi = min(lo + 4, 11)
            for h in range(4):
                for i in range(lo, hi):  # every query of the chunk sees every key of it
                    ref[h // 2, lo:hi] += torch.softmax(k[b, h // 2, lo:hi] @ q[b, h, i] * 0.5, -1) / 2
        torch.testing.assert_close(got[b, :, start:], ref[:, start:])
    assert bool(torch.isneginf(got[1, :, :3]).all())


# ---------------------------------------------------------------------------- pre-RoPE keys


def test_pre_rope_keys_undo_rope_at_the_prefill_positions(tiny_family):
    model = model64(tiny_family)
    ids = random_ids(2, 30, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    cache = prefill_cache(model, ids, mask)
    projected = projected_keys(model, ids, mask)
    ctx = compress(model, cache.copy(), ids, "full", 1.0, mask=mask)
    for layer_idx, layer in cache.folded_layers:
        got = pre_rope_keys(ctx, layer_idx, layer)
        torch.testing.assert_close(got[0], projected[layer_idx][0])
        torch.testing.assert_close(got[1, :, 7:], projected[layer_idx][1, :, 7:])  # padding: meaningless


def test_pre_rope_keys_refuse_a_compressed_cache():
    model = model64("llama")
    ids = random_ids(1, 30)
    cache = prefill_cache(model, ids)
    ctx = compress(model, cache, ids, "streamingllm[online=false]", 10)
    layer_idx, layer = cache.folded_layers[0]
    with pytest.raises(ValueError, match="uncompressed prefill"):
        pre_rope_keys(ctx, layer_idx, layer)


# ---------------------------------------------------------------------------- the selectors


def test_leverage_keeps_the_top_exact_leverage_of_the_projected_keys():
    model = model64("llama", num_key_value_heads=3, num_attention_heads=6)
    ids = random_ids(2, 60, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    cache = prefill_cache(model, ids, mask)
    full = cache.copy()
    projected = projected_keys(model, ids, mask)
    compress(model, cache, ids, "leverage[sketch=0,ridge=0]", 9, mask=mask)
    for layer_idx, layer in cache.folded_layers:
        assert layer.row_lengths().tolist() == [[9, 9, 9], [9, 9, 9]]
        for b, pad in ((0, 0), (1, 11)):
            got = kept_positions(full.layers[layer_idx], layer)[b]
            for h in range(3):
                scores = exact_leverage(projected[layer_idx][b, h, pad:])
                assert got[h] == ref_top(scores.tolist(), 9, offset=pad)


def compactor_reference(model, ids, layer_idx, full_layer, blend, chunk, sinks_start, sinks_end):
    """Compactor's scores of one unpadded row by the definition: λ·z(exact ℓ) + z(avgpool3(a·‖v‖))."""
    captured: dict[int, torch.Tensor] = {}
    attn = model.model.layers[layer_idx].self_attn
    hook = attn.q_proj.register_forward_hook(lambda m, a, out: captured.setdefault(0, out.detach()))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    keys_pre = projected_keys(model, ids)[layer_idx][0]
    keys, values, _, _ = full_layer.padded()
    keys, values = keys[0], values[0]
    h_kv, n = keys.shape[0], keys.shape[1]
    # post-RoPE queries: rotate the projected ones with the model's own rotary embedding
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = captured[0].reshape(1, n, -1, attn.head_dim).transpose(1, 2)
    cos, sin = model.model.rotary_emb(q, torch.arange(n)[None])
    q, _ = apply_rotary_pos_emb(q, q, cos, sin)
    q = q[0]
    groups = q.shape[0] // h_kv
    a = torch.zeros(h_kv, n, dtype=F64)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        for h in range(q.shape[0]):
            for i in range(lo, hi):
                a[h // groups, lo:hi] += torch.softmax(keys[h // groups, lo:hi] @ q[h, i], -1) / groups
    a = a * values.norm(dim=-1)
    pooled = torch.stack([(torch.nn.functional.pad(a, (1, 1))[:, j : j + 3]).sum(-1) / 3 for j in range(n)], -1)
    inner = slice(sinks_start, n - sinks_end)
    lev = torch.stack([exact_leverage(keys_pre[h, inner]) for h in range(h_kv)])

    def z(x):
        return (x - x.mean()) / x.std(unbiased=False)

    return blend * z(lev) + z(pooled[:, inner])


def test_compactor_blends_standardised_leverage_and_chunked_attention_and_keeps_sinks():
    model = model64("llama")
    ids = random_ids(1, 48, seed=6)
    observer = CompactorAttentionObserver(chunk=16, scaled=False)
    cache = prefill_cache(model, ids, observers=[observer])
    full = cache.copy()
    spec = "compactor[sketch=0,ridge=0,chunk=16,blend=0.7,sinks_start=3,sinks_end=2]"
    ctx = compress(model, cache, ids, spec, 12)
    assert "compactor" not in ctx.report  # the prefill observed the attention: no extra pass
    for layer_idx, layer in cache.folded_layers:
        scores = compactor_reference(model, ids, layer_idx, full.layers[layer_idx], 0.7, 16, 3, 2)
        got = kept_positions(full.layers[layer_idx], layer)[0]
        for h in range(scores.shape[0]):
            padded = [0.0] * 3 + scores[h].tolist() + [0.0] * 2
            assert got[h] == ref_top(padded, 12, protected={0, 1, 2, 46, 47})
    # without the observer the same attention comes from one extra prefill pass
    again = prefill_cache(model, ids)
    ctx = compress(model, again, ids, spec, 12)
    assert "extra prefill pass" in ctx.report["compactor"]
    for (_, a), (_, b) in zip(cache.folded_layers, again.folded_layers, strict=True):
        torch.testing.assert_close(a.padded()[0], b.padded()[0])


@pytest.mark.parametrize(
    "spec",
    [
        "leverage+keepkv",
        "leverage+am_fit",
        "leverage+grkv",
        "compactor+cam",
        "compactor+kvmerger",
        "leverage+d2o_merge",
        "global:leverage+am_fit",
        "adakv:compactor",
    ],
)
def test_leverage_and_compactor_compose_with_folders(spec):
    model = model64("qwen2")
    ids = random_ids(1, 64, seed=8)
    cache = prefill_cache(model, ids)
    compress(model, cache, ids, spec, 16)
    total = sum(int(layer.row_lengths().sum()) for _, layer in cache.folded_layers)
    assert total == 16 * 2 * len(cache.folded_layers)  # 2 KV heads × 16 per layer, whatever the split
    for _, layer in cache.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        assert bool(torch.isfinite(keys).all()) and bool(torch.isfinite(values).all())


def test_leverage_options_are_checked():
    with pytest.raises(SpecError, match="sketch"):
        build_method("leverage[sketch=-1]")
    with pytest.raises(SpecError, match="blend"):
        build_method("compactor[blend=-0.5]")
