"""``global:``: one ranking over all layers and heads (KVzip's allocation) for every selector.

Checks: the exact total budget, per-head lengths really stored (memory freed), more entries
where scores are higher, KVzip's own allocation reproduced, and per-layer standardisation of
scores that have no common scale.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from kvfold.methods import ComposedMethod, CompressionContext, Selector, SpecError, build_method
from kvfold.methods.core.budgets import global_head_budgets
from kvfold.methods.eviction.global_budget import GlobalBudget
from kvfold.runtime.budget import Budget
from tests.conftest import CharTokenizer
from tests.methods.eviction.test_eviction import compress, kept_positions, model64, prefill_cache, random_ids

# ---------------------------------------------------------------------------- the allocation


def test_global_head_budgets_rank_every_layer_and_head_together():
    gen = torch.Generator().manual_seed(0)
    layers = [torch.rand(2, 3, 20, generator=gen), torch.rand(2, 2, 30, generator=gen) * 0.5]
    valid = [torch.ones(2, 3, 20, dtype=torch.bool), torch.ones(2, 2, 30, dtype=torch.bool)]
    valid[1][1, :, :10] = False  # row 1 of layer 1 is padded
    protected = [torch.zeros(2, 3, 20, dtype=torch.bool), torch.zeros(2, 2, 30, dtype=torch.bool)]
    protected[0][:, :, 0] = True  # one sink per head in layer 0
    counts = global_head_budgets(layers, torch.tensor([25, 40]), protected, valid)
    for b, total in enumerate((25, 40)):
        assert sum(int(c[b].sum()) for c in counts) == total  # the exact total
        # reference: protected first, then the top scores of all layers and heads together
        pool = []
        for j, (s, ok, p) in enumerate(zip(layers, valid, protected, strict=True)):
            for h in range(s.shape[1]):
                for n in range(s.shape[2]):
                    if ok[b, h, n]:
                        pool.append((1 if p[b, h, n] else 0, float(s[b, h, n]), j, h))
        pool.sort(key=lambda e: (-e[0], -e[1]))
        expected = [torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.long)]
        for _, _, j, h in pool[:total]:
            expected[j][h] += 1
        assert [c[b].tolist() for c in counts] == [e.tolist() for e in expected]


def test_global_head_budgets_give_more_to_the_head_with_higher_scores_and_respect_the_floor():
    flat = torch.full((1, 2, 10), 0.1)
    sharp = torch.full((1, 2, 10), 0.1)
    sharp[0, 1, :6] = 0.9  # layer 1, head 1 holds the six best entries of the cache
    counts = global_head_budgets([flat, sharp], 8)
    assert int(counts[1][0, 1]) == 6  # all six of its best entries
    assert int(counts[1][0, 1]) > 8 // 4  # more than its uniform share (2)
    floored = global_head_budgets([flat, sharp], 8, minimum=1)
    assert all(int(c.min()) >= 1 for c in floored) and sum(int(c.sum()) for c in floored) == 8
    with pytest.raises(ValueError, match="minimum"):
        global_head_budgets([flat], 3, minimum=-1)


# ---------------------------------------------------------------------------- the wrapper


def test_global_snapkv_reaches_the_exact_budget_and_frees_memory_per_head():
    model = model64("llama", num_key_value_heads=3, num_attention_heads=6, num_hidden_layers=3)
    ids = random_ids(2, 160, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    full = prefill_cache(model, ids, mask)
    uniform, cache = full.copy(), full.copy()
    compress(model, uniform, ids, "snapkv[window=4]", 40, mask=mask)
    compress(model, cache, ids, "global:snapkv[window=4]", 40, mask=mask)
    lengths = torch.stack([layer.row_lengths() for _, layer in cache.folded_layers], 1)  # (B, L, H)
    assert lengths.sum((1, 2)).tolist() == [40 * 3 * 3, 40 * 3 * 3]  # budget · H · L per row, exactly
    assert bool((lengths >= 4).all())  # every head keeps at least its window (protected)
    assert len(set(lengths.flatten().tolist())) > 3  # budgets really differ across layers and heads
    assert sum(layer.stored is not None for _, layer in cache.folded_layers) >= 1  # stored per head
    assert cache.nbytes() < full.nbytes() * 0.4  # ≈ 40/160 of the full cache plus block rounding
    assert cache.nbytes() <= uniform.nbytes() * 1.5  # per-head lengths cost little over uniform ones
    for _, layer in cache.folded_layers:  # every kept entry is an unchanged original one
        kept_positions(full.layers[_], layer)


@dataclass
class PlantedScores(Selector):
    """Test selector: random scores in [0, 1), and in [gain, gain + 1) for head 0 of layer 1."""

    name: ClassVar[str] = "planted_scores_for_tests"
    comparable_scores: ClassVar[bool] = True
    gain: float = 10.0

    def score(self, layer_idx, layer, ctx):
        gen = torch.Generator().manual_seed(layer_idx)
        scores = torch.rand(layer.batch_size, layer.num_heads, layer.physical_length, generator=gen)
        if layer_idx == 1:
            scores[:, 0] += self.gain
        return scores


def planted_counts(model, ids, spec_wrappers, budget=12):
    cache = prefill_cache(model, ids)
    ctx = CompressionContext(
        model=model, cache=cache, input_ids=ids, attention_mask=None, budget=Budget.parse(str(budget))
    )
    method = ComposedMethod(spec="test", wrappers=spec_wrappers, selector=PlantedScores(), folder=None)
    with torch.no_grad():
        method.compress(ctx)
    return torch.stack([layer.row_lengths()[0] for _, layer in cache.folded_layers])  # (L, H)


def test_global_puts_more_entries_in_the_head_with_the_higher_scores():
    model = model64("llama", num_key_value_heads=2, num_attention_heads=4, num_hidden_layers=3)
    ids = random_ids(1, 48, seed=3)
    uniform = planted_counts(model, ids, ())
    planted = planted_counts(model, ids, (GlobalBudget(),))
    assert uniform.tolist() == [[12, 12]] * 3
    assert int(planted.sum()) == 12 * 2 * 3  # the same memory in total
    assert int(planted[1, 0]) == 48  # the planted head keeps every entry (its scores beat all others)
    assert int(planted[1, 0]) > int(planted[1, 1]) and int(planted[1, 0]) > int(planted[0].max())
    # zscore per layer: head 0 of layer 1 still stands out within its layer, less against the others
    standardised = planted_counts(model, ids, (GlobalBudget(normalize="zscore"),))
    assert int(standardised.sum()) == 72 and int(standardised[1, 0]) > int(standardised[1, 1])


def test_global_standardises_scores_without_a_common_scale():
    """A layer whose scores are 100× larger gains nothing under ``zscore`` but everything raw."""
    model = model64("llama", num_key_value_heads=2, num_attention_heads=4, num_hidden_layers=2)
    ids = random_ids(1, 40, seed=4)

    @dataclass
    class Scaled(PlantedScores):
        comparable_scores: ClassVar[bool] = False

        def score(self, layer_idx, layer, ctx):
            gen = torch.Generator().manual_seed(7)  # the same scores in both layers, up to scale
            scores = torch.rand(layer.batch_size, layer.num_heads, layer.physical_length, generator=gen)
            return scores * (100.0 if layer_idx == 1 else 1.0)

    def counts(wrapper):
        cache = prefill_cache(model, ids)
        ctx = CompressionContext(model=model, cache=cache, input_ids=ids, attention_mask=None, budget=Budget.parse(10))
        ComposedMethod(spec="t", wrappers=(wrapper,), selector=Scaled(), folder=None).compress(ctx)
        return torch.stack([layer.row_lengths()[0] for _, layer in cache.folded_layers])

    auto, raw = counts(GlobalBudget()), counts(GlobalBudget(normalize="none"))
    assert int(auto.sum()) == int(raw.sum()) == 10 * 2 * 2
    assert abs(int(auto[0].sum()) - int(auto[1].sum())) <= 1  # z-scores: both layers alike, ties aside
    assert int(raw[1].sum()) >= 40 - 2  # raw scores: the 100× layer takes all but the floors of layer 0


def test_global_kvzip_layerwise_reproduces_kvzip_allocation():
    model = model64("llama", num_key_value_heads=2, num_attention_heads=4)
    tok = CharTokenizer()
    ids = torch.tensor([tok("global budgets for every scorer, as kvzip does!").input_ids])
    own, wrapped = prefill_cache(model, ids), prefill_cache(model, ids)
    compress(model, own, ids, "kvzip[chunk=16]", 10, tokenizer=tok)
    compress(model, wrapped, ids, "global[minimum=0]:kvzip[chunk=16,layerwise=true]", 10, tokenizer=tok)
    for (_, a), (_, b) in zip(own.folded_layers, wrapped.folded_layers, strict=True):
        assert a.row_lengths().tolist() == b.row_lengths().tolist()
        torch.testing.assert_close(a.padded()[0], b.padded()[0])


def test_global_options_are_checked():
    with pytest.raises(SpecError, match="normalize"):
        build_method("global[normalize=rank]:snapkv")
    with pytest.raises(SpecError, match="minimum"):
        build_method("global[minimum=-1]:snapkv")
