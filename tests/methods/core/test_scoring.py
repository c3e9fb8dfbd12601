"""Scorers and selection against small loop-based references (explicit loops over b, h, n)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvfold.methods.core.scoring import (
    critical_reweight,
    expected_attention_scores,
    h2o_scores,
    h2o_update,
    knorm_scores,
    mean_rope_rotation,
    pool_gqa,
    pool_tokens,
    rope_cos_sin,
    snapkv_scores,
    tova_scores,
    window_attention,
)
from kvfold.methods.core.selection import critical_two_stage_select, protected_mask, topk_keep

F64 = torch.float64


# ---------------------------------------------------------------------------- references


def ref_keep(scores_row, count, prot_row=None, valid_row=None) -> list[int]:
    """Obvious top-k: protected (most recent first), then score desc, ties lower position."""
    n = len(scores_row)
    valid = [True] * n if valid_row is None else [bool(v) for v in valid_row]
    prot = [False] * n if prot_row is None else [bool(p) and v for p, v in zip(prot_row, valid, strict=True)]

    def key(j):
        s = float(scores_row[j])
        s = -math.inf if math.isnan(s) else s
        if not valid[j]:
            return (2, 0.0, j)
        if prot[j]:
            return (0, -j, j)
        return (1, -s, j)

    order = sorted(range(n), key=key)
    return sorted(order[: min(int(count), sum(valid))])


def kept(keep, lengths) -> list[list[list[int]]]:
    return [
        [keep[b, h, : lengths[b, h]].tolist() for h in range(keep.shape[1])] for b in range(keep.shape[0])
    ]


def ref_keep_all(scores, counts, protected=None, valid=None) -> list[list[list[int]]]:
    batch, heads, _ = scores.shape
    out = []
    for b in range(batch):
        row = []
        for h in range(heads):
            c = counts if isinstance(counts, int) else int(counts[b, h])
            row.append(
                ref_keep(
                    scores[b, h].tolist(),
                    c,
                    None if protected is None else protected[b, h].tolist(),
                    None if valid is None else valid[b, h].tolist(),
                )
            )
        out.append(row)
    return out


def ref_probs(q, k, scaling, log_mass=None, valid=None):
    """Attention of the last W tokens' queries, one (b, h, i, j) at a time."""
    batch, hq, width, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    out = torch.zeros(batch, hq, width, n, dtype=F64)
    for b in range(batch):
        for h in range(hq):
            kv = h // groups
            for i in range(width):
                pos = n - width + i
                if valid is not None and not valid[b, kv, pos]:
                    continue
                logits = {}
                for j in range(pos + 1):
                    if valid is None or valid[b, kv, j]:
                        z = scaling * float(q[b, h, i] @ k[b, kv, j])
                        logits[j] = z + (0.0 if log_mass is None else float(log_mass[b, kv, j]))
                if not logits:
                    continue
                m = max(logits.values())
                total = sum(math.exp(z - m) for z in logits.values())
                for j, z in logits.items():
                    out[b, h, i, j] = math.exp(z - m) / total
    return out


def ref_snapkv(q, k, scaling, window, kernel, pooling, log_mass=None, valid=None):
    batch, hq, _, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    w = min(window, q.shape[2])
    probs = ref_probs(q[:, :, -w:], k, scaling, log_mass, valid)
    split = n - w
    out = torch.zeros(batch, hkv, n, dtype=F64)
    for b in range(batch):
        for kv in range(hkv):
            for j in range(n):
                lo_seg, hi_seg = (0, split) if j < split else (split, n)
                per_head = []
                for g in range(groups):
                    h = kv * groups + g
                    votes = [float(probs[b, h, :, x].sum()) / w for x in range(n)]
                    neigh = [
                        votes[x] for x in range(j - kernel // 2, j + kernel // 2 + 1) if lo_seg <= x < hi_seg
                    ]
                    per_head.append(max(neigh) if pooling == "max" else sum(neigh) / kernel)
                out[b, kv, j] = sum(per_head) / groups
                if valid is not None and not valid[b, kv, j]:
                    out[b, kv, j] = -math.inf
    return out


def make(batch=2, hkv=2, groups=2, n=24, w=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hkv * groups, w, d, generator=g, dtype=F64)
    k = torch.randn(batch, hkv, n, d, generator=g, dtype=F64)
    v = torch.randn(batch, hkv, n, d, generator=g, dtype=F64)
    return q, k, v


def left_padding(batch, hkv, n, pads):
    valid = torch.ones(batch, hkv, n, dtype=torch.bool)
    for b, p in enumerate(pads):
        valid[b, :, :p] = False
    return valid


# ---------------------------------------------------------------------------- window attention


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_window_attention_matches_reference(groups):
    q, k, _ = make(groups=groups, seed=groups)
    log_mass = torch.rand(2, 2, 24, dtype=F64).log1p()
    valid = left_padding(2, 2, 24, [0, 5])
    got = window_attention(q, k, 0.35, log_mass=log_mass, valid=valid)
    assert got.shape == (2, 2 * groups, 6, 24)
    torch.testing.assert_close(got, ref_probs(q, k, 0.35, log_mass, valid))


def test_window_attention_is_causal_within_window():
    q, k, _ = make(n=20, w=5)
    probs = window_attention(q, k, 0.3)
    for i in range(5):
        assert probs[..., i, 20 - 5 + i + 1 :].abs().sum() == 0  # never sees a later token
        k2 = k.clone()
        k2[:, :, 20 - 5 + i + 1 :] += 10.0  # changing later keys leaves row i unchanged
        torch.testing.assert_close(window_attention(q, k2, 0.3)[..., i, :], probs[..., i, :])
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5, dtype=F64))


def test_window_attention_float32_and_padded_query_rows():
    q, k, _ = make(n=10, w=4)
    valid = left_padding(2, 2, 10, [0, 8])  # row 1: the first two window queries are padding
    probs = window_attention(q.float(), k.float(), 0.3, valid=valid)
    assert probs.dtype == torch.float32
    assert probs[1, :, :2].abs().max() == 0
    assert not torch.isnan(probs).any()


def test_pool_gqa_groups_consecutive_heads():
    x = torch.arange(12.0).reshape(1, 6, 2)  # 6 query heads, 2 KV heads -> groups {0,1,2}, {3,4,5}
    torch.testing.assert_close(pool_gqa(x, 2, "mean"), torch.tensor([[[2.0, 3.0], [8.0, 9.0]]]))
    torch.testing.assert_close(pool_gqa(x, 2, "max"), torch.tensor([[[4.0, 5.0], [10.0, 11.0]]]))
    torch.testing.assert_close(pool_gqa(x, 2, "sum"), torch.tensor([[[6.0, 9.0], [24.0, 27.0]]]))
    with pytest.raises(ValueError, match="multiple"):
        pool_gqa(x, 4)


def test_pool_tokens_edges_and_errors():
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0]])
    torch.testing.assert_close(pool_tokens(x, 3, "max"), torch.tensor([[5.0, 5.0, 5.0, 3.0, 3.0]]))
    torch.testing.assert_close(pool_tokens(x, 3, "avg"), torch.tensor([[2.0, 8 / 3, 7 / 3, 5 / 3, 1.0]]))
    with pytest.raises(ValueError, match="odd"):
        pool_tokens(x, 4)


# ---------------------------------------------------------------------------- SnapKV


@pytest.mark.parametrize(
    "groups,pooling,kernel", [(1, "max", 5), (2, "max", 3), (3, "avg", 5), (2, "avg", 1)]
)
def test_snapkv_matches_reference_and_keeps_window(groups, pooling, kernel):
    q, k, _ = make(groups=groups, n=26, w=9, seed=10 + groups)
    valid = left_padding(2, 2, 26, [3, 0])
    log_mass = torch.rand(2, 2, 26, dtype=F64)
    got = snapkv_scores(q, k, 0.4, window=6, kernel=kernel, pooling=pooling, log_mass=log_mass, valid=valid)
    ref = ref_snapkv(q, k, 0.4, 6, kernel, pooling, log_mass, valid)
    torch.testing.assert_close(got, ref)
    prot = protected_mask(2, 2, 26, sinks=2, recent=6, valid=valid)
    keep, lengths = topk_keep(got, 11, protected=prot, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(ref, 11, prot, valid)
    for b in range(2):
        for h in range(2):
            row = set(keep[b, h, : lengths[b, h]].tolist())
            assert set(range(20, 26)) <= row  # the observation window
            assert not row & set(range(3 if b == 0 else 0))  # no padding


def test_snapkv_float32_output():
    q, k, _ = make()
    scores = snapkv_scores(q.float(), k.half(), 0.3, window=4)
    assert scores.dtype == torch.float32 and scores.shape == (2, 2, 24)


# ---------------------------------------------------------------------------- H2O


@pytest.mark.parametrize("groups", [2, 3])
def test_h2o_matches_reference_and_chunking(groups):
    q, k, _ = make(groups=groups, n=16, w=16, seed=20 + groups)
    valid = left_padding(2, 2, 16, [0, 4])
    ref_p = ref_probs(q, k, 0.3, valid=valid)
    ref = torch.zeros(2, 2, 16, dtype=F64)
    for b in range(2):
        for kv in range(2):
            for j in range(16):
                ref[b, kv, j] = sum(float(ref_p[b, kv * groups + g, :, j].sum()) for g in range(groups))
                if not valid[b, kv, j]:
                    ref[b, kv, j] = -math.inf
    full = h2o_scores(q, k, 0.3, chunk=1000, valid=valid)
    torch.testing.assert_close(full, ref)
    for chunk in (1, 3, 7):
        torch.testing.assert_close(h2o_scores(q, k, 0.3, chunk=chunk, valid=valid), full)
    keep, lengths = topk_keep(full, 5, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(ref, 5, valid=valid)


def test_h2o_update_continues_the_prefill_accumulator():
    q, k, _ = make(n=12, w=12, seed=3)
    prefix = h2o_scores(q[:, :, :11], k[:, :, :11], 0.3)
    step = window_attention(q[:, :, 11:], k, 0.3)  # the new token attends all 12 keys
    torch.testing.assert_close(h2o_update(prefix, step), h2o_scores(q, k, 0.3))


# ---------------------------------------------------------------------------- TOVA, K-norm


def test_tova_is_head_averaged_last_query():
    g = torch.Generator().manual_seed(4)
    probs = torch.rand(2, 6, 3, 10, generator=g, dtype=F64).softmax(-1)
    valid = left_padding(2, 2, 10, [0, 2])
    got = tova_scores(probs, 2, valid=valid)
    for b in range(2):
        for kv in range(2):
            for j in range(10):
                expect = sum(float(probs[b, h, -1, j]) for h in range(6)) / 6
                if valid[b, kv, j]:
                    assert math.isclose(float(got[b, kv, j]), expect, rel_tol=1e-12)
                else:
                    assert got[b, kv, j] == -math.inf
    keep, lengths = topk_keep(got, 4, valid=valid)
    assert torch.equal(keep[:, 0], keep[:, 1])  # one keep set per layer


def test_knorm_keeps_low_norm_keys():
    _, k, _ = make(seed=5)
    got = knorm_scores(k)
    for b in range(2):
        for h in range(2):
            for j in range(24):
                assert math.isclose(float(got[b, h, j]), -math.sqrt(sum(float(x) ** 2 for x in k[b, h, j])))
    keep, lengths = topk_keep(got, 6)
    assert kept(keep, lengths) == ref_keep_all(got, 6)
    assert knorm_scores(k.half()).dtype == torch.float32


# ---------------------------------------------------------------------------- Expected attention


def llama_rotary(d=8):
    cfg = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, rope_theta=100.0)
    return LlamaRotaryEmbedding(cfg)


def test_rope_cos_sin_and_rotation_match_transformers():
    rotary = llama_rotary()
    pos = torch.arange(7, 12)
    cos_hf, sin_hf = rotary(torch.zeros(1, 5, 8), pos[None])
    cos, sin = rope_cos_sin(rotary.inv_freq, pos, rotary.attention_scaling)
    torch.testing.assert_close(cos, cos_hf[0])
    torch.testing.assert_close(sin, sin_hf[0])
    x = torch.randn(1, 1, 1, 8)
    for t in range(5):  # one position: R̄ is that position's rotation
        rotated, _ = apply_rotary_pos_emb(x, x, cos[t : t + 1], sin[t : t + 1], unsqueeze_dim=0)
        torch.testing.assert_close(
            mean_rope_rotation(cos[t : t + 1], sin[t : t + 1]) @ x[0, 0, 0], rotated[0, 0, 0]
        )


def ref_expected(qpre, k, v, cos, sin, scaling, eps, valid):
    batch, hq, m, d = qpre.shape
    hkv, n = k.shape[1], k.shape[2]
    groups = hq // hkv
    # R_t from transformers' own apply_rotary_pos_emb on the basis vectors
    eye = torch.eye(d, dtype=F64)[None, None]
    rots = []
    for t in range(cos.shape[0]):
        rotated, _ = apply_rotary_pos_emb(eye, eye, cos[t : t + 1], sin[t : t + 1], unsqueeze_dim=0)
        rots.append(rotated[0, 0].T)  # column j = R_t e_j
    r_bar = sum(rots) / len(rots)
    out = torch.zeros(batch, hkv, n, dtype=F64)
    for b in range(batch):
        for kv in range(hkv):
            per_head = []
            for gi in range(groups):
                h = kv * groups + gi
                mu = sum(qpre[b, h, i] for i in range(m)) / m
                sigma = sum(torch.outer(qpre[b, h, i] - mu, qpre[b, h, i] - mu) for i in range(m)) / m
                mu_bar, sigma_bar = r_bar @ mu, r_bar @ sigma @ r_bar.T
                z = {}
                for j in range(n):
                    if valid[b, kv, j]:
                        kj = k[b, kv, j]
                        z[j] = scaling * float(mu_bar @ kj) + 0.5 * scaling**2 * float(kj @ sigma_bar @ kj)
                top = max(z.values())
                total = sum(math.exp(x - top) for x in z.values())
                per_head.append({j: math.exp(x - top) / total for j, x in z.items()})
            for j in range(n):
                if not valid[b, kv, j]:
                    out[b, kv, j] = -math.inf
                    continue
                a = sum(p[j] for p in per_head) / groups
                out[b, kv, j] = (a + eps) * float(v[b, kv, j].norm())
    return out


@pytest.mark.parametrize("groups", [2, 3])
def test_expected_attention_matches_reference(groups):
    g = torch.Generator().manual_seed(30 + groups)
    qpre = torch.randn(2, 2 * groups, 7, 8, generator=g, dtype=F64)
    _, k, v = make(groups=groups, n=18, seed=31)
    rotary = llama_rotary()
    cos, sin = rope_cos_sin(rotary.inv_freq.double(), torch.arange(18, 18 + 16))
    valid = left_padding(2, 2, 18, [0, 3])
    got = expected_attention_scores(qpre, k, v, cos, sin, 8**-0.5, epsilon=1e-2, valid=valid)
    ref = ref_expected(qpre, k, v, cos, sin, 8**-0.5, 1e-2, valid)
    torch.testing.assert_close(got, ref)
    keep, lengths = topk_keep(got, 6, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(ref, 6, valid=valid)
    # batched tables (B, T, D), as a rotary module returns them, give the same
    got_b = expected_attention_scores(
        qpre,
        k,
        v,
        cos[None].expand(2, -1, -1),
        sin[None].expand(2, -1, -1),
        8**-0.5,
        epsilon=1e-2,
        valid=valid,
    )
    torch.testing.assert_close(got_b, got)


def test_expected_attention_single_query_single_position_is_true_attention():
    """Σ = 0 and one future position: the expectation is the attention of that rotated query."""
    g = torch.Generator().manual_seed(8)
    qpre = torch.randn(1, 4, 1, 8, generator=g, dtype=F64)
    _, k, v = make(batch=1, groups=2, n=10)
    rotary = llama_rotary()
    cos, sin = rope_cos_sin(rotary.inv_freq.double(), torch.tensor([10]))
    q_rot, _ = apply_rotary_pos_emb(qpre, qpre, cos, sin, unsqueeze_dim=0)
    true = pool_gqa(
        torch.softmax(torch.einsum("bhd,bhnd->bhn", q_rot[:, :, 0], k.repeat_interleave(2, 1)) * 0.3, -1), 2
    )
    got = expected_attention_scores(qpre, k, v, cos, sin, 0.3, use_value_norm=False)
    torch.testing.assert_close(got, true)


# ---------------------------------------------------------------------------- CriticalKV


def ref_out_norms(values, w_o, hq):
    batch, hkv, n, d = values.shape
    norms = torch.zeros(batch, hq, n, dtype=F64)
    for b in range(batch):
        for h in range(hq):
            for j in range(n):
                norms[b, h, j] = float(
                    (w_o[:, h * d : (h + 1) * d] @ values[b, h // (hq // hkv), j]).abs().sum()
                )
    return norms


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_critical_reweight_matches_reference(groups):
    q, k, v = make(groups=groups, n=14, seed=40 + groups)
    g = torch.Generator().manual_seed(41)
    w_o = torch.randn(12, 2 * groups * 8, generator=g, dtype=F64)
    valid = left_padding(2, 2, 14, [2, 0])
    norms = ref_out_norms(v, w_o, 2 * groups)
    # per-KV-head scores: (a + ε) · mean_g ‖W_oʰ v‖₁
    a = snapkv_scores(q, k, 0.3, window=4, valid=valid)
    got = critical_reweight(a, v, w_o, 2, 8, epsilon=1e-3, chunk=5, valid=valid)
    ref = torch.full((2, 2, 14), -math.inf, dtype=F64)
    for b in range(2):
        for kv in range(2):
            for j in range(14):
                if valid[b, kv, j]:
                    mean_norm = sum(float(norms[b, kv * groups + x, j]) for x in range(groups)) / groups
                    ref[b, kv, j] = (float(a[b, kv, j]) + 1e-3) * mean_norm
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(critical_reweight(a, v, w_o, 2, 8, epsilon=1e-3, chunk=1000, valid=valid), got)
    # per-query-head scores: mean_g (a_h + ε) · ‖W_oʰ v‖₁
    a_q = window_attention(q, k, 0.3, valid=valid).sum(2)
    got_q = critical_reweight(a_q, v, w_o, 2, 8, epsilon=1e-3, valid=valid)
    for b in range(2):
        for kv in range(2):
            for j in range(14):
                hs = range(kv * groups, (kv + 1) * groups)
                expect = sum((float(a_q[b, h, j]) + 1e-3) * float(norms[b, h, j]) for h in hs) / groups
                if valid[b, kv, j]:
                    assert math.isclose(float(got_q[b, kv, j]), expect, rel_tol=1e-9)
                else:
                    assert got_q[b, kv, j] == -math.inf


def ref_two_stage(attn, out, count, first, prot, valid):
    n = len(attn)
    idx = [j for j in range(n) if valid[j]]
    p = [j for j in idx if prot[j]]
    if count <= len(p):
        return sorted(sorted(p)[len(p) - count :])
    n1 = math.floor(first * count)
    others = sorted((j for j in idx if not prot[j]), key=lambda j: (-attn[j], j))
    stage1 = set(p) | set(others[: max(n1 - len(p), 0)])
    rest = sorted((j for j in idx if j not in stage1), key=lambda j: (-out[j], j))
    return sorted(stage1 | set(rest[: max(min(count, len(idx)) - len(stage1), 0)]))


def test_critical_two_stage_select_matches_reference():
    g = torch.Generator().manual_seed(50)
    attn = torch.randint(0, 6, (3, 2, 20), generator=g).double()  # many ties
    out = torch.randint(0, 6, (3, 2, 20), generator=g).double()
    valid = left_padding(3, 2, 20, [0, 4, 1])
    prot = protected_mask(3, 2, 20, sinks=1, recent=3, valid=valid)
    counts = torch.tensor([[9, 2], [12, 7], [3, 30]])
    keep, lengths = critical_two_stage_select(attn, out, counts, first_stage=0.5, protected=prot, valid=valid)
    for b in range(3):
        for h in range(2):
            expect = ref_two_stage(
                attn[b, h].tolist(),
                out[b, h].tolist(),
                int(counts[b, h]),
                0.5,
                prot[b, h].tolist(),
                valid[b, h].tolist(),
            )
            assert keep[b, h, : lengths[b, h]].tolist() == expect


# ---------------------------------------------------------------------------- protection and top-k


def test_protected_mask_skips_left_padding():
    valid = left_padding(3, 2, 10, [0, 3, 9])
    valid[0, 1, 5] = False  # a hole in the middle (per-head layouts)
    mask = protected_mask(3, 2, 10, sinks=2, recent=3, valid=valid)
    for b in range(3):
        for h in range(2):
            pos = [j for j in range(10) if valid[b, h, j]]
            expect = set(pos[:2]) | set(pos[-3:])
            assert {j for j in range(10) if mask[b, h, j]} == expect
    assert protected_mask(1, 1, 5, sinks=1, recent=1).tolist() == [[[True, False, False, False, True]]]
    with pytest.raises(ValueError):
        protected_mask(1, 1, 5, sinks=-1)


@pytest.mark.parametrize("seed", range(4))
def test_topk_keep_matches_reference_with_ties_protection_and_padding(seed):
    g = torch.Generator().manual_seed(100 + seed)
    scores = torch.randint(0, 4, (3, 4, 15), generator=g).float()  # heavy ties
    scores[0, 0, 3] = float("nan")
    valid = torch.rand(3, 4, 15, generator=g) > 0.2  # arbitrary holes
    prot = (torch.rand(3, 4, 15, generator=g) > 0.8) & valid
    counts = torch.randint(0, 16, (3, 4), generator=g)
    keep, lengths = topk_keep(scores, counts, protected=prot, valid=valid)
    assert kept(keep, lengths) == ref_keep_all(scores, counts, prot, valid)
    assert torch.equal(lengths, torch.minimum(counts, valid.sum(-1)))
    for b in range(3):
        for h in range(4):
            row = keep[b, h]
            length = int(lengths[b, h])
            assert row.tolist() == sorted(row.tolist())  # ascending, padded with the last kept index
            assert (row[length:] == (row[length - 1] if length else 0)).all()
            if length >= int(prot[b, h].sum()):
                assert set(torch.nonzero(prot[b, h]).flatten().tolist()) <= set(row[:length].tolist())
            assert valid[b, h, row[:length]].all()


def test_topk_keep_tie_rule_and_protected_overflow():
    keep, lengths = topk_keep(torch.ones(1, 1, 6), 3)
    assert keep.tolist() == [[[0, 1, 2]]]  # ties: lower position first
    prot = torch.tensor([[[True, True, False, False, True, True]]])
    keep, _ = topk_keep(torch.arange(6.0)[None, None], 3, protected=prot)
    assert keep.tolist() == [[[1, 4, 5]]]  # fewer slots than protected: the most recent protected
    keep, lengths = topk_keep(torch.zeros(2, 1, 4), torch.tensor([0, 2]))
    assert lengths.tolist() == [[0], [2]] and keep.tolist() == [[[0, 0]], [[0, 1]]]
    with pytest.raises(ValueError):
        topk_keep(torch.zeros(1, 1, 4), -1)


def test_padding_never_kept_ahead_of_valid_entries():
    scores = torch.full((1, 2, 8), -5.0)
    valid = left_padding(1, 2, 8, [5])
    scores[~valid] = 100.0  # even if a caller forgot to mask them
    keep, lengths = topk_keep(scores, 6, valid=valid)
    assert lengths.tolist() == [[3, 3]]
    assert keep[..., :3].tolist() == [[[5, 6, 7], [5, 6, 7]]]
