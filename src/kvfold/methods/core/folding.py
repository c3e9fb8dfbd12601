"""Folding: what every folder shares (``cam``, ``d2o_merge``, ``kvmerger``, ``keepkv``, ``grkv``).

A folder receives one layer after the selector chose what stays; :class:`MergingFolder` does the
set-up once — the padded entries before the fold, the kept and evicted masks, the kept entries
gathered, the merge records of ``kvfold mergemap`` — and hands a :class:`FoldSite` to the
method's :meth:`~MergingFolder.fold_layer`. Pure helpers, vectorized over batch rows and KV heads: the
window attention each retained or evicted entry receives, the mask of kept slots, seeded uniforms
that do not depend on the batch a context is in, and (from :mod:`.scoring`) the compute dtype
(float32, float64 for float64 models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Folder, gather_entries
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.scoring import compute_dtype, pool_gqa, window_attention
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

__all__ = [
    "FoldSite",
    "MergingFolder",
    "compute_dtype",
    "fresh_window_queries",
    "kept_mask",
    "row_uniforms",
    "window_scores",
]


def fresh_window_queries(layer: FoldedLayer, width: int, method: str) -> Tensor:
    """The last ``width`` prefill query states ``(B, H_q, W, D)`` of a layer not yet compressed.

    Raises:
        ValueError: the prefill kept no (or too few) query states, or the layer was compressed.
    """
    captured = layer.captured_queries
    if captured is None:
        raise UserError(
            f"{method} reads the last prefill query states, but this cache kept none; prefill with "
            "kvfold.prefill (or set cache.capture_window before the forward pass)"
        )
    if layer.physical_length != layer.logical_length:
        raise UserError(f"{method} compresses a freshly prefilled cache; this layer was already compressed")
    needed = min(width, layer.physical_length)
    if captured.shape[2] < needed:
        raise UserError(
            f"{method} needs the last {needed} prefill queries but the prefill kept {captured.shape[2]}; "
            f"pass methods=[...] or capture_window={width} to kvfold.prefill"
        )
    return captured[:, :, -needed:]


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
    queries = fresh_window_queries(layer, width, method)
    keys, _, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    dtype = compute_dtype(keys)
    beta = torch.where(valid, log_mass, torch.zeros_like(log_mass)).to(dtype)
    queries = queries.to(dtype)
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


@dataclass
class FoldSite:
    """One layer as a folder receives it: the selector's choice and the entries before the fold.

    Attributes:
        layer_idx, layer: the layer being folded (edited in place by the folder).
        keep: ``(B, H, K)`` kept slots in position order, valid up to ``lengths`` ``(B, H)``.
        scores: ``(B, H, N)`` the selector's final scores.
        keys, values, log_mass: the padded entries before the fold (β = −inf on empty slots).
    """

    layer_idx: int
    layer: FoldedLayer
    keep: Tensor
    lengths: Tensor
    scores: Tensor
    keys: Tensor
    values: Tensor
    log_mass: Tensor

    @classmethod
    def of(cls, layer_idx: int, layer: FoldedLayer, keep: Tensor, lengths: Tensor, scores: Tensor) -> FoldSite:
        keys, values, log_mass, _ = layer.padded()
        return cls(layer_idx, layer, keep, lengths, scores, keys, values, log_mass)

    @property
    def valid(self) -> Tensor:
        """``(B, H, N)`` bool: slots that hold an entry."""
        return torch.isfinite(self.log_mass)

    @property
    def kept(self) -> Tensor:
        """``(B, H, N)`` bool: the slots the selector kept."""
        return kept_mask(self.keep, self.lengths, self.log_mass.shape[-1])

    @property
    def evicted(self) -> Tensor:
        """``(B, H, N)`` bool: valid slots the selector did not keep."""
        return self.valid & ~self.kept

    def kept_entries(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(keys, values, β)`` of the kept slots, ``(B, H, K, ·)``; β = −inf past ``lengths``."""
        return gather_entries(self.layer, self.keep, self.lengths)

    def record_merges(
        self, ctx: CompressionContext, carrier: Tensor, merged: Tensor, share: Tensor | None = None
    ) -> None:
        """Diagnostics (``kvfold mergemap``): slot ``n`` with ``merged[..., n]`` went into ``carrier[..., n]``."""
        if ctx.merge_recorder is None:
            return
        position = torch.arange(merged.shape[-1], device=merged.device).expand_as(carrier)
        ctx.record_merges(self.layer_idx, carrier, torch.where(merged, position, torch.full_like(position, -1)), share)


class MergingFolder(Folder):
    """A folder that edits each layer once the selector has chosen: :meth:`fold` builds the
    :class:`FoldSite` and the method's :meth:`fold_layer` writes the layer's new content."""

    selector_spec: ClassVar[str | None] = None
    """The selector a bare use of the name implies (``cam`` = ``streamingllm[online=false]+cam``)."""
    window_option: ClassVar[str] = "window"
    """The option that counts the prefill queries the folder reads (its ``query_window``)."""

    @classmethod
    def default_selector(cls) -> str | None:
        return cls.selector_spec

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return getattr(self, self.window_option, 0)

    def fold(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        keep: Tensor,
        lengths: Tensor,
        scores: Tensor,
        ctx: CompressionContext,
    ) -> None:
        self.fold_layer(FoldSite.of(layer_idx, layer, keep, lengths, scores), ctx)

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        """Write the layer's new content (``site.layer.replace(...)``) from the selector's choice."""
        raise NotImplementedError
