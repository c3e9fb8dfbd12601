"""AdaKV's head budgets against a loop reference (floors, then one joint top over the layer)."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.core.selection import protected_mask, topk_keep
from kvfold.methods.eviction.adakv import adakv_head_budgets


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
            order = sorted(pos, key=lambda j, h=h: (0, -j) if prot[b, h, j] else (1, -float(scores[b, h, j]), j))
            floors.append(floor)
            chosen.append(set(order[:floor]))
        pool = [(h, j) for h in range(heads) for j in range(n) if valid[b, h, j] and j not in chosen[h]]
        pool.sort(
            key=lambda e: (
                (0, -(e[0] * n + e[1])) if prot[b, e[0], e[1]] else (1, -float(scores[b, e[0], e[1]]), e[0], e[1])
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
