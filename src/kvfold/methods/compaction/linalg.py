"""Batched numerical solvers shared by GRKV and Attention Matching.

Every function solves a stack of independent problems: all leading dimensions (e.g. layers × KV
heads) are batch dimensions and are never looped over in Python. Work happens in the dtype of the
inputs (callers pass float32, tests float64); nothing is cast down. Solvers never return NaN for
finite inputs: singular or ill-conditioned systems fall back to a ridge or pseudo-inverse solve.

Where each piece comes from:

- GRKV (``papers/grkv.md``): value step, a ridge regression toward the evicted cache, primal
  (§3.4 eq. 7, App. D.1 eq. 30) and dual / Woodbury (eq. 8, eq. 33) -> :func:`ridge_primal`,
  :func:`ridge_dual`; linearized key step (eq. 10, App. D.2 eq. 39-41), solved matrix-free with
  conjugate gradients -> :func:`conjugate_gradient`, :func:`ridge_dual_cg`.
- Attention Matching (``papers/attention-matching.md``): β by nonnegative least squares on the
  attention mass (§3.2, App. C.2 Algorithm 3) -> :func:`nnls`; C_v by least squares (§3.2 eq. 3-4,
  App. C.2 "Least Squares") -> :func:`lstsq_ridge`; max-shifted exponentials (App. A.2 "Stable
  computation") -> :func:`max_shifted_exp`. OMP key selection (§3.3 Algorithm 1, App. C.1
  Algorithm 2), built on :func:`nnls`, is :mod:`kvfold.methods.compaction.omp`.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "CGInfo",
    "conjugate_gradient",
    "lstsq_ridge",
    "max_shifted_exp",
    "nnls",
    "nnls_reference",
    "ridge_dual",
    "ridge_dual_cg",
    "ridge_primal",
    "spd_solve",
]


# ----------------------------------------------------------------------------------------------
# small helpers


def _default_max_cond(ref: Tensor) -> float:
    """Condition number above which a matrix is treated as singular at ``ref``'s precision (0.1/eps)."""
    return 0.1 / torch.finfo(ref.dtype).eps


def check_matrix(x: Tensor, name: str) -> None:
    """Raise ValueError unless ``x`` has shape (..., rows, cols); ``name`` names it in the message."""
    if x.ndim < 2:
        raise ValueError(f"{name} must have shape (..., rows, cols); got shape {tuple(x.shape)}")


def _batch_scalar(value: float | Tensor, ref: Tensor, name: str) -> Tensor:
    """A finite, non-negative per-problem scalar, shaped to broadcast against (..., r, c) matrices."""
    v = torch.as_tensor(value, dtype=ref.dtype, device=ref.device)
    if not bool(torch.isfinite(v).all()) or bool((v < 0).any()):
        raise ValueError(f"{name} must be finite and >= 0; got {value}")
    return v[..., None, None]


def _eye(n: int, ref: Tensor) -> Tensor:
    return torch.eye(n, dtype=ref.dtype, device=ref.device)


def batched_matvec(A: Tensor, x: Tensor) -> Tensor:
    """Batched ``A @ x`` for A (..., m, n) and x (..., n)."""
    return (A @ x.unsqueeze(-1)).squeeze(-1)


def batched_rmatvec(A: Tensor, y: Tensor) -> Tensor:
    """Batched ``Aᵀ @ y`` for A (..., m, n) and y (..., m)."""
    return (y.unsqueeze(-2) @ A).squeeze(-2)


def _all_finite(x: Tensor) -> Tensor:
    """Per-problem finiteness of a (..., r, c) tensor."""
    return torch.isfinite(x).flatten(-2).all(-1)


def _project(w: Tensor, lower: float | Tensor | None, upper: float | Tensor | None) -> Tensor:
    """Clamp to the box [lower, upper] (either side may be None)."""
    if lower is None and upper is None:
        return w
    return w.clamp(min=lower, max=upper)


# ----------------------------------------------------------------------------------------------
# symmetric positive definite systems and ridge regression (GRKV value step)


def spd_solve(M: Tensor, B: Tensor, *, max_cond: float | None = None) -> Tensor:
    """Solve ``M X = B`` for symmetric positive (semi)definite ``M``, batched.

    Cholesky first (``torch.linalg.cholesky_ex``). A problem falls back to the minimum-norm
    least-squares solution ``M⁺ B`` (``torch.linalg.pinv(hermitian=True)``) where the factorization
    fails (M not numerically PD), where ``(max diag L / min diag L)²`` — a lower bound on cond(M) —
    exceeds ``max_cond``, or where the Cholesky solution is not finite. Only the failing problems
    are recomputed.

    Args:
        M: (..., n, n) symmetric PSD matrices (only the lower triangle is read by Cholesky).
        B: (..., n, k) right-hand sides; batch dims broadcast with M's.
        max_cond: condition-number limit for trusting Cholesky; default 0.1/eps of the dtype.

    Returns:
        X: (..., n, k), finite wherever M and B are.
    """
    check_matrix(M, "M")
    check_matrix(B, "B")
    batch = torch.broadcast_shapes(M.shape[:-2], B.shape[:-2])
    M = M.expand(*batch, *M.shape[-2:])
    B = B.expand(*batch, *B.shape[-2:])
    if M.shape[-1] == 0:
        return B.clone()
    limit = _default_max_cond(M) if max_cond is None else max_cond
    L, info = torch.linalg.cholesky_ex(M)
    X = torch.cholesky_solve(B, L)
    diag = L.diagonal(dim1=-2, dim2=-1).abs()
    cond_lower_bound = (diag.amax(-1) / diag.amin(-1)).square()
    bad = (info != 0) | ~(cond_lower_bound <= limit) | ~_all_finite(X)
    if bool(bad.any()):
        X[bad] = torch.linalg.pinv(M[bad], hermitian=True) @ B[bad]
    return X


def _check_ridge_shapes(X: Tensor, Y: Tensor, V0: Tensor) -> None:
    for t, name in ((X, "X"), (Y, "Y"), (V0, "V0")):
        check_matrix(t, name)
    m, n = X.shape[-2:]
    if Y.shape[-2] != m or V0.shape[-2] != n or Y.shape[-1] != V0.shape[-1]:
        raise ValueError(
            f"expected X (..., m, n), Y (..., m, d), V0 (..., n, d); got X {tuple(X.shape)}, "
            f"Y {tuple(Y.shape)}, V0 {tuple(V0.shape)}"
        )


def ridge_primal(X: Tensor, Y: Tensor, V0: Tensor, lam: float | Tensor) -> Tensor:
    """Ridge regression toward a prior, primal form: an n×n system (GRKV eq. 7, App. D eq. 29-30).

    Solves ``argmin_V ‖X V − Y‖² + λ‖V − V0‖²`` as ``V = V0 + (XᵀX + λI_n)⁻¹ Xᵀ (Y − X V0)``.
    Cheaper than :func:`ridge_dual` when n < m. With λ = 0 and a singular XᵀX it returns the
    minimum-norm least-squares update (see :func:`spd_solve`).

    Args:
        X: (..., m, n) design matrices (GRKV: retained-cache attention A_win^(Ret), m = window).
        Y: (..., m, d) targets (GRKV: full-cache outputs A_win^(full) V_full).
        V0: (..., n, d) prior the solution is pulled toward (GRKV: evicted-cache values V_Ret^0).
        lam: ridge strength λ ≥ 0, a float or a tensor broadcastable to the batch dims.

    Returns:
        V: (..., n, d).

    Raises:
        ValueError: on mismatched shapes or a negative / non-finite λ.
    """
    _check_ridge_shapes(X, Y, V0)
    lam_ = _batch_scalar(lam, X, "lam")
    Xt = X.mT
    M = Xt @ X + lam_ * _eye(X.shape[-1], X)  # eq. 29: M = XᵀX + λ I_c
    E = Y - X @ V0  # E_V = Y − X V⁰
    return V0 + spd_solve(M, Xt @ E)  # eq. 30: V* = V⁰ + M⁻¹ Xᵀ E_V


def ridge_dual(X: Tensor, Y: Tensor, V0: Tensor, lam: float | Tensor) -> Tensor:
    """Ridge regression toward a prior, dual (Woodbury) form: an m×m system (GRKV eq. 8, App. D eq. 33).

    Same solution as :func:`ridge_primal` through ``M⁻¹Xᵀ = Xᵀ N⁻¹`` (eq. 31):
    ``V = V0 + Xᵀ Z`` with ``Z = (X Xᵀ + λ I_m)⁻¹ (Y − X V0)``. This is the GRKV value step; the
    m×m system (m = surrogate window, 32) is solved by Cholesky with a pseudo-inverse fallback.
    The linearized key step (eq. 10/41) has the same shape — ``z = vec(K* − K⁰)`` solves
    ``ridge_dual(J, (e + J g)[..., None], 0, λ_k)`` — when J is small enough to build; otherwise
    use :func:`ridge_dual_cg`.

    Args:
        X: (..., m, n) design matrices.
        Y: (..., m, d) targets.
        V0: (..., n, d) prior.
        lam: ridge strength λ ≥ 0 (float or tensor broadcastable to the batch dims). With λ = 0 and
            rank(X) < m the pseudo-inverse fallback gives the minimum-norm least-squares solution.

    Returns:
        V: (..., n, d).

    Raises:
        ValueError: on mismatched shapes or a negative / non-finite λ.

    Example:
        >>> X, Y, V0 = torch.rand(8, 32, 200), torch.randn(8, 32, 64), torch.randn(8, 200, 64)
        >>> ridge_dual(X, Y, V0, 1e-2).shape
        torch.Size([8, 200, 64])
    """
    _check_ridge_shapes(X, Y, V0)
    lam_ = _batch_scalar(lam, X, "lam")
    N = X @ X.mT + lam_ * _eye(X.shape[-2], X)  # N = X Xᵀ + λ I_m
    Z = spd_solve(N, Y - X @ V0)  # Z = N⁻¹ (Y − X V⁰)
    return V0 + X.mT @ Z  # eq. 33: V* = V⁰ + Xᵀ Z


# ----------------------------------------------------------------------------------------------
# conjugate gradients (GRKV key step)


class CGInfo(NamedTuple):
    """Per-problem diagnostics of :func:`conjugate_gradient` (all shaped like the batch dims).

    Attributes:
        iterations: int64, CG updates applied to each problem (``iterations.max()`` = loop count).
        residual: final relative residual ‖b − A x‖ / ‖b‖ as tracked by the CG recurrence
            (absolute ‖b − A x‖ where b = 0).
        converged: bool, ``residual <= tol``.
    """

    iterations: Tensor
    residual: Tensor
    converged: Tensor


def conjugate_gradient(
    matvec: Callable[[Tensor], Tensor],
    b: Tensor,
    x0: Tensor | None = None,
    iters: int = 16,
    tol: float = 1e-6,
) -> tuple[Tensor, CGInfo]:
    """Batched conjugate gradients for symmetric positive definite operators (GRKV App. D.2).

    Solves ``A x = b`` for every problem in the batch, with A given only as ``matvec``. Each
    problem stops updating once its relative residual is ≤ ``tol`` (the operator is still applied
    to the whole batch; frozen problems keep their iterate). A problem whose curvature ``pᵀAp`` is
    not positive (a zero residual, or an operator that is not SPD) is frozen instead of dividing by
    zero, so b = 0 yields x = 0 without NaN. Defaults (16 iterations, tol 1e-6) are GRKV's.

    Args:
        matvec: maps (..., n) -> (..., n); must act independently on each problem of the batch.
        b: (..., n) right-hand sides.
        x0: optional (..., n) starting point (default zeros).
        iters: maximum number of CG iterations.
        tol: relative residual tolerance.

    Returns:
        (x, info): x (..., n) and a :class:`CGInfo`.
    """
    if iters < 0:
        raise ValueError(f"iters must be >= 0; got {iters}")
    if x0 is None:
        x = torch.zeros_like(b)
        r = b.clone()
    else:
        x = x0.expand_as(b).clone()
        r = b - matvec(x)
    b_norm = b.norm(dim=-1)
    scale = torch.where(b_norm > 0, b_norm, torch.ones_like(b_norm))
    p = r.clone()
    rs = r.square().sum(-1)
    active = rs.sqrt() > tol * scale
    its = torch.zeros(b.shape[:-1], dtype=torch.long, device=b.device)
    for _ in range(iters):
        if not bool(active.any()):
            break
        Ap = matvec(p)
        curvature = (p * Ap).sum(-1)
        ok = active & (curvature > 0)
        alpha = torch.where(ok, rs / torch.where(ok, curvature, torch.ones_like(curvature)), 0.0)
        x = x + alpha.unsqueeze(-1) * p
        r = r - alpha.unsqueeze(-1) * Ap
        rs_new = r.square().sum(-1)
        beta = torch.where(ok, rs_new / torch.where(rs > 0, rs, torch.ones_like(rs)), 0.0)
        p = torch.where(ok.unsqueeze(-1), r + beta.unsqueeze(-1) * p, p)
        rs = torch.where(ok, rs_new, rs)
        its = its + ok.long()
        active = ok & (rs.sqrt() > tol * scale)
    residual = rs.sqrt() / scale
    return x, CGInfo(iterations=its, residual=residual, converged=residual <= tol)


def ridge_dual_cg(
    jvp: Callable[[Tensor], Tensor],
    vjp: Callable[[Tensor], Tensor],
    rhs: Tensor,
    lam: float | Tensor,
    *,
    alpha0: Tensor | None = None,
    iters: int = 16,
    tol: float = 1e-6,
) -> tuple[Tensor, Tensor, CGInfo]:
    """Matrix-free dual ridge solve, the GRKV key step (eq. 10, App. D.2 eq. 39-41).

    Solves ``(J Jᵀ + λ I) α = rhs`` by :func:`conjugate_gradient` using only products with J and
    Jᵀ, and returns ``z = Jᵀ α``. For the key step, ``rhs = vec(E) + J vec(K − K⁰)`` and the new
    keys are ``K⁰ + unvec(z)`` (eq. 41).

    Args:
        jvp: v (..., n_in) -> J v (..., n_out)  (Jacobian-vector product).
        vjp: u (..., n_out) -> Jᵀ u (..., n_in)  (vector-Jacobian product).
        rhs: (..., n_out) right-hand side.
        lam: λ > 0 (float or tensor broadcastable to the batch dims); makes the operator SPD.
        alpha0: optional (..., n_out) warm start for α.
        iters: CG iterations (GRKV: 16).
        tol: CG relative tolerance (GRKV: 1e-6).

    Returns:
        (z, α, info): z = Jᵀα (..., n_in), α (..., n_out), CG diagnostics.
    """
    lam_ = _batch_scalar(lam, rhs, "lam")[..., 0]  # (..., 1): broadcasts against (..., n_out)

    def normal_op(a: Tensor) -> Tensor:
        return jvp(vjp(a)) + lam_ * a  # (J Jᵀ + λ I) a

    alpha, info = conjugate_gradient(normal_op, rhs, alpha0, iters=iters, tol=tol)
    return vjp(alpha), alpha, info


# ----------------------------------------------------------------------------------------------
# least squares (Attention Matching C_v fit and NNLS initialization)


def _lstsq_gelsd(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """SVD-based least squares (LAPACK gelsd, CPU) and the exact condition number of A."""
    sol = torch.linalg.lstsq(A, B, driver="gelsd")
    s = sol.singular_values  # (..., min(m, n)), descending
    return sol.solution, s[..., 0] / s[..., -1]


def _lstsq_qr(A: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """Householder-QR least squares (gels-like, any device, any m, n) and a cond(A) estimate.

    m ≥ n: A = QR, X = R⁻¹QᵀB. m < n: Aᵀ = QR, minimum-norm X = Q R⁻ᵀ B. The estimate
    max|R_ii| / min|R_ii| is a lower bound on cond(A); it is infinite when R is singular.
    """
    m, n = A.shape[-2:]
    if m >= n:
        Q, R = torch.linalg.qr(A)
        X = torch.linalg.solve_triangular(R, Q.mT @ B, upper=True)
    else:
        Q, R = torch.linalg.qr(A.mT)
        X = Q @ torch.linalg.solve_triangular(R.mT, B, upper=False)
    d = R.diagonal(dim1=-2, dim2=-1).abs()
    return X, d.amax(-1) / d.amin(-1)


def _ridge_normal_equations(A: Tensor, B: Tensor, ridge: float) -> Tensor:
    """(AᵀA + λI)⁻¹AᵀB with λ = ridge · mean nonzero σ²(A); primal or dual, whichever is smaller."""
    m, n = A.shape[-2:]
    scale = A.square().sum((-2, -1)) / max(min(m, n), 1)  # ‖A‖_F² / rank bound
    lam = ridge * torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = A.new_zeros((*A.shape[:-2], n, B.shape[-1]))
    solve = ridge_primal if n <= m else ridge_dual
    return solve(A, B, zero, lam)


def lstsq_ridge(
    A: Tensor,
    B: Tensor,
    ridge: float = 1e-6,
    *,
    max_cond: float | None = None,
    driver: str | None = None,
) -> tuple[Tensor, Tensor]:
    """Batched least squares ``argmin_X ‖A X − B‖²`` with a ridge fallback (AM §3.2 eq. 3-4, App. C.2).

    First a plain least-squares solve (the paper uses ``torch.linalg.lstsq``): driver ``"gelsd"``
    (SVD, CPU only, minimum-norm for rank-deficient A) or ``"qr"`` (Householder QR, any device,
    minimum-norm for m < n). Problems whose result is not finite or whose A is ill-conditioned
    (cond(A) > ``max_cond``; exact from gelsd, a lower-bound estimate from QR's diagonal) are
    re-solved with the ridge normal equations ``(AᵀA + λI)⁻¹ AᵀB``, where
    ``λ = ridge · ‖A‖_F² / min(m, n)`` (relative to the mean squared singular value, so the
    fallback does not depend on the scale of A; λ = ridge when A = 0).

    Args:
        A: (..., m, n) design matrices.
        B: (..., m, k) right-hand sides (use ``b[..., None]`` for a vector).
        ridge: relative ridge strength of the fallback, > 0.
        max_cond: condition number above which the plain solve is not trusted; default 0.1/eps
            of the dtype (A singular at working precision).
        driver: ``"gelsd"`` or ``"qr"``; default gelsd on CPU, qr elsewhere (CUDA lstsq only
            has gels, which needs full rank and m ≥ n).

    Returns:
        (X, used_fallback): X (..., n, k); bool (...) marking the problems solved by the fallback.

    Raises:
        ValueError: on bad shapes, ``ridge <= 0``, or an unknown driver.
    """
    check_matrix(A, "A")
    check_matrix(B, "B")
    if A.shape[-2] != B.shape[-2]:
        raise ValueError(f"A (..., m, n) and B (..., m, k) need the same m; got {A.shape} and {B.shape}")
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0; got {ridge}")
    batch = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
    A = A.expand(*batch, *A.shape[-2:])
    B = B.expand(*batch, *B.shape[-2:])
    m, n = A.shape[-2:]
    if min(m, n) == 0:
        return A.new_zeros((*batch, n, B.shape[-1])), torch.zeros(batch, dtype=torch.bool, device=A.device)
    driver = driver or ("gelsd" if A.device.type == "cpu" else "qr")
    if driver == "gelsd":
        X, cond = _lstsq_gelsd(A, B)
    elif driver == "qr":
        X, cond = _lstsq_qr(A, B)
    else:
        raise ValueError(f"driver must be 'gelsd' or 'qr'; got {driver!r}")
    limit = _default_max_cond(A) if max_cond is None else max_cond
    fallback = ~(cond <= limit) | ~_all_finite(X)
    if bool(fallback.any()):
        X[fallback] = _ridge_normal_equations(A[fallback], B[fallback], ridge)
    return X, fallback


# ----------------------------------------------------------------------------------------------
# nonnegative least squares (Attention Matching β fit)


def _gram_top_eigenvalue(A: Tensor, *, exact_max: int = 64, power_iters: int = 32) -> Tensor:
    """L = λ_max(AᵀA) = ‖A‖₂², the Lipschitz constant of ∇½‖Aw − b‖².

    Exact (``eigvalsh`` of the smaller Gram matrix) when min(m, n) ≤ ``exact_max``; otherwise
    power iteration from the all-ones vector, inflated by 5% (power iteration underestimates) and
    capped at ‖A‖_F², which is always an upper bound.
    """
    m, n = A.shape[-2:]
    if min(m, n) <= exact_max:
        gram = A.mT @ A if n <= m else A @ A.mT
        return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0)
    v = A.new_full((*A.shape[:-2], n), 1.0 / math.sqrt(n))
    tiny = torch.finfo(A.dtype).tiny
    for _ in range(power_iters):
        u = batched_rmatvec(A, batched_matvec(A, v))
        v = u / u.norm(dim=-1, keepdim=True).clamp_min(tiny)
    rayleigh = batched_matvec(A, v).square().sum(-1)
    return torch.minimum(1.05 * rayleigh, A.square().sum((-2, -1)))


def nnls(
    A: Tensor,
    b: Tensor,
    iters: int = 2,
    init: str | Tensor = "lstsq",
    lower: float | Tensor | None = 0.0,
    upper: float | Tensor | None = None,
    *,
    ridge: float = 1e-6,
) -> Tensor:
    """Batched (box-)nonnegative least squares by Attention Matching Algorithm 3 (App. C.2).

    ``min_w ‖A w − b‖²`` subject to ``lower ≤ w ≤ upper``. Algorithm 3: unconstrained least squares
    (:func:`lstsq_ridge`, ridge-stabilized), clamped to the bounds (lines 1-5), then ``iters`` steps
    of projected gradient descent with step 1/L, L = ‖A‖₂² (lines 9-18; exact eigenvalue for small
    problems, power iteration otherwise). Each projected-gradient step never increases the
    objective, and the iterates converge to the exact solution, but slowly when A is
    ill-conditioned: ``iters=0`` or ``2`` (the paper's settings for OMP and for highest-attention
    keys) is an approximation. The AM β bounds map to ``lower=exp(β_min)``, ``upper=exp(β_max)``.

    Args:
        A: (..., m, n) features (AM: exp-scores Φ of the selected keys).
        b: (..., m) target (AM: attention mass).
        iters: projected-gradient steps after the initialization.
        init: ``"lstsq"`` (Algorithm 3), ``"zeros"``, or a (..., n) warm start; clamped either way.
        lower: lower bound ε (float, tensor broadcastable to (..., n), or None for −∞).
        upper: optional upper bound u (same forms).
        ridge: relative ridge of the least-squares fallback (see :func:`lstsq_ridge`).

    Returns:
        w: (..., n) with ``lower ≤ w ≤ upper``.

    Raises:
        ValueError: on bad shapes, negative ``iters``, an unknown ``init``, or lower > upper.
    """
    check_matrix(A, "A")
    if b.ndim < 1 or b.shape[-1] != A.shape[-2]:
        raise ValueError(f"expected A (..., m, n) and b (..., m); got {tuple(A.shape)} and {tuple(b.shape)}")
    if iters < 0:
        raise ValueError(f"iters must be >= 0; got {iters}")
    if lower is not None and upper is not None and bool(torch.as_tensor(lower > upper).any()):
        raise ValueError(f"need lower <= upper; got lower={lower}, upper={upper}")
    batch = torch.broadcast_shapes(A.shape[:-2], b.shape[:-1])
    A = A.expand(*batch, *A.shape[-2:])
    b = b.expand(*batch, b.shape[-1])
    n = A.shape[-1]
    if isinstance(init, Tensor):
        w = init.to(A).expand(*batch, n).clone()
    elif init == "lstsq":
        w = lstsq_ridge(A, b.unsqueeze(-1), ridge)[0].squeeze(-1)  # line 1: B⁽⁰⁾ = argmin ‖MB − y‖²
    elif init == "zeros":
        w = A.new_zeros((*batch, n))
    else:
        raise ValueError(f"init must be 'lstsq', 'zeros' or a tensor; got {init!r}")
    w = _project(w, lower, upper)  # lines 2-5: clamp to [ε, u]
    if iters == 0 or n == 0:
        return w
    L = _gram_top_eigenvalue(A)  # line 9: L ≈ ‖M‖₂²
    step = torch.where(L > 0, L.reciprocal(), torch.zeros_like(L)).unsqueeze(-1)  # line 10: η = 1/L
    for _ in range(iters):
        grad = batched_rmatvec(A, batched_matvec(A, w) - b)  # line 12: g = Mᵀ(MB − y)
        w = _project(w - step * grad, lower, upper)  # lines 13-17
    return w


def nnls_reference(A: Tensor, b: Tensor, *, tol: float | None = None, max_iter: int | None = None) -> Tensor:
    """Exact nonnegative least squares for one problem (Lawson–Hanson active set), float64.

    ``argmin_{w ≥ 0} ‖A w − b‖²``. Slow (Python loop, one lstsq per step) and meant as the ground
    truth in tests, not for use inside methods. Follows Lawson & Hanson (1974), ch. 23: move the
    variable with the largest positive gradient into the passive set, solve unconstrained least
    squares on the passive set, and step back toward the previous feasible point whenever that
    solution leaves the orthant.

    Args:
        A: (m, n) matrix.
        b: (m,) target.
        tol: optimality / positivity tolerance; default 10·eps·max(m, n)·‖A‖₁.
        max_iter: cap on inner iterations (default 3n + 10).

    Returns:
        w: (n,) float64 on the CPU.

    Raises:
        ValueError: on bad shapes.
        RuntimeError: if the iteration cap is reached.
    """
    if A.ndim != 2 or b.ndim != 1 or A.shape[0] != b.shape[0]:
        raise ValueError(f"expected A (m, n) and b (m,); got {tuple(A.shape)} and {tuple(b.shape)}")
    A = A.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    m, n = A.shape
    if tol is None:
        col_sum_max = float(A.abs().sum(0).max()) if n else 0.0
        tol = 10 * torch.finfo(torch.float64).eps * max(m, n) * col_sum_max
    max_iter = 3 * n + 10 if max_iter is None else max_iter
    x = torch.zeros(n, dtype=torch.float64)
    passive = torch.zeros(n, dtype=torch.bool)
    grad = A.T @ (b - A @ x)  # negative gradient of ½‖Ax − b‖²
    steps = 0
    while bool((~passive).any()) and float(grad.masked_fill(passive, -math.inf).max()) > tol:
        passive[int(grad.masked_fill(passive, -math.inf).argmax())] = True
        while True:
            steps += 1
            if steps > max_iter:
                raise RuntimeError(f"nnls_reference did not converge in {max_iter} iterations")
            s = torch.zeros(n, dtype=torch.float64)
            s[passive] = torch.linalg.lstsq(A[:, passive], b.unsqueeze(-1), driver="gelsd").solution[:, 0]
            if bool((s[passive] > tol).all()):
                break
            leaving = passive & (s <= tol)
            gap = x[leaving] - s[leaving]
            alpha = float(torch.where(gap > 0, x[leaving] / gap.clamp_min(1e-300), 0.0).min())
            x = x + alpha * (s - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = s
        grad = A.T @ (b - A @ x)
    return x


# ----------------------------------------------------------------------------------------------
# exponentials


def max_shifted_exp(logits: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """exp(ℓ − s) with s = max ℓ along ``dim`` (AM App. A.2 "Stable computation").

    ``Σ_j exp(ℓ_j) = exp(s) · Σ_j exp(ℓ_j − s)``, so masses and attention outputs are recovered
    exactly from the shifted features. A slice that is entirely −inf (fully masked) gets s = 0 and
    features 0 instead of NaN.

    Args:
        logits: any shape.
        dim: dimension to shift along (the key dimension).

    Returns:
        (features, shift): features = exp(logits − shift) in [0, 1]; shift has ``dim`` kept (size 1).
    """
    shift = logits.amax(dim=dim, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return torch.exp(logits - shift), shift
