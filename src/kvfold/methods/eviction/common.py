"""Small pieces the eviction selectors share: a layer's content, its prefill query window, masks
of the first and last valid entries, and the per-layer limits of an online policy.
"""

from __future__ import annotations

import torch

from kvfold.methods.core.base import Selector
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.selection import protected_mask
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


def layer_content(layer: FoldedLayer) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Keys, values, finite β (0 on empty slots) and the validity mask of a layer."""
    keys, values, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
    return keys, values, beta, valid


def captured_window(layer: FoldedLayer, width: int, method: str, strict: bool = True) -> Tensor:
    """The last ``width`` prefill queries ``(B, H_q, W, D)``.

    Their tokens are the layer's last ``W`` slots: true after a prefill, after appending a chunk
    to a compressed cache (chunked prefill), and after any selection that keeps its window (kept
    entries stay in position order).
    """
    captured = layer.captured_queries
    if captured is None:
        raise UserError(
            f"{method} reads the last prefill query states, but this cache kept none; prefill with "
            "kvfold.prefill (or set cache.capture_window before the forward pass)"
        )
    needed = min(width, layer.physical_length)
    if strict and captured.shape[2] < needed:
        raise UserError(
            f"{method} needs the last {needed} prefill queries but the prefill kept {captured.shape[2]}; "
            f"pass methods=[...] or capture_window={width} to kvfold.prefill"
        )
    return captured[:, :, -needed:]


def last_valid(valid: Tensor, counts: Tensor) -> Tensor:
    """``(B, H, N)`` bool: the last ``counts[b]`` valid entries of each row (``counts`` ``(B,)``)."""
    from_end = valid.long().flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid entry
    return valid & (from_end <= counts.to(valid.device)[:, None, None])


def first_valid(valid: Tensor, count: int) -> Tensor:
    """``(B, H, N)`` bool: the first ``count`` valid entries of each row (left padding skipped: the sinks)."""
    return protected_mask(*valid.shape, sinks=count, valid=valid)


def online_limits(selector: Selector, ctx: CompressionContext) -> dict[int, int]:
    """Per-layer online limits: the counts used at compression (max over batch rows)."""
    budgets = selector.layer_budgets(ctx)
    return {i: int(budgets[i].max()) for i, _ in ctx.cache.folded_layers}
