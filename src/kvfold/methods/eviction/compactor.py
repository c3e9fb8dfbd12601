"""Compactor: leverage scores blended with non-causal chunked attention; sinks kept.

Chari & Van Durme 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores* (arXiv:2507.08143). The attention half needs every prefill query:
it is observed during the prefill (:class:`CompactorAttentionObserver`), else recomputed by one
extra prefill pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import observe_prefill
from kvfold.methods.core.scoring import compute_dtype, gqa_groups, mask_invalid, pool_tokens, zscore
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import layer_content
from kvfold.methods.eviction.leverage import PAPER, layer_leverage
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


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
    groups = gqa_groups(num_q_heads, num_kv_heads)
    if keys.shape[2] != length:
        raise ValueError(f"need one query per key; got {length} queries and {keys.shape[2]} keys")
    dtype = compute_dtype(queries, keys)
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
    return mask_invalid(out, valid)


class CompactorAttentionObserver:
    """Prefill observer: writes ``layer.entry_stats[key]`` ``(B, H_kv, N)``, the non-causal
    attention each entry receives from the queries of its chunk
    (:func:`noncausal_chunk_attention`)."""

    def __init__(self, chunk: int, scaled: bool) -> None:
        self.chunk = chunk
        self.scaled = scaled
        self.key = f"compactor_attention[chunk={chunk},scaled={scaled}]"

    def __call__(self, layer_idx: int, layer: FoldedLayer, query: Tensor, scaling: float) -> None:
        keys, _, _, valid = layer_content(layer)
        layer.entry_stats[self.key] = noncausal_chunk_attention(
            query, keys, self.chunk, scaling if self.scaled else 1.0, valid
        )


@register
@dataclass
class Compactor(Selector):
    """Compactor (Chari & Van Durme 2025, arXiv:2507.08143, §3): ``score = λ · z(leverage) +
    z(attention)``, both standardised per batch row over the layer.

    * leverage: as :class:`~kvfold.methods.eviction.leverage.Leverage`, on the entries between the
      sinks;
    * attention: the attention each key receives from the queries of its own chunk of ``chunk``
      prefill tokens, non-causally (every query of the chunk sees every key of it), averaged over the
      GQA group, times ``‖v‖`` and averaged over 3 neighbours (as kvpress's release of the method);
      logits unscaled ``q·k`` by default, as the authors' release.

    Chunks start at the context's first token (kvpress starts them after the sinks); the leverage
    and both z-scores leave the sinks out. The first ``sinks_start`` and last ``sinks_end`` tokens
    are kept. Default ``λ = 0.5``: the
    authors' release (compactor-vllm) adds half the leverage z-score to the attention z-score;
    kvpress sets ``λ`` to the fraction evicted instead (``compactor[blend=0.9]`` at budget 0.1).
    Not implemented: the paper's context calibration (how far a context can be compressed).

    Parameters:
        blend: ``λ``, weight of the leverage z-score.
        chunk: tokens per non-causal attention chunk (256, kvpress; the authors' engine uses 128).
        scaled: scale logits by the model's ``1/√d`` (False: unscaled, as the authors' release).
        value_norm: weight the attention score by ``‖v‖`` (kvpress).
        sketch, ridge: the leverage sketch (48) and its relative ridge.
        sinks_start, sinks_end: first and last tokens always kept (8 and 4).
    """

    name: ClassVar[str] = "compactor"
    description: ClassVar[str] = "leverage scores + 0.5 x non-causal chunked attention (z-scored); sinks kept"
    paper: ClassVar[str] = PAPER
    blend: float = 0.5
    chunk: int = 256
    scaled: bool = False
    value_norm: bool = True
    sketch: int = 48
    ridge: float = 1e-6
    sinks_start: int = 8
    sinks_end: int = 4

    def validate(self) -> None:
        if self.blend < 0 or self.chunk < 1:
            raise SpecError(f"compactor: blend must be ≥ 0 and chunk ≥ 1; got {self.blend}, {self.chunk}")
        if min(self.sketch, self.sinks_start, self.sinks_end) < 0 or self.ridge < 0:
            raise SpecError("compactor: sketch, ridge, sinks_start and sinks_end must be ≥ 0")

    def observer(self) -> CompactorAttentionObserver:
        return CompactorAttentionObserver(self.chunk, self.scaled)

    def prefill_observers(self) -> list:
        return [self.observer()]

    def prepare(self, ctx: CompressionContext) -> None:
        observer = self.observer()

        def ready(layer: FoldedLayer) -> bool:
            stats = layer.entry_stats.get(observer.key)
            return stats is not None and stats.shape == (layer.batch_size, layer.num_heads, layer.physical_length)

        if not all(ready(layer) for _, layer in ctx.cache.folded_layers):
            observe_prefill(ctx, [observer])
            ctx.report["compactor"] = (
                "chunked attention recomputed with an extra prefill pass (pass methods=... to kvfold.prefill)"
            )

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        scored = valid & ~self.protected(layer_idx, layer, ctx)
        if not bool(scored.any()):
            return torch.zeros(valid.shape, device=valid.device).masked_fill(~valid, float("-inf"))
        attention = layer.entry_stats[self.observer().key].float()
        attention = torch.where(valid, attention, torch.zeros_like(attention))
        if self.value_norm:
            _, values, _, _ = layer_content(layer)
            attention = attention * torch.linalg.vector_norm(values.float(), dim=-1)
        attention = pool_tokens(attention, 3, "avg")
        leverage = layer_leverage(ctx, layer_idx, layer, self.sketch, self.ridge, scored)
        combined = self.blend * leverage + zscore(attention, scored).float()  # λ·z(ℓ) + z(a)
        # sinks are protected; give them the layer's top score so that scores stay finite
        top = combined.masked_fill(~scored, float("-inf")).amax(dim=(1, 2), keepdim=True)
        return torch.where(scored, combined, top.expand_as(combined)).masked_fill(~valid, float("-inf"))

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        return protected_mask(*valid.shape, sinks=self.sinks_start, recent=self.sinks_end, valid=valid)
