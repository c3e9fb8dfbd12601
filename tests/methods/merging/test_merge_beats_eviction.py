"""Merging beats its own eviction on constructed layers where the answer is known exactly.

Each folder runs through its own ``fold`` (ZSMerge through its offline fold, Algorithm 1) on a layer
built so that the merged cache reproduces the full cache's attention output exactly, while the
same selection with the evicted entries dropped does not. Replacing a method's merge step by
eviction makes its test here fail (the mutation run of tools/mutate_merging.py).

The layer: pairs of entries that share a key (unit basis vectors, so every cosine is exactly 0
or 1), an evicted entry right before its kept twin. With every pair's key shared, folding the
twin's value into its carrier as a mean keeps every query's output when the carrier's mass
counts both (KeepKV's votes, ZSMerge's ``log w``), and for mass-free means (D2O, KVMerger)
as well, because every pair loses the same half of its mass.
"""

from __future__ import annotations

import math

import torch

from kvfold.methods import CompressionContext
from kvfold.methods.merging.cam import CaM
from kvfold.methods.merging.d2o import D2OMerge
from kvfold.methods.merging.kvmerger import KVMerger
from kvfold.methods.merging.zsmerge.merge import BudgetSplit, fold_layers
from kvfold.runtime.budget import Budget
from kvfold.runtime.folded_layer import FoldedLayer

F64 = torch.float64
DIM = 4
PAIRS = 3


def attend(queries: torch.Tensor, layer: FoldedLayer) -> torch.Tensor:
    """``softmax(q·k/√D + β) v`` of every query ``(Q, D)`` on row 0, head 0 of a layer."""
    keys, values, beta, _ = layer.padded()
    logits = queries @ keys[0, 0].mT / math.sqrt(DIM) + beta[0, 0].to(F64)
    return torch.softmax(logits, -1) @ values[0, 0]


def twin_layer(values: torch.Tensor) -> FoldedLayer:
    """``2·PAIRS`` entries: evicted twin ``2i`` and kept carrier ``2i+1`` share the key ``e_i``;
    one prefill query (zero, so the window attention is uniform) is captured."""
    keys = torch.zeros(1, 1, 2 * PAIRS, DIM, dtype=F64)
    for i in range(PAIRS):
        keys[0, 0, 2 * i, i] = keys[0, 0, 2 * i + 1, i] = 1.0
    layer = FoldedLayer()
    layer.update(keys, values.view(1, 1, 2 * PAIRS, -1).to(F64))
    layer.captured_queries = torch.zeros(1, 1, 1, DIM, dtype=F64)
    return layer


def fold(folder, layer: FoldedLayer) -> CompressionContext:
    """The folder's own path, the selector having kept the carriers (odd slots)."""
    ctx = CompressionContext(model=torch.nn.Module(), cache=None, input_ids=torch.zeros(1, 2 * PAIRS, dtype=torch.long),
                             attention_mask=None, budget=Budget.parse(PAIRS))  # fmt: skip
    keep = torch.arange(1, 2 * PAIRS, 2).view(1, 1, PAIRS)
    folder.fold(0, layer, keep, torch.tensor([[PAIRS]]), None, ctx)
    return ctx


def evicted(layer: FoldedLayer) -> FoldedLayer:
    """The same selection with the twins dropped: the base eviction."""
    keys, values, beta, _ = layer.padded()
    out = FoldedLayer()
    out.update(keys[:, :, 1::2], values[:, :, 1::2])
    return out


def queries(count: int = 16) -> torch.Tensor:
    return torch.randn(count, DIM, generator=torch.Generator().manual_seed(0), dtype=F64) * 2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_d2o_merge_reproduces_the_full_output_that_its_eviction_loses():
    values = torch.randn(2 * PAIRS, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    full = twin_layer(values)
    q = queries()
    reference = attend(q, full)
    base = evicted(full)
    ctx = fold(D2OMerge(), full)
    assert ctx.report["d2o"][0]["merged"] == PAIRS
    # u = cos = 1: weights exp(1) for carrier and twin, the mean of the pair (§3.3)
    torch.testing.assert_close(full.padded()[1][0, 0], (values[0::2] + values[1::2]) / 2)
    assert rel(attend(q, full), reference) < 1e-12
    assert rel(attend(q, base), reference) > 0.05


def test_kvmerger_folder_reproduces_the_full_output_that_its_eviction_loses():
    values = torch.randn(2 * PAIRS, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    full = twin_layer(values)
    q = queries()
    reference = attend(q, full)
    base = evicted(full)
    ctx = fold(KVMerger(window=1, sigma=1.0), full)
    assert ctx.report["kvmerger"][0]["merged"] == PAIRS
    # a run of two equal keys (cos 1 ≥ 0.8); Gaussian weight exp(0) = 1 around the kept pivot
    torch.testing.assert_close(full.padded()[1][0, 0], (values[0::2] + values[1::2]) / 2)
    assert rel(attend(q, full), reference) < 1e-12
    assert rel(attend(q, base), reference) > 0.05


def test_cam_restores_the_output_its_eviction_loses_in_the_exact_expected_case():
    """Uniform window attention: every twin has the carriers' attention, p_e = 1 (merged for
    sure); with ``merge=1`` its value is added to the next kept entry, its carrier. Twins that
    cancel their carriers (``v_e = −v_c``) make the full output 0 for every query; CaM's merged
    values are then all 0 too (exact), while the eviction keeps the carriers' values."""
    carriers = torch.randn(PAIRS, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    values = torch.stack([-carriers, carriers], dim=1).reshape(2 * PAIRS, 3)
    full = twin_layer(values)
    q = queries()
    base_error = float(attend(q, evicted(full)).norm())
    ctx = fold(CaM(merge=1, window=1), full)
    assert ctx.report["cam"][0]["merged"] == PAIRS
    assert float(full.padded()[1].abs().max()) == 0.0  # v_c + v_e = 0
    assert float(attend(q, full).norm()) == 0.0 < 0.1 < base_error


def _zs_layer() -> tuple[FoldedLayer, torch.Tensor, torch.Tensor]:
    """12 tokens: two context tokens with high scores (keys e_2, e_3), two groups of low-scored
    tokens sharing a key each (group A at even positions < 10: e_0; group B at odd ones: e_1),
    the last two tokens in the proximity part."""
    n = 12
    keys = torch.zeros(1, 1, n, DIM, dtype=F64)
    scores = torch.zeros(1, 1, n, dtype=F64)
    low = iter(torch.linspace(0.09, 0.01, 6).tolist())
    for pos in range(n):
        if pos in (2, 3):
            keys[0, 0, pos, pos] = 1.0
            scores[0, 0, pos] = 10.0 + pos
        elif pos >= 10:
            keys[0, 0, pos, 2:] = 0.5
        else:
            keys[0, 0, pos, pos % 2] = 1.0
            scores[0, 0, pos] = {0: 0.1, 1: 0.2}.get(pos, next(low) if pos > 3 else 0.0)
    values = torch.randn(1, 1, n, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    layer = FoldedLayer()
    layer.update(keys, values)
    return layer, scores, values


def test_zsmerge_residual_slots_reproduce_the_full_output_that_its_eviction_loses():
    """Algorithm 1 on the layer above, budget 6 = B_p 2 + B_c 2 + B_r 2: the first two victims
    (one of each group) open the slots, every later victim joins the slot of its own key (eq. 6),
    so each slot is the mean of its group with ``w`` = the group's size and β = log w (α = 1,
    eq. 8): the full output for every query. ``residual=0`` (B_c 4, same scores) evicts."""
    full, scores, values = _zs_layer()
    q = queries()
    reference = attend(q, full)
    merged, _, _ = _zs_layer()
    fold_layers([merged], [scores], BudgetSplit(*(torch.tensor([x]) for x in (2, 2, 2))), 1.0, "merge")
    base, _, _ = _zs_layer()
    fold_layers([base], [scores], BudgetSplit(*(torch.tensor([x]) for x in (2, 4, 0))), 1.0, "merge")
    keys, new_values, beta, lengths = merged.padded()
    assert lengths.tolist() == [[6]] and base.padded()[3].tolist() == [[6]]
    # the two slots after the kept tokens: group A (positions 0, 4, 6, 8) and B (1, 5, 7, 9)
    torch.testing.assert_close(beta[0, 0, 4:].exp(), torch.tensor([4.0, 4.0]))
    torch.testing.assert_close(new_values[0, 0, 4], values[0, 0, [0, 4, 6, 8]].mean(0))
    torch.testing.assert_close(new_values[0, 0, 5], values[0, 0, [1, 5, 7, 9]].mean(0))
    assert rel(attend(q, merged), reference) < 1e-6  # β is stored in float32
    assert rel(attend(q, base), reference) > 0.05
