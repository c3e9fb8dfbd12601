"""Leverage: keep the keys that lie furthest outside the span of the others (geometric outliers).

Chari & Van Durme 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores* (arXiv:2507.08143): the approximate statistical leverage of the
centred, pre-RoPE keys of each KV head. Query-agnostic and free of any extra forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import pre_rope_keys
from kvfold.methods.core.scoring import zscore
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


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
    score is the diagonal of the sketch's hat matrix (:func:`leverage_scores`),
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
