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

Solver choices (differences from the paper, same minimisers): the least-squares problems are solved through their
normal equations with Cholesky (the paper's App. C.2 found Cholesky the fastest; on CPU it is 10–15× faster than the
SVD/QR ``lstsq``), with a tiny ridge relative to the Gram diagonal that pulls the solution toward the *prior* "every
kept entry keeps its own mass and value" (``w = 1``, ``C_v = V_S``) instead of toward zero. Where the queries
determine the answer the prior has no effect; where they do not (fewer queries than kept entries, collinear
features) the entry keeps its own mass and value rather than a minimum-norm guess. In particular ``t = T``
reproduces the block exactly for any number of queries. OMP keeps ``Φᵀ Φ_S`` incrementally, so a refit is a
``t × t`` solve and correlations ``Φᵀ r = Φᵀ m − (Φᵀ Φ_S) w`` cost no pass over Φ. ``solver="exact"`` runs the
reference solvers of :mod:`kvfold.methods.compaction.linalg` and :mod:`kvfold.methods.compaction.omp` instead.

All work is in float32 (float64 for float64 inputs), vectorised over problems, in groups whose ``(n, T)`` feature
matrices fit a memory budget; features and statistics: :mod:`kvfold.methods.compaction.attention_matching.features`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch

import kvfold.methods.compaction.attention_matching.grouping as grouping
from kvfold.methods.compaction.attention_matching.features import (
    STATISTICS_BYTES,
    Group,
    block_statistics,
    fused_statistics,
    max_shifted_features,
    selected_features,
)
from kvfold.methods.compaction.attention_matching.solvers import box_nnls, omp_keys, ridge_solve, symmetric_product
from kvfold.methods.compaction.attention_matching.value_rounding import feedback_round
from kvfold.methods.compaction.linalg import lstsq_ridge, nnls
from kvfold.methods.compaction.omp import gather_columns, omp_select
from kvfold.runtime.attention import FLASH_WITH_LSE
from kvfold.runtime.quant_config import QuantConfig

Tensor = torch.Tensor

DEFAULT_GROUP_BYTES = 192 << 20
"""Bytes of ``(n, T)`` feature matrices processed at once on the CPU (several such temporaries exist)."""


@dataclass(frozen=True)
class FitSizes:
    """How much of a fit one operation covers, by device: the same fit in fewer, larger operations
    where each operation costs a kernel launch.

    Attributes:
        group_bytes: memory for the problems fitted together (:attr:`FitConfig.group_bytes`).
        query_block: reference queries per block of the streamed normal equations
            (:attr:`FitConfig.query_block`).
        statistics_rows: queries per block of the attention statistics
            (:func:`~kvfold.methods.compaction.attention_matching.features.block_statistics`).
        statistics_bytes: bytes of one ``(problems, rows, T)`` feature block there.
        pad_products: multiply-adds a group may add in all by padding narrower problems to its width
            (:func:`~kvfold.methods.compaction.attention_matching.grouping.groups_by_width`), to save
            the operators of groups of their own (:attr:`FitConfig.pad_products`).
    """

    group_bytes: int
    query_block: int
    statistics_rows: int
    statistics_bytes: int
    pad_products: int


CPU_FIT_SIZES = FitSizes(DEFAULT_GROUP_BYTES, 1024, 256, STATISTICS_BYTES, 0)
"""Blocks that stay in a CPU's caches (a few MB of features at a time); no problem is padded past
the width slack (:mod:`~kvfold.methods.compaction.attention_matching.grouping`: on a CPU the work is
the time)."""

ACCELERATOR_FIT_SIZES = FitSizes(1 << 30, 8192, 4096, 512 << 20, grouping.GROUP_LAUNCH_PRODUCTS)
"""Blocks for a GPU, where every operation is a launch of a few microseconds whatever its size:
Llama-3.1-8B's shape at 1K tokens ran 89,000 fit operations with the CPU's blocks (counted by
``benchmarks/profile_compress.py --count``), most of them on blocks a GPU finishes in less than
their launch. The device memory they add stays under a gibibyte and a half. A group also takes
narrower problems padded to its width, up to a group's launches' worth of multiply-adds
(:mod:`~kvfold.methods.compaction.attention_matching.grouping`: 5.5 groups a layer before)."""


def fit_sizes(device: torch.device) -> FitSizes:
    """The block sizes of a fit on ``device``: :data:`CPU_FIT_SIZES` or :data:`ACCELERATOR_FIT_SIZES`."""
    return CPU_FIT_SIZES if device.type == "cpu" else ACCELERATOR_FIT_SIZES


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
            (memory follows the block, not the number of queries); None: by device (:func:`fit_sizes`).
        solver: ``"gram"`` (normal equations, fast) or ``"exact"`` (:mod:`kvfold.methods.compaction.linalg`,
            :mod:`kvfold.methods.compaction.omp`).
        group_bytes: memory budget for the feature matrices of one group of problems; None: by device.
        statistics_rows, statistics_bytes: the blocks of the attention statistics; None: by device.
        pad_products: multiply-adds a group of problems may add by padding problems narrower than
            the width slack of its widest to that width
            (:mod:`~kvfold.methods.compaction.attention_matching.grouping`; 0: none; the fit is the
            same, its work larger and its operators fewer); None: by device.
        value_storage: when the values will be stored in this integer format, the fitted values
            are rounded to its grid with error feedback (:mod:`.value_rounding`); None: left as
            fitted (the storage rounds each on its own).
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
    group_bytes: int | None = None
    query_block: int | None = None
    statistics_rows: int | None = None
    statistics_bytes: int | None = None
    pad_products: int | None = None
    value_storage: QuantConfig | None = None

    def sized(self, device: torch.device) -> FitConfig:
        """This configuration with every block size left to the device filled in (:func:`fit_sizes`)."""
        sizes = fit_sizes(device)
        fill = {name: getattr(sizes, name) for name in sizes.__dataclass_fields__ if getattr(self, name) is None}
        return replace(self, **fill) if fill else self


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


def _fused_statistics_apply(keys: Tensor, queries: Tensor, scaling: Tensor, config: FitConfig) -> bool:
    """True when :func:`fused_statistics` may replace :func:`block_statistics`: float32 on CPU,
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


@dataclass
class _Selection:
    """Kept keys of a group and their mass fit: positions ``idx`` ``(P, t)`` (ascending, unused slots
    last), ``ok`` the used slots, their features ``Φ_S`` ``(P, n, t)`` and weights ``w``, with the
    mass ``m`` and target output ``Y`` of the block."""

    idx: Tensor
    ok: Tensor
    lengths: Tensor
    phi_s: Tensor
    w: Tensor
    mass: Tensor
    target: Tensor
    history: Tensor | None = None


def _fit_group(
    group: Group,
    counts: Tensor,
    config: FitConfig,
    given: Tensor | None = None,
    candidates: Tensor | None = None,
    *,
    t_max: int | None = None,
) -> Compacted:
    """Compact the ``P`` problems of ``group`` at once to ``counts`` ``(P,)`` entries (see the module
    docstring); ``given`` ``(P, t)`` fixes the kept positions (−1 = unused slot) and only β and the
    values are fitted; ``candidates`` ``(P, T)`` bool limits the highest-attention keys to those
    entries; ``t_max``, when the caller knows it, is ``counts.max()`` (else it is read from the
    device)."""
    config = config.sized(group.keys.device)
    if t_max is None:
        t_max = int(counts.max()) if group.keys.shape[0] else 0
    (P, T, d), n = group.keys.shape, group.queries.shape[1]
    omp = given is None and config.keys == "omp"
    grouping.FIT_PRODUCTS.add(P, n, T, t_max, d, group.values.shape[-1], omp)
    if given is not None or config.keys == "highest":
        selection = _select_by_score(group, counts, t_max, config, given, candidates)
        if isinstance(selection, Compacted):
            return selection
    else:
        selection = _select_by_omp(group, counts, config)
    return _fit_values(group, selection, t_max, config)


def _kept_positions(
    square: Tensor | None, entry_valid: Tensor, counts: Tensor, t_max: int, given: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(idx, ok, lengths)``: the ``given`` positions, or the ``t`` keys with the largest mean
    squared attention weight ``square``; ascending, unused slots last (repeating a valid index)."""
    T = entry_valid.shape[-1]
    if given is not None:
        ok = (given >= 0) & entry_valid.gather(1, given.clamp_min(0))
        idx = torch.where(ok, given, torch.full_like(given, T)).sort(dim=-1).values[:, :t_max]  # used first
    else:
        # §3.3 / App. F.1: keep the t keys with the largest s_j = sqrt(mean_i a_ij²)
        score = square.masked_fill(~entry_valid, -math.inf)
        top = score.topk(t_max, dim=-1).indices
        ok = (torch.arange(t_max, device=square.device)[None, :] < counts[:, None]) & entry_valid.gather(1, top)
        idx = torch.where(ok, top, torch.full_like(top, T)).sort(dim=-1).values  # ascending positions
    ok = idx < T
    idx = torch.where(ok, idx, idx[:, :1].clamp_max(max(T - 1, 0)))
    return idx, ok, ok.sum(-1)


def _select_by_score(
    group: Group, counts: Tensor, t_max: int, config: FitConfig, given: Tensor | None, candidates: Tensor | None = None
) -> Compacted | _Selection:
    """Highest-attention keys (§3.3, App. F.1) or ``given`` ones, and β by (box-)NNLS (§3.2); the
    ``"gram"`` solver fits β and the values in one go (:func:`_streamed_fit`)."""
    K, V, beta0 = group.keys, group.values, group.beta0
    Q, qv, scale = group.queries, group.query_valid, group.scaling
    square = None
    if given is not None and _fused_statistics_apply(K, Q, scale, config):
        shift, mass, target = fused_statistics(K, V, beta0, Q, qv, scale)
    else:
        shift, mass, target, square = block_statistics(
            K, V, beta0, Q, qv, scale,
            block=config.statistics_rows, squares=given is None, budget=config.statistics_bytes,
        )  # fmt: skip
    selectable = torch.isfinite(beta0) if candidates is None else torch.isfinite(beta0) & candidates
    idx, ok, lengths = _kept_positions(square, selectable, counts, t_max, given)
    if config.solver != "exact":
        return _streamed_fit(group, shift, mass, target, idx, ok, lengths, config)
    phi_s = group.selected_features(shift, idx, ok)
    if config.fit_beta:
        # §3.2: w = argmin_{w ≥ 0} ‖Φ_S w − m‖ (box [e^β_min, e^β_max] for highest attention)
        lower, upper = _weight_box(config)
        root = _mass_weights(mass, qv, config.mass_weight, group.query_weight).sqrt()[..., None]
        rows, target_mass = phi_s * root, mass * root[..., 0]
        w = nnls(rows, target_mass, iters=config.nnls_iters, lower=lower, upper=upper, ridge=config.ridge) * ok
    else:
        w = ok.to(group.dtype)
    return _Selection(idx, ok, lengths, phi_s, w, mass, target)


def _select_by_omp(group: Group, counts: Tensor, config: FitConfig) -> _Selection:
    """OMP keys and their weights (§3.3 Algorithm 1; App. C.1 Algorithm 2), kept keys sorted."""
    K, T = group.keys, group.keys.shape[1]
    entry_valid = torch.isfinite(group.beta0)
    phi, mass, _ = max_shifted_features(K, group.beta0, group.queries, group.query_valid, group.scaling)
    safe_mass = torch.where(mass > 0, mass, torch.ones_like(mass))
    target = torch.bmm(phi, group.values) / safe_mass[..., None]  # eq. 1: exp(ℓ) V / Mass
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
    phi_s = gather_columns(phi, idx) * ok[:, None, :].to(group.dtype)
    return _Selection(idx, ok, ok.sum(-1), phi_s, w, mass, target, history)


def _over_norm(value: Tensor, norm: Tensor) -> Tensor:
    """``value / norm`` per problem, with a zero norm counting as 1 (relative residuals)."""
    return value / torch.where(norm > 0, norm, torch.ones_like(norm))


def _fit_values(group: Group, selection: _Selection, t_max: int, config: FitConfig) -> Compacted:
    """The values ``C_v`` by least squares on the selected keys (eq. 3–4), β, and the residuals."""
    V, dt = group.values, group.dtype
    idx, ok, w, mass, target = selection.idx, selection.ok, selection.w, selection.mass, selection.target
    fitted_mass = torch.bmm(selection.phi_s, w[..., None])[..., 0]
    mass_error = _over_norm((fitted_mass - mass).norm(dim=-1), mass.norm(dim=-1))
    # eq. 3-4: X = softmax(s·Q C_kᵀ + β) = Φ_S w / (Φ_S w)·1, C_v = argmin ‖X C_v − Y‖
    x = selection.phi_s.mul_(w[:, None, :])
    x.div_(torch.where(fitted_mass > 0, fitted_mass, torch.ones_like(fitted_mass))[..., None])
    if group.query_weight is not None:  # each query's residual times √(its weight), as in _streamed_fit
        root = group.query_weight[..., None].sqrt()
        x, target = x.mul_(root), target * root
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
    if config.value_storage is not None and t_max > 0:
        c_v = feedback_round(c_v, x.mT @ x, ok, config.value_storage)
    out_err = _over_norm((x @ c_v - target).flatten(1).norm(dim=-1), target.flatten(1).norm(dim=-1))
    return Compacted(
        index=idx,
        log_mass=_log_mass(group.beta0, idx, ok, w),
        values=c_v,
        lengths=selection.lengths,
        mass_error=mass_error,
        output_error=out_err,
        residual_history=selection.history,
    )


def _log_mass(beta0: Tensor, idx: Tensor, ok: Tensor, w: Tensor) -> Tensor:
    """``β = β⁰_S + log w`` on the used slots, −inf on the others."""
    beta0_s = beta0.gather(1, idx)
    log_w = torch.log(torch.where(ok, w, torch.ones_like(w)))
    return torch.where(ok, beta0_s + log_w, torch.full_like(beta0_s, -math.inf))


def _weight_box(config: FitConfig) -> tuple[float, float | None]:
    """The box of ``w = exp(β − β⁰)``: ``[e^β_min, e^β_max]`` (None bounds: ``[0, ∞)``)."""
    lower = 0.0 if config.beta_min is None else math.exp(config.beta_min)
    upper = None if config.beta_max is None else math.exp(config.beta_max)
    return lower, upper


def _value_ridge(config: FitConfig) -> float:
    return config.ridge if config.value_ridge is None else config.value_ridge


def _mass_weights(mass: Tensor, query_valid: Tensor, kind: str, query_weight: Tensor | None = None) -> Tensor:
    """Weights ``r_i`` of the mass fit ``Σ_i r_i ((Φ_S w)_i − m_i)²`` (0 on invalid queries; times ``query_weight``)."""
    valid = query_valid.to(mass.dtype) if query_weight is None else query_valid * query_weight.to(mass.dtype)
    if kind == "none":
        return valid
    if kind != "relative":
        raise ValueError(f"mass_weight must be none or relative; got {kind!r}")
    safe = torch.where(mass > 0, mass, torch.ones_like(mass))
    return valid * safe.pow(-2)  # relative error: ((Φ_S w)_i − m_i) / m_i


def _streamed_weights(
    group: Group,
    phi_s: Callable[[int, int], Tensor],
    blocks: list[tuple[int, int]],
    mass: Tensor,
    ok: Tensor,
    config: FitConfig,
) -> Tensor:
    """Pass 1 of :func:`_streamed_fit`: ``G = Φ_Sᵀ R Φ_S`` and ``c = Φ_Sᵀ R m`` (``R`` the query
    weights) accumulated block by block, then the box-NNLS (§3.2, Algorithm 3)."""
    if not config.fit_beta:
        return ok.to(group.dtype)
    P, t = ok.shape
    weight = _mass_weights(mass, group.query_valid, config.mass_weight, group.query_weight)
    gram = group.values.new_zeros(P, t, t)
    corr = group.values.new_zeros(P, t)
    for lo, hi in blocks:
        f = phi_s(lo, hi)
        weighted = f * weight[:, lo:hi, None]
        gram += symmetric_product(weighted, f)
        corr += (weighted.mT @ mass[:, lo:hi, None])[..., 0]
        del f, weighted  # before the next block's: one block of features held, not two
    gram = 0.5 * (gram + gram.mT)
    lower, upper = _weight_box(config)
    return box_nnls(gram, corr, ok, lower=lower, upper=upper, iters=config.nnls_iters, ridge=config.ridge)


def _streamed_fit(
    group: Group,
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
    values = group.values
    P, n, _ = group.queries.shape
    t, dim = idx.shape[-1], values.shape[-1]
    dt = group.dtype
    block = max(1, config.query_block)
    blocks = [(lo, min(n, lo + block)) for lo in range(0, n, block)]

    def phi_s(lo: int, hi: int) -> Tensor:
        q, qv = group.queries[:, lo:hi], group.query_valid[:, lo:hi]
        return selected_features(group.kept_keys, group.beta0, q, qv, group.scaling, shift[:, lo:hi], idx, ok)

    w = _streamed_weights(group, phi_s, blocks, mass, ok, config)
    v_s = values.gather(1, idx[..., None].expand(-1, -1, dim))
    xtx = values.new_zeros(P, t, t)
    xtr = values.new_zeros(P, t, dim)
    res_sq = values.new_zeros(P)
    mass_sq = values.new_zeros(P)
    for lo, hi in blocks:
        x = phi_s(lo, hi).mul_(w[:, None, :])  # Φ_S w, column by column
        fitted = x.sum(-1)
        mass_sq += (fitted - mass[:, lo:hi]).square().sum(-1)
        x.div_(torch.where(fitted > 0, fitted, torch.ones_like(fitted))[..., None])  # eq. 3: X
        y = target[:, lo:hi]
        if group.query_weight is not None:  # each query's residual times √(its weight)
            root = group.query_weight[:, lo:hi, None].sqrt()
            x, y = x.mul_(root), y * root
        residual = y - x @ v_s
        xtx += symmetric_product(x, x)
        xtr += x.mT @ residual
        res_sq += residual.square().sum((-2, -1))
        del x, residual  # before the next block's: one block of features held, not two
    xtx = 0.5 * (xtx + xtx.mT)
    c_v = v_s
    if config.fit_values and t > 0:  # eq. 4: C_v = V_S + argmin ‖X Δ − (Y − X V_S)‖
        c_v = v_s + ridge_solve(xtx, xtr, _value_ridge(config), ok) * ok[..., None].to(dt)
    if config.value_storage is not None and t > 0:
        c_v = feedback_round(c_v, xtx, ok, config.value_storage)
    fit = c_v - v_s  # ‖X (V_S + Δ) − Y‖² = ‖R‖² − 2⟨Δ, XᵀR⟩ + ⟨Δ, XᵀX Δ⟩
    out_sq = res_sq - 2 * (fit * xtr).sum((-2, -1)) + (fit * (xtx @ fit)).sum((-2, -1))
    target_sq = target.square().sum(-1) * (1.0 if group.query_weight is None else group.query_weight)
    return Compacted(
        index=idx,
        log_mass=_log_mass(group.beta0, idx, ok, w),
        values=c_v,
        lengths=lengths,
        mass_error=_over_norm(mass_sq.sqrt(), mass.norm(dim=-1)),
        output_error=_over_norm(out_sq.clamp_min(0).sqrt(), target_sq.sum(-1).sqrt()),
    )


def _omp_exact(
    phi: Tensor, mass: Tensor, counts: Tensor, entry_valid: Tensor, config: FitConfig
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OMP by :func:`kvfold.methods.compaction.omp.omp_select` (reference path; one budget per call)."""
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
    return idx, w, lengths, _padded_histories(histories, P, phi)


def _padded_histories(histories: list[tuple[Tensor, Tensor]], P: int, like: Tensor) -> Tensor:
    """``(P, steps)`` residual histories of groups of problems ``(rows, (len(rows), s))``, each
    padded with its last value to the longest (zeros for problems in no group)."""
    steps = max((h.shape[-1] for _, h in histories), default=1)
    history = like.new_zeros(P, steps)
    for rows, h in histories:
        history[rows] = torch.cat([h, h[:, -1:].expand(-1, steps - h.shape[-1])], dim=-1)
    return history


# ---------------------------------------------------------------------------- all problems


def _empty_result(P: int, t_max: int, dim: int, dt: torch.dtype, device: torch.device) -> Compacted:
    """Flat ``(P, …)`` buffers of :func:`fit_problems`: no entry kept, β = −inf."""
    return Compacted(
        index=torch.zeros(P, t_max, dtype=torch.long, device=device),
        log_mass=torch.full((P, t_max), -math.inf, dtype=torch.float32 if dt == torch.float32 else dt, device=device),
        values=torch.zeros(P, t_max, dim, dtype=dt, device=device),
        lengths=torch.zeros(P, dtype=torch.long, device=device),
        mass_error=torch.zeros(P, dtype=dt, device=device),
        output_error=torch.zeros(P, dtype=dt, device=device),
    )


def _copy_identity(out: Compacted, ids: Tensor, log_mass: Tensor, values: Tensor, key_dim: int) -> None:
    """Blocks ``ids`` that keep everything: their valid entries, unchanged."""
    t_max = out.index.shape[-1]
    T = log_mass.shape[-1]
    ok = torch.isfinite(log_mass[ids])
    order = torch.where(ok, torch.arange(T, device=log_mass.device), T).sort(dim=-1).values[:, :t_max]
    in_use = order < T
    order = torch.where(in_use, order, 0)
    out.index[ids] = order
    out.log_mass[ids] = torch.where(in_use, log_mass[ids].gather(1, order), -math.inf).to(out.log_mass.dtype)
    out.values[ids] = values[ids].gather(1, order[..., None].expand(-1, -1, key_dim)).to(out.values.dtype)
    out.lengths[ids] = in_use.sum(-1)


def _write_rows(out: Compacted, rows: Tensor, res: Compacted) -> None:
    """A group's result into the flat buffers (its width ``t`` may be narrower than theirs)."""
    t = res.index.shape[-1]
    out.index[rows, :t] = res.index
    out.log_mass[rows, :t] = res.log_mass.to(out.log_mass.dtype)
    out.values[rows, :t] = res.values
    out.lengths[rows] = res.lengths
    out.mass_error[rows] = res.mass_error
    out.output_error[rows] = res.output_error


def _groups(
    todo: Tensor, counts: Tensor, given: bool, shape: tuple[int, int, int, int], dt: torch.dtype, config: FitConfig
) -> list[tuple[Tensor, int]]:
    """The groups :func:`fit_problems` fits ``todo`` in (:func:`.grouping.groups_by_width`): within
    ``config.group_bytes`` with the attention statistics' one block of features (scored keys) counted once,
    ``shape`` = (entries, queries, key width, value width) a problem."""
    T, n, D, value_dim = shape
    scored = given or config.keys == "highest"
    rows_held = n if config.solver == "exact" else min(n, max(1, config.query_block))
    size = 8 if dt == torch.float64 else 4
    per_problem = grouping.bytes_per_problem(scored, T, n, D, size, rows_held)
    held = grouping.statistics_block_bytes(T, n, size, config.statistics_rows, config.statistics_bytes) if scored else 0
    padding = grouping.padding_products(scored, T, n, D, value_dim)
    room = max(1, config.group_bytes - held)
    return grouping.groups_by_width(todo, counts, per_problem, room, padding, config.pad_products)


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
    candidates: Tensor | None = None,
    compact_keys: Tensor | None = None,
    query_weight: Tensor | None = None,
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
        candidates: optional ``(..., T)`` bool: the highest-attention keys are chosen among these
            entries only (the attention statistics still read every entry); the count is capped
            at the candidates (``am_fit[preselect]``).
        compact_keys: optional ``(..., T, D)`` kept entries' keys as stored (quantized): the target
            reads ``keys``, the kept features these, so β and the values absorb the difference.
        query_weight: optional ``(..., n)`` weights of each query's squared residuals (given keys).

    Returns:
        A :class:`Compacted` with the same leading dims.
    """
    if query_weight is not None and given is None:
        raise ValueError("query_weight needs given keys")
    config = config.sized(keys.device)
    batch = keys.shape[:-2]
    T, D = keys.shape[-2:]
    n = queries.shape[-2]
    P = math.prod(batch)
    flat_keys, flat_values = keys.reshape(P, T, D), values.reshape(P, T, values.shape[-1])
    flat_compact = None if compact_keys is None else compact_keys.reshape(P, T, D)
    flat_lm = log_mass.reshape(P, T).float() if log_mass.dtype != torch.float64 else log_mass.reshape(P, T)
    flat_q, flat_qv = queries.reshape(P, n, queries.shape[-1]), query_valid.reshape(P, n)
    flat_qw = None if query_weight is None else query_weight.reshape(P, n).to(keys.device)
    scale = torch.as_tensor(scaling, dtype=torch.float64, device=keys.device).expand(batch).reshape(P)
    valid_entries = torch.isfinite(flat_lm).sum(-1)
    given_flat = None
    if given is not None:
        given_flat = given.reshape(P, given.shape[-1]).to(keys.device).long()
        counts = ((given_flat >= 0) & torch.isfinite(flat_lm).gather(1, given_flat.clamp_min(0))).sum(-1)
    cand_flat = None
    if candidates is not None:
        cand_flat = candidates.reshape(P, T).to(keys.device) & torch.isfinite(flat_lm)
        counts = torch.minimum(counts.reshape(P).to(keys.device).long(), cand_flat.sum(-1))
    counts = torch.minimum(counts.reshape(P).to(keys.device).long(), valid_entries)
    identity = counts >= valid_entries
    t_max = int(counts.max()) if P else 0
    dt = torch.float64 if keys.dtype == torch.float64 or queries.dtype == torch.float64 else torch.float32
    out = _empty_result(P, t_max, values.shape[-1], dt, keys.device)
    ids = identity.nonzero(as_tuple=True)[0]
    if ids.numel() and t_max > 0:
        _copy_identity(out, ids, flat_lm, flat_values, D)
    todo = (~identity & (counts > 0)).nonzero(as_tuple=True)[0]
    histories: list[tuple[Tensor, Tensor]] = []
    for rows, widest in _groups(todo, counts, given is not None, (T, n, D, values.shape[-1]), dt, config):
        inputs = (flat_keys, flat_values, flat_lm, flat_q, flat_qv, scale, flat_compact, flat_qw)
        group = Group.prepare(*(None if t is None else t[rows] for t in inputs))
        chosen = [None if t is None else t[rows] for t in (given_flat, cand_flat)]
        res = _fit_group(group, counts[rows], config, *chosen, t_max=widest)
        _write_rows(out, rows, res)
        if res.residual_history is not None:
            histories.append((rows, res.residual_history))
    if histories:
        out.residual_history = _padded_histories(histories, P, out.mass_error)
    return _unflatten(out, batch)


def _unflatten(out: Compacted, batch: torch.Size) -> Compacted:
    """The flat ``(P, …)`` result of :func:`fit_problems` with the problems' leading dims."""
    t_max = out.index.shape[-1]
    history = out.residual_history
    return Compacted(
        index=out.index.reshape(*batch, t_max),
        log_mass=out.log_mass.reshape(*batch, t_max),
        values=out.values.reshape(*batch, t_max, out.values.shape[-1]),
        lengths=out.lengths.reshape(batch),
        mass_error=out.mass_error.reshape(batch),
        output_error=out.output_error.reshape(batch),
        residual_history=None if history is None else history.reshape(*batch, history.shape[-1]),
    )
