"""KeepKV: ZIP-merging, electoral votes, EMA scores, prefill order, online merging.

The paper's theorems are property tests: Theorem 3 (the ZIP-merge leaves the scoring query's
output unchanged, in float64), Theorem 2 (a convex merge without votes shrinks the merged pair's
attention). Votes are conserved: Σ p in the cache + votes of evicted (below-threshold) entries =
tokens seen.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.methods import CompressionContext, SpecError, build_method
from kvfold.methods.merging.keepkv.merge import best_match, merge_first_keep, zip_merge, zip_merge_pair
from kvfold.methods.merging.keepkv.method import KeepKV
from kvfold.methods.merging.keepkv.online import KeepKVOnline
from kvfold.methods.merging.keepkv.scores import (
    ema_step,
    ema_step_one_,
    log_scores_of,
    step_log_scores,
    window_log_scores,
)
from kvfold.pipeline.context import greedy_decode
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from tests.conftest import FAMILIES, make_tiny_model
from tests.runtime.test_attention import _CharTokenizer

F64 = torch.float64
TEXTS = ["the quick brown fox jumps over the lazy dog; " * 3, "a shorter context, left padded. " * 2]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, log_votes: torch.Tensor, scaling: float):
    """Output of one query per row: softmax(q·k·scaling + log p) v, shapes (…, D), (…, N, D), (…, N)."""
    logits = torch.einsum("...d,...nd->...n", q, keys) * scaling + log_votes
    return torch.einsum("...n,...nd->...d", torch.softmax(logits, -1), values)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_cache(seed: int, batch=2, heads=3, length=12, dim=8):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, length, dim, generator=g, dtype=F64)
    values = torch.randn(batch, heads, length, dim, generator=g, dtype=F64)
    votes = torch.randint(1, 6, (batch, heads, length), generator=g).to(F64)
    query = torch.randn(batch, heads, dim, generator=g, dtype=F64)
    return keys, values, votes.log(), query


# ---------------------------------------------------------------------------- theorems


@pytest.mark.parametrize("seed", range(4))
def test_theorem3_one_zip_merge_leaves_the_scoring_query_output_unchanged(seed):
    keys, values, log_votes, q = random_cache(seed)
    scaling = 8**-0.5
    log_s = torch.einsum("bhd,bhnd->bhn", q, keys) * scaling  # ln s = q·k/√d of the scoring query
    e, c = 3, 7
    targets = torch.full(log_s.shape, c)
    merge = torch.zeros(log_s.shape, dtype=torch.bool)
    merge[..., e] = True
    out = zip_merge(keys, values, log_votes, log_s, targets, merge, eps=0.0)
    assert bool(out.receivers[..., c].all()) and int(out.receivers.sum()) == 2 * 3
    assert not bool(out.fallback.any())
    kept = [i for i in range(12) if i != e]
    before = attend(q, keys, values, log_votes, scaling)
    after = attend(q, out.keys[:, :, kept], out.values[:, :, kept], out.log_votes[:, :, kept], scaling)
    assert rel(after, before) <= 1e-10
    # p_r = p_e + p_c; eq. 7 / Algorithm 1 lines 8–10 written out for the pair
    p, s = log_votes.exp(), log_s.exp()
    w_e, w_c = p[..., e] * s[..., e], p[..., c] * s[..., c]
    k_r = (w_e[..., None] * keys[:, :, e] + w_c[..., None] * keys[:, :, c]) * (
        torch.log((w_e + w_c) / (p[..., e] + p[..., c])) / (w_e * log_s[..., e] + w_c * log_s[..., c])
    )[..., None]
    v_r = (w_e[..., None] * values[:, :, e] + w_c[..., None] * values[:, :, c]) / (w_e + w_c)[..., None]
    torch.testing.assert_close(out.keys[:, :, c], k_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.values[:, :, c], v_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.log_votes[..., c].exp(), p[..., e] + p[..., c])


def test_theorem3_holds_for_many_entries_into_several_carriers_at_once():
    """Eq. 25 (Appendix A.3): all entries a carrier absorbs are merged in one closed form."""
    keys, values, log_votes, q = random_cache(11, length=20)
    scaling = 0.3
    log_s = torch.einsum("bhd,bhnd->bhn", q, keys) * scaling
    g = torch.Generator().manual_seed(1)
    carriers = torch.tensor([0, 5, 9, 14])
    merge = torch.zeros(log_s.shape, dtype=torch.bool)
    merge[..., [1, 2, 3, 7, 8, 12, 13, 17, 19]] = True
    targets = carriers[torch.randint(0, 4, log_s.shape, generator=g)]
    out = zip_merge(keys, values, log_votes, log_s, targets, merge, eps=0.0)
    kept = (~merge[0, 0]).nonzero().flatten()
    before = attend(q, keys, values, log_votes, scaling)
    after = attend(q, out.keys[:, :, kept], out.values[:, :, kept], out.log_votes[:, :, kept], scaling)
    assert rel(after, before) <= 1e-10
    # votes conserved: Σ p over the kept entries = Σ p over all
    torch.testing.assert_close(out.log_votes[:, :, kept].exp().sum(-1), log_votes.exp().sum(-1))
    # ln ŝ_r = ln(Σ w / p_r): the merged entry's target score (eq. 27)
    s_r = torch.einsum("bhd,bhnd->bhn", q, out.keys) * scaling
    torch.testing.assert_close(s_r[..., out.receivers[0, 0]], out.log_scores[..., out.receivers[0, 0]])


@pytest.mark.parametrize("seed", range(4))
def test_theorem2_the_convex_key_without_votes_sags_and_eq7_with_votes_does_not(seed):
    """Theorem 2 on kvfold's own merge: ``zip_merge`` with the convex key (``scale_key=False``, the
    authors' code) and the votes dropped gives the merged entry less attention than the pair had
    (attention sag); eq. 7's key with the votes gives it exactly the pair's attention (Theorem 3)."""
    keys, values, _, q = random_cache(seed)
    scaling = 8**-0.5
    zero = torch.zeros(2, 3, 12, dtype=F64)
    log_s = torch.einsum("bhd,bhnd->bhn", q, keys) * scaling
    e, c = 2, 6
    merge = torch.zeros(log_s.shape, dtype=torch.bool)
    merge[..., e] = True
    targets = torch.full(log_s.shape, c)
    kept = [i for i in range(12) if i != e]
    attn = torch.softmax(log_s, -1)
    pair = attn[..., e] + attn[..., c]
    convex = zip_merge(keys, values, zero, log_s, targets, merge, eps=0.0, scale_key=False)
    assert bool(convex.fallback[..., c].all())  # every carrier took the convex key
    sagged = torch.softmax(torch.einsum("bhd,bhnd->bhn", q, convex.keys[:, :, kept]) * scaling, -1)
    assert bool((sagged[..., kept.index(c)] < pair).all())  # A_r < A_e + A_c: attention sag
    before = attend(q, keys, values, zero, scaling)
    assert rel(attend(q, convex.keys[:, :, kept], convex.values[:, :, kept], zero[..., kept], scaling), before) > 1e-6
    exact = zip_merge(keys, values, zero, log_s, targets, merge, eps=0.0)
    logits = torch.einsum("bhd,bhnd->bhn", q, exact.keys[:, :, kept]) * scaling + exact.log_votes[:, :, kept]
    torch.testing.assert_close(torch.softmax(logits, -1)[..., kept.index(c)], pair, rtol=1e-10, atol=1e-12)


def test_the_key_falls_back_to_a_convex_merge_when_the_denominator_vanishes():
    keys, values, _, _ = random_cache(5, batch=1, heads=1, length=2)
    log_votes = torch.tensor([[[0.0, 2.0]]], dtype=F64)
    log_s = torch.tensor([[[1.0, -1.0]]], dtype=F64)  # w_e ln ŝ_e + w_c ln ŝ_c = e·1 + e·(−1) = 0
    out = zip_merge(keys, values, log_votes, log_s, torch.tensor([[[1, 1]]]), torch.tensor([[[True, False]]]))
    assert out.fallback.tolist() == [[[False, True]]]
    w = (log_votes + log_s).exp()[0, 0]
    convex = (w[0] * keys[0, 0, 0] + w[1] * keys[0, 0, 1]) / w.sum()
    torch.testing.assert_close(out.keys[0, 0, 1], convex)
    torch.testing.assert_close(out.values[0, 0, 1], (w[0] * values[0, 0, 0] + w[1] * values[0, 0, 1]) / w.sum())
    assert math.isclose(float(out.log_votes[0, 0, 1].exp()), 1 + math.e**2)
    assert bool(torch.isfinite(out.keys).all())


def test_a_reflected_or_overscaled_key_falls_back_unless_max_scale_is_inf():
    keys, values, _, _ = random_cache(6, batch=1, heads=1, length=2)
    log_votes = torch.tensor([[[0.0, math.log(10.0)]]], dtype=F64)
    log_s = torch.tensor([[[1.0, -3.0]]], dtype=F64)  # μ = Σ w ln ŝ / Σ w > 0 > ln(Σ w / Σ p): γ < 0
    args = (keys, values, log_votes, log_s, torch.tensor([[[1, 1]]]), torch.tensor([[[True, False]]]))
    literal = zip_merge(*args)
    w = (log_votes + log_s).exp()[0, 0]
    convex = (w[0] * keys[0, 0, 0] + w[1] * keys[0, 0, 1]) / w.sum()
    gamma = float(math.log(w.sum() / 11) / ((w * log_s[0, 0]).sum() / w.sum()))
    assert gamma < 0 and not bool(literal.fallback.any())
    torch.testing.assert_close(literal.keys[0, 0, 1], gamma * convex)
    guarded = zip_merge(*args, max_scale=2.0)
    assert guarded.fallback.tolist() == [[[False, True]]]
    torch.testing.assert_close(guarded.keys[0, 0, 1], convex)


# ---------------------------------------------------------------------------- EMA scores (eq. 8)


def test_window_scores_are_the_bias_corrected_ema_of_causal_gqa_scores():
    g = torch.Generator().manual_seed(2)
    queries = torch.randn(2, 4, 3, 5, generator=g, dtype=F64)  # H_q = 4, H_kv = 2, W = 3
    keys = torch.randn(2, 2, 7, 5, generator=g, dtype=F64)
    valid = torch.ones(2, 2, 7, dtype=torch.bool)
    valid[1, :, :2] = False  # left padding of row 1
    alpha, scaling = 0.7, 0.4
    log_s, weight = window_log_scores(queries, keys, scaling, alpha, valid)
    for b in range(2):
        for kv in range(2):
            for i in range(7):
                num = den = 0.0
                for j in range(3):
                    if not valid[b, kv, i] or i > 4 + j:  # query j sits at slot 4 + j
                        continue
                    omega = (1 - alpha) * alpha ** (2 - j)
                    s = sum(math.exp(float(queries[b, h, j] @ keys[b, kv, i]) * scaling) for h in (2 * kv, 2 * kv + 1))
                    num += omega * s / 2
                    den += omega
                if den == 0:
                    assert log_s[b, kv, i] == float("-inf") and weight[b, kv, i] == 0
                else:
                    assert math.isclose(float(log_s[b, kv, i]), math.log(num / den), rel_tol=1e-12)
                    assert math.isclose(float(weight[b, kv, i]), den, rel_tol=1e-12)
    # one query, one head per group: ŝ = s exactly (Theorem 3's setting)
    one, _ = window_log_scores(queries[:, :2, -1:], keys, scaling, alpha)
    torch.testing.assert_close(one, torch.einsum("bhd,bhnd->bhn", queries[:, :2, -1], keys) * scaling)


def test_ema_step_equals_one_query_at_a_time_and_scores_come_back_from_probabilities():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 9, 4, generator=g, dtype=F64)
    beta = torch.randint(0, 3, (1, 2, 9), generator=g).to(F64)
    beta[0, 1, 0] = float("-inf")  # an empty slot
    query = torch.randn(1, 4, 3, 4, generator=g, dtype=F64)  # 3 new tokens = the last 3 slots
    scaling = 0.5
    direct = step_log_scores(query, keys, beta, scaling)
    logits = torch.einsum("bhqd,bhnd->bhqn", query, keys.repeat_interleave(2, 1)) * scaling
    causal = torch.arange(9)[None, :] <= torch.arange(6, 9)[:, None]
    full_logits = (logits + beta.repeat_interleave(2, 1)[:, :, None]).masked_fill(~causal, float("-inf"))
    probs = torch.softmax(full_logits, -1)
    from_probs = step_log_scores(query, keys, beta, scaling, probs)
    seen = torch.isfinite(direct) & causal
    torch.testing.assert_close(from_probs[seen], direct[seen], rtol=0, atol=1e-10)
    folded = logits.reshape(1, 2, 2 * 3, 9)  # the attention's scores: G query heads folded per KV head
    from_logits = step_log_scores(query, keys, beta, scaling, probs, logits=folded)
    torch.testing.assert_close(from_logits, direct, rtol=0, atol=1e-12)  # empty slot: -inf in both
    log_sum = torch.randn(1, 2, 9, generator=g, dtype=F64)
    weight = torch.rand(1, 2, 9, generator=g, dtype=F64)
    log_sum[..., 6:], weight[..., 6:] = float("-inf"), 0.0
    together = ema_step(log_sum, weight, direct, 6, 0.8)
    one_sum, one_weight = log_sum, weight
    for j in range(3):
        part = direct[:, :, j : j + 1, : 7 + j]
        s, w = ema_step(one_sum[..., : 7 + j], one_weight[..., : 7 + j], part, 6 + j, 0.8)
        one_sum, one_weight = torch.cat([s, one_sum[..., 7 + j :]], -1), torch.cat([w, one_weight[..., 7 + j :]], -1)
    torch.testing.assert_close(together[1], one_weight)
    ok = torch.isfinite(one_sum)
    torch.testing.assert_close(together[0][ok], one_sum[ok])
    # a constant score is recovered exactly by the bias correction
    const = torch.full((1, 4, 1, 9), 1.5, dtype=F64)
    s, w = ema_step(torch.full((1, 2, 9), float("-inf"), dtype=F64), torch.zeros(1, 2, 9, dtype=F64), const, 9, 0.9)
    torch.testing.assert_close(log_scores_of(s, w), torch.full((1, 2, 9), 1.5, dtype=F64))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_decode_step_ema_equals_ema_step(dtype):
    """:func:`ema_step_one_` (in place, a logaddexp chain over the GQA group) is :func:`ema_step`
    of one query, empty slots included."""
    g = torch.Generator().manual_seed(5)
    log_sum = torch.randn(2, 3, 11, generator=g, dtype=dtype) * 4
    weight = torch.rand(2, 3, 11, generator=g, dtype=dtype)
    log_sum[:, :, -1], weight[:, :, -1] = float("-inf"), 0.0  # the entry this step appended
    log_s = torch.randn(2, 12, 1, 11, generator=g, dtype=dtype) * 6  # 4 query heads per KV head
    log_s[0, 4:8, :, 2] = float("-inf")  # an empty slot of KV head 1
    log_sum[0, 1, 2], weight[0, 1, 2] = float("-inf"), 0.0
    expected_sum, expected_weight = ema_step(log_sum, weight, log_s, 10, 0.7)
    in_place_sum, in_place_weight = log_sum.clone(), weight.clone()
    ema_step_one_(in_place_sum, in_place_weight, log_s, 0.7)
    torch.testing.assert_close(in_place_weight, expected_weight)
    torch.testing.assert_close(in_place_sum, expected_sum)  # -inf at the empty slot in both
    assert in_place_sum[0, 1, 2] == float("-inf")


@pytest.mark.parametrize("max_scale", [math.inf, 3.0])
def test_the_pair_merge_equals_zip_merge_of_one_entry(max_scale):
    g = torch.Generator().manual_seed(6)
    keys = torch.randn(3, 2, 2, 5, generator=g, dtype=F64)
    values = torch.randn(3, 2, 2, 5, generator=g, dtype=F64)
    log_votes = torch.randint(0, 3, (3, 2, 2), generator=g).to(F64)
    log_scores = torch.randn(3, 2, 2, generator=g, dtype=F64) * 2
    log_scores[0, 0] = torch.tensor([1.0, -1.0], dtype=F64)  # equal weights w = p ŝ = e: μ = 0, the fallback
    log_votes[0, 0] = torch.tensor([0.0, 2.0], dtype=F64)
    key, value, log_p, log_s, exact = zip_merge_pair(keys, values, log_votes, log_scores, 1e-3, max_scale)
    merge = torch.tensor([True, False]).expand(3, 2, 2)
    whole = zip_merge(keys, values, log_votes, log_scores, torch.ones(3, 2, 2, dtype=torch.long), merge,
                      1e-3, max_scale)  # fmt: skip
    torch.testing.assert_close(key[:, :, 0], whole.keys[:, :, 1])
    torch.testing.assert_close(value[:, :, 0], whole.values[:, :, 1])
    torch.testing.assert_close(log_p[..., 0], whole.log_votes[..., 1])
    torch.testing.assert_close(log_s[..., 0], whole.log_scores[..., 1])
    assert torch.equal(~exact[..., 0], whole.fallback[..., 1])
    assert not bool(exact[0, 0, 0])


# ---------------------------------------------------------------------------- the folder on a layer


def make_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> FoldedLayer:
    layer = FoldedLayer()
    layer.update(keys, values)
    layer.captured_queries = queries
    return layer


def fold_layer(layer: FoldedLayer, keep: list[int], folder: KeepKV, scaling: float = 1.0) -> CompressionContext:
    ctx = CompressionContext(model=None, cache=None, input_ids=torch.zeros(1, 1), attention_mask=None,
                             budget=Budget.parse(len(keep)), memo={"keepkv_scalings": {0: scaling}})  # fmt: skip
    keep_t = torch.tensor(keep).expand(*layer.padded()[2].shape[:2], -1)
    lengths = torch.full(keep_t.shape[:2], len(keep))
    folder.fold(0, layer, keep_t, lengths, torch.zeros(1), ctx)
    return ctx


def test_threshold_merges_above_and_evicts_below():
    d = 4
    base = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    ortho = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64)

    def at_cos(c: float) -> torch.Tensor:
        return c * base + math.sqrt(1 - c * c) * ortho

    keys = torch.stack([base, at_cos(0.81), at_cos(0.79), torch.tensor([0.0, 0, 1, 0], dtype=F64)])[None, None]
    values = torch.randn(1, 1, 4, d, dtype=F64)
    layer = make_layer(keys, values, torch.randn(1, 1, 1, d, dtype=F64))
    ctx = fold_layer(layer, [0, 3], KeepKV(threshold=0.8))
    stats = ctx.report["keepkv"]
    assert (stats["merged"], stats["evicted"], stats["votes_dropped"]) == (1, 1, 1.0)
    assert layer.padded()[2].exp().tolist() == [[[2.0, 1.0]]]  # carrier 0 absorbed entry 1: p = 2
    layer = make_layer(keys, values, torch.randn(1, 1, 1, d, dtype=F64))
    ctx = fold_layer(layer, [0, 3], KeepKV(threshold=0.78))
    assert ctx.report["keepkv"]["merged"] == 2 and layer.padded()[2].exp().tolist() == [[[3.0, 1.0]]]


def test_best_match_respects_allowed_and_rank():
    rows = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    cands = torch.tensor([[[[1.0, 0.1], [0.1, 1.0], [1.0, 0.0]]]])
    sim, idx = best_match(rows, cands, torch.tensor([[[True, True, False]]]))
    assert idx.tolist() == [[[0, 1]]]
    sim, idx = best_match(rows, cands, torch.ones(1, 1, 3, dtype=torch.bool), torch.tensor([[[1, 0]]]),
                          torch.tensor([[[0, 0, 5]]]))  # fmt: skip
    assert int(idx[0, 0, 0]) == 0 and sim[0, 0, 1] == float("-inf")  # row 1 has rank 0: nothing above it


def test_merge_first_gives_the_slot_of_a_similar_entry_to_a_dissimilar_one():
    keys = torch.tensor([[1.0, 0, 0], [0.99, 0.1, 0], [0, 0, 1.0], [0, 1.0, 0]], dtype=F64)[None, None]
    scores = torch.tensor([[[4.0, 3.0, 2.0, 1.0]]])
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    keep, lengths = torch.tensor([[[0, 1]]]), torch.tensor([[2]])
    new_keep, new_lengths, swapped = merge_first_keep(keys, keep, lengths, scores, None, valid, 0.8)
    assert new_keep.tolist() == [[[0, 2]]] and new_lengths.tolist() == [[2]] and swapped.tolist() == [[1]]
    protected = torch.tensor([[[False, True, False, False]]])  # protected: first in priority, never merged away
    new_keep, _, swapped = merge_first_keep(keys, keep, lengths, scores, protected, valid, 0.8)
    assert new_keep.tolist() == [[[1, 2]]] and swapped.tolist() == [[1]]
    # evict-first keeps the selector's choice; merge-first merges entry 1 into 0 and keeps 2
    values = torch.randn(1, 1, 4, 3, dtype=F64)
    layer = make_layer(keys, values, torch.randn(1, 1, 1, 3, dtype=F64))
    fold_layer(layer, [0, 1], KeepKV(evict_first=True))
    assert layer.padded()[2].exp().tolist() == [[[1.0, 1.0]]]


@pytest.mark.parametrize("block", [3, 64])
def test_merge_first_matches_a_loop_reference(block):
    g = torch.Generator().manual_seed(7)
    centers = torch.randn(5, 6, generator=g, dtype=F64)
    noise = 0.3 * torch.randn(2, 2, 30, 6, generator=g, dtype=F64)
    keys = centers[torch.randint(0, 5, (2, 2, 30), generator=g)] + noise
    scores = torch.rand(2, 2, 30, generator=g, dtype=F64)
    valid = torch.ones(2, 2, 30, dtype=torch.bool)
    valid[1, :, :4] = False
    protected = torch.zeros_like(valid)
    protected[..., -3:] = True
    from kvfold.methods.core.selection import topk_keep

    keep, lengths = topk_keep(scores, 9, protected, valid)
    got, got_lengths, swapped = merge_first_keep(keys, keep, lengths, scores, protected, valid, 0.8, block=block)
    assert int(swapped.sum()) > 0
    for b in range(2):
        for h in range(2):
            kept = keep[b, h, : lengths[b, h]].tolist()
            rest = [j for j in range(30) if valid[b, h, j] and j not in kept]
            prot = sorted((j for j in kept if protected[b, h, j]), reverse=True)
            order = prot + sorted((j for j in kept if j not in prot), key=lambda j: (-float(scores[b, h, j]), j))
            order += sorted(rest, key=lambda j: (-float(scores[b, h, j]), j))
            unit = keys[b, h] / keys[b, h].norm(dim=-1, keepdim=True)
            mergeable = {
                i: not protected[b, h, i] and any(float(unit[i] @ unit[k]) > 0.8 for k in order[:j])
                for j, i in enumerate(order)
            }
            final = [i for i in order if not mergeable[i]] + [i for i in order if mergeable[i]]
            want = sorted(final[: int(lengths[b, h])])
            assert got[b, h, : got_lengths[b, h]].tolist() == want


# ---------------------------------------------------------------------------- on models


def mha64(family: str = "llama", **overrides):
    return kvfold.enable(make_tiny_model(family, num_key_value_heads=6, **overrides).to(F64))


def prefilled(model, texts, methods=None):
    return kvfold.prefill(model, _CharTokenizer(), texts, use_chat_template=False, methods=methods)


@pytest.mark.parametrize("order", ["true", "false"])
def test_theorem3_end_to_end_the_last_context_query_sees_the_same_output(order):
    model = mha64()
    pre = prefilled(model, TEXTS[:1])
    small = pre.compress(f"h2o+keepkv[window=1,threshold=-1,evict_first={order},max_scale=inf]", 0.3)
    evicted = pre.compress("h2o", 0.3)
    stats = small.report["keepkv"]
    assert stats["merged"] > 0 and stats["evicted"] == 0 and stats["fallbacks"] == 0
    for layer_idx, layer in small.cache.folded_layers:
        full = pre.cache.layers[layer_idx]
        q = full.captured_queries[:, :, -1]
        scaling = model.model.layers[layer_idx].self_attn.scaling
        keys, values, beta, _ = full.padded()
        before = attend(q, keys, values, beta, scaling)
        keys, values, beta, _ = layer.padded()
        assert keys.shape[2] < full.physical_length
        assert rel(attend(q, keys, values, beta, scaling), before) <= 1e-10
        # its own eviction (the same selection, the evicted entries dropped) changes that output
        keys, values, beta, _ = evicted.cache.layers[layer_idx].padded()
        assert keys.shape[2] == layer.physical_length
        assert rel(attend(q, keys, values, beta, scaling), before) > 1e-3


def test_votes_are_conserved_on_a_padded_batch():
    model = kvfold.enable(make_tiny_model("qwen2").to(F64))
    pre = prefilled(model, TEXTS)
    small = pre.compress("keepkv", 0.25)
    lengths = pre.attention_mask.sum(-1)
    held = 0.0
    for _, layer in small.cache.folded_layers:
        beta = layer.padded()[2]
        held += float(beta.exp().sum())  # β = −inf (padding, empty slots) counts 0
        assert int(layer.row_lengths().max()) < int(lengths.max())
    seen = float(lengths.sum()) * model.config.num_key_value_heads * len(small.cache.folded_layers)
    stats = small.report["keepkv"]
    assert stats["merged"] > 0 and stats["evicted"] > 0
    assert math.isclose(held + stats["votes_dropped"], seen, rel_tol=1e-6)  # β is stored in float32
    assert small.report["keepkv_fallbacks"] == stats["fallbacks"]


def test_a_batch_compresses_each_row_as_if_alone():
    model = kvfold.enable(make_tiny_model("llama").to(F64))
    both = prefilled(model, TEXTS).compress("keepkv", 0.3)
    alone = prefilled(model, TEXTS[1:]).compress("keepkv", 0.3)
    for (_, b_layer), (_, a_layer) in zip(both.cache.folded_layers, alone.cache.folded_layers, strict=True):
        k2, v2, beta2, n2 = b_layer.padded()
        k1, v1, beta1, n1 = a_layer.padded()
        assert n2[1].tolist() == n1[0].tolist()
        ok2, ok1 = torch.isfinite(beta2[1]), torch.isfinite(beta1[0])
        torch.testing.assert_close(k2[1][ok2], k1[0][ok1])
        torch.testing.assert_close(v2[1][ok2], v1[0][ok1])
        torch.testing.assert_close(beta2[1][ok2], beta1[0][ok1])


def online_run(model, spec: str, budget, steps: int, text: str = TEXTS[0]):
    """Compress, then decode ``steps`` tokens with the online policy, checking after every step."""
    tok = _CharTokenizer()
    pre = prefilled(model, [text])
    small = pre.compress(spec, budget)
    cache = small.cache.copy()
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=pre.attention_mask,
                             budget=Budget.parse(budget))  # fmt: skip
    policy = small.method.online_policy(ctx)
    cache.policy = policy
    state = policy.folder
    assert isinstance(state, KeepKVOnline)
    limits = {i: int(b.max()) for i, b in enumerate(small.method.selector.layer_budgets(ctx))}
    heads = model.config.num_key_value_heads
    layers = len(cache.folded_layers)
    dropped_before = small.report["keepkv"]["votes_dropped"]
    for step in range(steps):  # a 3-token forward (several victims at once), then single tokens
        greedy_decode(model, tok, cache, [5, 6, 7] if step == 0 else [5], 1, stop_at_eos=False)
        held = 0.0
        for layer_idx, layer in cache.folded_layers:
            assert layer.physical_length <= limits[layer_idx]  # the budget holds during generation
            held += float(layer.padded()[2].exp().sum())
        seen = cache.get_seq_length() * heads * layers
        assert math.isclose(held + dropped_before + state.votes_dropped, seen, rel_tol=1e-9)
    return state


@pytest.mark.parametrize("spec", ["keepkv", "h2o+keepkv", "streamingllm+keepkv"])
def test_online_merging_keeps_the_budget_and_the_votes(spec):
    model = kvfold.enable(make_tiny_model("mistral"))
    state = online_run(model, spec, 0.3, steps=6)
    assert state.merged + state.evicted >= (3 + 5) * 2  # every new token removed one entry per row
    assert state.merged > 0  # some victims were merged into a carrier, not dropped


def test_online_theorem3_with_the_current_step_scores():
    """With α → 0 the EMA is the step's own score: each online merge keeps that step's output (MHA)."""
    model = mha64()
    tok = _CharTokenizer()
    pre = prefilled(model, TEXTS[:1])
    small = pre.compress("streamingllm+keepkv[threshold=-1,alpha=1e-12,max_scale=inf]", 0.3)
    cache = small.cache.copy()
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=pre.attention_mask,
                             budget=Budget.parse(0.3))  # fmt: skip
    policy = small.method.online_policy(ctx)
    errors = []

    class Checking:
        needs_attention = True

        def after_forward(self, layer_idx, layer, query, probs, logits=None):
            scaling = model.model.layers[layer_idx].self_attn.scaling
            q = query[:, :, -1]
            keys, values, beta = (t.clone() for t in layer.dense_buffers())
            before = attend(q, keys, values, beta, scaling)
            policy.after_forward(layer_idx, layer, query, probs, logits)
            keys, values, beta = layer.dense_buffers()
            errors.append(rel(attend(q, keys, values, beta, scaling), before))

    cache.policy = Checking()
    greedy_decode(model, tok, cache, [5, 6, 7], 4, stop_at_eos=False)  # 3 victims per row at once, then 1
    assert policy.folder.merged >= (3 + 3) * 6 * 2 and policy.folder.fallbacks == 0
    assert max(errors) <= 1e-10


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_runs_keepkv_on_a_padded_batch_and_generates(family):
    model = kvfold.enable(make_tiny_model(family, eos_token_id=None))  # four tokens each, whatever is drawn
    pre = prefilled(model, TEXTS, methods="keepkv")
    for spec in ("keepkv", "snapkv+keepkv"):
        small = pre.compress(spec, 0.3)
        carriers = 0
        for _, layer in small.cache.folded_layers:
            keys, values, beta, _ = layer.padded()
            assert layer.physical_length < pre.input_ids.shape[1]
            ok = torch.isfinite(beta)
            assert bool(torch.isfinite(keys[ok]).all()) and bool(torch.isfinite(values[ok]).all())
            carriers += int((beta[ok] > 1e-6).sum())  # entries holding more than one vote
        assert small.report["keepkv"]["merged"] > 0 and carriers > 0  # the folder merged, not only evicted
        answers = small.generate("q?", max_new_tokens=4)
        assert len(answers) == 2 and all(a.new_tokens == 4 for a in answers)


def test_specs_defaults_and_errors():
    method = build_method("keepkv")
    assert method.selector.name == "h2o_cosine" and method.folder.name == "keepkv"
    assert (method.selector.split, method.selector.recent_share, method.selector.layer_ratio) == (
        "authors_code",
        0.2,
        0.84,
    )
    assert method.selector.sinks == 4 and (method.folder.eq7_scaling, method.folder.max_scale) == (True, 2.0)
    text = build_method("h2o_cosine[split=paper_text]").selector
    assert (text.recent_share, text.layer_ratio) == (0.8, 0.2)
    assert build_method("h2o_cosine[split=paper_text,recent_ratio=0.5]").selector.recent_share == 0.5
    with pytest.raises(SpecError, match="split must be one of"):
        build_method("h2o_cosine[split=reversed]")
    assert (method.folder.threshold, method.folder.evict_first) == (0.8, False)
    assert build_method("keepkv[threshold=0.9]").folder.threshold == 0.9
    assert build_method("pyramidkv+keepkv[window=16]").query_window == 32  # pyramidkv's own window
    with pytest.raises(SpecError):
        build_method("keepkv[threshold=2]")
    with pytest.raises(SpecError):
        build_method("keepkv[alpha=1]")
    model = kvfold.enable(make_tiny_model("llama"))
    pre = prefilled(model, TEXTS[:1])
    ctx = CompressionContext(model=model, cache=pre.cache.copy(), input_ids=pre.input_ids,
                             attention_mask=pre.attention_mask, budget=Budget.parse(0.3))  # fmt: skip
    assert build_method("snapkv+keepkv").online_policy(ctx) is None  # snapkv is one-shot
    policy = build_method("h2o+keepkv").online_policy(ctx)
    assert isinstance(policy.folder, KeepKVOnline) and policy.needs_attention
    assert build_method("h2o+keepkv[online=false]").online_policy(ctx).folder is None
    with pytest.raises(SpecError):
        build_method("adakv:h2o+keepkv").online_policy(ctx)


def test_h2o_cosine_budgets_decay_with_depth_and_average_the_budget():
    model = kvfold.enable(make_tiny_model("llama", num_hidden_layers=4))
    pre = prefilled(model, TEXTS[:1])
    small = pre.compress("h2o_cosine", 0.3)
    lengths = [layer.physical_length for _, layer in small.cache.folded_layers]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert sum(lengths) == 4 * math.ceil(0.3 * pre.input_ids.shape[1])


@pytest.mark.parametrize("split", ["authors_code", "paper_text"])
def test_h2o_cosine_splits_the_budget_as_each_reading_says(split):
    """``authors_code``: one recent window in every layer, 0.2 of the first layer's budget, layers
    shrinking to ~0.84; ``paper_text``: recent 80% of each layer's budget, layers shrinking to ~0.2."""
    model = kvfold.enable(make_tiny_model("llama", num_hidden_layers=6))
    tok = _CharTokenizer()
    pre = kvfold.prefill(model, tok, ["a fairly long context for the budgets. " * 12], use_chat_template=False)
    method = build_method(f"h2o_cosine[split={split}]").selector
    ctx = CompressionContext(model=model, cache=pre.cache.copy(), input_ids=pre.input_ids,
                             attention_mask=pre.attention_mask, budget=Budget.parse(0.5))  # fmt: skip
    budgets = [int(b[0]) for b in method.layer_budgets(ctx)]
    windows = [int(w[0]) for w in method.recent_windows(ctx)]
    ratio = budgets[-1] / budgets[0]
    if split == "authors_code":
        assert 0.8 <= ratio <= 0.9
        assert windows == [int(0.2 * budgets[0])] * 6
        assert all(b - w - 4 > 0.7 * b for b, w in zip(budgets, windows, strict=True))  # heavy hitters ≥ 70%
    else:
        assert 0.15 <= ratio <= 0.3
        assert windows == [int(0.8 * b) for b in budgets]
    kept = pre.compress(f"h2o_cosine[split={split}]", 0.5)
    assert [layer.physical_length for _, layer in kept.cache.folded_layers] == budgets


def test_eq7_scaling_false_keeps_the_convex_key_everywhere():
    model = mha64()
    pre = prefilled(model, TEXTS[:1])
    small = pre.compress("h2o+keepkv[window=1,threshold=-1,eq7_scaling=false]", 0.3)
    stats = small.report["keepkv"]
    assert stats["merged"] > 0 and stats["fallbacks"] == stats["receivers"] > 0


def test_a_cache_without_captured_queries_is_an_error():
    model = kvfold.enable(make_tiny_model("llama"))
    pre = prefilled(model, TEXTS[:1])
    cache = FoldedCache(model.config)
    with torch.no_grad():
        model(input_ids=pre.input_ids, past_key_values=cache, use_cache=True)
    ctx = CompressionContext(model=model, cache=cache, input_ids=pre.input_ids, attention_mask=None,
                             budget=Budget.parse(0.3))  # fmt: skip
    with pytest.raises(ValueError, match="prefill queries"):
        build_method("streamingllm+keepkv").compress(ctx)
