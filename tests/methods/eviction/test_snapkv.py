"""SnapKV's scores against a loop reference, and PyramidKV's layer budgets."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.core.selection import protected_mask, topk_keep
from kvfold.methods.eviction.snapkv import pyramid_layer_budgets, snapkv_scores
from tests.methods.core.references import F64, kept, left_padding, make, ref_keep_all, ref_probs

# ---------------------------------------------------------------------------- SnapKV


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
                    neigh = [votes[x] for x in range(j - kernel // 2, j + kernel // 2 + 1) if lo_seg <= x < hi_seg]
                    per_head.append(max(neigh) if pooling == "max" else sum(neigh) / kernel)
                out[b, kv, j] = sum(per_head) / groups
                if valid is not None and not valid[b, kv, j]:
                    out[b, kv, j] = -math.inf
    return out


@pytest.mark.parametrize("groups,pooling,kernel", [(1, "max", 5), (2, "max", 3), (3, "avg", 5), (2, "avg", 1)])
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


# ---------------------------------------------------------------------------- PyramidKV budgets


@pytest.mark.parametrize("avg,layers,window", [(100, 30, 32), (37, 7, 8), (64, 32, 0), (33, 4, 32)])
def test_pyramid_is_arithmetic_decreasing_with_exact_total(avg, layers, window):
    got = pyramid_layer_budgets(avg, layers, beta=20, window=window)
    assert sum(got) == avg * layers
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))
    assert min(got) >= max(window, 1)
    outside = avg - window
    smallest = outside / 20
    largest = 2 * outside - smallest
    for layer, value in enumerate(got):  # within rounding of the real-valued schedule
        real = window + largest - layer * (largest - smallest) / (layers - 1)
        assert abs(value - real) < 1


def test_pyramid_caps_at_context_and_degenerate_cases():
    got = pyramid_layer_budgets(300, 8, window=32, context_tokens=400)
    assert sum(got) == 2400 and max(got) <= 400 and got[0] == 400
    assert pyramid_layer_budgets(500, 4, context_tokens=400) == [400] * 4  # keep everything
    assert pyramid_layer_budgets(20, 4, window=32) == [20] * 4  # no room outside the window
    assert pyramid_layer_budgets(50, 1) == [50]
    with pytest.raises(ValueError, match="Budget.count"):
        pyramid_layer_budgets(0.1, 4)
