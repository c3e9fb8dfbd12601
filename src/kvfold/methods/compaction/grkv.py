"""GRKV: global ridge-regression merging on top of any eviction (``snapkv+grkv``, ``grkv``).

Peng et al. 2026, "GRKV: Global Regression for Training-Free KV Cache Compression in
Long-Context LLMs" (``papers/grkv.md``), §3.2–3.4, Algorithm 1 and Appendix D.

After an eviction has chosen the retained entries (any selector, wrapper or per-head budget),
GRKV rewrites the retained keys and values so that the compressed cache reproduces the full
cache's attention outputs on a surrogate query window, with ridge penalties that keep them near
their evicted-cache values (eq. 5)::

    min_{K,V}  ‖Y − softmax(Q_win Kᵀ/√d) V‖²_F + λ_k ‖K − K⁰‖²_F + λ_v ‖V − V⁰‖²_F

* surrogate window ``Q_win``: the real post-RoPE query states of ``m`` = 32 prompt tokens;
  every query head of a GQA group targets its KV head, so a KV head's problem has ``M = G·m``
  query rows, each attending causally (to the entries at or before its position).
  ``queries="last"``: the last ``m`` prompt tokens (§3.2); ``queries="stratified"`` (the authors'
  code): one token drawn (seeded) from each of ``m`` equal strata of the whole context, which
  costs one extra prefill pass to collect them (:class:`StratifiedQueries`).
* target ``Y = A_win^(full) V_full``: the full cache's pre-``o_proj`` attention output of those
  queries (eq. 4), computed from the layer before eviction.
* value step: ridge regression toward ``V⁰`` solved in the ``M×M`` dual (Woodbury, eq. 8/33).
* key step: the attention output linearized in ``K`` (eq. 34), ridge in the dual
  (eq. 10/39–41), ``(J Jᵀ + λ_k I) α = e + J g`` solved matrix-free by conjugate gradients
  through analytic Jacobian-vector / vector-Jacobian products (or with an explicit ``J`` when
  small), then ``K* = K⁰ + unvec(Jᵀ α)``.
* ``S`` alternating steps (default 1, Algorithm 1).
* fixed tokens (App. D.3), bit-identical after the update: sink tokens, the window's own tokens
  and the top ``fixed`` = 10% retained tokens by window attention.
* safeguard (ours, in neither the paper nor its code): per KV head, an update that raises the
  window objective (eq. 4) is not applied; the best of {base, V-only, K+V} is kept and reported
  in ``ctx.report["grkv"]``.

Everything is batched over batch rows and KV heads (no Python loop over heads or tokens) and
runs in float32 (float64 for float64 models) whatever the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.compaction.linalg import max_shifted_exp, ridge_dual, ridge_dual_cg
from kvfold.methods.core.base import register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import FoldSite, MergingFolder, fresh_window_queries
from kvfold.methods.core.model import layer_scaling, prefill_again
from kvfold.methods.core.scoring import window_attention
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor

__all__ = [
    "CHOICES",
    "GRKV",
    "KeyLinearization",
    "MergeResult",
    "QUERY_CHOICES",
    "StratifiedQueries",
    "stratified_positions",
    "family_lambda",
    "grkv_merge",
    "key_step",
    "value_step",
    "window_objective",
    "window_probs",
]

DEFAULT_LAMBDA = 1e-2
"""λ_k = λ_v for Llama (§4.1)."""
LAMBDA_PRESETS: dict[str, float] = {
    "mistral": 1e-1,
    "mixtral": 1e-1,
    "qwen2": 1e-1,
    "qwen2_moe": 1e-1,
    "qwen3": 1e-1,
    "qwen3_moe": 1e-1,
}
"""§4.1: "λ_k = λ_v = 10⁻² for Llama and 10⁻¹ for Mistral and Qwen" (by ``config.model_type``)."""

CHOICES = ("base", "values", "keys", "keys_values")
"""What a KV head ended with (index = code in :attr:`MergeResult.choice`)."""
_BASE, _VALUES, _KEYS, _KEYS_VALUES = range(4)

QUERY_CHOICES = ("last", "stratified")
"""Where GRKV's surrogate queries come from: the last ``m`` prompt tokens, or ``m`` strata of it."""

EXACT_MAX_ELEMENTS = 1 << 22
"""``solver="auto"`` solves the key step exactly when ``J`` and ``J Jᵀ`` have at most this many
entries per head (tiny models); otherwise by conjugate gradients (the paper)."""


def family_lambda(model_type: str | None) -> float:
    """The paper's ridge strength for a model family (§4.1): 0.1 for Mistral/Qwen, else 0.01."""
    return LAMBDA_PRESETS.get((model_type or "").lower(), DEFAULT_LAMBDA)


# ---------------------------------------------------------------------------- window attention


def window_probs(queries: Tensor, keys: Tensor, bias: Tensor, scaling: float) -> Tensor:
    """``A = softmax(Q Kᵀ·s + bias)`` per problem (max-shifted); fully masked rows are all zero.

    Args:
        queries: ``(..., M, D)`` surrogate queries.
        keys: ``(..., c, D)`` retained keys.
        bias: ``(..., M, c)`` additive logits: β of each entry, −inf where a query may not look
            (causal mask, empty slots).
        scaling: logit scale ``s`` (``1/√d``).

    Returns:
        ``(..., M, c)`` attention probabilities.
    """
    feats, _ = max_shifted_exp(queries @ keys.mT * scaling + bias)
    total = feats.sum(-1, keepdim=True)
    return feats / torch.where(total > 0, total, torch.ones_like(total))


def window_objective(
    queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor, target: Tensor, scaling: float
) -> Tensor:
    """eq. 4: ``L_win = ‖Y − A_win(K) V‖²_F`` per problem, shape ``(...)``."""
    return (target - window_probs(queries, keys, bias, scaling) @ values).square().sum((-2, -1))


# ---------------------------------------------------------------------------- value step


def value_step(probs: Tensor, target: Tensor, values0: Tensor, free: Tensor, lam_v: float) -> Tensor:
    """GRKV value step with fixed tokens: ridge toward ``V⁰`` in the dual (eq. 8/33, Alg. 1 l. 9–13).

    ``X_G`` keeps the columns of the free tokens (App. D.3); the fixed tokens' contribution is
    moved to the target, ``Y_G = Y − X_F V⁰_F``, so ``R_V = Y − X V⁰`` and::

        Z = (X_G X_Gᵀ + λ_v I_M)⁻¹ R_V          (eq. 8)
        V*_G = V⁰_G + X_Gᵀ Z,  V*_F = V⁰_F      (eq. 33)

    Args:
        probs: ``(..., M, c)`` ``X = A_win^(Ret)`` at the current keys.
        target: ``(..., M, D)`` ``Y``.
        values0: ``(..., c, D)`` ``V⁰`` (the evicted cache's values).
        free: ``(..., c)`` bool, the tokens that may change.
        lam_v: ``λ_v > 0``.

    Returns:
        ``(..., c, D)`` the new values (fixed rows equal ``V⁰``).
    """
    x_free = probs * free[..., None, :].to(probs.dtype)  # X_G (fixed and empty columns zeroed)
    x_fixed = probs - x_free  # X_F
    return ridge_dual(x_free, target - x_fixed @ values0, values0, lam_v)


# ---------------------------------------------------------------------------- key step


class KeyLinearization:
    """``f(K) = softmax(Q Kᵀ·s + bias) V`` at the current keys and its derivative in ``K`` (eq. 34).

    With ``p_ij`` the attention of query ``i`` on entry ``j`` and ``f_i = Σ_j p_ij v_j``::

        ∂f_i/∂k_j [δk_j] = s · p_ij (v_j − f_i) (q_i · δk_j)

    so ``J`` (``M·D_v × c·D``) has rank-one blocks ``s p_ij (v_j − f_i) q_iᵀ``. Products with
    ``J`` and ``Jᵀ`` cost two ``M×c×D`` matrix products each and never build ``J``; only the
    columns of the free keys are used (App. D.3).
    """

    def __init__(
        self, queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor, free: Tensor, scaling: float
    ) -> None:
        self.queries = queries
        self.values = values
        self.scaling = scaling
        self.free = free[..., None].to(keys.dtype)  # (..., c, 1)
        self.probs = window_probs(queries, keys, bias, scaling)  # (..., M, c)
        self.output = self.probs @ values  # f(K), (..., M, D_v)
        self.key_shape = keys.shape

    def jvp(self, delta_keys: Tensor) -> Tensor:
        """``J[δK]`` ``(..., M, D_v)`` for ``δK`` ``(..., c, D)``."""
        dl = self.scaling * (self.queries @ (delta_keys * self.free).mT)  # δℓ_ij = s q_i·δk_j
        dp = self.probs * (dl - (self.probs * dl).sum(-1, keepdim=True))  # softmax derivative
        return dp @ self.values

    def vjp(self, u: Tensor) -> Tensor:
        """``Jᵀ[u]`` ``(..., c, D)`` for ``u`` ``(..., M, D_v)``."""
        dp = u @ self.values.mT  # ū·v_j, (..., M, c)
        dl = self.probs * (dp - (u * self.output).sum(-1, keepdim=True))  # Σ_j p_ij u_i·v_j = u_i·f_i
        return self.scaling * (dl.mT @ self.queries) * self.free

    def matrix(self) -> Tensor:
        """The explicit ``J`` ``(..., M·D_v, c·D)`` (row-major ``vec``), for small problems and tests."""
        diff = self.values[..., None, :, :] - self.output[..., :, None, :]  # v_j − f_i, (..., M, c, D_v)
        blocks = (self.scaling * self.probs)[..., None, None] * diff[..., None] * self.queries[..., :, None, None, :]
        blocks = blocks * self.free[..., None, :, None, :]  # (..., M, c, D_v, D): free columns only
        lead = blocks.shape[:-4]
        m, c, dv, d = blocks.shape[-4:]
        return blocks.movedim(-2, -3).reshape(*lead, m * dv, c * d)


def key_step(
    queries: Tensor,
    keys: Tensor,
    keys0: Tensor,
    values: Tensor,
    bias: Tensor,
    free: Tensor,
    target: Tensor,
    scaling: float,
    lam_k: float,
    *,
    solver: str = "cg",
    cg_iters: int = 16,
    cg_tol: float = 1e-6,
) -> tuple[Tensor, Tensor | None]:
    """GRKV key step: linearized ridge in the dual (eq. 10, App. D.2 eq. 35–41, Alg. 1 l. 14–21).

    At the current keys ``K_t`` with values ``V`` fixed::

        E = Y − f(K_t),  G = K_t − K⁰ (free keys)
        (J Jᵀ + λ_k I) α = vec(E) + J vec(G)       (eq. 37–39)
        K* = K⁰ + unvec(Jᵀ α)                      (eq. 41)

    Args:
        queries, bias, target, scaling: as :func:`window_probs` and :func:`window_objective`.
        keys: ``(..., c, D)`` ``K_t``, where the map is linearized.
        keys0: ``(..., c, D)`` ``K⁰`` (the evicted cache's keys).
        values: ``(..., c, D_v)`` the values of this step.
        free: ``(..., c)`` bool.
        lam_k: ``λ_k > 0``.
        solver: ``"cg"`` (matrix-free conjugate gradients, :func:`kvfold.methods.compaction.linalg.ridge_dual_cg`)
            or ``"exact"`` (explicit ``J`` and a Cholesky solve of the ``M·D_v`` dual system).
        cg_iters, cg_tol: CG budget (the authors' code: 16 iterations, tol 1e-6).

    Returns:
        ``(K*, cg_residual)``: new keys (fixed rows equal ``K⁰``) and the final relative CG
        residual per problem (None for the exact solver).
    """
    lin = KeyLinearization(queries, keys, values, bias, free, scaling)
    mask = free[..., None].to(keys.dtype)
    error = target - lin.output  # E = Y − f(K_t)
    shift = (keys - keys0) * mask  # G = K_t − K⁰ on the free keys
    rhs = error + lin.jvp(shift)  # r_K = vec(E) + J vec(G)   (Alg. 1 line 18)
    lead = rhs.shape[:-2]
    rhs_vec = rhs.reshape(*lead, -1)
    if solver == "exact":
        jac = lin.matrix()
        zero = rhs_vec.new_zeros(*lead, jac.shape[-1], 1)
        z = ridge_dual(jac, rhs_vec[..., None], zero, lam_k)[..., 0]  # z = Jᵀ (J Jᵀ + λ_k I)⁻¹ r_K
        residual = None
    else:
        out_shape = lin.output.shape

        def jvp(v: Tensor) -> Tensor:
            return lin.jvp(v.reshape(lin.key_shape)).reshape(*lead, -1)

        def vjp(u: Tensor) -> Tensor:
            return lin.vjp(u.reshape(out_shape)).reshape(*lead, -1)

        z, _, info = ridge_dual_cg(jvp, vjp, rhs_vec, lam_k, iters=cg_iters, tol=cg_tol)
        residual = info.residual
    update = z.reshape(lin.key_shape) * mask  # unvec(Jᵀ α), zero on fixed keys
    return keys0 + update, residual  # eq. 41


# ---------------------------------------------------------------------------- alternating steps


@dataclass
class MergeResult:
    """What :func:`grkv_merge` produced, per problem (batch row × KV head).

    Attributes:
        keys, values: the merged retained cache.
        choice: ``(...)`` long, index into :data:`CHOICES` of the candidate kept last.
        objective_base: window objective (eq. 4) of the evicted cache.
        objective: window objective of the result (≤ ``objective_base`` with the safeguard).
        cg_residual: largest final relative CG residual of the key steps, or None.
    """

    keys: Tensor
    values: Tensor
    choice: Tensor
    objective_base: Tensor
    objective: Tensor
    cg_residual: Tensor | None = None


def _cap(new: Tensor, ref: Tensor, cap: float) -> Tensor:
    """Scale ``new − ref`` per problem so that ``‖new − ref‖_F ≤ cap · ‖ref‖_F`` (cap ≤ 0: off)."""
    if cap <= 0:
        return new
    delta = new - ref
    norm = delta.flatten(-2).norm(dim=-1)
    limit = cap * ref.flatten(-2).norm(dim=-1)
    scale = torch.where(norm > limit, limit / norm.clamp_min(torch.finfo(norm.dtype).tiny), torch.ones_like(norm))
    return ref + delta * scale[..., None, None]


def _keep_better(
    candidates: list[tuple[int, Tensor, Tensor]],
    objective: Callable[[Tensor, Tensor], Tensor],
    best: tuple[Tensor, Tensor, Tensor, Tensor],
    safeguard: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The safeguard over one step's candidates ``(code, keys, values)``: per problem, a candidate
    replaces the best ``(keys, values, objective, choice)`` only where it lowers eq. 4 (NaN never
    wins); without ``safeguard`` every candidate replaces it, so the last one is kept."""
    best_k, best_v, best_obj, choice = best
    for code, cand_k, cand_v in candidates:
        obj = objective(cand_k, cand_v)
        better = obj < best_obj if safeguard else torch.ones_like(best_obj, dtype=torch.bool)
        pick = better[..., None, None]
        best_k = torch.where(pick, cand_k, best_k)
        best_v = torch.where(pick, cand_v, best_v)
        best_obj = torch.where(better, obj, best_obj)
        choice = torch.where(better, torch.full_like(choice, code), choice)
    return best_k, best_v, best_obj, choice


def grkv_merge(
    queries: Tensor,
    keys0: Tensor,
    values0: Tensor,
    bias: Tensor,
    free: Tensor,
    target: Tensor,
    scaling: float,
    *,
    lam_k: float = DEFAULT_LAMBDA,
    lam_v: float = DEFAULT_LAMBDA,
    steps: int = 1,
    update_keys: bool = True,
    update_values: bool = True,
    solver: str = "cg",
    cg_iters: int = 16,
    cg_tol: float = 1e-6,
    cap_k: float = 0.0,
    cap_v: float = 0.0,
    safeguard: bool = True,
) -> MergeResult:
    """GRKV's alternating optimization (Algorithm 1) on a batch of problems.

    Each step: value step at the current keys (:func:`value_step`, toward ``V⁰``), then key step
    linearized at the current keys with the new values (:func:`key_step`, toward ``K⁰``). With
    ``safeguard`` (the authors' code), each problem keeps the best of {current, V-only, K+V} by
    the window objective (eq. 4), so the result never has a higher objective than ``(K⁰, V⁰)``,
    and the next step starts from it. Stops early when no entry moves by more than 1e-9
    (Alg. 1 line 24).

    Args:
        queries: ``(..., M, D)`` surrogate queries.
        keys0, values0: ``(..., c, D)`` the evicted (retained) cache ``K⁰``, ``V⁰``.
        bias: ``(..., M, c)`` β plus −inf for masked (causal, empty) pairs.
        free: ``(..., c)`` bool, tokens that may change (not fixed, not empty).
        target: ``(..., M, D_v)`` ``Y`` = full-cache attention output of the window.
        scaling: logit scale.
        lam_k, lam_v: ridge strengths (eq. 5).
        steps: ``S``.
        update_keys, update_values: the K-only / V-only ablations (GRK, GRV).
        solver, cg_iters, cg_tol: see :func:`key_step`.
        cap_k, cap_v: optional per-problem caps on ‖K − K⁰‖ / ‖V − V⁰‖ relative to ‖K⁰‖ / ‖V⁰‖
            (the authors' code uses 0.025 and 0.1; 0 = off, as in the paper).
        safeguard: keep the better of base and updated per problem.
    """
    if not (update_keys or update_values):
        raise ValueError("grkv: nothing to update (keys and values both off)")
    objective_base = window_objective(queries, keys0, values0, bias, target, scaling)
    best_k, best_v, best = keys0, values0, objective_base
    choice = torch.full(objective_base.shape, _BASE, dtype=torch.long, device=keys0.device)
    residual = None
    key_options = {"solver": solver, "cg_iters": cg_iters, "cg_tol": cg_tol}

    def objective(keys: Tensor, values: Tensor) -> Tensor:
        return window_objective(queries, keys, values, bias, target, scaling)

    for _ in range(steps):
        cur_k, cur_v = best_k, best_v
        candidates: list[tuple[int, Tensor, Tensor]] = []
        new_v = cur_v
        if update_values:
            probs = window_probs(queries, cur_k, bias, scaling)  # X at K_t   (Alg. 1 line 9)
            new_v = _cap(value_step(probs, target, values0, free, lam_v), values0, cap_v)
            candidates.append((_VALUES, cur_k, new_v))
        if update_keys:
            new_k, res = key_step(queries, cur_k, keys0, new_v, bias, free, target, scaling, lam_k, **key_options)
            new_k = _cap(new_k, keys0, cap_k)
            if res is not None:
                residual = res if residual is None else torch.maximum(residual, res)
            candidates.append((_KEYS_VALUES if update_values else _KEYS, new_k, new_v))
        best_k, best_v, best, choice = _keep_better(candidates, objective, (best_k, best_v, best, choice), safeguard)
        moved = max(float((best_k - cur_k).abs().max()), float((best_v - cur_v).abs().max()))
        if moved <= 1e-9:
            break
    return MergeResult(best_k, best_v, choice, objective_base, best, residual)


# ---------------------------------------------------------------------------- the folder


def stratified_positions(valid: Tensor, m: int, seed: int) -> Tensor:
    """``(B, m)`` slots: one drawn uniformly from each of ``m`` equal strata of a row's valid slots
    (left padding skipped); strata narrower than one slot repeat a slot. Every row draws from a
    fresh generator, so a context gets the same positions alone or in a batch."""
    count = valid.sum(-1).amax(-1).double()  # (B,) valid slots of each row (the same in every head)
    start = valid.shape[-1] - count  # left padding
    draws = [torch.rand(m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) for _ in count]
    u = torch.stack(draws).to(valid.device)
    edges = torch.arange(m, dtype=torch.float64, device=valid.device)
    offset = torch.floor((edges + u) * count[:, None] / m).clamp(max=(count - 1)[:, None])
    return (start[:, None] + offset).long()


class StratifiedQueries:
    """Prefill observer that keeps, per layer, the query states of stratified positions
    (:func:`stratified_positions`): ``picked[layer_idx] = (queries (B, H_q, m, D), positions (B, m))``."""

    def __init__(self, m: int, seed: int) -> None:
        self.m = m
        self.seed = seed
        self.positions: Tensor | None = None
        self.picked: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, layer_idx: int, layer: FoldedLayer, query: Tensor, scaling: float) -> None:
        if self.positions is None:  # the same positions in every layer
            self.positions = stratified_positions(torch.isfinite(layer.padded()[2]), self.m, self.seed)
        pos = self.positions.to(query.device)
        index = pos[:, None, :, None].expand(-1, query.shape[1], -1, query.shape[-1])
        self.picked[layer_idx] = (torch.gather(query, 2, index), pos)


def positioned_attention(
    queries: Tensor, keys: Tensor, scaling: float, log_mass: Tensor, valid: Tensor, positions: Tensor
) -> Tensor:
    """``(B, H_q, M, N)`` attention of queries at slots ``positions`` ``(B, M)`` on every entry at or
    before them (β included), as the full cache gave it."""
    heads = keys.shape[1]
    groups = queries.shape[1] // heads
    k = keys.repeat_interleave(groups, dim=1)
    beta = log_mass.repeat_interleave(groups, dim=1)[:, :, None, :]
    seen = valid.repeat_interleave(groups, dim=1)[:, :, None, :]
    seen = seen & (torch.arange(keys.shape[2], device=keys.device) <= positions[:, None, :, None])
    logits = (queries @ k.mT * scaling + beta).masked_fill(~seen, NEG_INF)
    return torch.softmax(logits, -1).nan_to_num(0.0)


@register
@dataclass
class GRKV(MergingFolder):
    """GRKV (Peng et al. 2026, §3, Algorithm 1, App. D): rewrite the retained K and V so the
    compressed cache reproduces the full cache's attention outputs on ``m`` prompt queries, with
    ridge penalties toward the evicted cache (see the module docstring).

    Use after any selector (``snapkv+grkv``, ``pyramidkv+grkv``, ``adakv:snapkv+grkv``,
    ``criticalkv:snapkv+grkv``, ``h2o+grkv``); ``grkv`` alone means ``snapkv+grkv``. The merge
    happens once after prefill: a selector's decode-time policy (H2O, TOVA, …) is not used.

    Parameters:
        lam: λ_k = λ_v; None = the family preset (0.1 for Mistral/Qwen, 0.01 otherwise, §4.1).
        lam_k, lam_v: override λ for keys / values separately.
        fixed: fraction β of the retained tokens kept fixed by attention score (0.1; 0 = none).
        steps: alternating steps S (1).
        m: surrogate queries per query head (32).
        queries: ``last`` (the last ``m`` prompt tokens, the paper) or ``stratified`` (one token from
            each of ``m`` strata of the context, the authors' code; one extra prefill pass).
        keys, values: update keys / values (both: GRKV; keys only: GRK; values only: GRV).
        sinks: first tokens of the context kept fixed (4; 0 = none).
        fix_window: keep the window's own tokens fixed (the paper's default; the ablation
            "sink and window tokens updated" is ``grkv[fix_window=false,sinks=0]``).
        solver: ``cg`` (matrix-free, the paper), ``exact`` (explicit Jacobian) or ``auto``
            (exact when ``J`` and ``J Jᵀ`` have at most 2²² entries per head).
        cg_iters, cg_tol: conjugate-gradient budget (16, 1e-6 as the authors' code).
        cap_k, cap_v: per-head caps on ‖ΔK‖/‖K⁰‖ and ‖ΔV‖/‖V⁰‖ (authors' code: 0.025 and 0.1;
            0 = off, the paper).
        safeguard: per head, never apply an update that raises the window objective (ours: neither
            the paper nor the authors' code has it).
    """

    name: ClassVar[str] = "grkv"
    description: ClassVar[str] = (
        "ridge-regression rewrite of retained K/V to match full attention outputs on the last 32 queries"
    )
    paper: ClassVar[str] = (
        "Peng et al. 2026, GRKV: Global Regression for Training-Free KV Cache Compression in Long-Context LLMs"
    )
    one_shot: ClassVar[bool] = True  # merges once after prefill (``h2o+grkv`` runs H2O one-shot)
    lam: float | None = None
    lam_k: float | None = None
    lam_v: float | None = None
    fixed: float = 0.1
    steps: int = 1
    m: int = 32
    keys: bool = True
    values: bool = True
    sinks: int = 4
    fix_window: bool = True
    solver: str = "auto"
    cg_iters: int = 16
    cg_tol: float = 1e-6
    cap_k: float = 0.0
    cap_v: float = 0.0
    safeguard: bool = True
    queries: str = "last"
    selector_spec: ClassVar[str] = "snapkv"
    window_option: ClassVar[str] = "m"

    def validate(self) -> None:
        for key in ("lam", "lam_k", "lam_v"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise SpecError(f"grkv: {key} must be > 0; got {value}")
        if not 0.0 <= self.fixed <= 1.0:
            raise SpecError(f"grkv: fixed must be a fraction in [0, 1]; got {self.fixed}")
        if self.steps < 1 or self.m < 1 or self.sinks < 0 or self.cg_iters < 1:
            raise SpecError("grkv: steps, m and cg_iters must be ≥ 1 and sinks ≥ 0")
        if not (self.keys or self.values):
            raise SpecError("grkv: keys=false and values=false leave nothing to update; use the selector alone")
        if self.solver not in ("auto", "cg", "exact"):
            raise SpecError(f"grkv: solver must be auto, cg or exact; got {self.solver!r}")
        if self.cap_k < 0 or self.cap_v < 0 or self.cg_tol < 0:
            raise SpecError("grkv: cap_k, cap_v and cg_tol must be ≥ 0")
        if self.queries not in QUERY_CHOICES:
            raise SpecError(f"grkv: queries must be one of {', '.join(QUERY_CHOICES)}; got {self.queries!r}")

    def prepare(self, ctx: CompressionContext) -> None:
        """``queries=stratified``: one more prefill pass keeps the stratified queries of every layer."""
        if self.queries != "stratified":
            return
        scratch = FoldedCache(ctx.model.config)
        observer = StratifiedQueries(self.m, ctx.seed)
        scratch.prefill_observers = [observer]
        prefill_again(ctx, scratch)
        ctx.memo["grkv_queries"] = observer.picked

    def lambdas(self, model_type: str | None) -> tuple[float, float]:
        """``(λ_k, λ_v)`` for a model family."""
        base = self.lam if self.lam is not None else family_lambda(model_type)
        return (self.lam_k or base, self.lam_v or base)

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        layer_idx, layer, keep, lengths = site.layer_idx, site.layer, site.keep, site.lengths
        keys_full, values_full, valid = site.keys, site.values, site.valid
        batch, heads, length, dim = keys_full.shape
        dtype = torch.promote_types(keys_full.dtype, torch.float32)
        scaling = layer_scaling(ctx, layer_idx, layer)
        queries, positions, probs_full = self._window(site, ctx, dtype, scaling)
        width = queries.shape[2]
        groups = queries.shape[1] // heads
        rows = groups * width  # M = G·m query rows per KV head
        probs_full = probs_full.reshape(batch, heads, rows, length)  # query head h → KV head h // G
        target = probs_full @ values_full.to(dtype)
        q = queries.to(dtype).reshape(batch, heads, rows, dim)

        keys0, values0, beta0 = site.kept_entries()  # K⁰, V⁰ (β = −inf past lengths)
        slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
        query_pos = positions.to(keep.device).repeat(1, groups)  # (B, M)
        allowed = keep[..., None, :] <= query_pos[:, None, :, None]  # causal: (B, H, M, c)
        bias = beta0.to(dtype)[..., None, :].masked_fill(~allowed, NEG_INF)

        free = slot & ~self._fixed_tokens(keep, slot, valid, probs_full.sum(2), width)
        evicts = lengths < valid.sum(-1)  # rows that lost nothing are left as they are
        free = free & evicts[..., None]
        report = ctx.report.setdefault("grkv", {})
        if not bool(free.any()):
            layer.replace(keys0, values0, beta0, lengths=lengths)
            nothing = {name: 0 for name in CHOICES} | {"base": batch * heads}
            report[layer_idx] = {"heads": batch * heads, **nothing, "free_tokens": 0, "note": "no free tokens"}
            return

        lam_k, lam_v = self.lambdas(getattr(ctx.model.config, "model_type", None))
        solver = self._key_solver(rows * values0.shape[-1], keep.shape[-1] * dim)
        result = grkv_merge(
            q,
            keys0.to(dtype),
            values0.to(dtype),
            bias,
            free,
            target,
            scaling,
            lam_k=lam_k,
            lam_v=lam_v,
            steps=self.steps,
            update_keys=self.keys,
            update_values=self.values,
            solver=solver,
            cg_iters=self.cg_iters,
            cg_tol=self.cg_tol,
            cap_k=self.cap_k,
            cap_v=self.cap_v,
            safeguard=self.safeguard,
        )
        # Fixed tokens (and heads that kept the base) stay bit-identical: only free rows are written.
        changed = free & (result.choice != _BASE)[..., None]
        new_keys = torch.where(changed[..., None], result.keys.to(keys0.dtype), keys0)
        new_values = torch.where(changed[..., None], result.values.to(values0.dtype), values0)
        layer.replace(new_keys, new_values, beta0, lengths=lengths)

        report[layer_idx] = _layer_report(result, free, solver)

    def _window(
        self, site: FoldSite, ctx: CompressionContext, dtype: torch.dtype, scaling: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The surrogate window (§3.2): its queries ``(B, H_q, m, D)``, their positions ``(B, m)`` and
        their attention on the layer before eviction ``(B, H_q, m, N)`` (eq. 4's ``A_win^(full)``)."""
        keys_full, log_mass, valid, keep = site.keys, site.log_mass, site.valid, site.keep
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass)).to(dtype)
        if self.queries == "stratified":
            queries, positions = ctx.memo["grkv_queries"][site.layer_idx]  # (B, H_q, m, D), (B, m)
            probs_full = positioned_attention(queries.to(dtype), keys_full.to(dtype), scaling, beta, valid, positions)
            return queries, positions, probs_full
        batch, length = keys_full.shape[0], keys_full.shape[2]
        queries = fresh_window_queries(site.layer, self.m, self.name)  # (B, H_q, w, D)
        positions = (length - queries.shape[2] + torch.arange(queries.shape[2], device=keep.device)).expand(batch, -1)
        # eq. 4: Y = A_win^(full) V_full, causal inside the window, from the layer before eviction.
        probs_full = window_attention(queries.to(dtype), keys_full.to(dtype), scaling, log_mass=beta, valid=valid)
        return queries, positions, probs_full

    def _key_solver(self, out_size: int, in_size: int) -> str:
        """``solver="auto"``: exact when ``J`` (``out_size × in_size``: ``M·D_v × c·D``) and ``J Jᵀ``
        have at most :data:`EXACT_MAX_ELEMENTS` entries per head, else conjugate gradients."""
        if self.solver != "auto":
            return self.solver
        small = max(out_size * in_size, out_size * out_size) <= EXACT_MAX_ELEMENTS
        return "exact" if small else "cg"

    def _fixed_tokens(self, keep: Tensor, slot: Tensor, valid: Tensor, attention: Tensor, width: int) -> Tensor:
        """Retained tokens that must not change (§3.4 "Fixed tokens", App. D.3), ``(B, H, c)`` bool.

        Sinks (the first ``sinks`` valid tokens of the context), the surrogate window's own tokens
        (the last ``width`` positions) and, among the other retained tokens, the
        ``⌊fixed · c⌋`` with the most attention from the window queries (summed over the window
        and the GQA group, before eviction).
        """
        length = valid.shape[-1]
        rank = valid.long().cumsum(-1)  # 1 for the first valid token
        sink = (torch.gather(rank, 2, keep) <= self.sinks) & slot
        window = (keep >= length - width) & slot if self.fix_window else torch.zeros_like(slot)
        candidates = slot & ~sink & ~window
        score = torch.gather(attention, 2, keep).masked_fill(~candidates, NEG_INF)
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices
        ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order).contiguous()
        position = torch.empty_like(order).scatter_(-1, order, ranks)  # rank of each slot by score
        count = torch.floor(slot.sum(-1).double() * self.fixed).long()  # ⌊β · c⌋ per row
        top = candidates & (position < count[..., None])
        return sink | window | top


def _layer_report(result: MergeResult, free: Tensor, solver: str) -> dict:
    """``ctx.report["grkv"][layer]``: what each KV head kept, the window objectives and the solver."""
    counts = torch.bincount(result.choice.flatten().cpu(), minlength=len(CHOICES))
    return {
        "heads": result.choice.numel(),
        **{name: int(counts[i]) for i, name in enumerate(CHOICES)},
        "choice": [[CHOICES[c] for c in row] for row in result.choice.cpu().tolist()],
        "objective_base": float(result.objective_base.sum()),
        "objective": float(result.objective.sum()),
        "free_tokens": int(free.sum()),
        "solver": solver,
        "cg_residual": None if result.cg_residual is None else float(result.cg_residual.max()),
    }
