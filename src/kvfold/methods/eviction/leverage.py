"""Leverage: keep the keys that lie furthest outside the span of the others (geometric outliers).

Chari & Van Durme 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores* (arXiv:2507.08143): the approximate statistical leverage of the
centred, pre-RoPE keys of each KV head. Query-agnostic and free of any extra forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.model import pre_rope_keys
from kvfold.methods.core.scoring import leverage_scores, zscore
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor

PAPER = (
    "Chari & Van Durme 2025, Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores"
)


def layer_leverage(
    ctx: CompressionContext, layer_idx: int, layer: FoldedLayer, sketch: int, ridge: float, scored: Tensor
) -> Tensor:
    """Standardised leverage ``(B, H, N)`` of the ``scored`` entries of a layer's pre-RoPE keys
    (other entries ``-inf``); the sketch is drawn from the compression's seed and the layer."""
    keys = pre_rope_keys(ctx, layer_idx, layer)
    raw = leverage_scores(keys, sketch=sketch, generator=ctx.generator(layer_idx), valid=scored, ridge=ridge)
    return zscore(raw, scored).float()


@register
@dataclass
class Leverage(Selector):
    """Approximate leverage scores (Chari & Van Durme 2025, arXiv:2507.08143, §3): an entry is
    kept for how much its key stands outside the subspace of the other keys of its head.

    Per KV head, the **pre-RoPE** keys (the cache's rotated keys un-rotated at their positions,
    :func:`kvfold.methods.core.model.pre_rope_keys`: exact, no hook and no extra pass) are
    centred over the context and sketched on the right by a Gaussian ``D × k`` matrix; the
    score is the diagonal of the sketch's hat matrix (:func:`kvfold.methods.core.scoring.leverage_scores`),
    standardised per batch row over the layer (as the authors' release; a per-layer affine map, so
    heads keep their order and compare within a layer for ``adakv:``). Needs the uncompressed
    prefill (slots = positions), so no chunked prefill.

    Parameters:
        sketch: sketch dimension ``k`` (48, the authors' release); 0 = exact leverage.
        ridge: relative ridge on the ``k × k`` Gram matrix (numerical guard only).
        sinks: first tokens always kept (0, as the release's leverage scorer).
    """

    name: ClassVar[str] = "leverage"
    query_agnostic: ClassVar[bool] = True  # keys only: a folder after it fits on the repeat pass
    description: ClassVar[str] = "query-agnostic: approximate leverage of the centred pre-RoPE keys (outliers)"
    paper: ClassVar[str] = PAPER
    sketch: int = 48
    ridge: float = 1e-6
    sinks: int = 0

    def validate(self) -> None:
        if self.sketch < 0 or self.ridge < 0 or self.sinks < 0:
            raise SpecError(
                f"{self.name}: sketch, ridge and sinks must be ≥ 0; got {self.sketch}, {self.ridge}, {self.sinks}"
            )

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return layer_leverage(ctx, layer_idx, layer, self.sketch, self.ridge, layer.valid_mask())

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return first_valid(layer.valid_mask(), self.sinks) if self.sinks else None
