"""Attention Matching fits, batched over many (layer, row, KV head, chunk) problems.

Zweiger et al. 2026, "Fast KV Compaction via Attention Matching" (``papers/attention-matching.md``).
One *problem* is one block of a single KV head: keys ``K`` ``(T, d)``, values ``V``, existing
log-mass ``β⁰`` (−inf = empty slot) and reference queries ``Q`` ``(n, d)``. It is compacted to
``t`` entries ``(C_k, β, C_v)`` that match, on the reference queries, the block's attention mass
(eq. 2) and its locally normalised attention output (eq. 1):

* features ``Φ_ij = exp(s·q_i·K_j + β⁰_j − shift_i)`` with the per-query max-shift of App. A.2
  ("Stable computation"); target mass ``m_i = Σ_j Φ_ij``; target output ``Y = (Φ V) / m``.
* keys ``C_k = K_S``, a subset (§3.3): highest attention (RMS over queries of the block-local
  attention weights, App. F.1) or OMP on the mass (Algorithm 1; k keys per step and a refit every
  τ steps, Algorithm 2).
* ``w = exp(β − β⁰_S)`` by (box-)nonnegative least squares ``min ‖Φ_S w − m‖`` (§3.2,
  Algorithm 3: least-squares init, clamp, projected gradient); so ``β = β⁰_S + log w``.
* values by least squares ``min ‖X C_v − Y‖`` with ``X = softmax(s·Q C_kᵀ + β)`` (eq. 3–4).

Solver choices (differences from the paper, same minimisers): the least-squares problems are
solved through their normal equations with Cholesky (the paper's App. C.2 found Cholesky the
fastest; on CPU it is 10–15× faster than the SVD/QR ``lstsq``), with a tiny ridge relative to the
Gram diagonal that pulls the solution toward the *prior* "every kept entry keeps its own mass and
value" (``w = 1``, ``C_v = V_S``) instead of toward zero. Where the queries determine the answer
the prior has no effect; where they do not (fewer queries than kept entries, collinear features)
the entry keeps its own mass and value rather than a minimum-norm guess. In particular ``t = T``
reproduces the block exactly for any number of queries. OMP keeps ``Φᵀ Φ_S`` incrementally, so a
refit is a ``t × t`` solve and correlations ``Φᵀ r = Φᵀ m − (Φᵀ Φ_S) w`` cost no pass over Φ.
``solver="exact"`` runs the reference solvers of :mod:`kvfold.methods.compaction.linalg` instead.

All work is in float32 (float64 for float64 inputs), vectorised over problems; problems are
processed in groups whose ``(n, T)`` feature matrices fit a memory budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from kvfold.methods.compaction.attention_matching.solvers import (
    _gather_cols,
    box_nnls,
    omp_keys,
    ridge_solve,
    symmetric_product,
)
from kvfold.methods.compaction.linalg import lstsq_ridge, nnls, omp_select
from kvfold.runtime.attention import FLASH_WITH_LSE

Tensor = torch.Tensor

DEFAULT_GROUP_BYTES = 192 << 20
"""Bytes of ``(n, T)`` feature matrices processed at once (several such temporaries exist)."""
STATISTICS_BYTES = 4 << 20
"""Bytes of one ``(problems, query block, T)`` feature block of :func:`_block_statistics`."""


@dataclass(frozen=True)
class FitConfig:
    """How a block is compacted.

    Attributes:
        keys: ``"highest"`` (AM-HighestAttnKeys) or ``"omp"`` (AM-OMP).
        k: OMP keys added per greedy step (1 = Algorithm 1; 4 in AM-OMP-fast).
        tau: OMP greedy steps between NNLS refits (1 = Algorithm 1; 2 in AM-OMP-fast).
        nnls_iters: projected-gradient steps of Algorithm 3 (2 for highest attention, 0 for OMP).
        beta_min, beta_max: bounds on ``β − β⁰`` (App. C.2 "Stabilizing β"): highest attention
            is boxed to ``[−3, 3]``; OMP drops keys below ``−7`` and caps at ``7``. None = no bound.
        ridge: relative ridge of the normal equations (fraction of the mean Gram diagonal).
        refills: OMP: times selection resumes after a β_min pruning (see :func:`omp_keys`).
        fit_values: refit ``C_v`` by least squares (False keeps the selected values).
        fit_beta: refit β by NNLS (False keeps ``β⁰``; OMP always fits β).
        mass_weight: how the queries are weighted in the mass fit (highest-attention and given
            keys): ``"none"`` is the paper's ``‖Φ_S w − m‖²``, ``"relative"`` divides each query's
            residual by its mass ``m_i`` (the relative error ``Σ_i ((Φ_S w)_i / m_i − 1)²``), so
            a query whose attention is peaked on a few keys (small max-shifted mass) counts as
            much as a diffuse one (mass in the hundreds).
        value_ridge: ridge of the value fit relative to the mean Gram diagonal, toward the kept
            entries' own values (``C_v = V_S`` when the queries say nothing); None = ``ridge``.
        query_block: reference queries per block while the fit's statistics are accumulated
            (memory follows the block, not the number of queries).
        solver: ``"gram"`` (normal equations, fast) or ``"exact"`` (:mod:`kvfold.methods.compaction.linalg`).
        group_bytes: memory budget for the feature matrices of one group of problems.
    """

    keys: Literal["highest", "omp"] = "highest"
    k: int = 1
    tau: int = 1
    nnls_iters: int = 2
    beta_min: float | None = -3.0
    beta_max: float | None = 3.0
    ridge: float = 1e-6
    refills: int = 8
    fit_values: bool = True
    fit_beta: bool = True
    mass_weight: Literal["none", "relative"] = "none"
    value_ridge: float | None = None
    solver: Literal["gram", "exact"] = "gram"
    group_bytes: int = DEFAULT_GROUP_BYTES
    query_block: int = 1024


@dataclass
class Compacted:
    """Result of :func:`fit_problems`, leading dims = the problems' batch dims.

    Attributes:
        index: ``(..., t)`` long, kept positions along the problem's T axis, ascending; slots past
            ``lengths`` repeat a valid index (their β is −inf).
        log_mass: ``(..., t)`` β of the compacted entries (−inf past ``lengths``).
        values: ``(..., t, D)`` fitted values ``C_v``.
        lengths: ``(...)`` entries kept.
        mass_error: ``(...)`` ``‖m − Φ_S w‖ / ‖m‖`` on the reference queries (eq. 2 residual).
        output_error: ``(...)`` ``‖X C_v − Y‖_F / ‖Y‖_F`` (eq. 1 residual).
        residual_history: OMP only: ``(..., steps + 1)`` ``‖m − Φ_S w‖`` after each greedy step.
    """

    index: Tensor
    log_mass: Tensor
    values: Tensor
    lengths: Tensor
    mass_error: Tensor
    output_error: Tensor
    residual_history: Tensor | None = None


# ---------------------------------------------------------------------------- one group


def _logits(keys: Tensor, beta0: Tensor, queries: Tensor, scaling: Tensor) -> Tensor:
    """``ℓ = s·Q Kᵀ + β⁰`` ``(P, n, T)`` (β⁰ = −inf on empty slots)."""
    return torch.bmm(queries, keys.mT).mul_(scaling[:, None, None]).add_(beta0[:, None, :])


def _features(
    keys: Tensor, beta0: Tensor, queries: Tensor, query_valid: Tensor, scaling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``Φ = exp(ℓ − shift)`` with the per-query max-shift (App. A.2; invalid queries → zero rows),
    the mass ``m = Φ·1`` and the shift ``(P, n)``."""
    phi = _logits(keys, beta0, queries, scaling)
    shift = phi.amax(dim=-1)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    phi.sub_(shift[..., None]).exp_()  # App. A.2: exp(ℓ − max ℓ), in place
    if not bool(query_valid.all()):
        phi.mul_(query_valid[..., None].to(phi.dtype))
    return phi, phi.sum(-1), shift


def _block_statistics(
    keys: Tensor,
    values: Tensor,
    beta0: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    scaling: Tensor,
    block: int = 256,
    squares: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What highest-attention selection needs, one block of queries at a time (cache friendly):
    the shift ``(P, n)``, the mass ``m`` ``(P, n)``, the target ``Y = Φ V / m`` ``(P, n, D)`` and
    ``Σ_i a_ij² / n`` ``(P, T)`` with ``a_ij = Φ_ij / m_i`` (the mean squared attention weight; zeros
    unless ``squares``: given keys need no selection score)."""
    P, n, _ = queries.shape
    shift = queries.new_zeros(P, n)
    mass = queries.new_zeros(P, n)
    target = queries.new_zeros(P, n, values.shape[-1])
    square = queries.new_zeros(P, keys.shape[1])
    n_valid = query_valid.sum(-1).clamp_min(1).to(queries.dtype)
    # A few problems at a time: the (problems, block, T) features stay in cache through their
    # ten or so passes. Every operation is per problem, so the result is the same bit for bit.
    step = max(1, STATISTICS_BYTES // max(1, block * keys.shape[1] * queries.element_size()))
    for p0 in range(0, P, step):
        p1 = min(P, p0 + step)
        k, v, b0, sc = keys[p0:p1], values[p0:p1], beta0[p0:p1], scaling[p0:p1]
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            phi, m, s = _features(k, b0, queries[p0:p1, lo:hi], query_valid[p0:p1, lo:hi], sc)
            safe = torch.where(m > 0, m, torch.ones_like(m))
            shift[p0:p1, lo:hi], mass[p0:p1, lo:hi] = s, m
            target[p0:p1, lo:hi] = torch.bmm(phi, v) / safe[..., None]  # eq. 1: exp(ℓ) V / Mass
            if squares:
                weights = (safe.pow(-2) / n_valid[p0:p1, None])[:, None, :]
                square[p0:p1] += torch.bmm(weights, phi.square_())[:, 0]
    return shift, mass, target, square


def _fused_statistics_apply(keys: Tensor, queries: Tensor, scaling: Tensor, config: FitConfig) -> bool:
    """True when :func:`_fused_statistics` may replace :func:`_block_statistics`: float32 on CPU,
    one logit scale, and a fit whose answer does not depend on the per-query shift (relative
    mass weighting: every quantity of the fit is a ratio to ``m_i``)."""
    return (
        FLASH_WITH_LSE is not None
        and config.mass_weight == "relative"
        and config.solver != "exact"
        and keys.device.type == "cpu"
        and keys.dtype == torch.float32
        and queries.dtype == torch.float32
        and bool((scaling == scaling[0]).all())
    )


def _fused_statistics(
    keys: Tensor, values: Tensor, beta0: Tensor, queries: Tensor, query_valid: Tensor, scaling: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The shift, mass and target of :func:`_block_statistics` (no selection score) from the fused
    attention kernel: ``Y = softmax(s·Q Kᵀ + β⁰) V`` and each query's log-sum-exp ``lse_i``, taken
    as the shift, so ``Φ_ij = exp(ℓ_ij − lse_i)`` are the attention weights and ``m_i = 1``.
    With relative mass weighting (``Σ_i ((Φ_S w)_i / m_i − 1)²``) and the value fit on
    ``X = Φ_S w / (Φ_S w)·1`` the fit is the same as with App. A.2's max-shift, at half the time
    of the blocks of :func:`_block_statistics` (no ``(n, T)`` features in memory either)."""
    P, n, _ = queries.shape
    mask = beta0[None, :, None, :].expand(1, P, n, beta0.shape[-1])
    target, lse = FLASH_WITH_LSE(
        queries[None], keys[None], values[None], 0.0, False, attn_mask=mask, scale=float(scaling[0])
    )
    valid = query_valid.to(queries.dtype)
    return lse[0].to(queries.dtype), valid, target[0] * valid[..., None]


def _selected_features(
    keys: Tensor,
    beta0: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    scaling: Tensor,
    shift: Tensor,
    idx: Tensor,
    ok: Tensor,
) -> Tensor:
    """``Φ_S = exp(ℓ_S − shift)`` ``(P, n, t)`` for the kept keys only (zero on unused slots)."""
    k_s = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))
    b_s = beta0.gather(1, idx).masked_fill(~ok, -math.inf)
    phi_s = _logits(k_s, b_s, queries, scaling).sub_(shift[..., None]).exp_()
    return phi_s.mul_(query_valid[..., None].to(phi_s.dtype))


def _fit_group(
    keys: Tensor,
    values: Tensor,
    log_mass: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    counts: Tensor,
    scaling: Tensor,
    config: FitConfig,
    given: Tensor | None = None,
) -> Compacted:
    """Compact ``P`` problems at once (see the module docstring); ``given`` ``(P, t)`` fixes the
    kept positions (−1 = unused slot) and only β and the values are fitted."""
    P, T, _ = keys.shape
    dt = torch.float64 if keys.dtype == torch.float64 or queries.dtype == torch.float64 else torch.float32
    K, V, Q = keys.to(dt), values.to(dt), queries.to(dt)
    beta0 = torch.where(torch.isfinite(log_mass), log_mass, torch.full_like(log_mass, -math.inf)).to(dt)
    entry_valid = torch.isfinite(beta0)
    qv = query_valid.to(torch.bool)
    scale = scaling.to(dt)
    t_max = int(counts.max()) if P else 0
    history = None
    if given is not None or config.keys == "highest":
        if given is not None and _fused_statistics_apply(K, Q, scale, config):
            shift, mass, target = _fused_statistics(K, V, beta0, Q, qv, scale)
        else:
            shift, mass, target, square = _block_statistics(K, V, beta0, Q, qv, scale, squares=given is None)
        if given is not None:
            ok = (given >= 0) & entry_valid.gather(1, given.clamp_min(0))
            idx = torch.where(ok, given, torch.full_like(given, T)).sort(dim=-1).values[:, :t_max]  # used first
        else:
            # §3.3 / App. F.1: keep the t keys with the largest s_j = sqrt(mean_i a_ij²)
            score = square.masked_fill(~entry_valid, -math.inf)
            top = score.topk(t_max, dim=-1).indices
            ok = (torch.arange(t_max, device=K.device)[None, :] < counts[:, None]) & entry_valid.gather(1, top)
            idx = torch.where(ok, top, torch.full_like(top, T)).sort(dim=-1).values  # ascending positions
        ok = idx < T
        idx = torch.where(ok, idx, idx[:, :1].clamp_max(max(T - 1, 0)))
        lengths = ok.sum(-1)
        if config.solver != "exact":
            return _streamed_fit(K, V, beta0, Q, qv, scale, shift, mass, target, idx, ok, lengths, config)
        phi_s = _selected_features(K, beta0, Q, qv, scale, shift, idx, ok)
        if config.fit_beta:
            # §3.2: w = argmin_{w ≥ 0} ‖Φ_S w − m‖ (box [e^β_min, e^β_max] for highest attention)
            lower, upper = _weight_box(config)
            root = _mass_weights(mass, qv, config.mass_weight).sqrt()[..., None]
            rows, target_mass = phi_s * root, mass * root[..., 0]
            w = nnls(rows, target_mass, iters=config.nnls_iters, lower=lower, upper=upper, ridge=config.ridge) * ok
        else:
            w = ok.to(dt)
    else:
        phi, mass, _ = _features(K, beta0, Q, qv, scale)
        safe_mass = torch.where(mass > 0, mass, torch.ones_like(mass))
        target = torch.bmm(phi, V) / safe_mass[..., None]  # eq. 1: exp(ℓ) V / Mass
        if config.solver == "exact":
            idx, w, lengths, history = _omp_exact(phi, mass, counts, entry_valid, config)
        else:
            idx, w, lengths, history = omp_keys(
                phi,
                mass,
                counts,
                entry_valid,
                k=config.k,
                tau=config.tau,
                nnls_iters=config.nnls_iters,
                beta_min=config.beta_min,
                beta_max=config.beta_max,
                ridge=config.ridge,
                refills=config.refills,
            )
        ok = (torch.arange(idx.shape[-1], device=K.device)[None, :] < lengths[:, None]) & (w > 0)
        # ascending positions, unused slots last
        order = torch.where(ok, idx, torch.full_like(idx, T)).sort(dim=-1)
        ok = order.values < T
        idx = torch.where(ok, order.values, idx[:, :1])
        w = w.gather(1, order.indices) * ok
        lengths = ok.sum(-1)
        phi_s = _gather_cols(phi, idx) * ok[:, None, :].to(dt)
        del phi
    fitted_mass = torch.bmm(phi_s, w[..., None])[..., 0]
    mass_norm = mass.norm(dim=-1)
    mass_error = (fitted_mass - mass).norm(dim=-1) / torch.where(mass_norm > 0, mass_norm, torch.ones_like(mass_norm))
    # eq. 3-4: X = softmax(s·Q C_kᵀ + β) = Φ_S w / (Φ_S w)·1, C_v = argmin ‖X C_v − Y‖
    x = phi_s.mul_(w[:, None, :])
    x.div_(torch.where(fitted_mass > 0, fitted_mass, torch.ones_like(fitted_mass))[..., None])
    v_s = V.gather(1, idx[..., None].expand(-1, -1, V.shape[-1]))
    if config.fit_values and t_max > 0:
        residual = target - x @ v_s
        if config.solver == "exact":
            fit = lstsq_ridge(x, residual, _value_ridge(config))[0]
        else:
            fit = ridge_solve(x.mT @ x, x.mT @ residual, _value_ridge(config), ok)
        c_v = v_s + fit * ok[..., None].to(dt)
    else:
        c_v = v_s
    y_norm = target.flatten(1).norm(dim=-1)
    out_err = (x @ c_v - target).flatten(1).norm(dim=-1) / torch.where(y_norm > 0, y_norm, torch.ones_like(y_norm))
    beta0_s = beta0.gather(1, idx)
    log_w = torch.log(torch.where(ok, w, torch.ones_like(w)))
    beta = torch.where(ok, beta0_s + log_w, torch.full_like(beta0_s, -math.inf))
    return Compacted(
        index=idx,
        log_mass=beta,
        values=c_v,
        lengths=lengths,
        mass_error=mass_error,
        output_error=out_err,
        residual_history=history,
    )


def _weight_box(config: FitConfig) -> tuple[float, float | None]:
    """The box of ``w = exp(β − β⁰)``: ``[e^β_min, e^β_max]`` (None bounds: ``[0, ∞)``)."""
    lower = 0.0 if config.beta_min is None else math.exp(config.beta_min)
    upper = None if config.beta_max is None else math.exp(config.beta_max)
    return lower, upper


def _value_ridge(config: FitConfig) -> float:
    return config.ridge if config.value_ridge is None else config.value_ridge


def _mass_weights(mass: Tensor, query_valid: Tensor, kind: str) -> Tensor:
    """Per-query weights ``r_i`` of the mass fit ``Σ_i r_i ((Φ_S w)_i − m_i)²`` (0 on invalid queries)."""
    valid = query_valid.to(mass.dtype)
    if kind == "none":
        return valid
    if kind != "relative":
        raise ValueError(f"mass_weight must be none or relative; got {kind!r}")
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))
    return valid * safe.pow(-2)  # relative error: ((Φ_S w)_i − m_i) / m_i


def _streamed_fit(
    keys: Tensor,
    values: Tensor,
    beta0: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    scaling: Tensor,
    shift: Tensor,
    mass: Tensor,
    target: Tensor,
    idx: Tensor,
    ok: Tensor,
    lengths: Tensor,
    config: FitConfig,
) -> Compacted:
    """β and values of the kept keys ``idx`` from normal equations accumulated one block of
    queries at a time: no ``(n, t)`` matrix is ever held, so memory follows
    ``config.query_block``, not the number of reference queries.

    Pass 1 accumulates ``G = Φ_Sᵀ R Φ_S`` and ``c = Φ_Sᵀ R m`` (``R`` the query weights) and solves
    the box-NNLS (§3.2, Algorithm 3); pass 2 accumulates ``XᵀX`` and ``Xᵀ(Y − X V_S)`` with
    ``X = Φ_S w / (Φ_S w)·1`` (eq. 3–4) and the residual norms, then solves the values.
    """
    P, n, _ = queries.shape
    t, dim = idx.shape[-1], values.shape[-1]
    dt = keys.dtype
    block = max(1, config.query_block)
    blocks = [(lo, min(n, lo + block)) for lo in range(0, n, block)]

    def phi_s(lo: int, hi: int) -> Tensor:
        q, qv = queries[:, lo:hi], query_valid[:, lo:hi]
        return _selected_features(keys, beta0, q, qv, scaling, shift[:, lo:hi], idx, ok)

    if config.fit_beta:
        weight = _mass_weights(mass, query_valid, config.mass_weight)
        gram = keys.new_zeros(P, t, t)
        corr = keys.new_zeros(P, t)
        for lo, hi in blocks:
            f = phi_s(lo, hi)
            weighted = f * weight[:, lo:hi, None]
            gram += symmetric_product(weighted, f)
            corr += (weighted.mT @ mass[:, lo:hi, None])[..., 0]
        gram = 0.5 * (gram + gram.mT)
        lower, upper = _weight_box(config)
        w = box_nnls(gram, corr, ok, lower=lower, upper=upper, iters=config.nnls_iters, ridge=config.ridge)
    else:
        w = ok.to(dt)
    v_s = values.gather(1, idx[..., None].expand(-1, -1, dim))
    xtx = keys.new_zeros(P, t, t)
    xtr = keys.new_zeros(P, t, dim)
    res_sq = keys.new_zeros(P)
    mass_sq = keys.new_zeros(P)
    for lo, hi in blocks:
        x = phi_s(lo, hi).mul_(w[:, None, :])  # Φ_S w, column by column
        fitted = x.sum(-1)
        mass_sq += (fitted - mass[:, lo:hi]).square().sum(-1)
        x.div_(torch.where(fitted > 0, fitted, torch.ones_like(fitted))[..., None])  # eq. 3: X
        residual = target[:, lo:hi] - x @ v_s
        xtx += symmetric_product(x, x)
        xtr += x.mT @ residual
        res_sq += residual.square().sum((-2, -1))
    if config.fit_values and t > 0:  # eq. 4: C_v = V_S + argmin ‖X Δ − (Y − X V_S)‖
        fit = ridge_solve(0.5 * (xtx + xtx.mT), xtr, _value_ridge(config), ok) * ok[..., None].to(dt)
        out_sq = res_sq - 2 * (fit * xtr).sum((-2, -1)) + (fit * (xtx @ fit)).sum((-2, -1))
        c_v = v_s + fit
    else:
        out_sq, c_v = res_sq, v_s
    mass_norm = mass.norm(dim=-1)
    y_norm = target.flatten(1).norm(dim=-1)
    beta0_s = beta0.gather(1, idx)
    log_w = torch.log(torch.where(ok, w, torch.ones_like(w)))
    return Compacted(
        index=idx,
        log_mass=torch.where(ok, beta0_s + log_w, torch.full_like(beta0_s, -math.inf)),
        values=c_v,
        lengths=lengths,
        mass_error=mass_sq.sqrt() / torch.where(mass_norm > 0, mass_norm, torch.ones_like(mass_norm)),
        output_error=out_sq.clamp_min(0).sqrt() / torch.where(y_norm > 0, y_norm, torch.ones_like(y_norm)),
    )


def _omp_exact(
    phi: Tensor, mass: Tensor, counts: Tensor, entry_valid: Tensor, config: FitConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OMP by :func:`kvfold.methods.compaction.linalg.omp_select` (reference path; one budget per call)."""
    P = phi.shape[0]
    t_max = int(counts.max())
    idx = torch.zeros(P, t_max, dtype=torch.long, device=phi.device)
    w = phi.new_zeros(P, t_max)
    lengths = torch.zeros(P, dtype=torch.long, device=phi.device)
    histories = []
    for t in sorted(set(counts.tolist())):  # problems grouped by budget (a few distinct values)
        rows = (counts == t).nonzero(as_tuple=True)[0]
        if t == 0:
            continue
        feats = phi[rows] * entry_valid[rows][:, None, :].to(phi.dtype)
        res = omp_select(
            feats,
            mass[rows],
            t,
            k=config.k,
            refit_every=config.tau,
            nnls_iters=config.nnls_iters,
            beta_bounds=(config.beta_min, config.beta_max),
            ridge=config.ridge,
        )
        idx[rows, :t] = res.indices
        w[rows, :t] = res.weights
        lengths[rows] = res.num_selected
        histories.append((rows, res.residual_norms))
    steps = max((h.shape[-1] for _, h in histories), default=1)
    history = phi.new_zeros(P, steps)
    for rows, h in histories:
        history[rows] = torch.cat([h, h[:, -1:].expand(-1, steps - h.shape[-1])], dim=-1)
    return idx, w, lengths, history


# ---------------------------------------------------------------------------- all problems


WIDTH_SLACK = 0.8
"""A group's narrowest problem keeps at least this fraction of its widest one's entries."""


def _groups_by_width(todo: Tensor, counts: Tensor, per_problem: Callable[[int], int], group_bytes: int) -> list[Tensor]:
    """Split the problems ``todo`` into groups fitted together: widest first, each group within
    ``group_bytes`` (``per_problem(t)`` bytes a problem of width ``t``) and no narrower than
    :data:`WIDTH_SLACK` of its widest problem. A group pads every problem to its widest one and
    the fit costs ``n·t²`` per problem, so under a global budget (one head of a layer keeping
    1,700 entries, another 11) mixing widths would multiply the work."""
    if todo.numel() == 0:
        return []
    order = counts[todo].argsort(descending=True, stable=True)
    todo, widths = todo[order], counts[todo][order].tolist()
    groups, start = [], 0
    while start < len(widths):
        widest = widths[start]
        cap = max(1, int(group_bytes // max(1, per_problem(widest))))
        stop = start + 1
        while stop < len(widths) and stop - start < cap and widths[stop] >= WIDTH_SLACK * widest:
            stop += 1
        groups.append(todo[start:stop])
        start = stop
    return groups


def fit_problems(
    keys: Tensor,
    values: Tensor,
    log_mass: Tensor,
    queries: Tensor,
    query_valid: Tensor,
    counts: Tensor,
    scaling: Tensor | float,
    config: FitConfig,
    given: Tensor | None = None,
) -> Compacted:
    """Compact a stack of blocks (any leading batch dims), a memory-bounded group at a time.

    Args:
        keys, values: ``(..., T, D)`` the blocks (post-RoPE keys).
        log_mass: ``(..., T)`` existing β⁰ (−inf = empty slot).
        queries: ``(..., n, D)`` reference queries (post-RoPE), query_valid: ``(..., n)`` bool.
        counts: ``(...)`` entries to keep per block (clamped to the valid entries). A block whose
            count reaches its valid entries is returned unchanged (no fit).
        scaling: the logit scale ``s`` (``1/√d``), a float or ``(...)``.
        config: see :class:`FitConfig`.
        given: optional ``(..., t)`` kept positions chosen by someone else (−1 = unused slot; the
            count is then the number of valid given positions): only β and the values are fitted
            (the ``am_fit`` folder).

    Returns:
        A :class:`Compacted` with the same leading dims.
    """
    batch = keys.shape[:-2]
    T, D = keys.shape[-2:]
    n = queries.shape[-2]
    P = math.prod(batch)
    flat = {
        "keys": keys.reshape(P, T, D),
        "values": values.reshape(P, T, values.shape[-1]),
        "log_mass": log_mass.reshape(P, T).float() if log_mass.dtype != torch.float64 else log_mass.reshape(P, T),
        "queries": queries.reshape(P, n, queries.shape[-1]),
        "query_valid": query_valid.reshape(P, n),
    }
    scale = torch.as_tensor(scaling, dtype=torch.float64, device=keys.device).expand(batch).reshape(P)
    valid_entries = torch.isfinite(flat["log_mass"]).sum(-1)
    given_flat = None
    if given is not None:
        given_flat = given.reshape(P, given.shape[-1]).to(keys.device).long()
        counts = ((given_flat >= 0) & torch.isfinite(flat["log_mass"]).gather(1, given_flat.clamp_min(0))).sum(-1)
    counts = torch.minimum(counts.reshape(P).to(keys.device).long(), valid_entries)
    identity = counts >= valid_entries
    t_max = int(counts.max()) if P else 0
    dt = torch.float64 if keys.dtype == torch.float64 or queries.dtype == torch.float64 else torch.float32
    index = torch.zeros(P, t_max, dtype=torch.long, device=keys.device)
    beta = torch.full((P, t_max), -math.inf, dtype=torch.float32 if dt == torch.float32 else dt, device=keys.device)
    out_values = torch.zeros(P, t_max, values.shape[-1], dtype=dt, device=keys.device)
    lengths = torch.zeros(P, dtype=torch.long, device=keys.device)
    mass_error = torch.zeros(P, dtype=dt, device=keys.device)
    output_error = torch.zeros(P, dtype=dt, device=keys.device)
    histories: list[tuple[Tensor, Tensor]] = []

    # Blocks that keep everything: the valid entries, unchanged.
    ids = identity.nonzero(as_tuple=True)[0]
    if ids.numel() and t_max > 0:
        ok = torch.isfinite(flat["log_mass"][ids])
        order = torch.where(ok, torch.arange(T, device=keys.device), T).sort(dim=-1).values[:, :t_max]
        in_use = order < T
        order = torch.where(in_use, order, 0)
        index[ids] = order
        beta[ids] = torch.where(in_use, flat["log_mass"][ids].gather(1, order), -math.inf).to(beta.dtype)
        out_values[ids] = flat["values"][ids].gather(1, order[..., None].expand(-1, -1, D)).to(dt)
        lengths[ids] = in_use.sum(-1)

    todo = (~identity & (counts > 0)).nonzero(as_tuple=True)[0]
    size = 8 if dt == torch.float64 else 4

    def per_problem(t: int) -> int:
        """Bytes one problem of width ``t`` holds while its group is fitted."""
        if given is not None or config.keys == "highest":  # a block of queries × T, then blocks × t
            rows_held = n if config.solver == "exact" else min(n, max(1, config.query_block))
            return size * (256 * T * 2 + rows_held * 3 * t + n * (D + 4) + 2 * t * (t + D) + T * D * 2)
        return size * (n * T + T * t + n * D)  # OMP keeps Φ (n × T) and Φᵀ Φ_S (T × t)

    for rows in _groups_by_width(todo, counts, per_problem, config.group_bytes):
        res = _fit_group(
            flat["keys"][rows],
            flat["values"][rows],
            flat["log_mass"][rows],
            flat["queries"][rows],
            flat["query_valid"][rows],
            counts[rows],
            scale[rows],
            config,
            None if given_flat is None else given_flat[rows],
        )
        t = res.index.shape[-1]
        index[rows, :t] = res.index
        beta[rows, :t] = res.log_mass.to(beta.dtype)
        out_values[rows, :t] = res.values
        lengths[rows] = res.lengths
        mass_error[rows] = res.mass_error
        output_error[rows] = res.output_error
        if res.residual_history is not None:
            histories.append((rows, res.residual_history))
    history = None
    if histories:
        steps = max(h.shape[-1] for _, h in histories)
        history = torch.zeros(P, steps, dtype=dt, device=keys.device)
        for rows, h in histories:
            history[rows] = torch.cat([h, h[:, -1:].expand(-1, steps - h.shape[-1])], dim=-1)
        history = history.reshape(*batch, steps)
    return Compacted(
        index=index.reshape(*batch, t_max),
        log_mass=beta.reshape(*batch, t_max),
        values=out_values.reshape(*batch, t_max, values.shape[-1]),
        lengths=lengths.reshape(batch),
        mass_error=mass_error.reshape(batch),
        output_error=output_error.reshape(batch),
        residual_history=history,
    )
