"""Budget resolution, layer schedules and AdaKV head allocation."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.core.budgets import (
    adakv_head_budgets,
    apportion,
    cosine_layer_budgets,
    pyramid_layer_budgets,
    uniform_layer_budgets,
)
from kvfold.methods.core.selection import protected_mask, topk_keep

# ---------------------------------------------------------------------------- layer schedules


def test_apportion_sums_and_bounds():
    assert apportion([1, 1, 1], 10) == [4, 3, 3]  # largest remainder, ties to the lower index
    got = apportion([10, 1, 1, 0], 40, minimum=3, maximum=20)
    assert sum(got) == 40 and min(got) >= 3 and max(got) <= 20 and got[0] == 20
    assert apportion([0, 0], 5) == [3, 2]
    with pytest.raises(ValueError):
        apportion([1, 1], 10, minimum=6)
    with pytest.raises(ValueError):
        apportion([1, 1], 10, maximum=4)
    with pytest.raises(ValueError):
        apportion([1, 0], 10, maximum=6)  # the zero-weight part can never grow


def test_uniform_layer_budgets():
    assert uniform_layer_budgets(64, 3) == [64, 64, 64]


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


@pytest.mark.parametrize("avg,layers,ratio", [(100, 30, 0.2), (10, 5, 0.5), (7, 12, 0.1)])
def test_cosine_decays_with_exact_total(avg, layers, ratio):
    got = cosine_layer_budgets(avg, layers, min_ratio=ratio, min_budget=2)
    assert sum(got) == avg * layers
    assert all(a >= b for a, b in zip(got, got[1:], strict=False))
    assert min(got) >= 2
    if avg >= 100:  # no clamping: first/last follow 2·avg/(1+r) and 2·r·avg/(1+r)
        assert abs(got[0] - 2 * avg / (1 + ratio)) < 1
        assert abs(got[-1] - 2 * ratio * avg / (1 + ratio)) < 1


def test_cosine_respects_minimum_and_context():
    got = cosine_layer_budgets(40, 10, min_ratio=0.05, context_tokens=60, min_budget=20)
    assert sum(got) == 400 and min(got) >= 20 and max(got) <= 60


# ---------------------------------------------------------------------------- AdaKV


def ref_adakv(scores, budget, alpha, prot, valid):
    """Loops: per-head floors, then the joint top over the layer's remaining entries."""
    batch, heads, n = scores.shape
    counts = torch.zeros(batch, heads, dtype=torch.long)
    sets = []
    for b in range(batch):
        floors, chosen = [], []
        for h in range(heads):
            pos = [j for j in range(n) if valid[b, h, j]]
            p = [j for j in pos if prot[b, h, j]]
            floor = min(len(p) + math.floor(alpha * max(budget - len(p), 0)), budget, len(pos))
            order = sorted(
                pos, key=lambda j, h=h: (0, -j) if prot[b, h, j] else (1, -float(scores[b, h, j]), j)
            )
            floors.append(floor)
            chosen.append(set(order[:floor]))
        pool = [(h, j) for h in range(heads) for j in range(n) if valid[b, h, j] and j not in chosen[h]]
        pool.sort(
            key=lambda e: (
                (0, -(e[0] * n + e[1]))
                if prot[b, e[0], e[1]]
                else (1, -float(scores[b, e[0], e[1]]), e[0], e[1])
            )
        )
        for h, j in pool[: heads * budget - sum(floors)]:
            chosen[h].add(j)
        for h in range(heads):
            counts[b, h] = len(chosen[h])
        sets.append([sorted(c) for c in chosen])
    return counts, sets


@pytest.mark.parametrize("alpha,budget", [(0.2, 6), (0.0, 4), (0.5, 9), (1.0, 5)])
def test_adakv_matches_reference(alpha, budget):
    g = torch.Generator().manual_seed(int(alpha * 10) + budget)
    scores = torch.randint(0, 8, (2, 4, 20), generator=g).float() + torch.rand(2, 4, 1, generator=g) * 3
    valid = torch.ones(2, 4, 20, dtype=torch.bool)
    valid[1, :, :5] = False  # left padding in row 1
    prot = protected_mask(2, 4, 20, sinks=1, recent=2, valid=valid)
    counts = adakv_head_budgets(scores, budget, alpha=alpha, protected=prot, valid=valid)
    ref_counts, ref_sets = ref_adakv(scores, budget, alpha, prot, valid)
    assert torch.equal(counts, ref_counts)
    assert counts.sum(-1).tolist() == [4 * budget, 4 * budget]
    keep, lengths = topk_keep(scores, counts, protected=prot, valid=valid)
    for b in range(2):
        for h in range(4):
            row = keep[b, h, : lengths[b, h]].tolist()
            assert row == ref_sets[b][h]  # topk_keep reproduces the joint selection
            assert set(torch.nonzero(prot[b, h]).flatten().tolist()) <= set(row)  # protected kept
            assert valid[b, h, row].all()
    floor = 3 + math.floor(alpha * (budget - 3))
    assert (counts >= floor).all()
    if alpha == 1.0:
        assert (counts == budget).all()


def test_adakv_moves_budget_to_peaked_heads():
    scores = torch.zeros(1, 2, 10)
    scores[0, 0] = 1.0  # head 0 has everything to keep, head 1 nothing
    counts = adakv_head_budgets(scores, 4, alpha=0.25)
    assert counts.tolist() == [[7, 1]]


def test_adakv_caps_by_valid_entries_and_per_row_budgets():
    scores = torch.rand(2, 3, 6)
    valid = torch.ones(2, 3, 6, dtype=torch.bool)
    valid[0, 0, :4] = False  # head 0 of row 0 has only 2 entries
    counts = adakv_head_budgets(scores, torch.tensor([4, 2]), alpha=0.2, valid=valid)
    assert (counts <= valid.sum(-1)).all()
    assert counts.sum(-1).tolist() == [12, 6]
    counts = adakv_head_budgets(scores, torch.tensor([5, 2]), alpha=0.2, valid=valid)
    assert counts.sum(-1).tolist() == [14, 6]  # row 0 has only 14 valid entries for 15 slots
    counts = adakv_head_budgets(scores, 100, valid=valid)  # more budget than entries: keep all
    assert torch.equal(counts, valid.sum(-1))
    with pytest.raises(ValueError):
        adakv_head_budgets(scores, 3, alpha=1.5)
