"""Property tests for kvfold.methods.compaction.omp: OMP key selection for attention-mass matching
(Attention Matching §3.3 Algorithm 1, App. C.1 Algorithm 2, with the β safeguards of App. C.2).

All exactness checks run in float64 with fixed seeds; a few smoke checks run in float32.
"""

import math

import pytest
import torch

from kvfold.methods.compaction.linalg import max_shifted_exp
from kvfold.methods.compaction.omp import omp_select

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def exp_features(seed: int, batch: tuple[int, ...], n_q: int, n_keys: int, spread: float = 2.0):
    """Max-shifted exp-scores and their mass, as Attention Matching builds them."""
    logits = torch.randn(*batch, n_q, n_keys, dtype=F64, generator=gen(seed)) * spread
    Phi, _ = max_shifted_exp(logits)
    return Phi, Phi.sum(-1)


def sparse_target(Phi, support, weights):
    cols = Phi.gather(-1, support.unsqueeze(-2).expand(*support.shape[:-1], Phi.shape[-2], support.shape[-1]))
    return (cols @ weights.unsqueeze(-1)).squeeze(-1)


def test_omp_recovers_exact_sparse_support():
    g = gen(22)
    batch, n_q, n_keys, t = 4, 64, 128, 5
    Phi = torch.randn(batch, n_q, n_keys, dtype=F64, generator=g)
    Phi = Phi / Phi.norm(dim=-2, keepdim=True)
    support = torch.stack([torch.randperm(n_keys, generator=g)[:t] for _ in range(batch)])
    weights = torch.rand(batch, t, dtype=F64, generator=g) + 0.5
    res = omp_select(Phi, sparse_target(Phi, support, weights), t, beta_bounds=(None, None))
    for i in range(batch):
        order = torch.argsort(res.indices[i])
        assert res.indices[i][order].tolist() == sorted(support[i].tolist())
        torch.testing.assert_close(res.weights[i][order], weights[i][torch.argsort(support[i])])
    assert (res.residual_norms[:, -1] <= 1e-10).all()


def test_omp_recovers_support_on_exp_features():
    Phi, _ = exp_features(23, (3,), 256, 64, spread=2.0)
    g = gen(24)
    support = torch.stack([torch.randperm(64, generator=g)[:6] for _ in range(3)])
    weights = torch.rand(3, 6, dtype=F64, generator=g) * 3 + 1
    res = omp_select(Phi, sparse_target(Phi, support, weights), 6)
    for i in range(3):
        assert sorted(res.indices[i].tolist()) == sorted(support[i].tolist())
    assert (res.residual_norms[:, -1] <= 1e-8 * res.residual_norms[:, 0]).all()


def test_omp_residual_non_increasing_and_consistent():
    Phi, m = exp_features(25, (2, 3), 96, 120)
    res = omp_select(Phi, m, 24, beta_bounds=(None, None))
    hist = res.residual_norms
    assert res.indices.shape == (2, 3, 24) and res.weights.shape == (2, 3, 24)
    assert hist.shape == (2, 3, 25)  # k = 1: one entry per key, plus ‖m‖
    torch.testing.assert_close(hist[..., 0], m.norm(dim=-1))
    assert (hist.diff(dim=-1) <= 1e-12 * hist[..., :1]).all()
    # keys are distinct, weights nonnegative, and the reported residual is the one of (indices, weights)
    assert (res.indices.sort(-1).values.diff(dim=-1) > 0).all()
    assert (res.weights >= 0).all() and (res.num_selected == 24).all()
    cols = Phi.gather(-1, res.indices.unsqueeze(-2).expand(2, 3, 96, 24))
    fitted = (cols @ res.weights.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close((m - fitted).norm(dim=-1), hist[..., -1])


def test_omp_batched_equals_per_problem():
    Phi, m = exp_features(26, (5,), 64, 80)
    res = omp_select(Phi, m, 12, k=2, refit_every=2)
    for i in range(5):
        one = omp_select(Phi[i], m[i], 12, k=2, refit_every=2)
        assert one.indices.tolist() == res.indices[i].tolist()
        torch.testing.assert_close(one.weights, res.weights[i])
        torch.testing.assert_close(one.residual_norms, res.residual_norms[i])


def test_omp_fast_variant_bounds():
    """AM-OMP-fast (k=4, τ=2). Guaranteed: without pruning the residual never increases (the previous
    weights stay feasible at each refit); a β_min pruning can raise it by at most
    exp(β_min)·Σ_pruned ‖Φ_j‖. Empirical, on these fixed seeds: the final residual is within 1.5× that
    of plain OMP with the same budget."""
    Phi, m = exp_features(27, (4,), 128, 200)
    t = 30
    fast = omp_select(Phi, m, t, k=4, refit_every=2, beta_bounds=(None, None))
    hist = fast.residual_norms
    assert hist.shape == (4, math.ceil(t / 4) + 1)  # one entry per greedy step of k keys, plus ‖m‖
    assert (hist[:, 1::2] == hist[:, :-1:2]).all()  # no refit on odd steps: residual unchanged
    assert (hist.diff(dim=-1) <= 1e-12 * hist[..., :1]).all()
    assert (hist[:, -1] < hist[:, 0]).all()

    guarded = omp_select(Phi, m, t, k=4, refit_every=2)  # default β ∈ [−7, 7] safeguards
    plain = omp_select(Phi, m, t)
    slack = math.exp(-7) * Phi.norm(dim=-2).amax(-1, keepdim=True) * t
    assert (guarded.residual_norms.diff(dim=-1) <= slack).all()
    assert (guarded.num_selected == t).all() and (guarded.indices.sort(-1).values.diff(dim=-1) > 0).all()
    assert (guarded.weights <= math.exp(7)).all() and (guarded.weights >= math.exp(-7)).all()
    assert (guarded.residual_norms[:, -1] <= 1.5 * plain.residual_norms[:, -1]).all()


def test_omp_monotone_safeguard():
    # Algorithm 3 with iters=0 (lstsq + clamp) can fit worse than the previous refit; the safeguard
    # keeps the previous weights instead, restoring the monotonicity of exact NNLS (Algorithm 1).
    g = gen(0)
    Phi = torch.rand(1, 20, 30, dtype=F64, generator=g)
    target = torch.randn(1, 20, dtype=F64, generator=g).abs() * 3
    verbatim = omp_select(Phi, target, 10, monotone=False, beta_bounds=(None, None))
    guarded = omp_select(Phi, target, 10, beta_bounds=(None, None))
    assert (verbatim.residual_norms.diff(dim=-1) > 1e-9).any()
    assert (guarded.residual_norms.diff(dim=-1) <= 1e-12).all()
    assert guarded.residual_norms[0, -1] < verbatim.residual_norms[0, -1]


def test_omp_beta_pruning_keeps_bounds():
    Phi, m = exp_features(28, (3,), 64, 40, spread=3.0)
    lo, hi = 0.0, 1.0  # aggressive on purpose so that keys get discarded and replaced
    res = omp_select(Phi, m, 20, beta_bounds=(lo, hi))
    assert (res.num_selected == 20).all()
    assert (res.weights >= math.exp(lo)).all() and (res.weights <= math.exp(hi) + 1e-12).all()
    assert res.residual_norms.shape[-1] > 21  # discarded keys cost extra steps
    assert (res.indices.sort(-1).values.diff(dim=-1) > 0).all()


def test_omp_pruning_can_run_out_of_keys():
    Phi, m = exp_features(3, (2,), 64, 24, spread=3.0)
    res = omp_select(Phi, m, 20, beta_bounds=(0.7, None))
    n = res.num_selected
    assert (n < 20).all()
    for i in range(2):
        assert (res.weights[i, : n[i]] >= math.exp(0.7)).all()
        assert (res.weights[i, n[i] :] == 0).all() and (res.indices[i, n[i] :] == 0).all()


def test_omp_full_budget_reproduces_mass_exactly():
    Phi, m = exp_features(29, (2,), 64, 16)
    res = omp_select(Phi, m, 16)
    assert res.indices.sort(-1).values.tolist() == [list(range(16))] * 2
    torch.testing.assert_close(res.weights, torch.ones(2, 16, dtype=F64))
    assert (res.residual_norms[:, -1] <= 1e-10 * res.residual_norms[:, 0]).all()


def test_omp_float32_smoke():
    logits = torch.randn(2, 3, 128, 256, generator=gen(30)) * 3
    Phi, _ = max_shifted_exp(logits)
    res = omp_select(Phi, Phi.sum(-1), 32, k=4, refit_every=2, nnls_iters=2)
    assert res.weights.dtype == torch.float32 and torch.isfinite(res.weights).all()
    assert (res.num_selected == 32).all()
    hist = res.residual_norms
    assert (hist.diff(dim=-1) <= 1e-5 * hist[..., :1]).all()


def test_omp_rejects_bad_arguments():
    Phi = torch.rand(8, 10)
    with pytest.raises(ValueError, match="t must be"):
        omp_select(Phi, Phi.sum(-1), 11)
    with pytest.raises(ValueError, match="refit_every"):
        omp_select(Phi, Phi.sum(-1), 3, refit_every=0)
