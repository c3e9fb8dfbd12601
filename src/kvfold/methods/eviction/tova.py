"""TOVA: keep the entries the last query attends to most (mean over the layer's heads); online.

Oren et al. 2024, *Transformers are Multi-State RNNs*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.online import OnlineEviction
from kvfold.methods.core.scoring import compute_dtype, gqa_groups, mask_invalid, window_attention
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.eviction.common import captured_window, layer_content, online_limits
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


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
    last = probs_last[:, :, -1, :].to(compute_dtype(probs_last))
    gqa_groups(last.shape[1], num_kv_heads)
    layer_score = last.mean(dim=1, keepdim=True)  # (B, 1, N): head-averaged
    return mask_invalid(layer_score.expand(-1, num_kv_heads, -1).contiguous(), valid)


# ---------------------------------------------------------------------------- TOVA


class TOVAOnline(OnlineEviction):
    """Online TOVA: each step, scores are the new token's attention (head-averaged over the
    layer); the lowest goes, never the newest token."""

    def __init__(self, limits: dict[int, int]) -> None:
        super().__init__(limits, needs_attention=True, recent=1)

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        return torch.zeros(layer.batch_size, layer.num_heads, count, device=layer.device)  # replaced each step

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        if probs is None:
            return state.new_zeros(state.shape[0], state.shape[1], q_len)
        _, _, log_mass = layer.dense_buffers()
        scores = tova_scores(probs, layer.num_heads, valid=torch.isfinite(log_mass))
        old = state.shape[-1]
        state.copy_(scores[..., :old].to(state.dtype))
        return scores[..., old:]


@register
@dataclass
class TOVA(Selector):
    """TOVA, Token Omission Via Attention (Oren et al. 2024, arXiv:2401.06104, §3, the TOVA policy).

    Keeps the entries with the highest attention from the **last** query, averaged over all query
    heads of the layer (so every KV head keeps the same tokens). One-shot: the last context
    token's query; online (default): each new token's query. Only the newest token is protected.

    Parameters:
        online: keep the budget during decoding too (TOVA is a decode-time policy).
    """

    name: ClassVar[str] = "tova"
    description: ClassVar[str] = "attention of the last query, averaged over the layer's heads; online"
    paper: ClassVar[str] = "Oren et al. 2024, Transformers are Multi-State RNNs"
    query_window: ClassVar[int] = 1
    supports_chunked_prefill: ClassVar[bool] = True
    comparable_scores: ClassVar[bool] = True  # attention probabilities, one scale in every layer
    online: bool = True

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, beta, valid = layer_content(layer)
        last = captured_window(layer, 1, self.name)
        scaling = layer_scaling(ctx, layer_idx, layer, require_module=True)
        probs = window_attention(last, keys, scaling, log_mass=beta, valid=valid)
        return tova_scores(probs, layer.num_heads, valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=1, valid=valid)

    def online_policy(self, ctx: CompressionContext) -> TOVAOnline | None:
        return TOVAOnline(online_limits(self, ctx)) if self.online else None
