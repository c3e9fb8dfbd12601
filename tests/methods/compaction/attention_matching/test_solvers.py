"""The least-squares pieces of Attention Matching's fits (:mod:`.solvers`): the symmetric products
of the normal equations (Zweiger et al. 2026 §3.2, eq. 4) computed by blocks equal the plain ones."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.methods.compaction.attention_matching import solve, solvers
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from kvfold.methods.compaction.omp import FeatureRefit, omp_greedy, omp_width

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


def _mixed_width_problems():
    """Four problems of 64 entries and 300 queries (float64) whose given keys number 40, 3, 38 and 12:
    a global budget's heads."""
    torch.manual_seed(3)
    keys, values = torch.randn(4, 64, 8, dtype=F64), torch.randn(4, 64, 8, dtype=F64)
    log_mass = torch.zeros(4, 64, dtype=F64)
    queries, valid = torch.randn(4, 300, 8, dtype=F64), torch.ones(4, 300, dtype=torch.bool)
    widths = [40, 3, 38, 12]
    given = torch.full((4, 40), -1)
    for p, w in enumerate(widths):
        given[p, :w] = torch.randperm(64)[:w].sort().values
    return keys, values, log_mass, queries, valid, widths, given


def test_a_gpu_fit_pads_narrow_problems_into_fewer_groups_and_fits_each_as_alone(monkeypatch):
    """With the accelerator's sizes, problems of widths 40, 3, 38 and 12 (a global budget's heads) are
    fitted in one group where the CPU takes three, and each problem's keys, β and values are what it
    gets fitted alone."""
    keys, values, log_mass, queries, valid, widths, given = _mixed_width_problems()
    fitted = []
    real = solve._fit_group
    monkeypatch.setattr(
        solve,
        "_fit_group",
        lambda group, *a, **k: fitted.append((group.keys.shape[0], k["t_max"])) or real(group, *a, **k),
    )
    results = {}
    for device in ("cpu", "cuda"):
        config = FitConfig(beta_min=0.0, mass_weight="relative").sized(torch.device(device))
        fitted.clear()
        args = (keys, values, log_mass, queries, valid, torch.tensor(widths), 8**-0.5, config, given)
        results[device] = (fit_problems(*args), list(fitted))
    (cpu, cpu_groups), (gpu, gpu_groups) = results["cpu"], results["cuda"]
    assert cpu_groups == [(2, 40), (1, 12), (1, 3)] and gpu_groups == [(4, 40)]  # widths known on the host
    assert gpu.lengths.tolist() == widths
    for p, w in enumerate(widths):
        assert torch.equal(gpu.index[p, :w], cpu.index[p, :w])
        torch.testing.assert_close(gpu.log_mass[p, :w], cpu.log_mass[p, :w], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(gpu.values[p, :w], cpu.values[p, :w], rtol=1e-9, atol=1e-10)
        assert torch.isinf(gpu.log_mass[p, w:]).all()


def test_a_fit_of_mixed_widths_equals_each_problem_fitted_alone():
    """``am_fit`` on given keys of very different widths (a global budget's heads) gives every
    problem what it gets when fitted alone, and each slot past a problem's width stays empty."""
    keys, values, log_mass, queries, valid, widths, given = _mixed_width_problems()
    config = FitConfig(beta_min=0.0, mass_weight="relative")
    together = fit_problems(keys, values, log_mass, queries, valid, torch.tensor(widths), 8**-0.5, config, given)
    assert together.lengths.tolist() == widths
    for p, w in enumerate(widths):
        alone = fit_problems(
            keys[p : p + 1],
            values[p : p + 1],
            log_mass[p : p + 1],
            queries[p : p + 1],
            valid[p : p + 1],
            torch.tensor([w]),
            8**-0.5,
            config,
            given[p : p + 1, :w],
        )
        assert torch.equal(together.index[p, :w], alone.index[0])
        torch.testing.assert_close(together.log_mass[p, :w], alone.log_mass[0], rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(together.values[p, :w], alone.values[0], rtol=1e-9, atol=1e-10)
        assert torch.isinf(together.log_mass[p, w:]).all()


def test_box_nnls_of_a_padded_problem_equals_the_problem_alone():
    """Algorithm 3's step ``1/L`` comes from the used slots: padding a 3-key problem to 40 slots
    (a wider problem's width in the same group) changes nothing, even when ``λ_max(G) < 1``."""
    torch.manual_seed(4)
    phi = torch.rand(1, 200, 3, dtype=F64) * 0.02
    mass = phi.sum(-1) * 1.3
    gram, corr = phi.mT @ phi, (phi.mT @ mass[..., None])[..., 0]
    assert torch.linalg.eigvalsh(gram)[0, -1] < 1
    alone = solvers.box_nnls(gram, corr, torch.ones(1, 3, dtype=torch.bool), lower=1.0, upper=20.0, iters=2, ridge=1e-6)
    padded_gram = torch.zeros(1, 40, 40, dtype=F64)
    padded_gram[:, :3, :3] = gram
    padded_corr = torch.zeros(1, 40, dtype=F64)
    padded_corr[:, :3] = corr
    ok = torch.arange(40)[None] < 3
    padded = solvers.box_nnls(padded_gram, padded_corr, ok, lower=1.0, upper=20.0, iters=2, ridge=1e-6)
    torch.testing.assert_close(padded[:, :3], alone, rtol=1e-12, atol=1e-12)
    assert (padded[:, 3:] == 0).all()


def test_fused_statistics_give_the_fit_of_the_max_shifted_blocks(monkeypatch):
    """``am_fit`` with relative mass weighting: the fused kernel's log-sum-exp shift (``m_i = 1``)
    and App. A.2's max-shift give the same β and values (the fit is a ratio to ``m_i``)."""
    torch.manual_seed(5)
    keys, values = torch.randn(3, 120, 16), torch.randn(3, 120, 16)
    log_mass = torch.zeros(3, 120)
    log_mass[:, 7] = 0.7
    queries, valid = torch.randn(3, 400, 16) * 2, torch.rand(3, 400) > 0.05
    given = torch.stack([torch.randperm(120)[:30].sort().values for _ in range(3)])
    config = FitConfig(beta_min=0.0, mass_weight="relative", query_block=128)
    args = (keys, values, log_mass, queries, valid, torch.full((3,), 30), 0.25, config, given)
    assert solve._fused_statistics_apply(keys, queries, torch.full((3,), 0.25), config)
    fused = fit_problems(*args)
    monkeypatch.setattr(solve, "_fused_statistics_apply", lambda *a: False)
    blocks = fit_problems(*args)
    assert torch.equal(fused.index, blocks.index)
    torch.testing.assert_close(fused.log_mass, blocks.log_mass, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fused.values, blocks.values, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused.output_error, blocks.output_error, rtol=1e-3, atol=1e-5)
    assert not solve._fused_statistics_apply(keys, queries, torch.full((3,), 0.25), FitConfig(mass_weight="none"))


def _pruned_omp_problem() -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked exp-scores (a few keys carry the mass): OMP's refits put weights below e^0.5 on
    some of 20 keys, so App. C.2's β_min pruning discards them and selection refills the slots."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 80, 50, generator=g, dtype=F64) * 5
    phi = torch.exp(logits - logits.amax(-1, keepdim=True))
    return phi, phi.sum(-1)


@pytest.mark.parametrize("refine", [True, False])
@pytest.mark.parametrize(("k", "tau"), [(1, 1), (4, 2)])
def test_omp_keys_reports_the_residual_of_the_keys_it_returns_after_a_beta_min_pruning(k, tau, refine):
    """Keys refilled into the slots freed by a pruning get their own ``Φᵀ Φ_S`` columns: the last
    reported residual is ‖m − Φ_S w‖ of the returned keys and weights (recomputed in float64)."""
    phi, mass = _pruned_omp_problem()
    idx, w, lengths, history = solvers.omp_keys(
        phi, mass, torch.full((4,), 20), torch.ones(4, 50, dtype=torch.bool), k=k, tau=tau, beta_min=0.5, refine=refine
    )
    assert bool((lengths < 20).all())  # every problem pruned keys below e^β_min
    kept = torch.arange(20)[None, :] < lengths[:, None]
    assert bool((w[kept] >= math.exp(0.5)).all()) and bool((w[~kept] == 0).all())
    residual = (mass - (phi.gather(2, idx[:, None, :].expand(-1, 80, -1)) * w[:, None, :]).sum(-1)).norm(dim=-1)
    torch.testing.assert_close(history[:, -1], residual, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(("k", "tau"), [(1, 1), (4, 2)])
def test_gram_refit_selects_what_the_feature_refit_selects_through_beta_min_prunings(k, tau):
    """The same greedy loop (β_min pruning, refills) with Algorithm 3 on the normal equations
    (``GramRefit``, ``refine=False``) and on the explicit features (``FeatureRefit``, the reference)."""
    phi, mass = _pruned_omp_problem()
    counts, w_min, w_max = torch.full((4,), 20), math.exp(0.5), math.exp(7.0)
    loop = dict(k=k, tau=tau, w_min=w_min, refills=8, refill_at_once=True)
    gram = solvers.GramRefit(phi, mass, omp_width(20, k, 50), w_max=w_max, nnls_iters=0, ridge=1e-12, refine=False)
    idx, w, count, history = omp_greedy(gram, counts, torch.zeros(4, 50, dtype=torch.bool), 20, **loop)
    feature = FeatureRefit(phi, mass, nnls_iters=0, w_max=w_max, ridge=1e-12, monotone=True)
    ref = omp_greedy(feature, counts, torch.zeros(4, 50, dtype=torch.bool), 20, **loop)
    ref_idx, ref_w, ref_count, ref_history = ref
    assert torch.equal(count, ref_count) and bool((count < 20).all())
    used = torch.arange(20)[None, :] < count[:, None]
    assert torch.equal(torch.where(used, idx, 0), ref_idx)  # the reference zeroes unused slots
    torch.testing.assert_close(w, ref_w, rtol=1e-7, atol=1e-8)
    torch.testing.assert_close(history, ref_history, rtol=1e-9, atol=1e-10)


def test_a_ridge_solve_reads_back_once_and_retries_only_the_problems_that_fail():
    """Every problem factorised at once, one host read to learn that all did (on a GPU, one wait a
    solve); a problem that fails is retried alone with a 10³× larger ridge, one that keeps failing (NaN)
    gets the prior (zeros); the others are solved as alone."""
    from kvfold.runtime.host_syncs import HostSyncCounter

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 6, 3, generator=g, dtype=torch.float64)
    gram, rhs = a.mT @ a, torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    with HostSyncCounter() as syncs:
        plain = solvers.ridge_solve(gram, rhs, 1e-6)
    assert sum(syncs.kvfold.values()) == 1, syncs.summary()
    gram[1] = torch.diag(torch.tensor([1.0, 1.0, -1e-5], dtype=torch.float64))  # indefinite at λ, not at 10³λ
    gram[2, 0, 0] = float("nan")
    out = solvers.ridge_solve(gram, rhs, 1e-6)
    for i in (0, 3):
        torch.testing.assert_close(out[i], plain[i], rtol=0, atol=0)
        alone = solvers.ridge_solve(gram[i : i + 1], rhs[i : i + 1], 1e-6)[0]
        torch.testing.assert_close(out[i], alone, rtol=0, atol=0)
    scale = (2 - 1e-5) / 3  # the mean diagonal
    lam = 1e-6 * scale + 16 * torch.finfo(F64).eps * scale * 3 + torch.finfo(F64).tiny ** 0.5
    retried = torch.linalg.solve(gram[1] + 1e3 * lam * torch.eye(3, dtype=F64), rhs[1])
    torch.testing.assert_close(out[1], retried)
    assert out[2].eq(0).all()


def test_block_sizes_are_the_devices_unless_set():
    """The CPU's blocks stay in its caches; a GPU's are large (each operation is a launch). A size set
    in the configuration is kept on every device."""
    cpu, gpu = FitConfig().sized(torch.device("cpu")), FitConfig().sized(torch.device("cuda"))
    for name in ("group_bytes", "query_block", "statistics_rows", "statistics_bytes", "pad_products"):
        assert getattr(cpu, name) == getattr(solve.CPU_FIT_SIZES, name)
        assert getattr(gpu, name) == getattr(solve.ACCELERATOR_FIT_SIZES, name) > getattr(cpu, name)
    assert FitConfig(query_block=7).sized(torch.device("cuda")).query_block == 7


@pytest.mark.parametrize("given", [False, True])
def test_a_fit_in_a_gpus_blocks_equals_the_fit_in_small_ones(monkeypatch, given):
    """The same fit in one block of queries and one group (the accelerator's sizes) as in blocks of a
    few queries and problems: the same keys, β and values up to summation order (in float64, where the
    normal equations do not amplify it past the tolerance); and the statistics ran in one block where
    the small sizes took many."""
    torch.manual_seed(3)
    keys, values = torch.randn(2, 3, 40, 8, dtype=F64), torch.randn(2, 3, 40, 8, dtype=F64)
    log_mass = torch.zeros(2, 3, 40, dtype=F64)
    queries, valid = torch.randn(2, 3, 150, 8, dtype=F64), torch.ones(2, 3, 150, dtype=torch.bool)
    chosen = torch.stack([torch.randperm(40)[:12].sort().values for _ in range(6)]).reshape(2, 3, 12)
    blocks = []
    real = solve.block_statistics
    monkeypatch.setattr(solve, "block_statistics", lambda *a, **k: blocks.append(k["block"]) or real(*a, **k))
    from kvfold.methods.compaction.attention_matching import features

    calls = []
    shifted = features.max_shifted_features
    monkeypatch.setattr(features, "max_shifted_features", lambda *a: calls.append(1) or shifted(*a))
    results = {}
    small = FitConfig(query_block=16, statistics_rows=16, statistics_bytes=16 * 40 * 8, group_bytes=1)
    for name, config in (("small", small), ("large", FitConfig().sized(torch.device("cuda")))):
        calls.clear()
        args = (keys, values, log_mass, queries, valid, torch.full((2, 3), 12), 8**-0.5, config)
        results[name] = (fit_problems(*args, given=chosen if given else None), len(calls))
    (large, large_calls), (small_fit, small_calls) = results["large"], results["small"]
    assert large_calls == 1 and small_calls == 6 * 10  # 6 problems one at a time × 10 blocks of 16 queries
    assert torch.equal(large.index, small_fit.index)
    torch.testing.assert_close(large.log_mass, small_fit.log_mass, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(large.values, small_fit.values, rtol=1e-9, atol=1e-10)


def _feature_grams(t: int, scale: float, seed: int = 0) -> torch.Tensor:
    """Gram matrices ``ΦᵀΦ`` of nonnegative features (``exp`` of logits, as the fits' are), batch of 3."""
    g = torch.Generator().manual_seed(seed)
    phi = (torch.randn(3, 2 * t, t, generator=g, dtype=torch.float64) * 1.5).exp() * scale
    return phi.mT @ phi


@pytest.mark.parametrize("t", [48, 200])
@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_top_eigenvalue_bounds_the_largest_eigenvalue_as_the_step_needs(t, scale):
    """:func:`solvers.top_eigenvalue` in float32 against float64's ``eigvalsh``: exact up to 64 entries;
    past that at least λ_max (a projected-gradient step of 1/L never increases the residual) and at
    most 1.05·λ_max and the trace, at Gram magnitudes from 1e-12 to 1e12 (no overflow or underflow
    between normalisations), with all-zero (padded) problems giving 0."""
    grams = _feature_grams(t, scale)
    exact = torch.linalg.eigvalsh(grams)[..., -1]
    padded = torch.cat([grams, torch.zeros(1, t, t, dtype=grams.dtype)]).float()
    got = solvers.top_eigenvalue(padded).double()
    assert got[-1] == 0
    if t <= 64:
        torch.testing.assert_close(got[:-1], exact, rtol=1e-5, atol=0)
    else:
        assert bool((got[:-1] >= exact * (1 - 1e-5)).all()) and bool((got[:-1] <= 1.05 * exact * (1 + 1e-5)).all())
        assert bool((got[:-1] <= grams.diagonal(dim1=-2, dim2=-1).sum(-1) * (1 + 1e-5)).all())


@pytest.mark.parametrize("iters", [30, 33])
def test_top_eigenvalue_normalising_every_few_steps_is_power_iteration_normalised_every_step(iters):
    """The direction of every-few-steps normalisation is power iteration's: the estimate equals one
    that normalises every step (float64, well-conditioned)."""
    grams = _feature_grams(120, 1.0, seed=1)
    v = torch.full(grams.shape[:-1], 120**-0.5, dtype=grams.dtype)
    for _ in range(iters):
        u = (grams @ v[..., None])[..., 0]
        v = u / u.norm(dim=-1, keepdim=True)
    every_step = 1.05 * (v * (grams @ v[..., None])[..., 0]).sum(-1)
    every_step = torch.minimum(every_step, grams.diagonal(dim1=-2, dim2=-1).sum(-1))
    torch.testing.assert_close(solvers.top_eigenvalue(grams, iters), every_step, rtol=1e-12, atol=0)
