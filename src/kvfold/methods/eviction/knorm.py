"""KNorm: keep the entries with the lowest key norms; online.

Devoto et al. 2024, *A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.online import PROTECTED, OnlineEviction
from kvfold.methods.core.scoring import compute_dtype, mask_invalid
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid, layer_content, online_limits
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


def knorm_scores(keys: Tensor, valid: Tensor | None = None) -> Tensor:
    """Key-norm scores (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for
    KV Cache Compression", arXiv:2406.11430): low ‖k‖₂ correlates with high attention, so ``score = −‖k‖₂``.

    Returns:
        ``(B, H_kv, N)``.
    """
    return mask_invalid(-torch.linalg.vector_norm(keys.to(compute_dtype(keys)), dim=-1), valid)


# ---------------------------------------------------------------------------- K-norm


class KNormOnline(OnlineEviction):
    """Online K-norm: every entry keeps the score ``−‖k‖`` it was born with; sinks protected."""

    def __init__(self, limits: dict[int, int], sinks: int) -> None:
        super().__init__(limits)
        self.sinks = sinks

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        keys, _, log_mass = layer.dense_buffers()
        valid = torch.isfinite(log_mass[:, :, :count])
        scores = knorm_scores(keys[:, :, :count], valid).float()
        return scores.masked_fill(first_valid(valid, self.sinks), PROTECTED)

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        keys, _, _ = layer.dense_buffers()
        return knorm_scores(keys[:, :, -q_len:]).float()


@register
@dataclass
class KNorm(Selector):
    """K-norm (Devoto et al. 2024, arXiv:2406.11430, §3–4): keys with a low L2 norm attract
    attention, so keep the entries with the smallest ``‖k‖``.

    No sinks by default, as in the authors' release (kvpress): the paper's observation is that
    attention sinks are exactly the lowest-norm keys, so they are kept anyway.

    Parameters:
        sinks: first tokens always kept (0 = none).
        online: keep the budget during decoding too (score of a new entry: its key norm).
    """

    name: ClassVar[str] = "knorm"
    query_agnostic: ClassVar[bool] = True
    description: ClassVar[str] = "keep the entries with the lowest key norm; online during decoding"
    paper: ClassVar[str] = "Devoto et al. 2024, A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
    supports_chunked_prefill: ClassVar[bool] = True
    sinks: int = 0
    online: bool = True

    def validate(self) -> None:
        if self.sinks < 0:
            raise SpecError(f"knorm: sinks must be ≥ 0; got {self.sinks}")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, _, _, valid = layer_content(layer)
        return knorm_scores(keys, valid)

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return first_valid(layer.valid_mask(), self.sinks) if self.sinks else None

    def online_policy(self, ctx: CompressionContext) -> KNormOnline | None:
        return KNormOnline(online_limits(self, ctx), sinks=self.sinks) if self.online else None
