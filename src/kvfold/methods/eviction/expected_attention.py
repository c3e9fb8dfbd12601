"""Expected Attention: the attention future queries are expected to give, times the value norm.

Devoto et al. 2025, *Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution*. Future queries are modelled as a Gaussian of the recent (un-rotated)
queries, rotated to the next positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import CompressionContext, Selector, register
from kvfold.methods.core.model import module_scaling, rope_tables, unrotate
from kvfold.methods.core.scoring import (
    expected_attention_scores,
)
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import captured_window, first_valid, layer_content
from kvfold.runtime.cache import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- Expected Attention


@register
@dataclass
class ExpectedAttention(Selector):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution", §3).

    Future queries are modelled as a Gaussian fitted to recent **pre-RoPE** queries, rotated by
    the mean RoPE rotation of the next ``n_future`` positions; each entry's score is its expected
    attention times ``‖v‖`` (:func:`kvfold.methods.core.scoring.expected_attention_scores`). Pre-RoPE
    queries come from the captured post-RoPE ones by the inverse rotation (RoPE is orthogonal),
    with the model's own rotary tables. The first ``sinks`` tokens are left out of the query
    statistics and of the softmax, and always kept.

    Difference from the release: it fits the statistics on all prompt queries; here they come
    from the last ``window`` queries captured at prefill (64 by default).

    Parameters:
        n_future: future positions averaged over (512).
        sinks: initial tokens excluded and kept (4).
        window: recent queries for the Gaussian (≤ what the prefill captured).
        use_covariance: include the ``kᵀΣk/2d`` term.
        use_value_norm: weight by ``‖v‖₂``.
        epsilon: added before the value-norm weighting.
    """

    name: ClassVar[str] = "expected_attention"
    description: ClassVar[str] = "expected attention of future queries (Gaussian of recent queries) x value norm"
    paper: ClassVar[str] = (
        "Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating Attention "
        "from Future Queries Distribution"
    )
    n_future: int = 512
    sinks: int = 4
    window: int = 64
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        for option in ("n_future", "window"):
            if getattr(self, option) < 1:
                raise SpecError(f"expected_attention: {option} must be ≥ 1; got {getattr(self, option)}")
        if self.sinks < 0 or self.epsilon < 0:
            raise SpecError("expected_attention: sinks and epsilon must be ≥ 0")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, values, beta, valid = layer_content(layer)
        captured = captured_window(layer, self.window, self.name, strict=False)
        sinks = first_valid(valid, self.sinks)
        key_valid = valid & ~sinks
        lengths = valid[:, 0].sum(-1).tolist()  # tokens per row (left padding excluded)
        rows = []
        for b in range(keys.shape[0]):  # per batch row: rows differ in length, so in positions
            row = slice(b, b + 1)
            rows.append(
                self._row_scores(
                    ctx, layer_idx, int(lengths[b]), captured[row], keys[row], values[row], beta[row], key_valid[row]
                )
            )
        scores = torch.cat(rows)
        # sinks are protected; give them the row's top score so that scores stay finite
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        return torch.where(sinks, top.expand_as(scores), scores)

    def _row_scores(
        self,
        ctx: CompressionContext,
        layer_idx: int,
        length: int,
        captured: Tensor,
        keys: Tensor,
        values: Tensor,
        beta: Tensor,
        key_valid: Tensor,
    ) -> Tensor:
        """Scores of one batch row of ``length`` tokens, ``(1, H_kv, N)``."""
        width = captured.shape[2]
        positions = torch.arange(length - width, length, device=keys.device)  # of the captured queries
        use = positions >= min(self.sinks, length - 1)  # real tokens past the sinks (at least one)
        cos, sin = rope_tables(ctx.model, layer_idx, positions[use])
        queries = unrotate(captured[:, :, use], cos, sin)  # pre-RoPE (1, H_q, M, D)
        future = torch.arange(length, length + self.n_future, device=keys.device)
        cos_f, sin_f = rope_tables(ctx.model, layer_idx, future)
        return expected_attention_scores(
            queries,
            keys,
            values,
            cos_f,
            sin_f,
            module_scaling(ctx, layer_idx, ctx.cache.layers[layer_idx]),
            use_covariance=self.use_covariance,
            use_value_norm=self.use_value_norm,
            epsilon=self.epsilon,
            log_mass=beta,
            valid=key_valid,
        )

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return first_valid(layer.valid_mask(), self.sinks) if self.sinks else None
