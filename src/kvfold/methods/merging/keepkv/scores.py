"""KeepKV's scores ŝ (eq. 8): a bias-corrected EMA of ``exp(q·k·scaling)`` over queries, with the
statistics that carry it from the prefill into decoding. See :mod:`kvfold.methods.merging.keepkv`.
"""

from __future__ import annotations

import math

import torch

from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.scoring import compute_dtype
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores (eq. 8)


def ema_log_weights(count: int, alpha: float, dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """``log ω_j = log(1 − α) + (count − 1 − j) log α`` for queries ``j = 0 … count − 1`` (eq. 8:
    the newest query weighs ``1 − α``, each older one ``α`` times less)."""
    steps = torch.arange(count - 1, -1, -1, dtype=dtype, device=device)
    return math.log1p(-alpha) + steps * math.log(alpha)


def window_log_scores(
    queries: Tensor, keys: Tensor, scaling: float, alpha: float, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """EMA scores after the prefill (eq. 8, ``t = L``) from the last ``W`` context queries.

    ``ŝ_i = Σ_j ω_j s_ji / Σ_j ω_j`` over the window queries ``j`` that see entry ``i`` (causal),
    with ``s_ji = exp(q_j·k_i·scaling)`` averaged over the query heads of the GQA group.

    Args:
        queries: ``(B, H_q, W, D)`` post-RoPE queries of the last ``W`` tokens, which are the last
            ``W`` slots of ``keys``.
        keys: ``(B, H_kv, N, D)``.
        scaling: logit scale.
        alpha: EMA decay ``α`` in (0, 1).
        valid: ``(B, H_kv, N)`` bool or None.

    Returns:
        ``(log ŝ, weight)``, both ``(B, H_kv, N)``: ``log ŝ`` (``-inf`` where no query saw the
        entry) and ``Σ_j ω_j`` of the queries that saw it (the bias correction, ``1 − α^t``).
    """
    batch, num_q, width, dim = queries.shape
    heads, length = keys.shape[1], keys.shape[2]
    groups = num_q // heads
    dtype = compute_dtype(queries, keys)
    q = queries.to(dtype).reshape(batch, heads, groups, width, dim)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys.to(dtype)) * scaling  # ln s (votes excluded)
    query_pos = torch.arange(length - width, length, device=keys.device)
    allowed = torch.arange(length, device=keys.device)[None, :] <= query_pos[:, None]  # (W, N) causal
    allowed = allowed.expand(batch, heads, width, length)
    if valid is not None:
        valid = valid.to(torch.bool)
        allowed = allowed & valid[:, :, None, :] & valid[:, :, query_pos][..., None]
    log_w = ema_log_weights(width, alpha, dtype, keys.device)
    x = (logits + log_w[:, None]).masked_fill(~allowed[:, :, None], NEG_INF)
    log_sum = torch.logsumexp(x.flatten(2, 3), dim=2) - math.log(groups)  # (B, H, N)
    weight = (allowed.to(dtype) * log_w.exp()[:, None]).sum(dim=2)
    log_score = torch.where(weight > 0, log_sum - weight.clamp_min(1e-300).log(), torch.full_like(log_sum, NEG_INF))
    return log_score, weight


def step_log_scores(
    query: Tensor,
    keys: Tensor,
    log_mass: Tensor,
    scaling: float,
    probs: Tensor | None = None,
    valid: Tensor | None = None,
    logits: Tensor | None = None,
) -> Tensor:
    """``ln s = q·k·scaling`` of this forward's queries for every entry, ``(B, H_q, q, N)``.

    With the attention's scores ``logits`` (``(B, H_kv, G·q, N)``, before β) they are used as
    they are. With the attention's probabilities ``P = p s / Z`` (votes included), ``ln s = ln P − β + ln Z``
    where ``ln Z`` comes from one anchor entry per query (its highest probability), so no second
    ``q·Kᵀ`` is needed. Without ``probs`` the logits are computed directly. Invalid slots get -inf.
    ``valid``: the ``(B, H, N)`` mask of finite ``log_mass`` when the caller has it already.
    """
    batch, num_q, q_len, dim = query.shape
    heads, length = keys.shape[1], keys.shape[2]
    groups = num_q // heads
    dtype = torch.promote_types(compute_dtype(query, keys), torch.float32)
    if valid is None:
        valid = torch.isfinite(log_mass)
    if logits is not None:
        logits = torch.where(valid[:, :, None, :], logits if logits.dtype == dtype else logits.to(dtype), NEG_INF)
        return logits.reshape(batch, num_q, q_len, length)
    beta = log_mass.to(dtype)
    folded = query.to(dtype).reshape(batch, heads, groups * q_len, dim)
    if probs is None:
        logits = torch.matmul(folded, keys.to(dtype).transpose(-1, -2)) * scaling
    else:
        p = probs.to(dtype).reshape(batch, heads, groups * q_len, length)
        log_p = p.clamp_min(torch.finfo(dtype).tiny).log()
        beta = torch.where(valid, beta, 0.0)[:, :, None, :]  # (B, H, 1, N)
        anchor = p.argmax(dim=-1, keepdim=True)  # (B, H, G·q, 1): each query's most attended entry
        k_anchor = torch.gather(keys, 2, anchor.expand(-1, -1, -1, dim)).to(dtype)
        logit_anchor = (folded * k_anchor).sum(-1, keepdim=True) * scaling
        # ln Z = ln s_a + β_a − ln P_a at the anchor a
        log_z = logit_anchor + torch.gather(beta.expand_as(p), 3, anchor) - torch.gather(log_p, 3, anchor)
        logits = log_p - beta + log_z
    logits = torch.where(valid[:, :, None, :], logits, NEG_INF)
    return logits.reshape(batch, num_q, q_len, length)


def ema_step(log_sum: Tensor, weight: Tensor, log_s: Tensor, first_new: int, alpha: float) -> tuple[Tensor, Tensor]:
    """Fold this forward's ``q`` queries into the EMA (eq. 8, ``t > L``): ``S ← α S + (1 − α) s``.

    Args:
        log_sum: ``(B, H_kv, N)`` ``log S`` (bias-uncorrected EMA), ``-inf`` for new slots.
        weight: ``(B, H_kv, N)`` ``Σ ω`` so far (0 for new slots); ``ŝ = S / weight``.
        log_s: ``(B, H_q, q, N)`` ``ln s`` of the queries (see :func:`step_log_scores`).
        first_new: slot of the first entry appended by this forward (query ``j`` sees slots
            ``< first_new + j + 1``).
        alpha: ``α``.

    Returns:
        The new ``(log_sum, weight)``.
    """
    batch, num_q, q_len, length = log_s.shape
    heads = log_sum.shape[1]
    groups = num_q // heads
    dtype = log_sum.dtype
    log_w = ema_log_weights(q_len, alpha, dtype, log_s.device)  # (q,)
    slots = torch.arange(length, device=log_s.device)
    seen = slots[None, :] <= first_new + torch.arange(q_len, device=log_s.device)[:, None]  # (q, N)
    x = log_s.to(dtype).reshape(batch, heads, groups, q_len, length) + log_w[:, None]
    x = x.masked_fill(~seen, NEG_INF)
    added = torch.logsumexp(x.flatten(2, 3), dim=2) - math.log(groups)
    added_weight = (seen.to(dtype) * log_w.exp()[:, None]).sum(0)
    decay = q_len * math.log(alpha)
    return torch.logaddexp(log_sum + decay, added), weight * math.exp(decay) + added_weight


def ema_step_one_(log_sum: Tensor, weight: Tensor, log_s: Tensor, alpha: float) -> None:
    """:func:`ema_step` for a forward of one query (a decode step), in place: every slot is seen,
    ``S ← α S + (1 − α) s`` and ``Σω ← α Σω + (1 − α)`` (eq. 8).

    The mean over the GQA group is a chain of ``logaddexp`` over its query heads (no max-shift
    pass: one decode step's row is small and this runs in every layer at every step); it agrees
    with :func:`ema_step` to rounding.

    Args:
        log_sum, weight: ``(B, H_kv, N)``, updated in place (views are fine).
        log_s: ``(B, H_q, 1, N)``.
        alpha: ``α``.
    """
    batch, num_q, q_len, length = log_s.shape
    if q_len != 1:
        raise ValueError(f"ema_step_one_ folds one query; got {q_len} (use ema_step)")
    heads = log_sum.shape[1]
    ema_fold_group_(log_sum, weight, log_s.reshape(batch, heads, num_q // heads, length), alpha)


def ema_fold_group_(log_sum: Tensor, weight: Tensor, log_s: Tensor, alpha: float) -> None:
    """The update of :func:`ema_step_one_` with the query heads of each GQA group on dim −2:
    ``S ← α S + (1 − α) s̄`` with ``s̄`` the mean of ``s`` over the group, and ``Σω ← α Σω + (1 − α)``
    (eq. 8), in place. Any leading dims: one layer ``(B, H_kv, G, N)``, or every layer of a
    batched decode step ``(L, B, H_kv, G, C)``.

    Args:
        log_sum, weight: ``log_s``'s shape without dim −2, updated in place (views are fine).
        log_s: ``ln s`` of one query per query head, the group's heads on dim −2.
        alpha: ``α``.
    """
    log_w, w = _one_query_weight(alpha, log_sum.dtype)
    x = log_s if log_s.dtype == log_sum.dtype else log_s.to(log_sum.dtype)
    groups = x.shape[-2]
    added = x.select(-2, 0)
    for head in range(1, groups):  # the group's mean: a chain of logaddexp (no max-shift pass)
        added = torch.logaddexp(added, x.select(-2, head))
    added = added + (log_w - math.log(groups))
    log_sum.copy_(torch.logaddexp(log_sum + math.log(alpha), added))
    weight.mul_(alpha).add_(w)


_ONE_QUERY_WEIGHT: dict[tuple[float, torch.dtype], tuple[float, float]] = {}


def _one_query_weight(alpha: float, dtype: torch.dtype) -> tuple[float, float]:
    """``(log ω, ω)`` of a single query as :func:`ema_step` rounds them in ``dtype`` (``ω = 1 − α``)."""
    found = _ONE_QUERY_WEIGHT.get((alpha, dtype))
    if found is None:
        log_w = ema_log_weights(1, alpha, dtype)
        found = (float(log_w[0]), float(log_w.exp()[0]))
        _ONE_QUERY_WEIGHT[(alpha, dtype)] = found
    return found


def log_scores_of(log_sum: Tensor, weight: Tensor) -> Tensor:
    """Bias-corrected ``log ŝ = log S − log Σω`` (``-inf`` where nothing was observed)."""
    return torch.where(weight > 0, log_sum - weight.clamp_min(1e-300).log(), torch.full_like(log_sum, NEG_INF))


STAT_LOG_SCORE = "keepkv_log_score"
STAT_WEIGHT = "keepkv_weight"


def folded_scalings(ctx: CompressionContext) -> dict[int, float]:
    """The logit scale of every folded layer (:func:`kvfold.methods.core.model.layer_scaling`: the
    module's scale, else ``1/√D``), kept in ``ctx.memo["keepkv_scalings"]`` (tests set it there)."""
    cached = ctx.memo.get("keepkv_scalings")
    if cached is None:
        cached = {i: layer_scaling(ctx, i, layer) for i, layer in ctx.cache.folded_layers}
        ctx.memo["keepkv_scalings"] = cached
    return cached
