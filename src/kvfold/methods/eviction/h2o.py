"""H2O: heavy hitters by accumulated attention plus the recent tokens; one-shot and online.

Zhang et al. 2023, *H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models*. The accumulated attention is observed during the prefill when the method is announced to
it (:class:`H2OPrefillObserver`), else recomputed by an extra pass; during decoding
:class:`H2OOnline` keeps the budget per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import observe_prefill
from kvfold.methods.core.online import PROTECTED, OnlineEviction
from kvfold.methods.core.scoring import GqaReduce, causal_probs, compute_dtype, mask_invalid, pool_gqa
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid, last_valid, layer_content, online_limits
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


def h2o_scores(
    queries_all: Tensor,
    keys: Tensor,
    scaling: float,
    chunk: int = 256,
    gqa_reduce: GqaReduce = "sum",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """H2O accumulated attention (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
    Generative Inference of Large Language Models", arXiv:2306.14048).

    Score of key ``j`` = Σ over the (causal) prefill queries ``i ≥ j`` of ``softmax_i(j)``: the
    total attention it received. Queries are processed ``chunk`` at a time, so at most
    ``(B, H_q, chunk, N)`` probabilities exist at once.

    Args:
        queries_all: ``(B, H_q, Q, D)`` post-RoPE queries of the last ``Q ≤ N`` tokens (usually all
            ``N`` prefill tokens); query ``i`` sits at key position ``N − Q + i``.
        keys: ``(B, H_kv, N, D)``.
        scaling: logit scale.
        chunk: queries per chunk (memory bound; the result does not depend on it).
        gqa_reduce: combination of the ``G`` query heads (``"sum"``: total attention received).
        log_mass, valid: see :mod:`kvfold.methods.core.scoring`.

    Returns:
        ``(B, H_kv, N)`` accumulated attention, ``-inf`` on padding. Continue it during decoding
        with :func:`h2o_update`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be ≥ 1; got {chunk}")
    num_queries, length = queries_all.shape[2], keys.shape[2]
    start = length - num_queries
    dtype = compute_dtype(queries_all, keys, log_mass)
    total = torch.zeros(queries_all.shape[0], queries_all.shape[1], length, dtype=dtype, device=keys.device)
    for lo in range(0, num_queries, chunk):  # loop over query chunks only, for memory
        hi = min(lo + chunk, num_queries)
        end = start + hi  # causal: this chunk sees keys [0, end) only
        probs = causal_probs(
            queries_all[:, :, lo:hi],
            keys[:, :, :end],
            scaling,
            start + lo,
            None if log_mass is None else log_mass[..., :end],
            None if valid is None else valid[..., :end],
        )
        total[..., :end] += probs.sum(dim=2)
    return mask_invalid(pool_gqa(total, keys.shape[1], gqa_reduce), valid)


def h2o_update(acc_scores: Tensor, probs_step: Tensor, gqa_reduce: GqaReduce = "sum") -> Tensor:
    """One online H2O step (Zhang et al. 2023): add this step's attention.

    Args:
        acc_scores: ``(B, H_kv, N_prev)`` accumulated scores, ``N_prev ≤ N``; entries appended since
            (positions ``N_prev … N − 1``) start from 0. ``-inf`` (padding) stays ``-inf``.
        probs_step: ``(B, H_q, q, N)`` attention probabilities of the step's ``q`` queries.
        gqa_reduce: must match the one used by :func:`h2o_scores`.

    Returns:
        A new ``(B, H_kv, N)`` tensor ``acc + Σ_queries pool_gqa(probs)``.
    """
    length = probs_step.shape[-1]
    if acc_scores.shape[-1] > length:
        raise ValueError(f"accumulator has {acc_scores.shape[-1]} entries but the step attends {length}")
    added = pool_gqa(probs_step.sum(dim=2), acc_scores.shape[1], gqa_reduce)
    dtype = torch.promote_types(acc_scores.dtype, compute_dtype(probs_step))
    acc = F.pad(acc_scores.to(dtype), (0, length - acc_scores.shape[-1]), value=0.0)
    return acc + added.to(dtype)


# ---------------------------------------------------------------------------- H2O


class H2OPrefillObserver:
    """Accumulates H2O's attention during the prefill (attention calls it once per layer).

    Writes ``layer.entry_stats["h2o"]`` ``(B, H_kv, N)``: the attention each entry received from
    all prefill queries, summed over the GQA group (:func:`h2o_scores`,
    computed ``chunk`` queries at a time so at most ``(B, H_q, chunk, N)`` probabilities exist).
    """

    key = "h2o"

    def __init__(self, chunk: int = 256) -> None:
        self.chunk = chunk

    def __call__(self, layer_idx: int, layer: FoldedLayer, query: Tensor, scaling: float) -> None:
        keys, _, beta, valid = layer_content(layer)
        layer.entry_stats[self.key] = h2o_scores(
            query, keys, scaling, chunk=self.chunk, gqa_reduce="sum", log_mass=beta, valid=valid
        )


class H2OOnline(OnlineEviction):
    """Online H2O: each step adds the step's attention to every entry's accumulated score
    (:func:`h2o_update`); the ``recent`` newest tokens and the sinks are
    never evicted; otherwise the entry with the least accumulated attention goes."""

    def __init__(self, limits: dict[int, int], recent: int, sinks: int) -> None:
        super().__init__(limits, needs_attention=True, recent=recent)
        self.sinks = sinks

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> Tensor:
        stats = layer.entry_stats.get(H2OPrefillObserver.key)
        if stats is None or stats.shape[-1] != count:
            raise UserError(
                "online h2o continues the accumulated attention of the kept entries; compress this cache "
                "with h2o first (its statistics are missing or no longer match the cache)"
            )
        _, _, log_mass = layer.dense_buffers()
        sinks = first_valid(torch.isfinite(log_mass[:, :, :count]), self.sinks)
        return stats.float().masked_fill(sinks, PROTECTED)

    def export_scores(self, layer_idx: int, layer: FoldedLayer, scores: Tensor) -> None:
        layer.entry_stats[H2OPrefillObserver.key] = scores  # the accumulated attention (sinks: +inf)

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> Tensor:
        if probs is None:
            return state.new_zeros(state.shape[0], state.shape[1], q_len)
        # h2o_update in place: Σ over every query seen of its attention (new entries start from 0)
        old = state.shape[-1]
        if probs.shape[-1] < old:
            raise ValueError(f"accumulator has {old} entries but the step attends {probs.shape[-1]}")
        step = probs[:, :, 0] if q_len == 1 else probs.sum(dim=2)
        added = pool_gqa(step, state.shape[1], "sum")
        state.add_(added[..., :old])  # computed in the promoted dtype, rounded to the state's
        return added[..., old:]


@register
@dataclass
class H2O(Selector):
    """H2O, Heavy-Hitter Oracle (Zhang et al. 2023, arXiv:2306.14048, the H₂ eviction policy, Algorithm 1).

    Score = attention accumulated over every prefill query (computed during the prefill by
    :class:`H2OPrefillObserver`, or by an extra forward pass when the prefill ran without it).
    The budget is split between heavy hitters and the most recent tokens, half and half as in
    the paper's experiments. Online (default): during decoding the scores keep accumulating and
    the cache never exceeds the budget. Chunked prefill runs the online policy over the chunks
    after the first (:mod:`kvfold.pipeline.chunked`): an entry's score is the attention it received from
    every query seen, chunk after chunk, on the evolving cache (the H₂ policy of Algorithm 1,
    ``chunk`` queries per step).

    Parameters:
        recent_ratio: share of the budget kept for the most recent tokens (0.5: the paper's
            equal heavy/recent split).
        sinks: first tokens always kept (0: H2O keeps none).
        online: keep the budget during decoding too.
    """

    name: ClassVar[str] = "h2o"
    description: ClassVar[str] = "heavy hitters by accumulated attention + recent half; online during decoding"
    paper: ClassVar[str] = (
        "Zhang et al. 2023, H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
    )
    supports_chunked_prefill: ClassVar[bool] = True
    comparable_scores: ClassVar[bool] = True  # attention probabilities, one scale in every layer
    chunked_prefill_online: ClassVar[bool] = True  # the scores need every chunk's attention
    recent_ratio: float = 0.5
    sinks: int = 0
    online: bool = True

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise SpecError(f"h2o: recent_ratio must be in [0, 1]; got {self.recent_ratio}")
        if self.sinks < 0:
            raise SpecError(f"h2o: sinks must be ≥ 0; got {self.sinks}")

    def prefill_observers(self) -> list:
        return [H2OPrefillObserver()]

    def prepare(self, ctx: CompressionContext) -> None:
        def ready(layer: FoldedLayer) -> bool:
            stats = layer.entry_stats.get(H2OPrefillObserver.key)
            return stats is not None and stats.shape == (layer.batch_size, layer.num_heads, layer.physical_length)

        if not all(ready(layer) for _, layer in ctx.cache.folded_layers):
            observe_prefill(ctx, [H2OPrefillObserver()])
            ctx.report["h2o"] = (
                "accumulated attention recomputed with an extra prefill pass (pass methods=... to kvfold.prefill)"
            )

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        return layer.entry_stats[H2OPrefillObserver.key]

    def recent_counts(self, budget: Tensor) -> Tensor:
        """Recent tokens kept out of a budget: ``⌊recent_ratio · budget⌋``."""
        return torch.floor(budget.double() * self.recent_ratio).long()

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        recent = self.recent_counts(self.layer_budgets(ctx)[layer_idx])
        return last_valid(valid, recent) | first_valid(valid, self.sinks)

    def online_policy(self, ctx: CompressionContext) -> H2OOnline | None:
        if not self.online:
            return None
        limits = online_limits(self, ctx)
        recent = int(self.recent_counts(torch.tensor(max(limits.values()))))
        return H2OOnline(limits, recent=recent, sinks=self.sinks)
