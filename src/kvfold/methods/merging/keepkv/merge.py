"""KeepKV's merge map: the ZIP-merge of eq. 7 / eq. 25 (Appendix A.3), the most similar carrier, and
merge-first selection (Appendix B). See :mod:`kvfold.methods.merging.keepkv`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvfold.methods.core.folding import kept_mask
from kvfold.methods.core.scoring import compute_dtype
from kvfold.methods.core.selection import priority_order, topk_keep
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor
_SIM_CHUNK = 1 << 22
"""Similarity entries computed at once (bounds the memory of the cosine matrices)."""


# ---------------------------------------------------------------------------- ZIP-merge (eq. 7, 25)


@dataclass
class ZipMerge:
    """Result of :func:`zip_merge`; every tensor has the slots of the input.

    Attributes:
        keys, values: ``(B, H, N, D)``; receivers hold the merged entries, other slots unchanged.
        log_votes: ``(B, H, N)`` ``log p`` (``log p_r`` at receivers).
        log_scores: ``(B, H, N)`` ``log ŝ``; at receivers ``log ŝ_r = log(Σ w_i / p_r)`` (eq. 27).
        receivers: ``(B, H, N)`` bool, slots that absorbed at least one entry.
        fallback: ``(B, H, N)`` bool, receivers whose key used the convex fallback.
    """

    keys: Tensor
    values: Tensor
    log_votes: Tensor
    log_scores: Tensor
    receivers: Tensor
    fallback: Tensor


def _group_sum(group: Tensor, x: Tensor) -> Tensor:
    """Σ of ``x`` over the entries of each group, at the group's slot (``x`` ``(B, H, N[, D])``)."""
    index = group if x.dim() == 3 else group[..., None].expand_as(x)
    return torch.zeros_like(x).scatter_add_(2, index, x)


def zip_merge(
    keys: Tensor,
    values: Tensor,
    log_votes: Tensor,
    log_scores: Tensor,
    targets: Tensor,
    merge: Tensor,
    eps: float = 1e-3,
    max_scale: float = math.inf,
    scale_key: bool = True,
) -> ZipMerge:
    """ZIP-merge entries into carriers (eq. 7; several at once by eq. 25 of Appendix A.3).

    For every carrier ``c`` with absorbed set ``E_c`` and ``K' = E_c ∪ {c}``, ``w_i = p_i ŝ_i``::

        k_r = (Σ w_i k_i) · ln(Σ w_i / Σ p_i) / Σ w_i ln ŝ_i
        v_r = Σ w_i v_i / Σ w_i,      p_r = Σ p_i

    computed with max-shifted weights. When ``|Σ w_i ln ŝ_i| ≤ eps · Σ w_i |ln ŝ_i|``, or the key's
    scale ``γ`` (``k_r = γ k̄``) is not finite or outside ``[1/max_scale, max_scale]``,
    ``k_r = k̄ = Σ w_i k_i / Σ w_i`` (convex merge with counts).

    Args:
        keys, values: ``(B, H, N, D)``.
        log_votes: ``(B, H, N)`` ``log p`` (= β); finite for every entry involved. ``log p_r`` is
            rounded to this dtype before the key is solved, so the merge stays exact as stored.
        log_scores: ``(B, H, N)`` ``log ŝ``; finite for every entry involved.
        targets: ``(B, H, N)`` long, the slot each merged entry goes into (a slot with
            ``merge`` False, read only where ``merge`` is True).
        merge: ``(B, H, N)`` bool, entries merged away (their slots keep stale content).
        eps: relative tolerance of the key formula's denominator.
        max_scale: largest factor the key may be scaled by (``inf``: no bound, not even on the sign).
        scale_key: False: never scale the key, ``k_r = k̄`` for every carrier (what the authors'
            code does; the merge is then exact for the scoring query only when the keys agree).

    Returns:
        A :class:`ZipMerge`.
    """
    dtype = compute_dtype(keys, log_scores)
    dtype = torch.promote_types(dtype, torch.float32)
    k, v = keys.to(dtype), values.to(dtype)
    log_p, log_s = log_votes.to(dtype), log_scores.to(dtype)
    slots = torch.arange(keys.shape[2], device=keys.device).expand_as(merge)
    group = torch.where(merge, targets, slots)
    absorbed = torch.zeros_like(group).scatter_add_(2, group, merge.long())
    receivers = (absorbed > 0) & ~merge
    involved = merge | receivers
    group = torch.where(involved, group, slots)
    zero = torch.zeros_like(log_p)
    log_w = torch.where(involved, log_p + log_s, zero)  # log w_i = log p_i + log ŝ_i
    top = torch.full_like(log_w, NEG_INF).scatter_reduce_(2, group, log_w, "amax")
    omega = torch.where(involved, torch.exp(log_w - top.gather(2, group)), zero)  # w_i / max w
    total = _group_sum(group, omega)
    safe_total = torch.where(receivers, total, torch.ones_like(total))
    key_mean = _group_sum(group, omega[..., None] * k) / safe_total[..., None]  # convex k̄
    value_mean = _group_sum(group, omega[..., None] * v) / safe_total[..., None]  # v_r (eq. 25)
    lam = torch.where(involved, log_s, zero)
    mu = _group_sum(group, omega * lam) / safe_total  # Σ w ln ŝ / Σ w
    spread = _group_sum(group, omega * lam.abs()) / safe_total
    p_top = torch.full_like(log_p, NEG_INF).scatter_reduce_(2, group, torch.where(involved, log_p, zero), "amax")
    p_sum = _group_sum(group, torch.where(involved, torch.exp(log_p - p_top.gather(2, group)), zero))
    log_p_r = p_top + torch.where(receivers, p_sum, torch.ones_like(p_sum)).log()  # log Σ p_i
    log_p_r = log_p_r.to(log_votes.dtype).to(dtype)  # as stored (β is float32): the key absorbs its rounding
    log_s_r = top + safe_total.log() - log_p_r  # ln(Σ w / Σ p): the merged entry's target ln ŝ_r
    scale = log_s_r / torch.where(mu != 0, mu, torch.ones_like(mu))
    exact = (mu.abs() > eps * spread) & torch.isfinite(scale)
    if math.isfinite(max_scale):
        exact = exact & (scale >= 1.0 / max_scale) & (scale <= max_scale)
    if not scale_key:
        exact = torch.zeros_like(exact)
    merged_key = torch.where(exact[..., None], scale[..., None] * key_mean, key_mean)  # eq. 7 / fallback
    at = receivers[..., None]
    return ZipMerge(
        keys=torch.where(at, merged_key, k),
        values=torch.where(at, value_mean, v),
        log_votes=torch.where(receivers, log_p_r, log_p),
        log_scores=torch.where(receivers, log_s_r, log_s),
        receivers=receivers,
        fallback=receivers & ~exact,
    )


def zip_merge_pair(
    keys: Tensor,
    values: Tensor,
    log_votes: Tensor,
    log_scores: Tensor,
    eps: float = 1e-3,
    max_scale: float = math.inf,
    scale_key: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`zip_merge` of one entry into one carrier (eq. 7, a decode step's victim), row by row,
    without the group maps: with two entries every weighted mean of eq. 7 is one ``lerp`` by the
    absorbed entry's weight share ``w_0 / (w_0 + w_1) = σ(ln w_0 − ln w_1)``, and the sums of
    ``p`` and ``w`` are ``logaddexp``. Agrees with :func:`zip_merge` to rounding.

    Args:
        keys, values: ``(B, H, 2, D)``: the absorbed entry (index 0) and its carrier (index 1).
        log_votes, log_scores: ``(B, H, 2)`` ``log p`` and ``log ŝ`` of the pair.
        eps, max_scale, scale_key: as in :func:`zip_merge`.

    Returns:
        The merged entry of every row: ``key (B, H, 1, D)``, ``value (B, H, 1, D)``,
        ``log p_r (B, H, 1)``, ``log ŝ_r (B, H, 1)`` and ``exact (B, H, 1)`` (False: the key is the
        convex fallback), as :func:`zip_merge` writes them at the carrier's slot.
    """
    dtype = torch.promote_types(compute_dtype(keys, log_scores), torch.float32)
    k = keys if keys.dtype == dtype else keys.to(dtype)
    v = values if values.dtype == dtype else values.to(dtype)
    log_p = log_votes if log_votes.dtype == dtype else log_votes.to(dtype)
    log_s = log_scores if log_scores.dtype == dtype else log_scores.to(dtype)
    log_w = log_p + log_s  # log w_i = log p_i + log ŝ_i
    w0, w1 = log_w.narrow(2, 0, 1), log_w.narrow(2, 1, 1)  # (B, H, 1)
    share = torch.sigmoid(w0 - w1)  # w_0 / (w_0 + w_1)
    parts = torch.cat([k, v, log_s.unsqueeze(-1), log_s.abs().unsqueeze(-1)], dim=-1)  # (B, H, 2, 2D + 2)
    means = torch.lerp(parts[:, :, 1], parts[:, :, 0], share)  # Σ w x / Σ w of each part
    key_mean, value_mean, mu, spread = means.unsqueeze(2).split([k.shape[-1], v.shape[-1], 1, 1], dim=-1)
    log_p_r = torch.logaddexp(log_p.narrow(2, 0, 1), log_p.narrow(2, 1, 1))  # log Σ p_i
    if log_votes.dtype != dtype:
        log_p_r = log_p_r.to(log_votes.dtype).to(dtype)  # as stored: the key absorbs its rounding
    log_s_r = torch.logaddexp(w0, w1) - log_p_r  # ln(Σ w / Σ p)
    scale = log_s_r.unsqueeze(-1) / mu  # μ = 0 gives ±inf or nan, and fails the first test below
    exact = mu.abs() > eps * spread
    if math.isfinite(max_scale):  # in [1/max_scale, max_scale]: finite too
        exact = exact & (scale.clamp(1.0 / max_scale, max_scale) == scale)
    else:
        exact = exact & torch.isfinite(scale)
    if not scale_key:
        exact = torch.zeros_like(exact)
    merged_key = torch.where(exact, scale * key_mean, key_mean)  # eq. 7 / fallback
    return merged_key, value_mean, log_p_r, log_s_r, exact.squeeze(-1)


# ---------------------------------------------------------------------------- similarity


def _unit(x: Tensor) -> Tensor:
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x if x.dtype == dtype else x.to(dtype)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def best_match(
    rows: Tensor,
    candidates: Tensor,
    allowed: Tensor,
    row_rank: Tensor | None = None,
    candidate_rank: Tensor | None = None,
    candidate_norms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Most cosine-similar allowed candidate of every row key (Algorithm 1, lines 4–5).

    Args:
        rows: ``(B, H, R, D)`` keys to place.
        candidates: ``(B, H, C, D)`` keys they may merge into.
        allowed: ``(B, H, C)`` bool (e.g. retained, valid).
        row_rank, candidate_rank: optional ``(B, H, R)`` and ``(B, H, C)``; when given, a row may only
            match candidates of lower rank (higher priority).
        candidate_norms: optional ``(B, H, C)`` Euclidean norms of the candidates, when the caller
            keeps them (a decode step then reads each key once, in the similarity itself).

    Returns:
        ``(similarity (B, H, R), index (B, H, R))``; similarity ``-inf`` when nothing is allowed.
    """
    dtype = torch.promote_types(rows.dtype, torch.float32)
    a = rows if rows.dtype == dtype else rows.to(dtype)
    b = candidates if candidates.dtype == dtype else candidates.to(dtype)
    if candidate_norms is None:
        candidate_norms = torch.linalg.vector_norm(b, dim=-1)
    tiny = torch.finfo(dtype).tiny
    b_norm = candidate_norms.to(dtype).clamp_min(tiny).unsqueeze(2)  # (B, H, 1, C)
    # a row's own norm scales all its similarities alike: it divides the best one only
    a_norm = torch.linalg.vector_norm(a, dim=-1).clamp_min(tiny)  # (B, H, R)
    batch, heads, count = rows.shape[:3]
    step = max(1, _SIM_CHUNK // max(1, batch * heads * candidates.shape[2]))
    sims, idx = [], []
    for lo in range(0, count, step):  # chunks of rows bound the memory of the cosine matrix
        sim = torch.matmul(a[:, :, lo : lo + step], b.transpose(-1, -2)) / b_norm  # (B, H, r, C)
        mask = allowed[:, :, None, :]
        if row_rank is not None and candidate_rank is not None:
            mask = mask & (candidate_rank[:, :, None, :] < row_rank[:, :, lo : lo + step, None])
        best = torch.where(mask, sim, NEG_INF).max(dim=-1)
        sims.append(best.values)
        idx.append(best.indices)
    if len(sims) == 1:
        return sims[0] / a_norm, idx[0]
    return torch.cat(sims, dim=2) / a_norm, torch.cat(idx, dim=2)


def merge_first_keep(
    keys: Tensor,
    keep: Tensor,
    lengths: Tensor,
    scores: Tensor,
    protected: Tensor | None,
    valid: Tensor,
    threshold: float,
    block: int = 256,
) -> tuple[Tensor, Tensor, Tensor]:
    """KeepKV's merge-before-evict prefill (Appendix B, Table 3), as a re-selection.

    Priority: the selector's kept entries first (protected first, then by score), then the rest by
    score. An unprotected entry whose key has cosine ``> threshold`` with some higher-priority entry
    is *mergeable*; mergeable entries move behind all others, and each row keeps its first
    ``lengths`` entries in that order. So similar entries are merged instead of taking a slot and the
    freed slots go to the next dissimilar entries.

    Mergeability is computed ``block`` priorities at a time, only as far down the order as some row
    still lacks ``lengths`` non-mergeable entries (work ≈ K², not N², at small budgets).

    Returns:
        ``(keep (B, H, K), lengths (B, H), swapped (B, H))`` as :func:`~kvfold.methods.core.selection.topk_keep`,
        ``swapped`` = kept entries replaced per row.
    """
    batch, heads, length = valid.shape
    kept = kept_mask(keep, lengths, length)
    order = priority_order(scores, protected, valid)
    tier = (~kept).long().gather(2, order)  # kept entries before the others, order kept within
    order = order.gather(2, torch.sort(tier, dim=2, stable=True).indices)  # slots by priority
    unit = _unit(torch.gather(keys, 2, order[..., None].expand(-1, -1, -1, keys.shape[-1])))
    ok = valid.gather(2, order)
    movable = ok if protected is None else ok & ~protected.gather(2, order)
    mergeable = torch.zeros_like(ok)
    done = 0
    while done < length:  # blocks of priorities, until every row has enough non-mergeable entries
        hi = min(length, done + block)
        sim = torch.matmul(unit[:, :, done:hi], unit[:, :, :hi].transpose(-1, -2))  # (B, H, b, hi)
        above = torch.arange(hi, device=keys.device)[None, :] < torch.arange(done, hi, device=keys.device)[:, None]
        sim = sim.masked_fill(~(above & ok[:, :, None, :hi]), NEG_INF)
        mergeable[:, :, done:hi] = movable[:, :, done:hi] & (sim.amax(-1) > threshold)
        done = hi
        if bool(((ok[:, :, :done] & ~mergeable[:, :, :done]).sum(-1) >= lengths).all()):
            break
    rank = torch.arange(length, device=keys.device).expand(batch, heads, length)
    key = torch.empty_like(order).scatter_(2, order, rank + length * mergeable.long())
    new_keep, new_lengths = topk_keep(-key.double(), lengths, valid=valid)
    swapped = (kept & ~kept_mask(new_keep, new_lengths, length)).sum(-1)
    return new_keep, new_lengths, swapped


def merged_weight(weight: Tensor, targets: Tensor, merge: Tensor, receivers: Tensor) -> Tensor:
    """The EMA weight ``Σω`` (eq. 8's bias correction) of each carrier after a ZIP-merge: the largest
    of its group's (the carrier and the entries it absorbed); other slots keep theirs.

    Args:
        weight: ``(B, H, N)`` ``Σω`` of every slot.
        targets, merge: as given to :func:`zip_merge`.
        receivers: :attr:`ZipMerge.receivers`.
    """
    slots = torch.arange(weight.shape[2], device=weight.device).expand_as(merge)
    group = torch.where(merge, targets, slots)
    top = weight.clone().scatter_reduce_(2, group, torch.where(merge, weight, torch.zeros_like(weight)), "amax")
    return torch.where(receivers, top, weight)
