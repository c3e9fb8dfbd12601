"""Property tests for kvfold.methods.compaction.linalg:
the solvers behind GRKV (ridge, CG) and Attention Matching (NNLS, least squares); OMP is in test_omp.py.

All exactness checks run in float64 with fixed seeds; a few smoke checks run in float32.
"""

import math

import pytest
import torch

from kvfold.methods.compaction.linalg import (
    conjugate_gradient,
    lstsq_ridge,
    max_shifted_exp,
    nnls,
    nnls_reference,
    ridge_dual,
    ridge_dual_cg,
    ridge_primal,
    spd_solve,
)

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def ridge_objective(X, Y, V0, lam, V):
    return (X @ V - Y).square().sum((-2, -1)) + lam * (V - V0).square().sum((-2, -1))


def nnls_objective(A, b, w):
    return (A @ w.unsqueeze(-1)).squeeze(-1).sub(b).square().sum(-1)


# ---------------------------------------------------------------------------------------------
# ridge (GRKV value step, eq. 7/8/33)


@pytest.mark.parametrize(("m", "n"), [(8, 40), (32, 32), (40, 8)])
def test_ridge_dual_equals_primal(m, n):
    g = gen(0)
    X = torch.rand(2, 3, m, n, dtype=F64, generator=g)
    Y = torch.randn(2, 3, m, 5, dtype=F64, generator=g)
    V0 = torch.randn(2, 3, n, 5, dtype=F64, generator=g)
    for lam in (1e-2, 1.0):
        primal = ridge_primal(X, Y, V0, lam)
        dual = ridge_dual(X, Y, V0, lam)
        assert dual.shape == (2, 3, n, 5)
        assert (dual - primal).norm() <= 1e-10 * primal.norm()


def test_ridge_per_problem_lambda():
    g = gen(1)
    X = torch.rand(3, 6, 10, dtype=F64, generator=g)
    Y, V0 = torch.randn(3, 6, 2, dtype=F64, generator=g), torch.randn(3, 10, 2, dtype=F64, generator=g)
    lam = torch.tensor([1e-3, 1e-1, 10.0], dtype=F64)
    batched = ridge_dual(X, Y, V0, lam)
    for i in range(3):
        torch.testing.assert_close(batched[i], ridge_primal(X[i], Y[i], V0[i], float(lam[i])))


def test_ridge_infinite_lambda_returns_prior():
    g = gen(2)
    X = torch.rand(4, 32, 50, dtype=F64, generator=g)
    Y, V0 = torch.randn(4, 32, 8, dtype=F64, generator=g), torch.randn(4, 50, 8, dtype=F64, generator=g)
    for solve in (ridge_dual, ridge_primal):
        torch.testing.assert_close(solve(X, Y, V0, 1e12), V0, atol=1e-9, rtol=0)


def test_ridge_solution_is_optimal():
    g = gen(3)
    X = torch.rand(4, 16, 24, dtype=F64, generator=g)
    Y, V0 = torch.randn(4, 16, 6, dtype=F64, generator=g), torch.randn(4, 24, 6, dtype=F64, generator=g)
    lam = 1e-2
    V = ridge_dual(X, Y, V0, lam)
    best = ridge_objective(X, Y, V0, lam, V)
    assert (best <= ridge_objective(X, Y, V0, lam, V0)).all()
    for scale in (1e-4, 1e-2, 1.0):
        for _ in range(5):
            P = torch.randn(V.shape, dtype=F64, generator=g) * scale
            assert (best <= ridge_objective(X, Y, V0, lam, V + P) + 1e-12 * best).all()


def test_ridge_zero_lambda_rank_deficient_gives_least_squares():
    # λ = 0 with m > n: X Xᵀ is singular, the dual falls back to the pseudo-inverse: V = V0 + X⁺(Y − X V0).
    g = gen(4)
    X = torch.randn(3, 30, 6, dtype=F64, generator=g)
    Y, V0 = torch.randn(3, 30, 2, dtype=F64, generator=g), torch.randn(3, 6, 2, dtype=F64, generator=g)
    V = ridge_dual(X, Y, V0, 0.0)
    assert torch.isfinite(V).all()
    torch.testing.assert_close(V, V0 + torch.linalg.pinv(X) @ (Y - X @ V0))


def test_ridge_rejects_bad_inputs():
    X, Y, V0 = torch.rand(4, 5), torch.rand(4, 2), torch.rand(5, 2)
    with pytest.raises(ValueError, match="lam"):
        ridge_dual(X, Y, V0, -1.0)
    with pytest.raises(ValueError, match="expected X"):
        ridge_primal(X, Y, V0[:4], 1.0)


def test_spd_solve_singular_unbatched_falls_back_to_pinv():
    v = torch.tensor([[1.0], [2.0], [3.0]], dtype=F64)
    M = v @ v.T  # rank one
    B = torch.tensor([[1.0], [0.0], [1.0]], dtype=F64)
    X = spd_solve(M, B)
    assert torch.isfinite(X).all()
    torch.testing.assert_close(X, torch.linalg.pinv(M) @ B)


def test_ridge_float32_no_nan_on_degenerate_input():
    X = torch.zeros(2, 32, 100)  # no attention at all
    Y, V0 = torch.randn(2, 32, 64), torch.randn(2, 100, 64)
    for lam in (0.0, 1e-2):
        V = ridge_dual(X, Y, V0, lam)
        assert V.dtype == torch.float32
        torch.testing.assert_close(V, V0)


# ---------------------------------------------------------------------------------------------
# conjugate gradients (GRKV key step, App. D.2)


def random_spd(seed: int, batch: int, n: int, cond: float = 50.0) -> torch.Tensor:
    g = gen(seed)
    Q, _ = torch.linalg.qr(torch.randn(batch, n, n, dtype=F64, generator=g))
    eig = torch.logspace(0, math.log10(cond), n, dtype=F64)
    return Q @ torch.diag_embed(eig.expand(batch, n)) @ Q.mT


def test_cg_matches_direct_solve():
    A = random_spd(5, 4, 20)
    b = torch.randn(4, 20, dtype=F64, generator=gen(6))
    x, info = conjugate_gradient(lambda v: (A @ v.unsqueeze(-1)).squeeze(-1), b, iters=200, tol=1e-10)
    ref = torch.linalg.solve(A, b)
    assert info.converged.all()
    assert (info.residual <= 1e-10).all()
    assert ((A @ x.unsqueeze(-1)).squeeze(-1) - b).norm(dim=-1).max() <= 1e-9 * b.norm(dim=-1).min()
    torch.testing.assert_close(x, ref, rtol=1e-8, atol=1e-8)


def test_cg_batch_with_solved_problem_has_no_nan():
    A = random_spd(7, 3, 10)
    b = torch.randn(3, 10, dtype=F64, generator=gen(8))
    b[1] = 0.0
    x, info = conjugate_gradient(lambda v: (A @ v.unsqueeze(-1)).squeeze(-1), b, iters=50, tol=1e-10)
    assert torch.isfinite(x).all()
    assert (x[1] == 0).all()
    assert info.iterations[1] == 0 and bool(info.converged[1])
    torch.testing.assert_close(x[[0, 2]], torch.linalg.solve(A[[0, 2]], b[[0, 2]]))
    # a warm start at the solution does no work
    x2, info2 = conjugate_gradient(lambda v: (A @ v.unsqueeze(-1)).squeeze(-1), b, x0=x, iters=50, tol=1e-8)
    assert (info2.iterations == 0).all()
    torch.testing.assert_close(x2, x)


def test_cg_stops_at_iteration_cap():
    A = random_spd(9, 2, 30, cond=1e4)
    b = torch.randn(2, 30, dtype=F64, generator=gen(10))
    x, info = conjugate_gradient(lambda v: (A @ v.unsqueeze(-1)).squeeze(-1), b, iters=3, tol=1e-12)
    assert (info.iterations == 3).all() and not info.converged.any()
    assert torch.isfinite(x).all()


def test_ridge_dual_cg_matches_direct_dual():
    # GRKV eq. 39-41: z = Jᵀ (J Jᵀ + λI)⁻¹ rhs, i.e. ridge_dual(J, rhs, 0, λ).
    g = gen(11)
    J = torch.randn(3, 12, 40, dtype=F64, generator=g)
    rhs = torch.randn(3, 12, dtype=F64, generator=g)
    lam = 0.1
    z, alpha, info = ridge_dual_cg(
        lambda v: (J @ v.unsqueeze(-1)).squeeze(-1),
        lambda u: (J.mT @ u.unsqueeze(-1)).squeeze(-1),
        rhs,
        lam,
        iters=100,
        tol=1e-12,
    )
    direct = ridge_dual(J, rhs.unsqueeze(-1), torch.zeros(3, 40, 1, dtype=F64), lam).squeeze(-1)
    assert info.converged.all()
    torch.testing.assert_close(z, direct, rtol=1e-9, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# NNLS (Attention Matching Algorithm 3) and its exact reference


def assert_box_kkt(A, b, w, lower, upper, tol):
    """First-order optimality of min ‖Aw − b‖² on a box: the gradient pushes only into active bounds."""
    grad = A.mT @ (A @ w - b)
    at_lower = w <= lower + 1e-12
    at_upper = w >= upper - 1e-12 if upper is not None else torch.zeros_like(w, dtype=torch.bool)
    free = ~at_lower & ~at_upper
    assert (grad[free].abs() <= tol).all()
    assert (grad[at_lower] >= -tol).all()
    assert (grad[at_upper] <= tol).all()


def test_nnls_reference_satisfies_kkt():
    g = gen(12)
    for _ in range(5):
        A = torch.randn(30, 15, dtype=F64, generator=g)
        b = torch.randn(30, dtype=F64, generator=g)
        w = nnls_reference(A, b)
        assert (w >= 0).all()
        assert 0 < int((w > 0).sum()) < 15  # a real mix of active and free constraints
        assert_box_kkt(A, b, w, 0.0, None, tol=1e-10)


def test_nnls_matches_reference():
    g = gen(13)
    A = torch.randn(6, 40, 12, dtype=F64, generator=g)
    b = torch.randn(6, 40, dtype=F64, generator=g)
    w = nnls(A, b, iters=3000)
    ref = torch.stack([nnls_reference(A[i], b[i]) for i in range(6)])
    assert (w >= 0).all()
    f, f_ref = nnls_objective(A, b, w), nnls_objective(A, b, ref)
    assert ((f - f_ref).abs() <= 1e-6 * f_ref).all()
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=0)


def test_nnls_lower_bound_matches_shifted_reference():
    # min over w ≥ ε equals ε + argmin_{u ≥ 0} ‖A u − (b − A ε)‖².
    g = gen(14)
    A = torch.randn(3, 30, 8, dtype=F64, generator=g)
    b = torch.randn(3, 30, dtype=F64, generator=g)
    eps = 0.05
    w = nnls(A, b, iters=3000, lower=eps)
    shift = torch.full((8,), eps, dtype=F64)
    ref = torch.stack([eps + nnls_reference(A[i], b[i] - A[i] @ shift) for i in range(3)])
    assert (w >= eps).all()
    torch.testing.assert_close(w, ref, atol=1e-6, rtol=0)


def test_nnls_box_bounds_respected_and_optimal():
    # Attention Matching's highest-attention β bounds: w = exp(β) ∈ [e^-3, e^3].
    g = gen(15)
    A = torch.rand(4, 50, 10, dtype=F64, generator=g) + torch.eye(50, 10, dtype=F64)
    b = torch.randn(4, 50, dtype=F64, generator=g) * 10
    lo, hi = math.exp(-3), math.exp(3)
    for iters in (0, 2, 5000):
        w = nnls(A, b, iters=iters, lower=lo, upper=hi)
        assert (w >= lo).all() and (w <= hi).all()
    for i in range(4):
        assert_box_kkt(A[i], b[i], w[i], lo, hi, tol=1e-6)


def test_nnls_feasible_case_equals_lstsq():
    g = gen(16)
    A = torch.rand(5, 40, 10, dtype=F64, generator=g)
    w_true = torch.rand(5, 10, dtype=F64, generator=g) + 0.5
    b = (A @ w_true.unsqueeze(-1)).squeeze(-1)
    lstsq = torch.linalg.lstsq(A, b.unsqueeze(-1)).solution.squeeze(-1)
    for iters in (0, 2, 100):
        w = nnls(A, b, iters=iters)
        torch.testing.assert_close(w, lstsq)
        torch.testing.assert_close(w, w_true)


def test_nnls_projected_gradient_never_increases_objective():
    g = gen(17)
    A = torch.rand(3, 60, 20, dtype=F64, generator=g)
    b = torch.randn(3, 60, dtype=F64, generator=g).abs()
    previous = None
    for iters in range(0, 30):
        f = nnls_objective(A, b, nnls(A, b, iters=iters, init="zeros"))
        if previous is not None:
            assert (f <= previous * (1 + 1e-12)).all()
        previous = f


def test_nnls_large_problem_uses_power_iteration():
    # n > 64 takes the power-iteration estimate of L; projected gradient must still converge.
    g = gen(18)
    A = torch.randn(200, 80, dtype=F64, generator=g)
    b = torch.randn(200, dtype=F64, generator=g)
    w = nnls(A, b, iters=2000, init="zeros")
    ref = nnls_reference(A, b)
    f, f_ref = nnls_objective(A, b, w), nnls_objective(A, b, ref)
    assert (w >= 0).all()
    assert abs(float(f - f_ref)) <= 1e-6 * float(f_ref)


def test_nnls_degenerate_inputs_are_finite():
    w = nnls(torch.zeros(2, 10, 4), torch.randn(2, 10), iters=5)
    assert torch.isfinite(w).all() and (w == 0).all()
    A = torch.ones(3, 16, 6)  # identical columns: singular
    w = nnls(A, torch.ones(3, 16), iters=5, upper=math.exp(7))
    assert torch.isfinite(w).all()
    assert (A @ w.unsqueeze(-1)).squeeze(-1).sub(1).abs().max() < 1e-3


def test_nnls_rejects_bad_arguments():
    A, b = torch.rand(5, 3), torch.rand(5)
    with pytest.raises(ValueError, match="lower <= upper"):
        nnls(A, b, lower=2.0, upper=1.0)
    with pytest.raises(ValueError, match="init"):
        nnls(A, b, init="random")
    with pytest.raises(ValueError, match="expected A"):
        nnls(A, b[:4])


# ---------------------------------------------------------------------------------------------
# least squares with ridge fallback (Attention Matching C_v, NNLS init)


@pytest.mark.parametrize("driver", ["gelsd", "qr"])
def test_lstsq_ridge_well_conditioned_is_plain_lstsq(driver):
    g = gen(19)
    A = torch.randn(3, 30, 10, dtype=F64, generator=g)
    B = torch.randn(3, 30, 4, dtype=F64, generator=g)
    X, fallback = lstsq_ridge(A, B, driver=driver)
    assert not fallback.any()
    torch.testing.assert_close(X, torch.linalg.lstsq(A, B).solution)


def test_lstsq_ridge_qr_underdetermined_is_min_norm():
    g = gen(20)
    A = torch.randn(2, 6, 15, dtype=F64, generator=g)
    B = torch.randn(2, 6, 3, dtype=F64, generator=g)
    X, fallback = lstsq_ridge(A, B, driver="qr")
    assert not fallback.any()
    torch.testing.assert_close(X, torch.linalg.pinv(A) @ B)


@pytest.mark.parametrize("driver", ["gelsd", "qr"])
def test_lstsq_ridge_falls_back_on_singular_systems(driver):
    g = gen(21)
    A = torch.randn(3, 20, 5, dtype=F64, generator=g)
    A[1, :, 4] = A[1, :, 3]  # duplicated column: exactly singular
    A[2, :, 4] = A[2, :, 3] * (1 + 1e-15)  # numerically singular
    B = torch.randn(3, 20, 2, dtype=F64, generator=g)
    X, fallback = lstsq_ridge(A, B, driver=driver)
    assert fallback.tolist() == [False, True, True]
    assert torch.isfinite(X).all()
    # the fallback is a near-optimal least-squares fit with a bounded solution
    best = (A @ torch.linalg.pinv(A) @ B - B).square().sum((-2, -1))
    assert ((A @ X - B).square().sum((-2, -1)) <= best * (1 + 1e-6)).all()
    assert X.abs().max() < 1e3


def test_lstsq_ridge_float32_ill_conditioned_and_zero():
    A = torch.ones(2, 12, 4)
    A[1] = 0.0
    X, fallback = lstsq_ridge(A, torch.ones(2, 12, 1))
    assert fallback.all() and torch.isfinite(X).all()
    assert (X[1] == 0).all()
    torch.testing.assert_close(A[0] @ X[0], torch.ones(12, 1), atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# max-shifted exponentials (Attention Matching App. A.2)


def test_max_shifted_exp():
    logits = torch.randn(3, 5, 40, dtype=F64, generator=gen(31)) * 50
    logits[0, 0] = -math.inf  # a fully masked row
    feats, shift = max_shifted_exp(logits)
    assert shift.shape == (3, 5, 1)
    assert torch.isfinite(feats).all() and (feats <= 1).all()
    assert (feats[0, 0] == 0).all() and shift[0, 0, 0] == 0
    mass = torch.logsumexp(logits[1:], dim=-1)
    torch.testing.assert_close(shift[1:, :, 0] + feats[1:].sum(-1).log(), mass)
