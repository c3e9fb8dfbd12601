"""The least-squares pieces of an Attention Matching fit, batched over problems: a ridge solve
through the normal equations (Cholesky, a tiny ridge toward the prior), box-nonnegative least
squares for the mass weights (Algorithm 3), and OMP key selection on the mass with incremental
Gram updates (Algorithms 1–2). See :mod:`.solve` for the problem and the solver choices.
"""

from __future__ import annotations

import math

import torch

from kvfold.methods.compaction.omp import gather_columns, omp_greedy, omp_width

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- linear algebra


SYMMETRIC_BLOCK = 256
"""Columns per block of :func:`symmetric_product` (narrower products lose BLAS efficiency)."""


def symmetric_product(left: Tensor, right: Tensor, block: int = SYMMETRIC_BLOCK) -> Tensor:
    """``leftᵀ right`` ``(P, t, t)`` for ``(P, n, t)`` factors whose product is symmetric
    (``Φ_Sᵀ R Φ_S`` with ``left = R Φ_S``, ``XᵀX``; the normal equations of §3.2 and eq. 4):
    only the blocks on and above the diagonal are multiplied, those below are their mirror, so
    a wide product costs a little over half. Narrow products (``t ≤ 2·block``) are one ``bmm``.
    The diagonal blocks keep their own rounding; callers symmetrise (``½(G + Gᵀ)``) as before.
    """
    t = right.shape[-1]
    if t <= 2 * block:
        return left.mT @ right
    out = right.new_empty(*right.shape[:-2], t, t)
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        out[..., lo:hi, lo:] = left[..., lo:hi].mT @ right[..., lo:]
        out[..., hi:, lo:hi] = out[..., lo:hi, hi:].mT
    return out


def _masked_gram(gram: Tensor, ok: Tensor) -> Tensor:
    """Zero rows/columns of unused slots and put 1 on their diagonal (keeps Cholesky defined)."""
    okf = ok.to(gram.dtype)
    return gram * okf[..., :, None] * okf[..., None, :] + torch.diag_embed(1.0 - okf)


def ridge_solve(gram: Tensor, rhs: Tensor, ridge: float, ok: Tensor | None = None) -> Tensor:
    """Solve ``(G + λI) X = R`` by Cholesky, ``λ = ridge · mean diag(G) + 16·eps·trace(G)`` per problem
    (the second term keeps the factorisation defined at the working precision: it is negligible in
    float64 and about 2e-6 of the trace in float32).

    Args:
        gram: ``(..., t, t)`` symmetric PSD Gram matrices.
        rhs: ``(..., t, k)`` right-hand sides.
        ridge: relative ridge (> 0).
        ok: ``(..., t)`` bool, used slots (others get an identity row and a zero solution).

    Returns:
        ``(..., t, k)``. Problems whose factorisation fails are retried with a 10³× larger ridge
        (twice); a problem that still fails gets zeros (the prior).
    """
    t = gram.shape[-1]
    if t == 0:
        return rhs.clone()
    if ok is not None:
        gram = _masked_gram(gram, ok)
        rhs = rhs * ok[..., None].to(rhs.dtype)
    diag = gram.diagonal(dim1=-2, dim2=-1)
    count = ok.sum(-1).clamp_min(1) if ok is not None else torch.full(diag.shape[:-1], t, device=diag.device)
    scale = (diag * (ok if ok is not None else 1)).sum(-1) / count
    tiny = torch.finfo(gram.dtype).tiny ** 0.5
    floor = 16 * torch.finfo(gram.dtype).eps * scale * count
    lam = ridge * torch.where(scale > 0, scale, torch.ones_like(scale)) + floor + tiny
    eye = torch.eye(t, dtype=gram.dtype, device=gram.device)
    chol, info = torch.linalg.cholesky_ex(gram + lam[..., None, None] * eye)  # every problem at once
    sol = torch.cholesky_solve(rhs, chol)
    good = (info == 0) & torch.isfinite(sol).flatten(-2).all(-1)
    out = torch.where(good[..., None, None], sol, torch.zeros_like(sol))
    if bool(good.all()):  # the one host read of a solve where every problem factorises (on a GPU: one wait)
        return out
    todo = ~good
    for factor in (1e3, 1e6):  # the problems that failed, alone
        if not bool(todo.any()):
            break
        g = gram[todo] + (factor * lam[todo])[..., None, None] * eye
        chol, info = torch.linalg.cholesky_ex(g)
        sol = torch.cholesky_solve(rhs[todo], chol)
        good = (info == 0) & torch.isfinite(sol).flatten(-2).all(-1)
        idx = todo.nonzero(as_tuple=True)
        sel = tuple(i[good] for i in idx)
        out[sel] = sol[good]
        still = todo.clone()
        still[sel] = False
        todo = still
    return out


POWER_NORMALISE_EVERY = 5
"""Power-iteration steps between normalisations in :func:`top_eigenvalue`."""


def top_eigenvalue(gram: Tensor, iters: int = 30) -> Tensor:
    """``λ_max(G)`` of symmetric positive semi-definite ``(..., t, t)`` Gram matrices: exact for t ≤ 64,
    else power iteration inflated 5% and capped by the trace (as
    :func:`kvfold.methods.compaction.linalg.nnls` estimates ``L ≈ ‖M‖₂²``, Attention Matching App. C.2).

    The iteration runs on ``G / tr G``, whose largest eigenvalue lies in [1/t, 1] for a nonzero ``G``,
    and normalises its vector every :data:`POWER_NORMALISE_EVERY` steps only. The direction is the one
    normalising every step gives, at one launch a step instead of four on a GPU; from the all-ones
    start (not orthogonal to the top eigenvector of a Gram of nonnegative features, as the fits' are)
    five unnormalised steps shrink the vector by about t⁻⁵ at most, far above float32's smallest
    normal number at any width held in memory. All-zero matrices (padding) give 0.
    """
    if gram.shape[-1] <= 64:
        return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0)
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    scale = torch.where(trace > 0, trace.reciprocal(), torch.zeros_like(trace))
    unit = gram * scale[..., None, None]
    tiny = torch.finfo(gram.dtype).tiny
    v = torch.full(gram.shape[:-1], gram.shape[-1] ** -0.5, dtype=gram.dtype, device=gram.device)
    for step in range(1, iters + 1):
        v = (unit @ v[..., None])[..., 0]
        if step % POWER_NORMALISE_EVERY == 0 or step == iters:
            v = v / v.norm(dim=-1, keepdim=True).clamp_min(tiny)
    rayleigh = (v * (unit @ v[..., None])[..., 0]).sum(-1) * trace
    return torch.minimum(1.05 * rayleigh.clamp_min(0), trace)


def box_nnls(
    gram: Tensor,
    corr: Tensor,
    ok: Tensor,
    *,
    lower: float,
    upper: float | None,
    iters: int,
    ridge: float,
    prior: float = 1.0,
) -> Tensor:
    """Algorithm 3 (App. C.2) on the normal equations: ``min_{lower ≤ w ≤ upper} ‖Φ_S w − m‖²``.

    With ``G = Φ_Sᵀ Φ_S`` and ``c = Φ_Sᵀ m``: line 1 (least squares) is ``(G + λI)(w − w₀) =
    c − G w₀`` with the prior ``w₀ = prior`` (a tiny ridge, see the module docstring); lines 2–5
    clamp; lines 9–18 run ``iters`` projected-gradient steps ``w ← Π(w − (G w − c)/L)`` with
    ``L = λ_max(G)``.

    Args:
        gram: ``(..., t, t)``; corr: ``(..., t)``; ok: ``(..., t)`` used slots.
        lower, upper: the box (``upper`` None = unbounded above).
        iters: projected-gradient steps.
        ridge: relative ridge of the initial solve.
        prior: the value the ridge pulls toward.

    Returns:
        ``(..., t)`` weights in the box on used slots, 0 elsewhere.
    """
    okf = ok.to(gram.dtype)
    gram = _masked_gram(gram, ok)
    corr = corr * okf
    w0 = prior * okf
    delta = ridge_solve(gram, (corr - (gram @ w0[..., None])[..., 0])[..., None], ridge, ok)[..., 0]
    w = (w0 + delta).clamp(min=lower, max=upper)  # lines 1-5: B⁽⁰⁾ = clamp(lstsq)
    if iters > 0:
        # line 9: L ≈ ‖M‖₂², of the used slots only: the unit diagonal of unused ones (which kept the
        # factorisation above defined) would cap the step of a problem padded to a wider group's
        # width. Cleared in place: this masked Gram is our own, and the steps below read the used
        # rows only (an unused row's column is zero).
        gram.diagonal(dim1=-2, dim2=-1).mul_(okf)
        lipschitz = top_eigenvalue(gram)
        step = torch.where(lipschitz > 0, lipschitz.reciprocal(), torch.zeros_like(lipschitz))[..., None]
        for _ in range(iters):  # lines 11-18: g = Mᵀ(MB − y); B = Π(B − g/L)
            grad = (gram @ w[..., None])[..., 0] - corr
            w = (w - step * grad).clamp(min=lower, max=upper)
    return w * okf


def _sq_residual(mm: Tensor, corr: Tensor, gram: Tensor, w: Tensor) -> Tensor:
    """``‖m − Φ_S w‖² = mᵀm − 2 wᵀc + wᵀ G w`` (clamped at 0 against rounding)."""
    quad = (w * (gram @ w[..., None])[..., 0]).sum(-1)
    return (mm - 2 * (w * corr).sum(-1) + quad).clamp_min(0)


def _refine_candidates(
    gram: Tensor,
    g: Tensor,
    corr: Tensor,
    ok: Tensor,
    w_new: Tensor,
    w_prev: Tensor,
    w_max: float | None,
    ridge: float,
) -> list[Tensor]:
    """``refine``: the refit re-solved on its positive support (an active-set step) and a few
    projected-gradient steps from the previous weights (``g``: the masked Gram), beside those weights."""
    support = ok & (w_new > 0)
    for _ in range(2):  # re-solve on the positive support (an active-set step)
        w_new = box_nnls(gram, corr, support, lower=0.0, upper=w_max, iters=0, ridge=ridge)
        support = support & (w_new > 0)
    lipschitz = g.abs().sum(-1).amax(-1)  # Gershgorin: ≥ λ_max(G), so 1/L is a safe step
    step = torch.where(lipschitz > 0, lipschitz.reciprocal(), torch.zeros_like(lipschitz))[..., None]
    w_pg = w_prev
    for _ in range(3):  # projected gradient from the previous weights: never increases the residual
        w_pg = ((w_pg - step * ((g @ w_pg[..., None])[..., 0] - corr)).clamp(min=0.0, max=w_max)) * ok
    return [w_new, w_pg, w_prev]


def _omp_refit(
    gram: Tensor,
    corr: Tensor,
    ok: Tensor,
    w_prev: Tensor,
    mm: Tensor,
    *,
    w_max: float | None,
    nnls_iters: int,
    ridge: float,
    refine: bool,
) -> Tensor:
    """The NNLS refit of OMP (Alg. 1 line 7, Alg. 2 line 9); never worse than ``w_prev``."""
    w_new = box_nnls(
        gram, corr, ok, lower=0.0, upper=w_max, iters=nnls_iters, ridge=ridge, prior=0.0 if not refine else 1.0
    )
    g = _masked_gram(gram, ok)
    candidates = [w_new, w_prev]
    if refine:
        candidates = _refine_candidates(gram, g, corr, ok, w_new, w_prev, w_max, ridge)
    best = candidates[0]
    best_res = _sq_residual(mm, corr, g, best)
    tol = 64 * torch.finfo(g.dtype).eps * mm  # the Gram form of the residual is exact to about this
    for cand in candidates[1:]:  # the first (least-squares) refit wins ties up to rounding
        res = _sq_residual(mm, corr, g, cand)
        better = res < best_res - tol
        best = torch.where(better[:, None], cand, best)
        best_res = torch.where(better, res, best_res)
    return best


class GramRefit:
    """OMP's refit on the normal equations (an :class:`kvfold.methods.compaction.omp.OMPRefit`).

    ``Φᵀ Φ_S`` is kept one column per slot, filled for the keys added since the last refit in one
    pass over Φ, so a refit is a ``t × t`` solve (:func:`box_nnls`, see :func:`omp_keys` for
    ``refine``) and the correlations ``Φᵀ r = Φᵀ m − (Φᵀ Φ_S) w`` cost no pass over Φ.
    """

    zero_unused = False

    def __init__(
        self, phi: Tensor, mass: Tensor, width: int, *, w_max: float | None, nnls_iters: int, ridge: float, refine: bool
    ) -> None:
        P, _, T = phi.shape
        self.phi = phi
        self.dtype = phi.dtype
        self.w_max, self.nnls_iters, self.ridge, self.refine = w_max, nnls_iters, ridge, refine
        self.cross = torch.zeros(P, T, width, dtype=phi.dtype, device=phi.device)  # Φᵀ Φ_S, one column per slot
        self.c0 = torch.bmm(mass[:, None, :], phi)[:, 0]  # Φᵀ m
        self.mm = mass.square().sum(-1)
        self.corr = self.c0.clone()  # Alg. 1 line 3: r = m, so c = Φᵀ m
        self.first_new = torch.zeros(P, dtype=torch.long, device=phi.device)  # first slot without its column

    def start_norm(self) -> Tensor:
        return self.mm.sqrt()

    def correlations(self) -> Tensor:
        return self.corr

    def weights(self, cols: Tensor, ok: Tensor, w: Tensor, refit: Tensor, count: Tensor) -> Tensor:
        # Φᵀ Φ_S for the keys added since the last refit, in one pass over Φ
        lo, hi = int(self.first_new.min()), cols.shape[-1]
        self.cross[:, :, lo:hi] = torch.bmm(gather_columns(self.phi, cols[:, lo:hi]).mT, self.phi).mT
        self.first_new = torch.where(refit, count, self.first_new)
        s = cols.shape[-1]
        gram = self.cross[:, :, :s].gather(1, cols[:, :, None].expand(-1, -1, s))  # Φ_Sᵀ Φ_S
        gram = 0.5 * (gram + gram.mT)
        cs = self.c0.gather(1, cols) * ok
        return _omp_refit(
            gram,
            cs,
            ok,
            w * ok,
            self.mm,
            w_max=self.w_max,
            nnls_iters=self.nnls_iters,
            ridge=self.ridge,
            refine=self.refine,
        )

    def reorder(self, moved: Tensor, order: Tensor) -> None:
        s = order.shape[-1]
        rows = moved.nonzero(as_tuple=True)[0]
        T = self.cross.shape[1]
        self.cross[rows, :, :s] = self.cross[rows, :, :s].gather(2, order[rows, None, :].expand(-1, T, -1))

    def update(self, w_fit: Tensor, cols: Tensor, w: Tensor, ok: Tensor, refit: Tensor) -> Tensor:
        # a β_min pruning compacted the slots: the keys refilled into the freed ones need their columns
        self.first_new = torch.minimum(self.first_new, ok.sum(-1))
        s = cols.shape[-1]
        # Alg. 2 line 10: r = m − Φ_S w, so Φᵀ r = Φᵀ m − (Φᵀ Φ_S) w
        self.corr = self.c0 - torch.bmm(self.cross[:, :, :s], w[..., None])[..., 0]
        gram = self.cross[:, :, :s].gather(1, cols[..., None].expand(-1, -1, s))
        res = _sq_residual(self.mm, self.c0.gather(1, cols) * ok, _masked_gram(0.5 * (gram + gram.mT), ok), w)
        return res.sqrt()


def omp_keys(
    phi: Tensor,
    mass: Tensor,
    counts: Tensor,
    entry_valid: Tensor,
    *,
    k: int = 1,
    tau: int = 1,
    nnls_iters: int = 0,
    beta_min: float | None = -7.0,
    beta_max: float | None = 7.0,
    ridge: float = 1e-6,
    refine: bool = True,
    refills: int = 8,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OMP key selection on the mass (§3.3 Algorithm 1; App. C.1 Algorithm 2), per-problem budgets.

    Each greedy step adds the ``k`` unselected keys with the largest correlation ``c_j = rᵀ Φ_{:,j}``
    (raw, as in the paper); every ``tau`` steps and when a problem's budget is filled, ``w`` is
    refitted (Algorithm 3 with ``nnls_iters`` steps, ``0 ≤ w ≤ e^β_max``) and ``r = m − Φ_S w``.
    A refit never fits worse than the previous weights (zero on the new keys, which is feasible),
    so the residual never increases, as with the exact NNLS of Algorithm 1. With ``refine``
    (default) the clamped least-squares refit is brought closer to exact NNLS: it is re-solved on
    its positive support, and a few projected-gradient steps from the previous weights compete
    with it (so a new key with positive correlation always enters with a positive weight instead
    of being pruned and replaced over and over when the clamped refit goes wrong). Once the
    budget is filled, keys with ``w < e^β_min`` are discarded for good and selection continues
    (App. C.2 "Stabilizing β"), at most ``refills`` times per problem: after that the keys still
    below ``e^β_min`` are discarded and their slots stay empty. The paper continues until every
    kept key satisfies the bound and notes that OMP rarely goes below it; on small models it
    often does, one or two keys per round, and an unbounded loop ran ~1,900 greedy steps for a
    budget of 205 keys. ``refine=False`` is Algorithms 1–3 verbatim (plus the never-worse rule),
    as :func:`kvfold.methods.compaction.omp.omp_select`. The loop is
    :func:`kvfold.methods.compaction.omp.omp_greedy`, the refit :class:`GramRefit`.

    Args:
        phi: ``(P, n, T)`` mass features; mass: ``(P, n)`` target.
        counts: ``(P,)`` keys to select per problem (≤ valid entries).
        entry_valid: ``(P, T)`` bool, candidate keys.
        refills: how many times a problem may go back to selection after a β_min pruning.

    Returns:
        ``(index (P, t), weights (P, t), lengths (P,), residual_history (P, steps + 1))`` with
        ``t = max(counts)``; selected slots first, in selection order.
    """
    P, _, T = phi.shape
    t_max = int(counts.max()) if P else 0
    w_min = None if beta_min is None else math.exp(beta_min)
    w_max = None if beta_max is None else math.exp(beta_max)
    width = omp_width(t_max, k, T)
    fit = GramRefit(phi, mass, width, w_max=w_max, nnls_iters=nnls_iters, ridge=ridge, refine=refine)
    banned = ~entry_valid.clone()
    return omp_greedy(fit, counts, banned, t_max, k=k, tau=tau, w_min=w_min, refills=refills, refill_at_once=True)
