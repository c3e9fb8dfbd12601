"""Small shared pieces of the merging baselines (``cam``, ``d2o``, ``kvmerger``).

Pure helpers, vectorized over batch rows and KV heads: the window attention each retained or
evicted entry receives, the mask of kept slots, seeded uniforms that do not depend on the batch a
context is in, and a compute dtype (float32, float64 for float64 models).
"""

from __future__ import annotations

import torch

from kvfold.cache import FoldedLayer
from kvfold.methods.core.base import CompressionContext
from kvfold.methods.core.scoring import pool_gqa, window_attention

Tensor = torch.Tensor

__all__ = ["compute_dtype", "kept_mask", "layer_scaling", "row_uniforms", "window_scores"]


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any input is float64, else float32 (never half precision for scores)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def layer_scaling(ctx: CompressionContext, layer_idx: int, layer: FoldedLayer) -> float:
    """The attention module's logit scale (``module.scaling``; ``1/√D`` when it has none)."""
    scales = ctx.memo.get("merging_scaling")
    if scales is None:
        scales = {}
        for module in ctx.model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
                scales.setdefault(int(module.layer_idx), getattr(module, "scaling", None))
        ctx.memo["merging_scaling"] = scales
    scale = scales.get(layer_idx)
    return float(scale) if scale is not None else layer.head_dim**-0.5


def window_scores(
    ctx: CompressionContext, layer_idx: int, layer: FoldedLayer, width: int, method: str
) -> tuple[Tensor, Tensor]:
    """Mean attention of the last ``width`` prefill queries on every entry of a fresh layer.

    The probabilities are causal inside the window, include β, and are averaged over the window
    and over the query heads of each KV head (GQA).

    Returns:
        ``(scores (B, H_kv, N), probs (B, H_q, W, N))`` in the compute dtype; padding scores 0.

    Raises:
        ValueError: the prefill kept no (or too few) query states, or the layer was compressed.
    """
    captured = layer.captured_queries
    if captured is None:
        raise ValueError(
            f"{method} reads the last prefill query states, but this cache kept none; prefill with "
            "kvfold.prefill (or set cache.capture_window before the forward pass)"
        )
    if layer.physical_length != layer.logical_length:
        raise ValueError(f"{method} compresses a freshly prefilled cache; this layer was already compressed")
    needed = min(width, layer.physical_length)
    if captured.shape[2] < needed:
        raise ValueError(
            f"{method} needs the last {needed} prefill queries but the prefill kept {captured.shape[2]}; "
            f"pass methods=[...] or capture_window={width} to kvfold.prefill"
        )
    keys, _, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    dtype = compute_dtype(keys)
    beta = torch.where(valid, log_mass, torch.zeros_like(log_mass)).to(dtype)
    queries = captured[:, :, -needed:].to(dtype)
    probs = window_attention(queries, keys.to(dtype), layer_scaling(ctx, layer_idx, layer), log_mass=beta, valid=valid)
    scores = pool_gqa(probs.mean(dim=2), keys.shape[1], "mean")
    return scores.masked_fill(~valid, 0.0), probs


def kept_mask(keep: Tensor, lengths: Tensor, length: int) -> Tensor:
    """``(B, H, N)`` bool: True at the slots listed in ``keep[..., :lengths]``."""
    slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
    hits = torch.zeros(*keep.shape[:2], length, dtype=torch.long, device=keep.device)
    return hits.scatter_add(-1, keep, slot.long()) > 0


def row_uniforms(ctx: CompressionContext, layer_idx: int, valid: Tensor, dtype: torch.dtype) -> Tensor:
    """Seeded uniforms ``(B, H, N)`` indexed by each entry's rank among the valid entries of its row.

    Every batch row draws from a fresh ``ctx.generator(layer_idx)``, so a context gets the same
    draws alone or inside a left-padded batch (reproducible per seed).
    """
    batch, heads, _ = valid.shape
    rank = (valid.long().cumsum(-1) - 1).clamp(min=0)
    counts = valid.sum(-1).amax(-1)  # (B,) most valid entries of any head of the row
    rows = []
    for b in range(batch):  # one generator per batch row (not per head or token)
        draws = torch.rand(heads, max(int(counts[b]), 1), generator=ctx.generator(layer_idx), dtype=torch.float64)
        rows.append(torch.gather(draws.to(valid.device), 1, rank[b].clamp(max=draws.shape[1] - 1)))
    return torch.stack(rows).to(dtype)
