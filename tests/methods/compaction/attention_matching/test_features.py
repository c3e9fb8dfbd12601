"""The features and statistics of a group of Attention Matching problems (:mod:`.features`):
the max-shifted exp-scores of App. A.2 and the statistics of highest-attention selection (§3.3)."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.compaction.attention_matching import features, solve
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from kvfold.runtime import exact_products
from kvfold.runtime.live_bytes import LiveBytes


def test_block_statistics_a_few_problems_at_a_time_equal_all_at_once(monkeypatch):
    """Highest-attention selection's statistics (§3.3, App. F.1) bit for bit whatever the number of
    problems whose features are held at once."""
    torch.manual_seed(1)
    keys, values = torch.randn(7, 40, 8), torch.randn(7, 40, 8)
    beta0 = torch.zeros(7, 40)
    beta0[:, :3] = float("-inf")
    queries, valid = torch.randn(7, 300, 8), torch.rand(7, 300) > 0.1
    scaling = torch.full((7,), 8**-0.5)
    monkeypatch.setattr(features, "STATISTICS_BYTES", 1 << 40)
    together = features.block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    monkeypatch.setattr(features, "STATISTICS_BYTES", 2 * 64 * 40 * 4)  # two problems at a time
    apart = features.block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    for a, b in zip(together, apart, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("keys_by", ["highest", "given", "omp"])
def test_16_bit_queries_and_keys_fit_as_their_float32_upcast(monkeypatch, keys_by):
    """Where :func:`exact_products.applies` (a GPU; forced here) a group keeps bfloat16 queries and keys and
    forms their logits with float32 sums: the fit is the upcast operands' (on the CPU, where the product
    converts them, bit for bit), while the values, β and every statistic stay float32."""
    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 48, 16, generator=gen).bfloat16()
    values = torch.randn(2, 3, 48, 16, generator=gen).bfloat16()
    log_mass = torch.zeros(2, 3, 48)
    log_mass[..., :2] = -math.inf
    queries = (2 * torch.randn(2, 3, 200, 16, generator=gen)).bfloat16()
    valid = torch.rand(2, 3, 200, generator=gen) > 0.05
    given = torch.stack([torch.randperm(46, generator=gen)[:20].sort().values + 2 for _ in range(6)]).reshape(2, 3, 20)
    config = FitConfig(keys="omp" if keys_by == "omp" else "highest", query_block=64)
    args = (keys, values, log_mass, queries, valid, torch.full((2, 3), 20), 16**-0.5, config)
    monkeypatch.setattr(solve, "_fused_statistics_apply", lambda *a: False)  # a GPU's statistics, by blocks
    operands = []
    product = exact_products.float32_bmm
    monkeypatch.setattr(exact_products, "float32_bmm", lambda a, b: operands.append(a.dtype) or product(a, b))
    fits = {}
    for forced in (False, True):
        monkeypatch.setattr(exact_products, "FORCED", forced)
        fits[forced] = fit_problems(*args, given=given if keys_by == "given" else None)
    assert operands and set(operands) == {torch.bfloat16}  # only the forced fit took 16-bit operands
    upcast, sixteen = fits[False], fits[True]
    assert sixteen.values.dtype == sixteen.log_mass.dtype == torch.float32
    for name in ("index", "lengths", "log_mass", "values", "mass_error", "output_error"):
        assert torch.equal(getattr(sixteen, name), getattr(upcast, name)), name


def test_a_group_keeps_16_bit_operands_only_where_exact_products_apply(monkeypatch):
    """The group's queries and keys stay bfloat16 when forced (half a group's query bytes) and are float32
    otherwise, and a float32 or mixed pair is never kept; values, β and scales are float32 either way."""
    keys, values = torch.randn(2, 10, 8).bfloat16(), torch.randn(2, 10, 8).bfloat16()
    log_mass, queries, valid = torch.zeros(2, 10), torch.randn(2, 30, 8).bfloat16(), torch.ones(2, 30, dtype=torch.bool)
    scale = torch.full((2,), 0.3)
    for forced, kept in ((True, torch.bfloat16), (False, torch.float32), (None, torch.float32)):
        monkeypatch.setattr(exact_products, "FORCED", forced)
        group = features.Group.prepare(keys, values, log_mass, queries, valid, scale, keys.clone())
        assert group.queries.dtype == group.keys.dtype == group.compact_keys.dtype == kept
        assert group.values.dtype == group.beta0.dtype == group.scaling.dtype == group.dtype == torch.float32
    monkeypatch.setattr(exact_products, "FORCED", True)
    mixed = features.Group.prepare(keys, values, log_mass, queries.float(), valid, scale)
    assert mixed.queries.dtype == mixed.keys.dtype == torch.float32
    halves = features.Group.prepare(keys, values, log_mass, queries.half(), valid, scale)
    assert halves.queries.dtype == halves.keys.dtype == torch.float32


def test_the_attention_statistics_hold_one_block_of_features_at_a_time():
    """The previous block's features are freed before the next block's are made: one block held, not two
    (on a GPU a block is up to 512 MB)."""
    gen = torch.Generator().manual_seed(0)
    problems, entries, dim, queries, block = 2, 512, 8, 256, 64
    keys, values = (torch.randn(problems, entries, dim, generator=gen) for _ in range(2))
    query = torch.randn(problems, queries, dim, generator=gen)
    valid, scaling = torch.ones(problems, queries, dtype=torch.bool), torch.full((problems,), 0.3)
    features_block = problems * block * entries * 4
    with torch.inference_mode(), LiveBytes() as ledger:
        features.block_statistics(
            keys, values, torch.zeros(problems, entries), query, valid, scaling, block=block, budget=features_block
        )
    assert ledger.peak < 1.5 * features_block  # 1.13 blocks; 2.11 with the last block kept


@pytest.mark.parametrize(("fit_beta", "bound"), [(True, 4.8), (False, 4.1)])
def test_a_streamed_fit_holds_one_block_of_selected_features_at_a_time(fit_beta, bound):
    """The normal equations' blocks of ``Φ_S`` (β's pass, then the values') are freed before the next block's
    are made. Peaks in blocks: 4.29 with β fitted (5.27 with the last block kept), 3.69 without (4.49)."""
    gen = torch.Generator().manual_seed(0)
    problems, entries, dim, queries, kept, block = 2, 256, 8, 1536, 32, 512
    keys, values = (torch.randn(problems, entries, dim, generator=gen) for _ in range(2))
    query = torch.randn(problems, queries, dim, generator=gen)
    given = torch.stack([torch.randperm(entries, generator=gen)[:kept].sort().values for _ in range(problems)])
    config = FitConfig(
        query_block=block, statistics_rows=8, statistics_bytes=1 << 30, group_bytes=1 << 30, fit_beta=fit_beta
    )
    with torch.inference_mode(), LiveBytes() as ledger:
        fit_problems(
            keys, values, torch.zeros(problems, entries), query, torch.ones(problems, queries, dtype=torch.bool),
            torch.full((problems,), kept), 0.3, config, given=given,
        )  # fmt: skip
    assert ledger.peak < bound * problems * block * kept * 4
