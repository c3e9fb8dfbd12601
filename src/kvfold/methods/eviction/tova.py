"""TOVA: keep the entries the last query attends to most (mean over the layer's heads); online.

Oren et al. 2024, *Transformers are Multi-State RNNs*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.model import module_scaling
from kvfold.methods.core.online import OnlineEviction
from kvfold.methods.core.scoring import (
    tova_scores,
    window_attention,
)
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.eviction.common import captured_window, layer_content, online_limits
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor


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
        probs = window_attention(last, keys, module_scaling(ctx, layer_idx, layer), log_mass=beta, valid=valid)
        return tova_scores(probs, layer.num_heads, valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, recent=1, valid=valid)

    def online_policy(self, ctx: CompressionContext) -> TOVAOnline | None:
        return TOVAOnline(online_limits(self, ctx)) if self.online else None
