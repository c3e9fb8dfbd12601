"""The least-squares pieces of Attention Matching's fits (:mod:`.solvers`): the symmetric products
of the normal equations (Zweiger et al. 2026 §3.2, eq. 4) computed by blocks equal the plain ones."""

from __future__ import annotations

import pytest
import torch

from kvfold.methods.compaction.attention_matching import solve, solvers
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems

F64 = torch.float64


@pytest.mark.parametrize("t", [5, 16, 17, 37, 64])
def test_symmetric_product_by_blocks_equals_the_plain_product(t):
    torch.manual_seed(t)
    phi = torch.rand(3, 50, t, dtype=F64)
    weight = torch.rand(3, 50, 1, dtype=F64)
    plain = (weight * phi).mT @ phi
    blocked = solvers.symmetric_product(weight * phi, phi, block=8)
    torch.testing.assert_close(blocked, plain, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(solvers.symmetric_product(phi, phi, block=8), phi.mT @ phi, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_a_wide_fit_by_blocks_equals_the_fit_with_plain_products(monkeypatch, dtype):
    """``am_fit``'s β and values on given keys (t = 40 of 48, wider than two blocks of 8)."""
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 48, 8, dtype=dtype)
    values = torch.randn(2, 3, 48, 8, dtype=dtype)
    log_mass = torch.zeros(2, 3, 48)
    queries = torch.randn(2, 3, 200, 8, dtype=dtype)
    valid = torch.ones(2, 3, 200, dtype=torch.bool)
    given = torch.stack([torch.randperm(48)[:40].sort().values for _ in range(6)]).reshape(2, 3, 40)
    config = FitConfig(beta_min=0.0, mass_weight="relative", query_block=64)
    args = (keys, values, log_mass, queries, valid, torch.full((2, 3), 40), 8**-0.5, config)
    monkeypatch.setattr(solve, "symmetric_product", lambda left, right: left.mT @ right)
    plain = fit_problems(*args, given=given)
    monkeypatch.setattr(solve, "symmetric_product", lambda left, right: solvers.symmetric_product(left, right, 8))
    blocked = fit_problems(*args, given=given)
    assert torch.equal(blocked.index, plain.index)
    torch.testing.assert_close(blocked.output_error, plain.output_error, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(blocked.mass_error, plain.mass_error, rtol=1e-4, atol=1e-6)
    if dtype == F64:  # in float32 the value solve (40 unknowns, 8-dim queries) amplifies rounding
        torch.testing.assert_close(blocked.values, plain.values, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(blocked.log_mass, plain.log_mass, rtol=1e-9, atol=1e-10)


def test_block_statistics_a_few_problems_at_a_time_equal_all_at_once(monkeypatch):
    """Highest-attention selection's statistics (§3.3, App. F.1) bit for bit whatever the number of
    problems whose features are held at once."""
    torch.manual_seed(1)
    keys, values = torch.randn(7, 40, 8), torch.randn(7, 40, 8)
    beta0 = torch.zeros(7, 40)
    beta0[:, :3] = float("-inf")
    queries, valid = torch.randn(7, 300, 8), torch.rand(7, 300) > 0.1
    scaling = torch.full((7,), 8**-0.5)
    monkeypatch.setattr(solve, "STATISTICS_BYTES", 1 << 40)
    together = solve._block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    monkeypatch.setattr(solve, "STATISTICS_BYTES", 2 * 64 * 40 * 4)  # two problems at a time
    apart = solve._block_statistics(keys, values, beta0, queries, valid, scaling, block=64)
    for a, b in zip(together, apart, strict=True):
        assert torch.equal(a, b)
