"""What the attention-based scorers share: window attention, GQA pooling, token pooling, z-scores.

Pure tensor functions, vectorized over batch, heads and tokens. The scores themselves live with
their methods (:mod:`kvfold.methods.eviction`: ``snapkv_scores`` in :mod:`~kvfold.methods.eviction.snapkv`,
``h2o_scores`` in :mod:`~kvfold.methods.eviction.h2o`, …); every scorer returns ``(B, H_kv, N)``
scores where **higher = keep first**.

Conventions (shared by every function here and by the scorers built on them):

* keys / values ``(B, H_kv, N, D)``; queries ``(B, H_q, W, D)`` post-RoPE, ``H_q = H_kv · G``;
  query head ``h`` reads KV head ``h // G`` (transformers' GQA convention).
* ``valid``: optional bool ``(B, H_kv, N)``; False marks padding. Padding gets score ``-inf``
  and is never kept (see :func:`kvfold.methods.core.selection.topk_keep`).
* ``log_mass``: optional float ``(B, H_kv, N)`` added to the attention logits of each entry
  (an entry standing for ``w`` tokens has ``log_mass = log w``).
* A window of ``W`` queries is the last ``W`` tokens of the context and the last ``W`` keys
  are those same tokens, so window attention is causal among them: query ``i`` sees keys
  ``0 … N − W + i``.
* Scores are float32 (float64 when the inputs are float64, which the tests use).

Protection: scorers return **finite** scores for every valid entry, the observation window
included; "always keep the window / the sinks" is expressed once, by
:func:`~kvfold.methods.core.selection.protected_mask` passed to
:func:`~kvfold.methods.core.selection.topk_keep` (or to an allocation such as
:func:`kvfold.methods.eviction.adakv.adakv_head_budgets`). So SnapKV =
``topk_keep(snapkv_scores(...), counts, protected_mask(..., recent=window))``. Finite scores
compose: they can be reweighted (CriticalKV), normalised or compared across heads (AdaKV)
without ``inf · 0`` or ``inf − inf``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
GqaReduce = Literal["mean", "max", "sum"]


# ---------------------------------------------------------------------------- helpers


def compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 if any input is float64, else float32 (scores never run in half precision)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def gqa_groups(num_q_heads: int, num_kv_heads: int) -> int:
    """``G = H_q / H_kv``, the query heads that share one KV head.

    Raises:
        ValueError: ``H_q`` is not a positive multiple of ``H_kv``.
    """
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a positive multiple of KV heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


def mask_invalid(scores: Tensor, valid: Tensor | None) -> Tensor:
    """Padding gets ``-inf``."""
    if valid is None:
        return scores
    return scores.masked_fill(~valid.to(torch.bool), float("-inf"))


def causal_probs(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    query_start: int,
    log_mass: Tensor | None,
    valid: Tensor | None,
) -> Tensor:
    """Softmax attention of queries at key positions ``query_start + i``, ``(B, H_q, W, N)``.

    Query ``i`` sees keys ``j ≤ query_start + i`` that are valid; a query whose own position is
    padding (``valid`` False there) gets an all-zero row. :func:`window_attention` is the case
    ``query_start = N − W``; H2O runs it over chunks of every prefill query.

    Args:
        queries: ``(B, H_q, W, D)`` post-RoPE queries.
        keys: ``(B, H_kv, N, D)`` post-RoPE keys.
        scaling: logit scale.
        query_start: key position of the first query, ``0 ≤ query_start ≤ N − W``.
        log_mass, valid: see the module docstring.

    Raises:
        ValueError: the queries do not fit the keys, or ``H_q`` is not a multiple of ``H_kv``.
    """
    batch, num_q_heads, width, dim = queries.shape
    _, num_kv_heads, length, _ = keys.shape
    groups = gqa_groups(num_q_heads, num_kv_heads)
    if query_start < 0 or query_start + width > length:
        raise ValueError(f"{width} queries starting at key position {query_start} do not fit {length} keys")
    dtype = compute_dtype(queries, keys, log_mass)
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
    return causal_probs(queries, keys, scaling, keys.shape[2] - queries.shape[2], log_mass, valid)


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
    groups = gqa_groups(num_q_heads, num_kv_heads)
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


# ---------------------------------------------------------------------------- z-scores


def zscore(scores: Tensor, valid: Tensor | None = None) -> Tensor:
    """Standardise ``(B, H, N)`` scores per batch row over all heads and valid entries:
    ``(s − mean) / std`` (std floored at 1e-6, population variance). Invalid entries get ``-inf``.

    Compactor normalises both of its scores this way before blending them (Chari & Van Durme
    2025, arXiv:2507.08143); an affine map per row, so it keeps every head's order and the
    comparison of heads within a layer.
    """
    dtype = compute_dtype(scores)
    s = scores.to(dtype)
    ok = torch.isfinite(s) if valid is None else valid.to(torch.bool) & torch.isfinite(s)
    count = ok.sum(dim=(1, 2), keepdim=True).clamp_min(1)
    zeroed = torch.where(ok, s, torch.zeros_like(s))
    mean = zeroed.sum(dim=(1, 2), keepdim=True) / count
    var = (torch.where(ok, s - mean, torch.zeros_like(s)) ** 2).sum(dim=(1, 2), keepdim=True) / count
    z = (s - mean) / var.sqrt().clamp_min(1e-6)
    return z.masked_fill(~ok, float("-inf"))
