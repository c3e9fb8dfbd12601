"""Methods that prove the plumbing: ``full``, ``streamingllm`` and ``random``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, Standalone, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.online import RecencyEviction
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid
from kvfold.runtime.folded_layer import FoldedLayer


@register
@dataclass
class Full(Standalone):
    """No compression: the cache keeps every entry (equals stock transformers)."""

    name: ClassVar[str] = "full"
    description: ClassVar[str] = "no compression (reference)"
    paper: ClassVar[str] = "-"

    def compress(self, ctx: CompressionContext) -> None:
        return None


@register
@dataclass
class StreamingLLM(Selector):
    """StreamingLLM: attention sinks plus the most recent tokens (Xiao et al., 2024, §3.2).

    Parameters:
        sinks: number of initial tokens always kept (the paper's 4 attention sinks).
        online: keep the budget during decoding too (evict the oldest non-sink entry).
    """

    name: ClassVar[str] = "streamingllm"
    query_agnostic: ClassVar[bool] = True
    description: ClassVar[str] = "keep 4 sink tokens and the most recent tokens; online during decoding"
    paper: ClassVar[str] = "Xiao et al. 2024, Efficient Streaming Language Models with Attention Sinks"
    supports_chunked_prefill: ClassVar[bool] = True
    sinks: int = 4
    online: bool = True

    def validate(self) -> None:
        if self.sinks < 0:
            raise SpecError("streamingllm: sinks must be ≥ 0")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> torch.Tensor:
        valid = layer.valid_mask()
        n = valid.shape[-1]
        return torch.arange(n, dtype=torch.float32, device=valid.device).expand(valid.shape).clone()

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> torch.Tensor:
        return first_valid(layer.valid_mask(), self.sinks)

    def online_policy(self, ctx: CompressionContext) -> RecencyEviction | None:
        if not self.online:
            return None
        limit = int(ctx.row_budgets.max())
        return RecencyEviction({i: limit for i, _ in ctx.cache.folded_layers}, sinks=self.sinks)


@register
@dataclass
class RandomKeep(Selector):
    """Keeps a uniformly random subset of the context (a sanity floor; seeded, reproducible)."""

    name: ClassVar[str] = "random"
    query_agnostic: ClassVar[bool] = True
    description: ClassVar[str] = "random subset of entries (sanity floor)"
    paper: ClassVar[str] = "-"
    supports_chunked_prefill: ClassVar[bool] = True

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> torch.Tensor:
        b, h = layer.batch_size, layer.num_heads
        scores = torch.rand(b, h, layer.physical_length, generator=ctx.generator(layer_idx))
        return scores.to(layer.device)
