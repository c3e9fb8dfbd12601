"""Token scores of the eviction baselines, and the top-k selection they share.

Pure tensor functions, vectorized over batch, heads and tokens. Each scorer follows one paper
(named in its docstring) and returns ``(B, H_kv, N)`` scores where **higher = keep first**.

Conventions (shared by every function here):

* keys / values ``(B, H_kv, N, D)``; queries ``(B, H_q, W, D)`` post-RoPE, ``H_q = H_kv · G``;
  query head ``h`` reads KV head ``h // G`` (transformers' GQA convention).
* ``valid``: optional bool ``(B, H_kv, N)``; False marks padding. Padding gets score ``-inf``
  and is never kept (see :func:`topk_keep`).
* ``log_mass``: optional float ``(B, H_kv, N)`` added to the attention logits of each entry
  (an entry standing for ``w`` tokens has ``log_mass = log w``).
* A window of ``W`` queries is the last ``W`` tokens of the context and the last ``W`` keys
  are those same tokens, so window attention is causal among them: query ``i`` sees keys
  ``0 … N − W + i``.
* Scores are float32 (float64 when the inputs are float64, which the tests use).

Protection: scorers return **finite** scores for every valid entry, the observation window
included; "always keep the window / the sinks" is expressed once, by :func:`protected_mask`
passed to :func:`topk_keep` (or to :func:`kvfold.methods.core.budgets.adakv_head_budgets`). So
SnapKV = ``topk_keep(snapkv_scores(...), counts, protected_mask(..., recent=window))``.
Finite scores compose: they can be reweighted (CriticalKV), normalised or compared across
heads (AdaKV) without ``inf · 0`` or ``inf − inf``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
GqaReduce = Literal["mean", "max", "sum"]


# ---------------------------------------------------------------------------- helpers


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (scores never run in half precision)."""
    return (
        torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32
    )


def _groups(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a positive multiple of KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def _mask_invalid(scores: Tensor, valid: Tensor | None) -> Tensor:
    """Padding gets ``-inf``."""
    if valid is None:
        return scores
    return scores.masked_fill(~valid.to(torch.bool), float("-inf"))


def _safe_softmax(logits: Tensor) -> Tensor:
    """Max-shifted softmax over the last axis; rows with no finite logit give all zeros."""
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(logits - peak)  # exp(-inf) = 0 for masked entries
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), weights * 0)


def _causal_probs(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    query_start: int,
    log_mass: Tensor | None,
    valid: Tensor | None,
) -> Tensor:
    """Softmax attention of queries at key positions ``query_start + i``, ``(B, H_q, W, N)``.

    Query ``i`` sees keys ``j ≤ query_start + i`` that are valid; a query whose own position is
    padding (``valid`` False there) gets an all-zero row.
    """
    batch, num_q_heads, width, dim = queries.shape
    _, num_kv_heads, length, _ = keys.shape
    groups = _groups(num_q_heads, num_kv_heads)
    if query_start < 0 or query_start + width > length:
        raise ValueError(f"{width} queries starting at key position {query_start} do not fit {length} keys")
    dtype = _compute_dtype(queries, keys, log_mass)
    # logits = q·k · scaling + β (β = log_mass, the entry's log multiplicity). Built in one buffer
    # and edited in place: the (B, H_q, W, N) matrix is the cost here, so it is written once by the
    # matmul, masked only where masking can apply and normalised by one fused softmax.
    q = (queries.to(dtype) * scaling).reshape(batch, num_kv_heads, groups * width, dim)
    logits = torch.matmul(q, keys.to(dtype).transpose(-1, -2)).view(batch, num_kv_heads, groups, width, length)
    if log_mass is not None:
        beta = log_mass.to(dtype)
        if bool((beta != 0).any()):
            logits.add_(beta[:, :, None, None, :])
    # causal: only the keys at the queries' own positions can lie in a query's future
    future = torch.ones(width, width, dtype=torch.bool, device=keys.device).triu_(1)
    logits[..., query_start : query_start + width].masked_fill_(future, float("-inf"))
    padded = valid is not None and not bool(valid.all())
    if padded:
        valid = valid.to(torch.bool)
        logits.masked_fill_(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if padded:  # a padding query sees no valid key (NaN row): it gets an all-zero row
        query_valid = valid[:, :, query_start : query_start + width]  # (B, H_kv, W)
        probs.masked_fill_(~query_valid[:, :, None, :, None], 0.0)
        probs.nan_to_num_(0.0)
    return probs.reshape(batch, num_q_heads, width, length)


# ---------------------------------------------------------------------------- attention + pooling


def window_attention(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Attention probabilities of the last ``W`` context tokens' queries over all ``N`` keys.

    The observation window of SnapKV (Li et al. 2024, arXiv:2404.14469): the queries are the
    last ``W`` tokens, so query ``i`` sees keys ``0 … N − W + i`` (causal inside the window).
    Computed in fp32 (fp64 for fp64 inputs) with max-shifted exponentials; GQA without
    repeating the keys. Assumes the window's tokens are the last ``W`` slots of the key axis.

    Args:
        queries: ``(B, H_q, W, D)`` post-RoPE queries of the last ``W`` tokens, ``W ≤ N``.
        keys: ``(B, H_kv, N, D)`` post-RoPE keys.
        scaling: logit scale, usually ``1/√D``.
        log_mass: ``(B, H_kv, N)`` added to the logits (β), or None.
        valid: ``(B, H_kv, N)`` bool, False = padding (never attended), or None. A window query
            whose own token is padding gets an all-zero row.

    Returns:
        ``(B, H_q, W, N)`` probabilities; each valid row sums to 1.

    Raises:
        ValueError: ``W > N`` or ``H_q`` not a multiple of ``H_kv``.

    Example:
        >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8)
        >>> window_attention(q, k, 8**-0.5).shape
        torch.Size([1, 4, 3, 10])
    """
    return _causal_probs(queries, keys, scaling, keys.shape[2] - queries.shape[2], log_mass, valid)


def pool_gqa(scores_hq: Tensor, num_kv_heads: int, reduce: GqaReduce = "mean") -> Tensor:
    """Combine per-query-head scores into per-KV-head scores.

    Query heads ``g·G … g·G + G − 1`` share KV head ``g`` (transformers' convention), so the
    reduction runs over consecutive groups of ``G = H_q / H_kv`` heads.

    Args:
        scores_hq: ``(B, H_q, ...)``.
        num_kv_heads: ``H_kv``.
        reduce: ``"mean"``, ``"max"`` or ``"sum"`` over the ``G`` query heads of a group.

    Returns:
        ``(B, H_kv, ...)``.
    """
    batch, num_q_heads = scores_hq.shape[:2]
    groups = _groups(num_q_heads, num_kv_heads)
    grouped = scores_hq.reshape(batch, num_kv_heads, groups, *scores_hq.shape[2:])
    if reduce == "mean":
        return grouped.mean(dim=2)
    if reduce == "max":
        return grouped.amax(dim=2)
    if reduce == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"reduce must be 'mean', 'max' or 'sum'; got {reduce!r}")


def pool_tokens(scores: Tensor, kernel: int, pooling: Literal["max", "avg"] = "max") -> Tensor:
    """1-D pooling along the last (token) axis, same length, stride 1 (SnapKV's clustering).

    ``"max"`` takes the max over the ``kernel`` neighbours that exist; ``"avg"`` sums them and
    divides by ``kernel`` (zero padding at the edges, as ``avg_pool1d(count_include_pad=True)``
    in SnapKV's release). Inputs must be finite (pool before masking padding to ``-inf``).

    Args:
        scores: ``(..., N)``.
        kernel: odd, ≥ 1 (1 = no pooling).
        pooling: ``"max"`` or ``"avg"``.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd positive integer; got {kernel}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg'; got {pooling!r}")
    length = scores.shape[-1]
    if kernel == 1 or length == 0:
        return scores
    flat = scores.reshape(-1, 1, length)
    pad = kernel // 2
    if pooling == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=pad)
    else:
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=pad, count_include_pad=True)
    return pooled.reshape(scores.shape)


# ---------------------------------------------------------------------------- scorers


def snapkv_scores(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    window: int = 32,
    kernel: int = 5,
    pooling: Literal["max", "avg"] = "max",
    gqa_reduce: GqaReduce = "mean",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """SnapKV scores (Li et al. 2024, "SnapKV: LLM Knows What You Are Looking
    for Before Generation", arXiv:2404.14469).

    ``C = Σ_{window queries} softmax(q·Kᵀ·scaling + β) / W``, pooled along tokens with
    ``kernel`` (each query head separately), then reduced over the GQA group.

    The observation window's own tokens get their (finite) window-attention scores; pooling
    does not cross the prefix/window boundary (SnapKV pools the prefix only). SnapKV always
    keeps the window: pass ``protected_mask(..., recent=window)`` to :func:`topk_keep`.

    Args:
        queries: ``(B, H_q, Q, D)`` post-RoPE queries of the last ``Q`` context tokens; the last
            ``min(window, Q)`` are used.
        keys: ``(B, H_kv, N, D)``.
        scaling: logit scale (``1/√D``).
        window: observation window ``W`` (32 in SnapKV).
        kernel: odd pooling kernel (5 or 7 in SnapKV; 1 = none).
        pooling: ``"max"`` (SnapKV's default) or ``"avg"``.
        gqa_reduce: how the ``G`` query heads of a KV head combine (``"mean"`` as AdaKV/kvpress).
        log_mass, valid: see the module docstring.

    Returns:
        ``(B, H_kv, N)`` scores, ``-inf`` on padding.
    """
    width = min(window, queries.shape[2], keys.shape[2])
    if width < 1:
        raise ValueError(f"window must be ≥ 1 and queries non-empty; got window={window}")
    probs = window_attention(queries[:, :, -width:], keys, scaling, log_mass=log_mass, valid=valid)
    votes = probs.sum(dim=2) / width  # (B, H_q, N): mean attention over the window queries
    split = keys.shape[2] - width
    pooled = torch.cat(
        [pool_tokens(votes[..., :split], kernel, pooling), pool_tokens(votes[..., split:], kernel, pooling)],
        dim=-1,
    )
    return _mask_invalid(pool_gqa(pooled, keys.shape[1], gqa_reduce), valid)


def h2o_scores(
    queries_all: Tensor,
    keys: Tensor,
    scaling: float,
    chunk: int = 256,
    gqa_reduce: GqaReduce = "sum",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """H2O accumulated attention (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
    Generative Inference of Large Language Models", arXiv:2306.14048).

    Score of key ``j`` = Σ over the (causal) prefill queries ``i ≥ j`` of ``softmax_i(j)``: the
    total attention it received. Queries are processed ``chunk`` at a time, so at most
    ``(B, H_q, chunk, N)`` probabilities exist at once.

    Args:
        queries_all: ``(B, H_q, Q, D)`` post-RoPE queries of the last ``Q ≤ N`` tokens (usually all
            ``N`` prefill tokens); query ``i`` sits at key position ``N − Q + i``.
        keys: ``(B, H_kv, N, D)``.
        scaling: logit scale.
        chunk: queries per chunk (memory bound; the result does not depend on it).
        gqa_reduce: combination of the ``G`` query heads (``"sum"``: total attention received).
        log_mass, valid: see the module docstring.

    Returns:
        ``(B, H_kv, N)`` accumulated attention, ``-inf`` on padding. Continue it during decoding
        with :func:`h2o_update`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1; got {chunk}")
    num_queries, length = queries_all.shape[2], keys.shape[2]
    start = length - num_queries
    dtype = _compute_dtype(queries_all, keys, log_mass)
    total = torch.zeros(queries_all.shape[0], queries_all.shape[1], length, dtype=dtype, device=keys.device)
    for lo in range(0, num_queries, chunk):  # loop over query chunks only, for memory
        hi = min(lo + chunk, num_queries)
        end = start + hi  # causal: this chunk sees keys [0, end) only
        probs = _causal_probs(
            queries_all[:, :, lo:hi],
            keys[:, :, :end],
            scaling,
            start + lo,
            None if log_mass is None else log_mass[..., :end],
            None if valid is None else valid[..., :end],
        )
        total[..., :end] += probs.sum(dim=2)
    return _mask_invalid(pool_gqa(total, keys.shape[1], gqa_reduce), valid)


def h2o_update(acc_scores: Tensor, probs_step: Tensor, gqa_reduce: GqaReduce = "sum") -> Tensor:
    """One online H2O step (Zhang et al. 2023): add this step's attention.

    Args:
        acc_scores: ``(B, H_kv, N_prev)`` accumulated scores, ``N_prev ≤ N``; entries appended since
            (positions ``N_prev … N − 1``) start from 0. ``-inf`` (padding) stays ``-inf``.
        probs_step: ``(B, H_q, q, N)`` attention probabilities of the step's ``q`` queries.
        gqa_reduce: must match the one used by :func:`h2o_scores`.

    Returns:
        A new ``(B, H_kv, N)`` tensor ``acc + Σ_queries pool_gqa(probs)``.
    """
    length = probs_step.shape[-1]
    if acc_scores.shape[-1] > length:
        raise ValueError(f"accumulator has {acc_scores.shape[-1]} entries but the step attends {length}")
    added = pool_gqa(probs_step.sum(dim=2), acc_scores.shape[1], gqa_reduce)
    dtype = torch.promote_types(acc_scores.dtype, _compute_dtype(probs_step))
    acc = F.pad(acc_scores.to(dtype), (0, length - acc_scores.shape[-1]), value=0.0)
    return acc + added.to(dtype)


def tova_scores(probs_last: Tensor, num_kv_heads: int, valid: Tensor | None = None) -> Tensor:
    """TOVA scores (Oren et al. 2024, "Transformers are Multi-State RNNs",
    arXiv:2401.06104).

    The attention of the **last** query, averaged over all query heads of the layer: one score
    per token for the layer, so every KV head keeps the same set (the result is that score
    repeated for each KV head).

    Args:
        probs_last: ``(B, H_q, q, N)`` attention probabilities; the last of the ``q`` rows is used.
        num_kv_heads: ``H_kv`` of the returned scores.
        valid: ``(B, H_kv, N)`` bool or None.

    Returns:
        ``(B, H_kv, N)``.
    """
    last = probs_last[:, :, -1, :].to(_compute_dtype(probs_last))
    _groups(last.shape[1], num_kv_heads)
    layer_score = last.mean(dim=1, keepdim=True)  # (B, 1, N): head-averaged
    return _mask_invalid(layer_score.expand(-1, num_kv_heads, -1).contiguous(), valid)


def knorm_scores(keys: Tensor, valid: Tensor | None = None) -> Tensor:
    """Key-norm scores (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for
    KV Cache Compression", arXiv:2406.11430): low ‖k‖₂ correlates with high attention, so ``score = −‖k‖₂``.

    Returns:
        ``(B, H_kv, N)``.
    """
    return _mask_invalid(-torch.linalg.vector_norm(keys.to(_compute_dtype(keys)), dim=-1), valid)


# ---------------------------------------------------------------------------- expected attention


def rope_cos_sin(
    inv_freq: Tensor, positions: Tensor, attention_scaling: float = 1.0
) -> tuple[Tensor, Tensor]:
    """The rotary ``cos``, ``sin`` tables of transformers' default RoPE (``rotate_half`` layout).

    ``freqs = positions ⊗ inv_freq``, ``emb = [freqs, freqs]``; ``cos = cos(emb)·attention_scaling``.

    Args:
        inv_freq: ``(D/2,)`` the rotary module's ``inv_freq``.
        positions: ``(T,)`` absolute positions.
        attention_scaling: the rotary module's ``attention_scaling`` (1 for plain RoPE).

    Returns:
        ``cos``, ``sin``: ``(T, D)`` float32 (float64 if ``inv_freq`` is float64).
    """
    dtype = _compute_dtype(inv_freq)
    freqs = positions.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def mean_rope_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """``R̄ = mean_t R_t``, the average RoPE rotation over the positions of ``cos``/``sin``.

    For transformers' layout ``R_t x = cos_t ⊙ x + sin_t ⊙ rotate_half(x)``, i.e.
    ``R_t = diag(cos_t) + diag(sin_t)·P`` with ``P x = [−x₂; x₁]``.

    Args:
        cos, sin: ``(T, D)`` or ``(B, T, D)`` (as returned by a rotary module).

    Returns:
        ``(D, D)`` or ``(B, D, D)``: apply to a column vector, ``q_rot = R̄ q``.
    """
    dtype = _compute_dtype(cos, sin)
    cos_mean, sin_mean = cos.to(dtype).mean(dim=-2), sin.to(dtype).mean(dim=-2)  # (..., D)
    dim = cos.shape[-1]
    half = dim // 2
    perm = torch.zeros(dim, dim, dtype=dtype, device=cos.device)
    perm[:half, half:] = -torch.eye(half, dtype=dtype, device=cos.device)
    perm[half:, :half] = torch.eye(half, dtype=dtype, device=cos.device)
    return torch.diag_embed(cos_mean) + sin_mean[..., :, None] * perm


def expected_attention_scores(
    queries_pre_rope: Tensor,
    keys: Tensor,
    values: Tensor,
    cos: Tensor,
    sin: Tensor,
    scaling: float,
    use_covariance: bool = True,
    use_value_norm: bool = True,
    epsilon: float = 0.0,
    gqa_reduce: GqaReduce = "mean",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Expected Attention scores (Devoto et al. 2025, "Expected Attention: KV Cache Compression
    by Estimating Attention from Future Queries Distribution", released in NVIDIA kvpress).

    Future queries are modelled as Gaussian ``q ~ N(μ, Σ)`` with ``μ, Σ`` the mean and (biased)
    covariance of the recent **pre-RoPE** queries of each query head. A future query at position
    ``t`` is ``R_t q``; averaging over the ``T`` future positions whose ``cos``/``sin`` are given
    uses the mean rotation ``R̄`` (:func:`mean_rope_rotation`): ``μ̄ = R̄ μ``, ``Σ̄ = R̄ Σ R̄ᵀ``.
    For a logit ``z = s·q̄·k`` with ``q̄ ~ N(μ̄, Σ̄)``, ``E[exp z] = exp(s·μ̄·k + s²·kᵀΣ̄k / 2)``
    (``s = scaling``, ``= μ̄·k/√d + kᵀΣ̄k/(2d)`` for ``s = 1/√d``). These expected scores are
    normalised over the keys (softmax, with ``β`` and padding), averaged over the GQA group,
    and weighted by the value norm: ``score = (ā + ε)·‖v‖₂``.

    Approximation: ``μ̄`` is exactly the mean of ``R_t μ`` over ``t``, but ``R̄ Σ R̄ᵀ`` replaces
    ``mean_t R_t Σ R_tᵀ`` and the mixture over positions is treated as one Gaussian (the spread
    of ``R_t μ`` across ``t`` is ignored), as in the authors' release.

    Args:
        queries_pre_rope: ``(B, H_q, M, D)`` recent pre-RoPE query states (drop sink tokens first;
            ``M = 1`` gives ``Σ = 0``).
        keys: ``(B, H_kv, N, D)`` post-RoPE keys; values: ``(B, H_kv, N, D)``.
        cos, sin: ``(T, D)`` or ``(B, T, D)`` rotary tables of the next ``T`` positions (e.g.
            ``rope_cos_sin(inv_freq, arange(L, L + n_future))``, ``L`` the logical length).
        scaling: logit scale (``1/√D``).
        use_covariance: include the ``s²·kᵀΣ̄k/2`` term.
        use_value_norm: multiply by ``‖v‖₂``.
        epsilon: ``ε`` added before the value-norm weighting.
        gqa_reduce: combination of the ``G`` query heads (``"mean"``).
        log_mass, valid: see the module docstring.

    Returns:
        ``(B, H_kv, N)``, ``-inf`` on padding.
    """
    batch, num_q_heads, num_samples, dim = queries_pre_rope.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    groups = _groups(num_q_heads, num_kv_heads)
    dtype = _compute_dtype(queries_pre_rope, keys, values, cos, sin, log_mass)
    q = queries_pre_rope.to(dtype)
    mu = q.mean(dim=2)  # (B, H_q, D)
    rot = mean_rope_rotation(cos, sin).to(dtype)  # (D, D) or (B, D, D)
    rot = rot[:, None] if rot.dim() == 3 else rot  # broadcast over heads
    mu_bar = (rot @ mu[..., None])[..., 0]  # μ̄ = R̄ μ
    k = keys.to(dtype)
    k_grouped = k[:, :, None]  # (B, H_kv, 1, N, D)
    logits = torch.einsum("bkgd,bknd->bkgn", mu_bar.reshape(batch, num_kv_heads, groups, dim), k) * scaling
    if use_covariance and num_samples > 1:
        centered = q - mu[:, :, None]
        sigma = centered.transpose(-1, -2) @ centered / num_samples  # Σ (B, H_q, D, D)
        sigma_bar = rot @ sigma @ rot.transpose(-1, -2)  # Σ̄ = R̄ Σ R̄ᵀ
        sigma_bar = sigma_bar.reshape(batch, num_kv_heads, groups, dim, dim)
        quad = ((k_grouped @ sigma_bar) * k_grouped).sum(dim=-1)  # kᵀ Σ̄ k, (B, H_kv, G, N)
        logits = logits + 0.5 * scaling**2 * quad
    if log_mass is not None:
        logits = logits + log_mass.to(dtype)[:, :, None, :]
    if valid is not None:
        logits = logits.masked_fill(~valid.to(torch.bool)[:, :, None, :], float("-inf"))
    probs = _safe_softmax(logits).reshape(batch, num_q_heads, length)
    scores = pool_gqa(probs, num_kv_heads, gqa_reduce)
    if use_value_norm:
        scores = (scores + epsilon) * torch.linalg.vector_norm(values.to(dtype), dim=-1)
    elif epsilon:
        scores = scores + epsilon
    return _mask_invalid(scores, valid)


# ---------------------------------------------------------------------------- CriticalKV


def critical_reweight(
    scores: Tensor,
    values: Tensor,
    o_proj_weight: Tensor,
    num_kv_heads: int,
    head_dim: int,
    epsilon: float = 1e-4,
    gqa_reduce: GqaReduce = "mean",
    chunk: int = 256,
    valid: Tensor | None = None,
) -> Tensor:
    """Output-aware importance (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference
    from an Output Perturbation Perspective", arXiv:2502.03805): ``(a + ε)·‖W_oʰ v‖₁``.

    Evicting entry ``i`` perturbs the layer output by at most ``Σ_h a_{h,i}·‖W_oʰ v_i‖₁``
    (up to a constant), where ``W_oʰ = W_o[:, h·D:(h+1)·D]`` is query head ``h``'s slice of
    ``o_proj``. With GQA a KV head's value feeds the ``G`` query heads of its group:

    * per-query-head ``scores`` ``(B, H_q, N)``: ``Σ``/mean over the group of
      ``(a_h + ε)·‖W_oʰ v‖₁`` (the bound itself);
    * per-KV-head ``scores`` ``(B, H_kv, N)``: ``(a + ε) · reduce_h ‖W_oʰ v‖₁`` (as the authors'
      release does with GQA-pooled SnapKV scores).

    Values are projected ``chunk`` tokens at a time, ``(B, H_q, chunk, hidden)`` at most.

    Args:
        scores: ``(B, H_q, N)`` or ``(B, H_kv, N)`` attention-based scores (≥ 0 on valid entries).
        values: ``(B, H_kv, N, D)``.
        o_proj_weight: ``(hidden, H_q·D)`` the ``nn.Linear`` weight of ``o_proj``.
        num_kv_heads, head_dim: ``H_kv`` and ``D`` (checked against ``values``).
        epsilon: ``ε`` added to the attention score.
        gqa_reduce: ``"mean"`` (release) or ``"sum"`` / ``"max"`` over the group.
        chunk: tokens per projection chunk.
        valid: padding mask; also, entries whose input score is ``-inf`` stay ``-inf``.

    Returns:
        ``(B, H_kv, N)``.
    """
    batch, kv_heads, length, dim = values.shape
    if (kv_heads, dim) != (num_kv_heads, head_dim):
        raise ValueError(f"values have {kv_heads} heads of dim {dim}; expected {num_kv_heads} × {head_dim}")
    if o_proj_weight.shape[1] % head_dim:
        raise ValueError(
            f"o_proj input size {o_proj_weight.shape[1]} is not a multiple of head_dim {head_dim}"
        )
    num_q_heads = o_proj_weight.shape[1] // head_dim
    groups = _groups(num_q_heads, num_kv_heads)
    if scores.shape[1] not in (num_q_heads, num_kv_heads):
        raise ValueError(f"scores have {scores.shape[1]} heads; expected {num_q_heads} or {num_kv_heads}")
    dtype = _compute_dtype(scores, values, o_proj_weight)
    # W_o as (H_kv, G, D, hidden): the slice of query head h = k·G + g maps its D outputs to hidden.
    w_o = o_proj_weight.to(dtype).T.reshape(num_kv_heads, groups, head_dim, -1)
    v = values.to(dtype)
    norms = []
    for lo in range(0, length, chunk):  # loop over token chunks only, for memory
        projected = torch.einsum("bknd,kgdo->bkgno", v[:, :, lo : lo + chunk], w_o)
        norms.append(projected.abs().sum(dim=-1))  # ‖W_oʰ v‖₁
    out_norm = torch.cat(norms, dim=-1) if norms else v.new_zeros(batch, num_kv_heads, groups, 0)
    a = scores.to(dtype)
    dropped = torch.isneginf(a)
    if groups > 1 and scores.shape[1] == num_q_heads:
        # Σ_h-style bound per query head, then combined over the group
        per_head = (a.reshape(batch, num_kv_heads, groups, length) + epsilon) * out_norm
        result = pool_gqa(per_head.reshape(batch, num_q_heads, length), num_kv_heads, gqa_reduce)
        dropped = dropped.reshape(batch, num_kv_heads, groups, length).any(dim=2)
    else:
        group_norm = pool_gqa(out_norm.reshape(batch, num_q_heads, length), num_kv_heads, gqa_reduce)
        result = (a + epsilon) * group_norm
    result = result.masked_fill(dropped, float("-inf"))
    return _mask_invalid(result, valid)


# ---------------------------------------------------------------------------- leverage (Compactor)


def zscore(scores: Tensor, valid: Tensor | None = None) -> Tensor:
    """Standardise ``(B, H, N)`` scores per batch row over all heads and valid entries:
    ``(s − mean) / std`` (std floored at 1e-6, population variance). Invalid entries get ``-inf``.

    Compactor normalises both of its scores this way before blending them (Chari & Van Durme
    2025, arXiv:2507.08143); an affine map per row, so it keeps every head's order and the
    comparison of heads within a layer.
    """
    dtype = _compute_dtype(scores)
    s = scores.to(dtype)
    ok = torch.isfinite(s) if valid is None else valid.to(torch.bool) & torch.isfinite(s)
    count = ok.sum(dim=(1, 2), keepdim=True).clamp_min(1)
    zeroed = torch.where(ok, s, torch.zeros_like(s))
    mean = zeroed.sum(dim=(1, 2), keepdim=True) / count
    var = (torch.where(ok, s - mean, torch.zeros_like(s)) ** 2).sum(dim=(1, 2), keepdim=True) / count
    z = (s - mean) / var.sqrt().clamp_min(1e-6)
    return z.masked_fill(~ok, float("-inf"))


def leverage_scores(
    keys: Tensor,
    sketch: int = 48,
    generator: torch.Generator | None = None,
    valid: Tensor | None = None,
    ridge: float = 1e-6,
) -> Tensor:
    """Approximate statistical leverage of every key (Chari & Van Durme 2025, "Compactor:
    Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores",
    arXiv:2507.08143): how far a key lies outside the span of the others.

    Per batch row and head, with ``K`` the ``n × D`` matrix of the valid keys:

    * centre: ``K̄ = K − 1 μᵀ``, ``μ`` the mean valid key;
    * right Gaussian sketch: ``X = K̄ Φ``, ``Φ ∈ R^{D×k}``, ``Φ_ij ~ N(0, 1/k)`` (``k = sketch``);
    * leverage ``ℓ_i = x_iᵀ (XᵀX + λ I)⁻¹ x_i`` — the diagonal of the hat matrix of ``X``, i.e.
      the squared row norms of ``U`` in ``X = U Σ Vᵀ``; ``λ = ridge · tr(XᵀX)/k`` only guards a
      rank-deficient Gram matrix.

    ``sketch=0`` (or ``k ≥ D``: the sketch then has the column space of ``K̄``) gives the exact
    leverage of ``K̄``. The ``k × k`` system is solved by Cholesky in float64 (``O(n·k²)``, no
    ``n × n`` matrix). Without ridge, ``Σ_i ℓ_i = rank(X)``.

    Args:
        keys: ``(B, H, N, D)``, normally **pre-RoPE** keys (see
            :func:`kvfold.methods.core.model.pre_rope_keys`).
        sketch: ``k`` (48 in the paper's release); 0 = exact.
        generator: draws ``Φ`` (one per batch row and head), for reproducible scores.
        valid: ``(B, H, N)`` bool or None; padding is left out of the mean and the Gram matrix.
        ridge: relative ridge ``λ`` (≥ 0).

    Returns:
        ``(B, H, N)`` leverage in ``[0, 1]`` (float64), ``-inf`` on padding.
    """
    if sketch < 0 or ridge < 0:
        raise ValueError(f"sketch and ridge must be ≥ 0; got sketch={sketch}, ridge={ridge}")
    batch, heads, length, dim = keys.shape
    k = keys.to(torch.float64)
    ok = torch.ones(batch, heads, length, dtype=torch.bool, device=keys.device) if valid is None else valid.bool()
    weight = ok[..., None].to(torch.float64)
    mean = (k * weight).sum(dim=2, keepdim=True) / weight.sum(dim=2, keepdim=True).clamp_min(1)
    centred = (k - mean) * weight  # padding rows are zero: they add nothing to XᵀX
    if 0 < sketch < dim:
        phi = torch.randn(batch, heads, dim, sketch, generator=generator, dtype=torch.float64)
        x = centred @ (phi.to(keys.device) / math.sqrt(sketch))  # X = K̄ Φ, (B, H, N, k)
    else:
        x = centred
    gram = x.transpose(-1, -2) @ x  # XᵀX, (B, H, k, k)
    width = gram.shape[-1]
    eye = torch.eye(width, dtype=torch.float64, device=keys.device)
    scale = gram.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None] / width
    jitter = ridge * scale.clamp_min(torch.finfo(torch.float64).tiny)
    for _ in range(8):  # Cholesky of XᵀX + λI; raise λ if the Gram matrix is singular
        factor, info = torch.linalg.cholesky_ex(gram + jitter * eye)
        if not bool((info != 0).any()):
            break
        jitter = torch.where(info[..., None, None] != 0, jitter * 100 + 1e-12 * scale + 1e-300, jitter)
    else:  # pragma: no cover - only for NaN inputs
        raise ValueError("leverage: the sketched Gram matrix is not positive definite (non-finite keys?)")
    # ℓ_i = ‖L⁻¹ x_i‖², with XᵀX + λI = L Lᵀ
    solved = torch.linalg.solve_triangular(factor, x.transpose(-1, -2), upper=False)  # (B, H, k, N)
    scores = (solved * solved).sum(dim=-2).clamp_min(0)
    return scores.masked_fill(~ok, float("-inf"))


def noncausal_chunk_attention(
    queries: Tensor,
    keys: Tensor,
    chunk: int = 256,
    scaling: float = 1.0,
    valid: Tensor | None = None,
) -> Tensor:
    """Compactor's attention score (Chari & Van Durme 2025, arXiv:2507.08143): the attention each
    key receives from the queries of its own chunk of ``chunk`` tokens, **non-causally** (a query
    also sees the later keys of its chunk), summed over those queries and averaged over the GQA
    group. Chunks start at each row's first valid token; the last chunk may be shorter.

    Cost ``O(N · chunk · D)`` per head: the whole prefill's queries, none of the ``N × N`` matrix.

    Args:
        queries: ``(B, H_q, N, D)`` post-RoPE queries of every context token (a prefill's).
        keys: ``(B, H_kv, N, D)`` post-RoPE keys of the same tokens.
        chunk: tokens per chunk (≥ 1).
        scaling: logit scale (the authors' release uses 1, i.e. unscaled ``q·k``).
        valid: ``(B, H_kv, N)`` bool or None: padding neither attends nor is attended.

    Returns:
        ``(B, H_kv, N)`` float32 (float64 for float64 inputs), ``-inf`` on padding.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1; got {chunk}")
    batch, num_q_heads, length, dim = queries.shape
    num_kv_heads = keys.shape[1]
    groups = _groups(num_q_heads, num_kv_heads)
    if keys.shape[2] != length:
        raise ValueError(f"need one query per key; got {length} queries and {keys.shape[2]} keys")
    dtype = _compute_dtype(queries, keys)
    ok = torch.ones(batch, num_kv_heads, length, dtype=torch.bool, device=keys.device) if valid is None else valid
    out = torch.zeros(batch, num_kv_heads, length, dtype=dtype, device=keys.device)
    for b in range(batch):
        start = int(length - ok[b, 0].sum())  # left padding: the row's tokens are its last ones
        for lo in range(start, length, chunk):
            hi = min(lo + chunk, length)
            q = queries[b, :, lo:hi].to(dtype).reshape(num_kv_heads, groups * (hi - lo), dim)
            logits = torch.matmul(q * scaling, keys[b, :, lo:hi].to(dtype).transpose(-1, -2))
            logits = logits.masked_fill(~ok[b, :, None, lo:hi], float("-inf"))
            probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (H_kv, G·c, c)
            out[b, :, lo:hi] = probs.sum(dim=1) / groups  # Σ over the chunk's queries, mean over G
    return _mask_invalid(out, valid)
