"""CriticalKV's output-aware reweighting and two-stage selection against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.core.scoring import window_attention
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.eviction.criticalkv import critical_reweight, critical_two_stage_select
from kvfold.methods.eviction.snapkv import snapkv_scores
from tests.methods.core.references import F64, left_padding, make


def ref_out_norms(values, w_o, hq):
    batch, hkv, n, d = values.shape
    norms = torch.zeros(batch, hq, n, dtype=F64)
    for b in range(batch):
        for h in range(hq):
            for j in range(n):
                norms[b, h, j] = float((w_o[:, h * d : (h + 1) * d] @ values[b, h // (hq // hkv), j]).abs().sum())
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
