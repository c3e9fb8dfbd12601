"""KeepKV: electoral votes and zero inference-perturbation merging (Tian et al. 2025, "KeepKV:
Achieving Periodic Lossless KV Cache Compression for Efficient LLM Inference", §3, Algorithm 1,
Appendices A–B).

Instead of dropping an evicted entry ``(k_e, v_e)``, KeepKV merges it into its most
cosine-similar retained entry ``(k_c, v_c)`` (threshold ``T``; below it the entry is evicted)
so that the attention output of the step whose scores were used is exactly unchanged
(Theorem 3). Each entry carries **electoral votes** ``p`` (tokens it stands for, 1 at first),
which enter attention as ``β = log p`` (eq. 6). With ``s_i = exp(q·k_i·scaling)`` and
``w_i = p_i ŝ_i``, the ZIP-merge of eq. 7 / Algorithm 1 lines 8–10 is::

    k_r = (w_e k_e + w_c k_c) · ln((w_e + w_c)/(p_e + p_c)) / (w_e ln ŝ_e + w_c ln ŝ_c)
    v_r = (w_e v_e + w_c v_c) / (w_e + w_c)
    p_r = p_e + p_c

so that ``p_r s_r = Σ p_i s_i`` and ``p_r s_r v_r = Σ p_i s_i v_i`` for the scoring query.

**Several entries into one carrier.** All entries a carrier absorbs in one compression are
merged at once with the closed form of Appendix A.3 (eq. 25), the same three lines with sums
over ``K'_e = {absorbed} ∪ {c}``. It is exact for the scoring query whatever the number of
absorbed entries, and independent of their order (sequential pairwise merges are exact too,
but give an order-dependent key).

**Scores** ``ŝ`` (eq. 8): a bias-corrected exponential moving average of ``s`` over queries. After
the prefill it runs over the last ``window`` context queries (the last one weighs most); during
decoding each new query updates it, ``S ← α S + (1 − α) s``. The bias correction divides by the
weight of the queries that actually saw the entry (``1 − α^t`` for an entry seen by ``t``
queries), so entries inside the window are not under-scored. GQA: ``ŝ`` of a KV head is the
mean of ``s`` over its query heads (so with one query head and one query ``ŝ = s`` and Theorem 3
holds exactly). Scores are float32 (float64 for float64 models).

**Numerical safety.** Eq. 7 scales the convex key ``k̄ = Σ w_i k_i / Σ w_i`` by
``γ = ln(Σ w_i / Σ p_i) / (Σ w_i ln ŝ_i / Σ w_i)``, whose denominator vanishes when the logits
straddle 0: near that pole ``γ`` is huge or negative (a reflected key), exact for the scoring
query but wrong for every other one. The key falls back to the convex merge ``k̄`` (values and
votes as above) when ``|Σ w_i ln ŝ_i| ≤ eps · Σ w_i |ln ŝ_i|``, when ``γ`` is not finite, or when
``γ ∉ [1/max_scale, max_scale]`` (default 2; ``max_scale=inf`` keeps only the first two, the
literal formula). On SmolLM2 (2K-token RULER contexts, budget 0.2) the pole itself is hit by
about 1 carrier in 20 000, but 2% of the carriers get a reflected key and the literal formula
raises the relative attention-output error of ``h2o+keepkv`` to 2.1 (``h2o``: 0.27); with the
scale guard 6–13% of the carriers fall back and ``h2o+keepkv`` beats ``h2o``. Fallbacks are
counted (``ctx.report["keepkv_fallbacks"]``, ``KeepKVOnline.fallbacks``).

**Prefill order** (Appendix B, Table 3). ``merge-first`` (default): before the budget is
filled, an unprotected entry whose key has cosine ``> T`` with a higher-priority entry (kept
before it by the selector's order) is moved behind every entry that has none (Fast-NMS style),
so similar entries are merged rather than taking a slot, and the freed slots go to the next
dissimilar entries. ``evict_first``: the selector's choice is kept as is. Either way every entry
left out is merged into its most similar carrier if the cosine is ``> T``, else evicted.

**Online** (decoding): on top of the selector's online policy (``h2o``, ``h2o_cosine``,
``streamingllm``, ``tova``, ``knorm``): each step updates ``ŝ`` with the step's attention and,
before the policy removes its victim, ZIP-merges it into its most similar remaining entry, in
place in the dense buffers (work ∝ budget). **Chunked prefill** (:mod:`kvfold.chunked`) runs the
same online half over the chunks after the first: each chunk's attention updates ``ŝ`` (its
queries in order, eq. 8) and the chunk's victims are merged at once (eq. 25) into the entries
that remain; a selector without an online mode (``snapkv``) cannot be chunked with KeepKV.

**Votes** are conserved: ``Σ p`` over the cache plus the votes of evicted (below-threshold)
entries equals the number of tokens seen (``votes_dropped`` in the reports).

Differences from the paper and its code: the paper states no ``α`` or ``w`` (we use 0.9 and
32; 0.5 / 0.99 / ``w`` = 64 change SmolLM2's fidelity by < 2%); it does not define how
merge-before-evict picks what to merge (ours is the Fast-NMS rule above), how several entries
enter one carrier (ours: eq. 25 at once), nor guards the key formula (``max_scale``). Its code has
no EMA and is MHA-only with batch 1. Ours: GQA (scores pooled over the group), batches with left
padding, per-layer budgets, float32 β (the merged key absorbs β's rounding, so a merge stays exact
as stored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfold.cache import NEG_INF, FoldedCache, FoldedLayer
from kvfold.methods.base import CompressionContext, Folder, register
from kvfold.methods.budgets import cosine_layer_budgets
from kvfold.methods.eviction import H2O, H2OOnline, attention_modules
from kvfold.methods.online import OnlineEviction, StepView
from kvfold.methods.scoring import _priority_order, topk_keep
from kvfold.methods.spec import SpecError

Tensor = torch.Tensor

PAPER = "Tian et al. 2025, KeepKV: Achieving Periodic Lossless KV Cache Compression for Efficient LLM Inference"
_SIM_CHUNK = 1 << 22
"""Similarity entries computed at once (bounds the memory of the cosine matrices)."""
_TALLY_BATCH = 256
"""Decode steps (of all layers) whose merge counts :class:`KeepKVOnline` adds up at once."""


# ---------------------------------------------------------------------------- scores (eq. 8)


def _dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


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
    dtype = _dtype(queries, keys)
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
    dtype = torch.promote_types(_dtype(query, keys), torch.float32)
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


def ema_step(
    log_sum: Tensor, weight: Tensor, log_s: Tensor, first_new: int, alpha: float
) -> tuple[Tensor, Tensor]:
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
    groups = num_q // heads
    log_w, w = _one_query_weight(alpha, log_sum.dtype)
    x = log_s.reshape(batch, heads, groups, length)
    if x.dtype != log_sum.dtype:
        x = x.to(log_sum.dtype)
    added = x[:, :, 0]
    for head in range(1, groups):
        added = torch.logaddexp(added, x[:, :, head])
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

    Returns:
        A :class:`ZipMerge`.
    """
    dtype = _dtype(keys, log_scores)
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """:func:`zip_merge` of one entry into one carrier (eq. 7, a decode step's victim), row by row,
    without the group maps: with two entries every weighted mean of eq. 7 is one ``lerp`` by the
    absorbed entry's weight share ``w_0 / (w_0 + w_1) = σ(ln w_0 − ln w_1)``, and the sums of
    ``p`` and ``w`` are ``logaddexp``. Agrees with :func:`zip_merge` to rounding.

    Args:
        keys, values: ``(B, H, 2, D)``: the absorbed entry (index 0) and its carrier (index 1).
        log_votes, log_scores: ``(B, H, 2)`` ``log p`` and ``log ŝ`` of the pair.
        eps, max_scale: as in :func:`zip_merge`.

    Returns:
        The merged entry of every row: ``key (B, H, 1, D)``, ``value (B, H, 1, D)``,
        ``log p_r (B, H, 1)``, ``log ŝ_r (B, H, 1)`` and ``exact (B, H, 1)`` (False: the key is the
        convex fallback), as :func:`zip_merge` writes them at the carrier's slot.
    """
    dtype = torch.promote_types(_dtype(keys, log_scores), torch.float32)
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
        ``(keep (B, H, K), lengths (B, H), swapped (B, H))`` as :func:`~kvfold.methods.scoring.topk_keep`,
        ``swapped`` = kept entries replaced per row.
    """
    batch, heads, length = valid.shape
    kept = _kept_mask(keep, lengths, length)
    order = _priority_order(scores, protected, valid)
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
    swapped = (kept & ~_kept_mask(new_keep, new_lengths, length)).sum(-1)
    return new_keep, new_lengths, swapped


def _kept_mask(keep: Tensor, lengths: Tensor, length: int) -> Tensor:
    """``(B, H, N)`` bool of the kept slots (slots past a row's length repeat an index: ignored)."""
    in_row = torch.arange(keep.shape[-1], device=keep.device) < lengths[..., None]
    mask = torch.zeros(*keep.shape[:2], length + 1, dtype=torch.bool, device=keep.device)
    return mask.scatter_(2, torch.where(in_row, keep, length), True)[..., :length]


# ---------------------------------------------------------------------------- the folder


@register
@dataclass
class KeepKV(Folder):
    """KeepKV folding (Tian et al. 2025, §3.3, Algorithm 1; see the module docstring).

    ``SELECTOR+keepkv`` merges what any selector evicts; ``keepkv`` alone runs on the paper's
    default selector ``h2o_cosine`` (H2O scores, cosine layer budgets, 4 sinks, recent:heavy 4:1).

    Parameters:
        threshold: cosine similarity ``T`` above which an evicted entry is merged (0.8).
        window: prefill queries of the EMA scores, ``w`` (32; the paper gives none).
        alpha: EMA decay ``α`` (0.9; the paper gives none).
        evict_first: prefill order; False = merge-before-evict (Appendix B, Table 3's better one).
        eps: relative tolerance below which the key formula's denominator counts as zero.
        max_scale: the exact key ``γ k̄`` falls back to ``k̄`` when ``γ ∉ [1/max_scale, max_scale]``
            (2; ``inf`` = the literal eq. 7, only guarded at its pole).
        online: also merge during decoding when the selector evicts online (h2o, streamingllm, …).
    """

    name: ClassVar[str] = "keepkv"
    description: ClassVar[str] = "merge evicted entries into the most similar kept one, output-preserving, votes"
    paper: ClassVar[str] = PAPER
    supports_chunked_prefill: ClassVar[bool] = True
    chunked_prefill_online: ClassVar[bool] = True  # merges the online selector's victims chunk after chunk
    threshold: float = 0.8
    window: int = 32
    alpha: float = 0.9
    evict_first: bool = False
    eps: float = 1e-3
    max_scale: float = 2.0
    online: bool = True

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    @classmethod
    def default_selector(cls) -> str:
        return "h2o_cosine"

    def validate(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise SpecError(f"keepkv: threshold must be a cosine in [-1, 1]; got {self.threshold}")
        if self.window < 1:
            raise SpecError(f"keepkv: window must be ≥ 1; got {self.window}")
        if not 0.0 < self.alpha < 1.0:
            raise SpecError(f"keepkv: alpha must be in (0, 1); got {self.alpha}")
        if self.eps < 0:
            raise SpecError(f"keepkv: eps must be ≥ 0; got {self.eps}")
        if not self.max_scale >= 1.0:
            raise SpecError(f"keepkv: max_scale must be ≥ 1 (inf = unbounded); got {self.max_scale}")

    # -- one-shot ----------------------------------------------------------------------
    def reselect(self, layer_idx, layer, keep, lengths, scores, protected, valid, ctx):
        if self.evict_first:
            return keep, lengths
        keys = layer.padded()[0]
        keep, lengths, swapped = merge_first_keep(keys, keep, lengths, scores, protected, valid, self.threshold)
        _count(ctx.report, "swapped", int(swapped.sum()))
        return keep, lengths

    def window_scores(self, layer_idx: int, layer: FoldedLayer, scaling: float) -> tuple[Tensor, Tensor]:
        """``(log ŝ, weight)`` ``(B, H, N)`` of a prefilled layer from its captured queries."""
        queries = layer.captured_queries
        if queries is None:
            raise ValueError(
                "keepkv scores entries with the last prefill queries, but this cache kept none; prefill with "
                "kvfold.prefill (or set cache.capture_window before the forward pass)"
            )
        keys, _, log_mass, _ = layer.padded()
        width = min(self.window, queries.shape[2], keys.shape[2])
        return window_log_scores(queries[:, :, -width:], keys, scaling, self.alpha, torch.isfinite(log_mass))

    def fold(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        keep: Tensor,
        lengths: Tensor,
        scores: Tensor,
        ctx: CompressionContext,
    ) -> None:
        keys, values, log_mass, _ = layer.padded()
        length = keys.shape[2]
        valid = torch.isfinite(log_mass)
        log_score, weight = self.window_scores(layer_idx, layer, _scalings(ctx)[layer_idx])
        in_row = torch.arange(keep.shape[-1], device=keep.device) < lengths[..., None]
        kept = _kept_mask(keep, lengths, length)
        evicted = valid & ~kept
        carrier_keys = torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
        sim, choice = best_match(keys, carrier_keys, in_row)  # Algorithm 1, lines 4–5
        merge = evicted & (sim > self.threshold) & torch.isfinite(log_score)
        targets = torch.gather(keep, 2, choice)
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        merged = zip_merge(keys, values, beta, log_score, targets, merge, self.eps, self.max_scale)
        weight = _merged_weight(weight, targets, merge, merged.receivers)
        idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
        layer.replace(
            torch.gather(merged.keys, 2, idx),
            torch.gather(merged.values, 2, idx),
            torch.gather(merged.log_votes, 2, keep),
            lengths,
        )
        # the EMA state follows the carriers, for the online phase
        layer.entry_stats[STAT_LOG_SCORE] = torch.gather(merged.log_scores, 2, keep).float()
        layer.entry_stats[STAT_WEIGHT] = torch.gather(weight, 2, keep).float()
        if ctx.merge_recorder is not None:  # diagnostics (kvfold mergemap): absorbed slot → carrier slot
            slots = torch.arange(length, device=keys.device).expand_as(merge)
            ctx.record_merges(layer_idx, targets, torch.where(merge, slots, -1), merge.to(keys.dtype))
        dropped = evicted & ~merge
        _count(ctx.report, "merged", int(merge.sum()))
        _count(ctx.report, "evicted", int(dropped.sum()))
        _count(ctx.report, "votes_dropped", float(beta.exp()[dropped].sum()))
        _count(ctx.report, "fallbacks", int(merged.fallback.sum()))
        _count(ctx.report, "receivers", int(merged.receivers.sum()))
        ctx.report["keepkv_fallbacks"] = ctx.report["keepkv"]["fallbacks"]

    # -- online ------------------------------------------------------------------------
    def online_policy(self, policy: Any, ctx: CompressionContext) -> Any:
        """The selector's online policy, made to merge its victims (None if it cannot be)."""
        if not self.online:
            return policy
        inner = list(policy.policies.values()) if isinstance(policy, LayerPolicies) else [policy]
        if not all(isinstance(p, OnlineEviction) for p in inner):
            return None
        state = KeepKVOnline(self, _scalings(ctx))
        for p in inner:
            p.folder = state
            p.needs_attention = True
        policy.needs_attention = True
        if isinstance(policy, LayerPolicies):
            policy.folder = state
            if all(type(p) is H2OOnline and len(p.limits) == 1 for p in inner):
                from kvfold.methods.keepkv_decode import LayerBatchedDecode

                policy.batched = LayerBatchedDecode(policy.policies, state)
        return policy


STAT_LOG_SCORE = "keepkv_log_score"
STAT_WEIGHT = "keepkv_weight"


def _merged_weight(weight: Tensor, targets: Tensor, merge: Tensor, receivers: Tensor) -> Tensor:
    """EMA weight (observations) of merged entries: the largest of the group's."""
    slots = torch.arange(weight.shape[2], device=weight.device).expand_as(merge)
    group = torch.where(merge, targets, slots)
    top = weight.clone().scatter_reduce_(2, group, torch.where(merge, weight, torch.zeros_like(weight)), "amax")
    return torch.where(receivers, top, weight)


def _count(report: dict, key: str, value: float) -> None:
    stats = report.setdefault("keepkv", {"merged": 0, "evicted": 0, "votes_dropped": 0.0, "fallbacks": 0,
                                         "receivers": 0, "swapped": 0})  # fmt: skip
    stats[key] += value


def _scalings(ctx: CompressionContext) -> dict[int, float]:
    cached = ctx.memo.get("keepkv_scalings")
    if cached is None:
        modules = attention_modules(ctx.model)
        cached = {}
        for i, layer in ctx.cache.folded_layers:  # the module's scale, else 1/√D (only then read from the layer)
            scaling = getattr(modules.get(i), "scaling", None)
            cached[i] = float(scaling) if scaling is not None else layer.head_dim**-0.5
        ctx.memo["keepkv_scalings"] = cached
    return cached


class KeepKVOnline:
    """The decode-time half of KeepKV, attached as ``policy.folder`` to an online eviction policy.

    :meth:`observe` updates every entry's EMA score with the step's attention (Algorithm 1, line 6)
    and returns the slot-aligned state the policy moves with its slots; :meth:`fold` ZIP-merges the
    victims into their most similar remaining entries before the policy removes them (lines 4–5,
    8–10). Counters: ``merged``, ``evicted`` (below threshold), ``votes_dropped``, ``fallbacks``.
    """

    def __init__(self, folder: KeepKV, scalings: dict[int, float]) -> None:
        self.folder = folder
        self.scalings = scalings
        self._log_sum: dict[int, Tensor] = {}
        self._weight: dict[int, Tensor] = {}
        self._key_norm: dict[int, Tensor] = {}  # slot-aligned ‖k‖ (B, H, capacity), for best_match
        self._counts: dict[str, float] = {"merged": 0, "evicted": 0, "votes_dropped": 0.0, "fallbacks": 0}
        self._pending: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # decode steps not counted yet

    @property
    def merged(self) -> int:
        """Victims merged into a carrier."""
        return int(self._counted("merged"))

    @property
    def evicted(self) -> int:
        """Victims dropped (no carrier above the threshold)."""
        return int(self._counted("evicted"))

    @property
    def votes_dropped(self) -> float:
        """Votes ``p`` of the dropped victims."""
        return float(self._counted("votes_dropped"))

    @property
    def fallbacks(self) -> int:
        """Merged keys that fell back to the convex merge."""
        return int(self._counted("fallbacks"))

    def report(self) -> dict[str, float]:
        return {"merged": self.merged, "evicted": self.evicted, "votes_dropped": self.votes_dropped,
                "fallbacks": self.fallbacks}  # fmt: skip

    def _counted(self, key: str) -> float:
        self._flush()
        return self._counts[key]

    def _tally(self, goes: Tensor, leaving: Tensor, exact: Tensor, victim_beta: Tensor) -> None:
        """Keep a decode step's outcome ``(B, H, 1)`` per row; :meth:`_flush` counts it later, with
        many steps at once (no host synchronisation per step)."""
        self._pending.append((goes, leaving, exact, victim_beta))
        if len(self._pending) >= _TALLY_BATCH:
            self._flush()

    def _flush(self) -> None:
        """Add the pending decode steps to the counters (runs of steps with equal shapes at once)."""
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            end = start + 1
            while end < len(pending) and pending[end][0].shape == pending[start][0].shape:
                end += 1
            goes, leaving, exact, beta = (torch.stack(group) for group in zip(*pending[start:end], strict=True))
            merged, leaving_count, exact_count = torch.stack([goes, leaving, goes & exact]).flatten(1).sum(1).tolist()
            self._counts["merged"] += merged
            self._counts["evicted"] += leaving_count - merged
            self._counts["fallbacks"] += merged - exact_count
            if leaving_count > merged:  # each step's dropped votes, added step after step
                dropped = torch.where(leaving & ~goes, beta.exp(), 0.0).flatten(1).sum(1)
                for votes in dropped.tolist():
                    self._counts["votes_dropped"] += votes
            start = end

    def _state(self, layer_idx: int, layer: FoldedLayer, old: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """The slot-aligned EMA ``(log S, Σω)`` and key norms of a layer, created or grown to ``n``
        slots; a created or grown state has its norms computed for every slot."""
        log_sum = self._log_sum.get(layer_idx)
        weight = self._weight.get(layer_idx)
        key_norm = self._key_norm.get(layer_idx)
        if log_sum is None:
            dtype = torch.float64 if layer.dtype == torch.float64 else torch.float32
            capacity = n + 16
            log_sum = torch.full((layer.batch_size, layer.num_heads, capacity), NEG_INF, dtype=dtype,
                                 device=layer.device)  # fmt: skip
            weight = torch.zeros_like(log_sum)
            if old:
                log_score, w = self._initial(layer_idx, layer, old)
                weight[:, :, :old] = w.to(dtype)
                log_sum[:, :, :old] = torch.where(w > 0, log_score + w.clamp_min(1e-300).log(), NEG_INF).to(dtype)
        elif log_sum.shape[2] < n:
            grow = n + 16 - log_sum.shape[2]
            log_sum = torch.cat([log_sum, log_sum.new_full((*log_sum.shape[:2], grow), NEG_INF)], dim=2)
            weight = torch.cat([weight, weight.new_zeros(*weight.shape[:2], grow)], dim=2)
            key_norm = None
        if key_norm is None:
            key_norm = torch.zeros_like(weight)
            keys = layer.dense_buffers()[0]
            key_norm[:, :, :n] = torch.linalg.vector_norm(keys.to(key_norm.dtype), dim=-1)
        self._log_sum[layer_idx], self._weight[layer_idx], self._key_norm[layer_idx] = log_sum, weight, key_norm
        return log_sum, weight, key_norm

    def _initial(self, layer_idx: int, layer: FoldedLayer, count: int) -> tuple[Tensor, Tensor]:
        """Scores of the entries present before the first step: from the one-shot fold, else from the
        captured prefill queries, else none (the first step's query then starts the EMA)."""
        log_score = layer.entry_stats.get(STAT_LOG_SCORE)
        weight = layer.entry_stats.get(STAT_WEIGHT)
        if log_score is not None and weight is not None and log_score.shape[-1] == count:
            return log_score, weight
        if layer.captured_queries is not None and layer.physical_length == layer.logical_length:
            keys, _, log_mass = layer.dense_buffers()
            width = min(self.folder.window, layer.captured_queries.shape[2], count)
            return window_log_scores(
                layer.captured_queries[:, :, -width:], keys[:, :, :count], self.scalings[layer_idx],
                self.folder.alpha, torch.isfinite(log_mass[:, :, :count]),
            )  # fmt: skip
        empty = torch.zeros(layer.batch_size, layer.num_heads, count, device=layer.device)
        return empty.fill_(NEG_INF), torch.zeros_like(empty)

    def observe(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: Tensor,
        probs: Tensor | None,
        view: StepView | None = None,
        logits: Tensor | None = None,
    ) -> list[Tensor]:
        """Update the EMA with this forward's queries; return the slot-aligned state tensors.

        ``view``: the layer's buffers for this step, when the policy has taken them already.
        ``logits``: the attention's scores before β (``(B, H_kv, G·q, N)``), when it computed them.
        """
        if view is None:
            keys, values, log_mass = layer.dense_buffers()
            view = StepView(keys, values, log_mass, torch.isfinite(log_mass))
        n = view.keys.shape[2]
        q_len = query.shape[2]
        old = n - q_len
        fresh = self._key_norm.get(layer_idx) is None or self._key_norm[layer_idx].shape[2] < n
        log_sum, weight, key_norm = self._state(layer_idx, layer, old, n)
        if not fresh:  # the norms of the entries this forward appended
            key_norm.narrow(2, old, q_len).copy_(
                torch.linalg.vector_norm(view.keys.narrow(2, old, q_len).to(key_norm.dtype), dim=-1)
            )
        log_sum_n, weight_n = log_sum.narrow(2, 0, n), weight.narrow(2, 0, n)
        log_sum_n.narrow(2, old, q_len).fill_(NEG_INF)
        weight_n.narrow(2, old, q_len).fill_(0.0)
        log_s = step_log_scores(query, view.keys, view.log_mass, self.scalings[layer_idx], probs, view.valid, logits)
        if q_len == 1:  # a decode step: the same update, in place
            ema_step_one_(log_sum_n, weight_n, log_s, self.folder.alpha)
        else:
            new_sum, new_weight = ema_step(log_sum_n, weight_n, log_s, old, self.folder.alpha)
            log_sum_n.copy_(new_sum)
            weight_n.copy_(new_weight)
        return [log_sum, weight, key_norm]

    def export_state(self, layer_idx: int, layer: FoldedLayer) -> None:
        """Write the EMA state of a layer's slots where :meth:`_initial` of a fresh policy reads it."""
        log_sum = self._log_sum.get(layer_idx)
        if log_sum is None:
            return
        n = layer.physical_length
        weight = self._weight[layer_idx][:, :, :n]
        layer.entry_stats[STAT_LOG_SCORE] = log_scores_of(log_sum[:, :, :n], weight).float()
        layer.entry_stats[STAT_WEIGHT] = weight.float()

    def fold(self, layer_idx: int, layer: FoldedLayer, victims: Tensor, view: StepView | None = None) -> None:
        """ZIP-merge the ``victims`` ``(B, H, E)`` (slots about to be removed) into carriers, in place.

        ``view``: the layer's buffers for this step, when the policy has taken them already.
        """
        if view is None:
            keys, values, log_mass = layer.dense_buffers()
            valid = torch.isfinite(log_mass)
        else:
            keys, values, log_mass, valid = view
        n = keys.shape[2]
        log_sum = self._log_sum[layer_idx].narrow(2, 0, n)
        weight = self._weight[layer_idx].narrow(2, 0, n)
        key_norm = self._key_norm[layer_idx].narrow(2, 0, n)
        if victims.shape[2] == 1:
            self._fold_one(keys, values, log_mass, log_sum, weight, key_norm, victims, valid)
            return
        # several victims (a multi-token forward): closed form over the whole row (eq. 25)
        leaving = torch.zeros_like(valid).scatter_(2, victims, True) & valid
        if not bool(leaving.any()):
            return
        victim_keys = torch.gather(keys, 2, victims[..., None].expand(-1, -1, -1, keys.shape[-1]))
        sim, targets = best_match(victim_keys, keys, valid & ~leaving)
        goes = torch.gather(leaving, 2, victims) & (sim > self.folder.threshold)
        goes = goes & (torch.gather(weight, 2, victims) > 0)  # observed at least once: ŝ is defined
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        slots = torch.arange(n, device=keys.device).expand_as(valid).contiguous()
        target_map = slots.scatter(2, victims, torch.where(goes, targets, victims))
        merge = torch.zeros_like(valid).scatter_(2, victims, goes)
        log_score = log_scores_of(log_sum, weight)
        merged = zip_merge(keys, values, beta, log_score, target_map, merge, self.folder.eps, self.folder.max_scale)
        new_weight = _merged_weight(weight, target_map, merge, merged.receivers)
        at = merged.receivers
        for buffer, new in (
            (keys, merged.keys),
            (values, merged.values),
            (log_mass, merged.log_votes),
            (log_sum, merged.log_scores + new_weight.clamp_min(1e-300).log()),
            (weight, new_weight),
        ):
            buffer.copy_(torch.where(at if buffer.dim() == 3 else at[..., None], new.to(buffer.dtype), buffer))
        key_norm.copy_(torch.linalg.vector_norm(keys.to(key_norm.dtype), dim=-1))
        dropped = leaving & ~merge
        self._flush()  # the counts stay in step order
        self._counts["merged"] += int(goes.sum())
        self._counts["evicted"] += int(dropped.sum())
        self._counts["votes_dropped"] += float(beta.exp()[dropped].sum())
        self._counts["fallbacks"] += int(merged.fallback.sum())

    def _fold_one(
        self,
        keys: Tensor,
        values: Tensor,
        log_mass: Tensor,
        log_sum: Tensor,
        weight: Tensor,
        key_norm: Tensor,
        victim: Tensor,
        valid: Tensor,
    ) -> None:
        """A decode step's victim ``(B, H, 1)`` per row: ZIP-merge it into its most similar
        remaining entry (eq. 7, on the (victim, carrier) pair only, O(D) per row).

        :meth:`observe` has run on this forward, so every slot's EMA weight is ``≥ 1 − α > 0``:
        ``ŝ`` is defined everywhere (``log ŝ = log S − log Σω``). The merged entry goes to the
        carrier's slot; a row that does not merge writes it into the victim's own slot instead,
        which the policy overwrites or drops next (so no masked write).
        """
        dim = keys.shape[-1]
        leaving = valid.gather(2, victim)  # the victim is an entry, not an empty slot
        victim_key = keys.gather(2, victim.unsqueeze(-1).expand(-1, -1, 1, dim))
        allowed = valid.scatter(2, victim, False)
        sim, target = best_match(victim_key, keys, allowed, candidate_norms=key_norm)  # Algorithm 1, lines 4–5
        goes = leaving & (sim > self.folder.threshold)
        pair = torch.cat([victim, target], dim=2)  # (B, H, 2)
        pair_k = keys.gather(2, pair.unsqueeze(-1).expand(-1, -1, -1, dim))
        pair_v = values.gather(2, pair.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
        pair_beta = log_mass.gather(2, pair)  # finite wherever the row merges
        pair_weight = weight.gather(2, pair)
        pair_score = log_sum.gather(2, pair) - pair_weight.log()  # log ŝ (log_scores_of, every weight > 0)
        key, value, log_p, log_s, exact = zip_merge_pair(
            pair_k, pair_v, pair_beta, pair_score, self.folder.eps, self.folder.max_scale
        )
        new_weight = pair_weight.amax(-1, keepdim=True)  # the EMA weight of the group: its largest
        slot = torch.where(goes, target, victim)
        stored = key if key.dtype == keys.dtype else key.to(keys.dtype)
        keys.scatter_(2, slot.unsqueeze(-1).expand(-1, -1, 1, dim), stored)
        key_norm.scatter_(2, slot, torch.linalg.vector_norm(stored.to(key_norm.dtype), dim=-1))
        values.scatter_(
            2,
            slot.unsqueeze(-1).expand(-1, -1, 1, values.shape[-1]),
            value if value.dtype == values.dtype else value.to(values.dtype),
        )
        log_mass.scatter_(2, slot, log_p if log_p.dtype == log_mass.dtype else log_p.to(log_mass.dtype))
        log_sum.scatter_(2, slot, (log_s + new_weight.log()).to(log_sum.dtype))
        weight.scatter_(2, slot, new_weight)
        self._tally(goes, leaving, exact, pair_beta.narrow(2, 0, 1))


class LayerPolicies:
    """One online policy per layer (layers with different limits and recent windows).

    With ``batched`` (a :class:`~kvfold.methods.keepkv_decode.LayerBatchedDecode`, which KeepKV
    sets on H2O's per-layer policies), a decode forward's layers are held until its last layer
    and stepped at once; whenever that cannot be done (a longer forward, a layer not yet at its
    limit) each layer's policy steps as it would have, in layer order.
    """

    def __init__(self, policies: dict[int, OnlineEviction]) -> None:
        self.policies = policies
        self.needs_attention = any(p.needs_attention for p in policies.values())
        self.folder = None
        self.batched = None
        self._last = max(policies) if policies else -1
        self._held: list[tuple] = []  # this forward's decode steps, until its last layer

    @property
    def steps(self) -> int:
        return self.policies[min(self.policies)].steps if self.policies else 0

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        policy = self.policies.get(layer_idx)
        if policy is None:
            return
        if self._held and layer_idx <= self._held[-1][0]:  # a new forward: the last one stopped early
            self._step_held()
        if self.batched is None or query.shape[2] != 1:
            policy.after_forward(layer_idx, layer, query, probs, logits)
            return
        self._held.append((layer_idx, layer, query, probs, logits))
        if layer_idx == self._last:
            self._step_held()

    def _step_held(self) -> None:
        held, self._held = self._held, []
        if not self.batched.step(held):
            for item in held:
                self.policies[item[0]].after_forward(*item)
            self.batched.adopt()

    def export_state(self, cache: FoldedCache) -> None:
        """Every layer's policy writes its state into the cache (see :meth:`OnlineEviction.export_state`)."""
        if self._held:
            self._step_held()
        for policy in self.policies.values():
            policy.export_state(cache)


# ---------------------------------------------------------------------------- the default selector


@register
@dataclass
class H2OCosine(H2O):
    """H2O scores with PyramidInfer-style cosine layer budgets: KeepKV's default selection
    (Tian et al. 2025, Appendix B.3; Zhang et al. 2023, H2O; Yang et al. 2024, PyramidInfer).

    Accumulated attention (H2O) picks the heavy hitters; each layer keeps a recent window of
    ``recent_ratio`` of its budget (recent:heavy = 4:1, the paper's 4:1–5:1) and the first
    ``sinks`` tokens; layer budgets decay with depth along half a cosine
    (:func:`kvfold.methods.budgets.cosine_layer_budgets`, last/first ≈ ``min_ratio``), with the
    mean over layers equal to the budget. Online, each layer keeps its own budget and window.

    Parameters:
        recent_ratio: share of a layer's budget kept for the most recent tokens (0.8).
        sinks: first tokens always kept (4).
        min_ratio: last-layer / first-layer budget of the cosine schedule (0.2).
        online: keep the budgets during decoding too.
    """

    name: ClassVar[str] = "h2o_cosine"
    description: ClassVar[str] = "H2O scores, cosine layer budgets, 4 sinks, recent:heavy 4:1 (KeepKV default)"
    paper: ClassVar[str] = PAPER + " (App. B.3); Zhang et al. 2023, H2O; Yang et al. 2024, PyramidInfer"
    recent_ratio: float = 0.8
    sinks: int = 4
    min_ratio: float = 0.2
    online: bool = True

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.min_ratio <= 1.0:
            raise SpecError(f"h2o_cosine: min_ratio must be in (0, 1]; got {self.min_ratio}")

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        memo = ctx.memo.get("h2o_cosine_budgets")
        if memo is not None:
            return [b.clone() for b in memo]
        folded = [i for i, _ in ctx.cache.folded_layers]
        budgets = [ctx.row_budgets.clone() for _ in range(ctx.num_layers)]
        rows = zip(ctx.row_budgets.tolist(), ctx.context_lengths.tolist(), strict=True)
        per_row = [  # one schedule per batch row, (L_folded,) each
            cosine_layer_budgets(avg, len(folded), self.min_ratio, context_tokens=n, min_budget=self.sinks + 1)
            for avg, n in rows
        ]
        table = torch.tensor(per_row, dtype=torch.long).T  # (L_folded, B)
        for j, layer_idx in enumerate(folded):
            budgets[layer_idx] = table[j].clone()
        ctx.memo["h2o_cosine_budgets"] = budgets
        return [b.clone() for b in budgets]

    def online_policy(self, ctx: CompressionContext) -> LayerPolicies | None:
        if not self.online:
            return None
        budgets = self.layer_budgets(ctx)
        policies = {}
        for layer_idx, _ in ctx.cache.folded_layers:
            limit = int(budgets[layer_idx].max())
            recent = int(self.recent_counts(torch.tensor(limit)))
            policies[layer_idx] = H2OOnline({layer_idx: limit}, recent=recent, sinks=self.sinks)
        return LayerPolicies(policies)
