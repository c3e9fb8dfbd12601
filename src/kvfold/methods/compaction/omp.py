"""OMP key selection for attention-mass matching (Attention Matching §3.3 Algorithm 1, App. C.1 Algorithm 2).

Zweiger et al. 2026 (``papers/attention-matching.md``). Greedy selection of the keys whose
exp-score columns best reproduce the attention mass, with the β safeguards of App. C.2
"Stabilizing β": :func:`omp_select` is the reference, on explicit features with the refit
:class:`FeatureRefit` (Algorithm 3 by :func:`kvfold.methods.compaction.linalg.nnls`). Its greedy
loop :func:`omp_greedy` also runs AM's batched fits, with the refit of
:class:`kvfold.methods.compaction.attention_matching.solvers.GramRefit`.

Every function works on a stack of independent problems (all leading dimensions are batch
dimensions), in the dtype of its inputs, like :mod:`kvfold.methods.compaction.linalg`.
"""

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from kvfold.methods.compaction.linalg import batched_matvec, batched_rmatvec, check_matrix, nnls

__all__ = [
    "FeatureRefit",
    "OMPRefit",
    "OMPResult",
    "gather_columns",
    "omp_greedy",
    "omp_select",
    "omp_width",
]


def _sq_residual(A: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """‖A w − b‖² per problem."""
    return (batched_matvec(A, w) - b).square().sum(-1)


class OMPResult(NamedTuple):
    """Output of :func:`omp_select`.

    Attributes:
        indices: (..., t) int64 key indices, valid slots first, in selection order.
        weights: (..., t) w ≥ 0 from the last NNLS refit; β = log w (AM §3.3). Slots past
            ``num_selected`` hold index 0 and weight 0 (β = −inf: they receive no attention).
        residual_norms: (..., steps + 1) ‖m − Φ_S w‖ after each greedy step; entry 0 is ‖m‖.
            Between refits (Algorithm 2) the residual is unchanged. Problems that finish early
            repeat their final value.
        num_selected: (...,) int64 number of valid slots; equals t unless the β_min pruning rule
            discarded keys and no candidate keys were left to replace them.
    """

    indices: Tensor
    weights: Tensor
    residual_norms: Tensor
    num_selected: Tensor


class OMPRefit(Protocol):
    """How :func:`omp_greedy` refits the weights of the selected keys and updates the residual.

    :class:`FeatureRefit` (here) runs Algorithm 3 on the explicit features Φ_S, the reference;
    :class:`kvfold.methods.compaction.attention_matching.solvers.GramRefit` works on the normal
    equations with Φᵀ Φ_S kept incrementally (AM's batched fits).

    Attributes:
        dtype: dtype of the weights.
        zero_unused: after a refit, unused slots get index 0 and weight 0 (False: their weights
            are multiplied by 0 and their indices are left as they are).
    """

    dtype: torch.dtype
    zero_unused: bool

    def start_norm(self) -> Tensor:
        """‖m‖ per problem (Alg. 1 line 3: r = m)."""
        ...

    def correlations(self) -> Tensor:
        """c = Φᵀ r (..., T) at the current residual (Alg. 1 line 5)."""
        ...

    def weights(self, cols: Tensor, ok: Tensor, w: Tensor, refit: Tensor, count: Tensor) -> Tensor:
        """The NNLS refit (Alg. 1 line 7, Alg. 2 line 9) of the keys ``cols`` (..., s).

        ``ok`` (..., s) marks the used slots, ``w`` (..., s) are the current weights, ``refit``
        (...) the problems due a refit and ``count`` (...) their selected keys. Returns (..., s).
        """
        ...

    def reorder(self, moved: Tensor, order: Tensor) -> None:
        """Follow the kept-first reordering ``order`` (..., s) of the slots of the problems ``moved``."""
        ...

    def update(self, w_fit: Tensor, cols: Tensor, w: Tensor, ok: Tensor, refit: Tensor) -> Tensor:
        """Alg. 2 line 10: r = m − Φ_S w on the refitted problems; returns ‖r‖ per problem.

        ``w_fit`` (..., s) is the refit with the discarded keys zeroed, in the slot order the refit
        saw; ``cols``, ``w`` and ``ok`` are the slots after the kept-first reordering.
        """
        ...


def gather_columns(Phi: Tensor, cols: Tensor) -> Tensor:
    """Phi[..., :, cols] per problem: Phi (..., q, T), cols (..., s) -> (..., q, s)."""
    return Phi.gather(-1, cols.unsqueeze(-2).expand(*cols.shape[:-1], Phi.shape[-2], cols.shape[-1]))


class FeatureRefit:
    """Algorithm 3 (App. C.2) on the explicit features Φ_S: the refit of :func:`omp_select`.

    Each refit solves :func:`kvfold.methods.compaction.linalg.nnls` (least squares + clamp to
    ``[0, w_max]``, then ``nnls_iters`` projected-gradient steps) and keeps the residual
    ``r = m − Φ_S w`` as a vector, so the correlations ``Φᵀ r`` cost one pass over Φ per greedy
    step. With ``monotone`` the previous weights (0 on the new keys) replace the least-squares
    refit whenever they fit better: they are feasible for the enlarged problem, so the residual
    never increases, as with exact NNLS.
    """

    zero_unused = True

    def __init__(
        self, Phi: Tensor, target: Tensor, *, nnls_iters: int, w_max: float | None, ridge: float, monotone: bool
    ) -> None:
        self.Phi = Phi
        self.target = target
        self.dtype = Phi.dtype
        self.nnls_iters = nnls_iters
        self.w_max = w_max
        self.ridge = ridge
        self.monotone = monotone
        self.r = target.clone()  # Alg. 1 line 3: r = m
        self.Phi_S = Phi.new_zeros(0)

    def start_norm(self) -> Tensor:
        return self.r.norm(dim=-1)

    def correlations(self) -> Tensor:
        return batched_rmatvec(self.Phi, self.r)  # c_j = rᵀΦ_{:,j}

    def weights(self, cols: Tensor, ok: Tensor, w: Tensor, refit: Tensor, count: Tensor) -> Tensor:
        Phi_S = gather_columns(self.Phi, cols) * ok.unsqueeze(-2)
        w_new = nnls(Phi_S, self.target, iters=0, lower=0.0, upper=self.w_max, ridge=self.ridge)  # lstsq + clamp
        if self.monotone:
            w_prev = w * ok
            better = _sq_residual(Phi_S, w_new, self.target) <= _sq_residual(Phi_S, w_prev, self.target)
            w_new = torch.where(better.unsqueeze(-1), w_new, w_prev)
        if self.nnls_iters > 0:
            w_new = nnls(Phi_S, self.target, iters=self.nnls_iters, init=w_new, lower=0.0, upper=self.w_max)
        self.Phi_S = Phi_S
        return w_new

    def reorder(self, moved: Tensor, order: Tensor) -> None:
        pass  # the residual is computed in the refit's own slot order

    def update(self, w_fit: Tensor, cols: Tensor, w: Tensor, ok: Tensor, refit: Tensor) -> Tensor:
        r_new = self.target - batched_matvec(self.Phi_S, w_fit)
        self.r = torch.where(refit.unsqueeze(-1), r_new, self.r)
        return self.r.norm(dim=-1)


def omp_width(t: int, k: int, n_keys: int) -> int:
    """Slots of :func:`omp_greedy`'s state: ``t`` selected, then scratch for the candidates a step
    does not take (at most ``max(k, t)`` of them)."""
    return t + max(max(1, min(k, n_keys)), t)


@dataclass
class _Greedy:
    """What OMP has selected so far, per problem (leading dims = the problems)."""

    index: Tensor  # (..., width) long: the selected keys first, in selection order; scratch past t
    weights: Tensor  # (..., width) w ≥ 0 of the last refit
    count: Tensor  # (...) long, keys selected
    banned: Tensor  # (..., T) bool: selected, discarded, or never a candidate
    pending: Tensor  # (...) bool: keys were added since the last refit
    filled: Tensor  # (...) bool: the budget was reached once
    rounds: Tensor  # (...) long: β_min prunings so far
    stopped: Tensor  # (...) bool: pruned with no refill left

    @classmethod
    def start(cls, banned: Tensor, width: int, dtype: torch.dtype) -> "_Greedy":
        batch, dev = banned.shape[:-1], banned.device
        return cls(
            index=torch.zeros((*batch, width), dtype=torch.long, device=dev),
            weights=torch.zeros((*batch, width), dtype=dtype, device=dev),
            count=torch.zeros(batch, dtype=torch.long, device=dev),
            banned=banned,
            pending=torch.zeros(batch, dtype=torch.bool, device=dev),
            filled=torch.zeros(batch, dtype=torch.bool, device=dev),
            rounds=torch.zeros(batch, dtype=torch.long, device=dev),
            stopped=torch.zeros(batch, dtype=torch.bool, device=dev),
        )


def _take_top_keys(state: _Greedy, corr: Tensor, per_step: Tensor, grow: Tensor, width: int, scratch: int) -> None:
    """Alg. 1 line 5 / Alg. 2 lines 5-7: add the ``per_step`` unselected keys with the largest
    correlation ``c_j = rᵀΦ_{:,j}`` to S (problems that do not ``grow`` take none)."""
    top = corr.masked_fill(state.banned, -math.inf).topk(width, dim=-1).indices
    ranks = torch.arange(width, device=top.device)
    take = (ranks < per_step.unsqueeze(-1)) & grow.unsqueeze(-1) & ~state.banned.gather(-1, top)
    slot = torch.where(take, state.count.unsqueeze(-1) + take.cumsum(-1) - 1, scratch + ranks)
    state.index.scatter_(-1, slot, top)  # Alg. 2 line 7: S = S ∪ J*
    state.banned |= torch.zeros_like(state.banned).scatter(-1, top, take)
    state.count = state.count + take.sum(-1)
    state.pending = state.pending | take.any(-1)


def _refit(
    state: _Greedy, fit: OMPRefit, refit: Tensor, prune: Tensor, w_min: float | None, refills: int | None
) -> Tensor:
    """Refit the problems ``refit`` (Alg. 1 line 7, Alg. 2 lines 9-10), discard the keys below
    ``w_min`` of the problems ``prune`` (App. C.2 "Stabilizing β"), move the kept slots first and
    return ‖r‖ per problem."""
    s = int(state.count.max())
    ok = torch.arange(s, device=state.count.device) < state.count.unsqueeze(-1)
    cols = state.index[..., :s]
    w_new = fit.weights(cols, ok, state.weights[..., :s], refit, state.count)
    keep = ok
    if w_min is not None:  # after greedy selection, discard keys with β < β_min
        keep = ok & ~(prune.unsqueeze(-1) & (w_new < w_min))
    w_new = w_new * keep
    state.weights[..., :s] = torch.where(refit.unsqueeze(-1), w_new, state.weights[..., :s])
    pruned = refit & (keep != ok).any(-1)
    if refills is not None:
        state.stopped |= pruned & (state.rounds >= refills)
        state.rounds += pruned.long()
    if bool(pruned.any()):  # kept slots first, in selection order
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
        moved = pruned.unsqueeze(-1)
        state.index[..., :s] = torch.where(moved, cols.gather(-1, order), state.index[..., :s])
        state.weights[..., :s] = torch.where(moved, state.weights[..., :s].gather(-1, order), state.weights[..., :s])
        fit.reorder(pruned, order)
    state.count = torch.where(refit, keep.sum(-1), state.count)
    state.pending = state.pending & ~refit
    used = torch.arange(s, device=ok.device) < state.count.unsqueeze(-1)
    if fit.zero_unused:
        state.index[..., :s] = torch.where(used, state.index[..., :s], 0)
        state.weights[..., :s] = torch.where(used, state.weights[..., :s], 0.0)
    else:
        state.weights[..., :s] = state.weights[..., :s] * used
    return fit.update(w_new, state.index[..., :s], state.weights[..., :s], used, refit)


def omp_greedy(
    fit: OMPRefit,
    counts: Tensor,
    banned: Tensor,
    t: int,
    *,
    k: int = 1,
    tau: int = 1,
    w_min: float | None = None,
    refills: int | None = None,
    refill_at_once: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The greedy loop of OMP (AM §3.3 Algorithm 1; App. C.1 Algorithm 2), any refit.

    Each step adds the ``k`` unselected keys with the largest correlation ``c_j = rᵀ Φ_{:,j}``
    (raw, as in the paper); every ``tau`` steps, and when a problem's budget is filled (or no
    candidates remain), ``fit`` refits w and updates r. Once the budget is filled, keys with
    ``w < w_min`` are discarded for good and selection continues (App. C.2 "Stabilizing β").

    Args:
        fit: the refit (:class:`FeatureRefit` or the Attention Matching ``GramRefit``).
        counts: (...) long, keys to select per problem (≤ ``t``).
        banned: (..., T) bool, keys that may not be selected (modified in place).
        t: slots of the result (``max(counts)`` or more).
        k: keys added per greedy step.
        tau: greedy steps between refits.
        w_min: ``exp(β_min)``, or None for no pruning.
        refills: times a problem may go back to selection after a pruning; after that the keys
            still below ``w_min`` are discarded and their slots stay empty. None: no limit (the
            paper: until every kept key satisfies the bound or no candidates remain).
        refill_at_once: after the budget was filled once, take all missing keys in one step
            (else ``k`` per step; the top-k then always ranks ``min(k, T)`` candidates).

    Returns:
        ``(index (..., t), weights (..., t), count (...), residual_history (..., steps + 1))``;
        selected slots first, in selection order.
    """
    n_keys = banned.shape[-1]
    k_top = max(1, min(k, n_keys))
    state = _Greedy.start(banned, omp_width(t, k, n_keys), fit.dtype)
    history = [fit.start_norm()]
    for step in itertools.count(1):
        need = counts - state.count
        grow = (need > 0) & (~state.banned).any(-1) & ~state.stopped
        if not bool((grow | state.pending).any()):
            break
        if refill_at_once:  # refilling after a β_min pruning takes all missing keys in one step
            per_step = torch.where(state.filled, need, need.clamp(max=k))
            width = max(1, min(int(per_step.max()), n_keys))
        else:
            per_step, width = need.clamp(max=k), k_top
        _take_top_keys(state, fit.correlations(), per_step, grow, width, t)
        done = (state.count >= counts) | ~(~state.banned).any(-1)
        state.filled |= done
        refit = state.pending & (done | (step % tau == 0))  # Alg. 2 line 8
        if bool(refit.any()):
            history.append(_refit(state, fit, refit, refit & done, w_min, refills))
        else:
            history.append(history[-1])
    return state.index[..., :t].clone(), state.weights[..., :t].clone(), state.count, torch.stack(history, dim=-1)


def _check_omp_args(Phi: Tensor, target: Tensor, t: int, k: int, refit_every: int, nnls_iters: int) -> None:
    check_matrix(Phi, "Phi")
    n_q, T = Phi.shape[-2:]
    if target.ndim < 1 or target.shape[-1] != n_q:
        raise ValueError(f"expected Phi (..., q, T) and target (..., q); got {tuple(Phi.shape)}, {tuple(target.shape)}")
    if not 1 <= t <= T:
        raise ValueError(f"t must be in [1, n_keys={T}]; got {t}")
    if k < 1 or refit_every < 1 or nnls_iters < 0:
        raise ValueError(f"need k >= 1, refit_every >= 1, nnls_iters >= 0; got {k}, {refit_every}, {nnls_iters}")


def omp_select(
    Phi: Tensor,
    target: Tensor,
    t: int,
    *,
    k: int = 1,
    refit_every: int = 1,
    nnls_iters: int = 0,
    beta_bounds: tuple[float | None, float | None] = (-7.0, 7.0),
    ridge: float = 1e-6,
    monotone: bool = True,
) -> OMPResult:
    """Greedy key selection for attention-mass matching, AM-OMP (§3.3 Alg. 1) and AM-OMP-fast (Alg. 2).

    Seeks t columns S of Φ and weights w ≥ 0 minimizing ‖Φ_{:,S} w − m‖². Each greedy step adds
    the k unselected keys with the largest correlation ``c_j = rᵀ Φ_{:,j}`` with the residual r
    (raw, unnormalized, as in the paper); every ``refit_every`` (τ) steps, and when the budget is
    filled, w is refitted by NNLS (:func:`~kvfold.methods.compaction.linalg.nnls`, Algorithm 3 with
    ``nnls_iters`` projected-gradient steps; the paper uses 0) and r = m − Φ_S w. k=1, τ=1 is
    Algorithm 1; the paper's fast variant is k=4, τ=2. Selected keys are masked out, so each key
    is picked at most once. The loop is :func:`omp_greedy`, the refit :class:`FeatureRefit`.

    β safeguards (App. C.2): ``w ≤ exp(β_max)`` is enforced inside NNLS; once the budget is filled,
    keys with ``w < exp(β_min)`` (including w = 0) are discarded for good and selection continues
    until every kept key has β ≥ β_min (or no candidates remain). Either bound may be None.

    Residual guarantees (with ``monotone=True``, the default): the lstsq+clamp refit is replaced
    by the previous weights whenever those fit better, so — as with the exact NNLS of Algorithm 1 —
    ``residual_norms`` never increases, for any k and τ, except at a β_min pruning, which can raise
    it by at most exp(β_min)·Σ_pruned ‖Φ_{:,j}‖. ``monotone=False`` is Algorithm 3 verbatim, whose
    clamped least-squares refit can increase the residual.

    The caller builds Φ and m with the per-query max-shift of App. A.2 (see
    :func:`kvfold.methods.compaction.linalg.max_shifted_exp`): ``Φ_ij = exp(q_i·K_j/√d − s_i)``,
    ``m_i = Σ_j Φ_ij``. The shift s_i rescales query i's row of the least-squares problem by
    exp(−s_i), exactly as in the paper.

    Args:
        Phi: (..., n_queries, n_keys) nonnegative mass features (exp-scores, max-shifted per row).
        target: (..., n_queries) mass vector m.
        t: number of keys to select, 1 ≤ t ≤ n_keys.
        k: keys added per greedy step.
        refit_every: τ, greedy steps between NNLS refits.
        nnls_iters: projected-gradient steps per refit (Algorithm 3).
        beta_bounds: (β_min, β_max) safeguards; (None, None) disables both.
        ridge: relative ridge of the least-squares fallback inside NNLS.
        monotone: keep the previous weights when the refit would fit worse (see above).

    Returns:
        An :class:`OMPResult` (indices, weights, residual_norms, num_selected).

    Raises:
        ValueError: on bad shapes or parameters.

    Example:
        >>> logits = torch.randn(4, 256, 512)  # (heads, reference queries, keys)
        >>> Phi, _ = max_shifted_exp(logits)
        >>> res = omp_select(Phi, Phi.sum(-1), t=64, k=4, refit_every=2)
        >>> res.indices.shape, res.weights.shape
        (torch.Size([4, 64]), torch.Size([4, 64]))
    """
    _check_omp_args(Phi, target, t, k, refit_every, nnls_iters)
    n_q, T = Phi.shape[-2:]
    beta_min, beta_max = beta_bounds
    batch = torch.broadcast_shapes(Phi.shape[:-2], target.shape[:-1])
    Phi = Phi.expand(*batch, n_q, T)
    target = target.expand(*batch, n_q)
    w_max = None if beta_max is None else math.exp(beta_max)
    fit = FeatureRefit(Phi, target, nnls_iters=nnls_iters, w_max=w_max, ridge=ridge, monotone=monotone)
    counts = torch.full(batch, t, dtype=torch.long, device=Phi.device)
    banned = torch.zeros((*batch, T), dtype=torch.bool, device=Phi.device)
    w_min = None if beta_min is None else math.exp(beta_min)
    indices, weights, count, history = omp_greedy(fit, counts, banned, t, k=k, tau=refit_every, w_min=w_min)
    return OMPResult(indices=indices, weights=weights, residual_norms=history, num_selected=count)
