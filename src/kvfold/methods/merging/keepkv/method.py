"""The registered ``keepkv`` folder (offline: merge-first selection, then one ZIP-merge per carrier;
online: :mod:`.online`) and its default selector ``h2o_cosine``. See
:mod:`kvfold.methods.merging.keepkv`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvfold.methods.core.base import register
from kvfold.methods.core.budgets import cosine_layer_budgets
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import FoldSite, MergingFolder, kept_mask
from kvfold.methods.core.online import OnlineEviction
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import first_valid, last_valid
from kvfold.methods.eviction.h2o import H2O, H2OOnline
from kvfold.methods.merging.keepkv.merge import best_match, merge_first_keep, merged_weight, zip_merge
from kvfold.methods.merging.keepkv.online import KeepKVOnline, LayerPolicies
from kvfold.methods.merging.keepkv.scores import STAT_LOG_SCORE, STAT_WEIGHT, folded_scalings, window_log_scores
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

PAPER = "Tian et al. 2025, KeepKV: Achieving Periodic Lossless KV Cache Compression for Efficient LLM Inference"

Tensor = torch.Tensor


def _count(report: dict, key: str, value: float) -> None:
    """Add ``value`` to the one-shot fold's counter ``key`` in ``report["keepkv"]``."""
    stats = report.setdefault("keepkv", {"merged": 0, "evicted": 0, "votes_dropped": 0.0, "fallbacks": 0,
                                         "receivers": 0, "swapped": 0})  # fmt: skip
    stats[key] += value


# ---------------------------------------------------------------------------- the folder


@register
@dataclass
class KeepKV(MergingFolder):
    """KeepKV folding (Tian et al. 2025, §3.3, Algorithm 1; see the module docstring).

    ``SELECTOR+keepkv`` merges what any selector evicts; ``keepkv`` alone runs on the paper's
    default selector ``h2o_cosine`` (H2O scores, cosine layer budgets, 4 sinks; its ``split``
    option chooses between the two readings of Appendix B, see :class:`H2OCosine`).

    Parameters:
        threshold: cosine similarity ``T`` above which an evicted entry is merged (0.8).
        window: prefill queries of the EMA scores, ``w`` (32; the paper gives none).
        alpha: EMA decay ``α`` (0.9; the paper gives none).
        evict_first: prefill order; False = merge-before-evict (Appendix B, Table 3's better one).
        eps: relative tolerance below which the key formula's denominator counts as zero.
        eq7_scaling: scale the merged key by eq. 7's ``γ`` so the scoring query's output is unchanged
            (True, the paper); False = the convex key ``k̄ = Σ w_i k_i / Σ w_i`` for every carrier,
            which is what the authors' code (``modify_llama_oursk.py``) does.
        max_scale: the exact key ``γ k̄`` falls back to ``k̄`` when ``γ ∉ [1/max_scale, max_scale]``
            (2, ours: neither the paper nor the authors' code has this bound; ``inf`` = the
            literal eq. 7, only guarded at its pole).
        online: also merge during decoding when the selector evicts online (h2o, streamingllm, …).
    """

    name: ClassVar[str] = "keepkv"
    description: ClassVar[str] = "merge evicted entries into the most similar kept one, output-preserving, votes"
    paper: ClassVar[str] = PAPER
    supports_chunked_prefill: ClassVar[bool] = True
    chunked_prefill_online: ClassVar[bool] = True  # merges the online selector's victims chunk after chunk
    threshold: float = 0.8
    window: int = 32
    alpha: float = 0.9
    evict_first: bool = False
    eps: float = 1e-3
    eq7_scaling: bool = True
    max_scale: float = 2.0
    online: bool = True
    selector_spec: ClassVar[str] = "h2o_cosine"

    def validate(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise SpecError(f"keepkv: threshold must be a cosine in [-1, 1]; got {self.threshold}")
        if self.window < 1:
            raise SpecError(f"keepkv: window must be ≥ 1; got {self.window}")
        if not 0.0 < self.alpha < 1.0:
            raise SpecError(f"keepkv: alpha must be in (0, 1); got {self.alpha}")
        if self.eps < 0:
            raise SpecError(f"keepkv: eps must be ≥ 0; got {self.eps}")
        if not self.max_scale >= 1.0:
            raise SpecError(f"keepkv: max_scale must be ≥ 1 (inf = unbounded); got {self.max_scale}")

    # -- one-shot ----------------------------------------------------------------------
    def reselect(self, layer_idx, layer, keep, lengths, scores, protected, valid, ctx):
        if self.evict_first:
            return keep, lengths
        keys = layer.padded()[0]
        keep, lengths, swapped = merge_first_keep(keys, keep, lengths, scores, protected, valid, self.threshold)
        _count(ctx.report, "swapped", int(swapped.sum()))
        return keep, lengths

    def window_scores(self, layer_idx: int, layer: FoldedLayer, scaling: float) -> tuple[Tensor, Tensor]:
        """``(log ŝ, weight)`` ``(B, H, N)`` of a prefilled layer from its captured queries."""
        queries = layer.captured_queries
        if queries is None:
            raise UserError(
                "keepkv scores entries with the last prefill queries, but this cache kept none; prefill with "
                "kvfold.prefill (or set cache.capture_window before the forward pass)"
            )
        keys, _, log_mass, _ = layer.padded()
        width = min(self.window, queries.shape[2], keys.shape[2])
        return window_log_scores(queries[:, :, -width:], keys, scaling, self.alpha, torch.isfinite(log_mass))

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        layer_idx, layer, keep, lengths = site.layer_idx, site.layer, site.keep, site.lengths
        keys, values, log_mass, valid = site.keys, site.values, site.log_mass, site.valid
        length = keys.shape[2]
        log_score, weight = self.window_scores(layer_idx, layer, folded_scalings(ctx)[layer_idx])
        in_row = torch.arange(keep.shape[-1], device=keep.device) < lengths[..., None]
        kept = kept_mask(keep, lengths, length)
        evicted = valid & ~kept
        carrier_keys = torch.gather(keys, 2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
        sim, choice = best_match(keys, carrier_keys, in_row)  # Algorithm 1, lines 4–5
        merge = evicted & (sim > self.threshold) & torch.isfinite(log_score)
        targets = torch.gather(keep, 2, choice)
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        merged = zip_merge(keys, values, beta, log_score, targets, merge, self.eps, self.max_scale, self.eq7_scaling)
        weight = merged_weight(weight, targets, merge, merged.receivers)
        idx = keep[..., None].expand(-1, -1, -1, keys.shape[-1])
        layer.replace(
            torch.gather(merged.keys, 2, idx),
            torch.gather(merged.values, 2, idx),
            torch.gather(merged.log_votes, 2, keep),
            lengths,
        )
        # the EMA state follows the carriers, for the online phase
        layer.entry_stats[STAT_LOG_SCORE] = torch.gather(merged.log_scores, 2, keep).float()
        layer.entry_stats[STAT_WEIGHT] = torch.gather(weight, 2, keep).float()
        if ctx.merge_recorder is not None:  # diagnostics (kvfold mergemap): absorbed slot → carrier slot
            site.record_merges(ctx, targets, merge, merge.to(keys.dtype))
        dropped = evicted & ~merge
        _count(ctx.report, "merged", int(merge.sum()))
        _count(ctx.report, "evicted", int(dropped.sum()))
        _count(ctx.report, "votes_dropped", float(beta.exp()[dropped].sum()))
        _count(ctx.report, "fallbacks", int(merged.fallback.sum()))
        _count(ctx.report, "receivers", int(merged.receivers.sum()))
        ctx.report["keepkv_fallbacks"] = ctx.report["keepkv"]["fallbacks"]

    # -- online ------------------------------------------------------------------------
    def online_policy(self, policy: Any, ctx: CompressionContext) -> Any:
        """The selector's online policy, made to merge its victims (None if it cannot be)."""
        if not self.online:
            return policy
        inner = list(policy.policies.values()) if isinstance(policy, LayerPolicies) else [policy]
        if not all(isinstance(p, OnlineEviction) for p in inner):
            return None
        state = KeepKVOnline(self, folded_scalings(ctx))
        for p in inner:
            p.folder = state
            p.needs_attention = True
        policy.needs_attention = True
        if isinstance(policy, LayerPolicies):
            policy.folder = state
            if all(type(p) is H2OOnline and len(p.limits) == 1 for p in inner):
                from kvfold.methods.merging.keepkv.decode import LayerBatchedDecode

                policy.batched = LayerBatchedDecode(policy.policies, state)
        return policy


# ---------------------------------------------------------------------------- the default selector


@register
@dataclass
class H2OCosine(H2O):
    """H2O scores with PyramidInfer-style cosine layer budgets: KeepKV's default selection
    (Tian et al. 2025, Appendix B.3; Zhang et al. 2023, H2O; Yang et al. 2024, PyramidInfer).

    Accumulated attention (H2O) picks the heavy hitters; each layer keeps a recent window and the
    first ``sinks`` tokens; layer budgets decay with depth along half a cosine
    (:func:`kvfold.methods.core.budgets.cosine_layer_budgets`, last/first ≈ ``min_ratio``), with the
    mean over layers equal to the budget. Online, each layer keeps its own budget and window.

    Appendix B says KeepKV uses PyramidInfer's open-source defaults and words the split as
    "recent window : heavy hitter between 5:1 and 4:1"; the authors' code it cites (``run_helm.py``:
    PyramidInfer recent ratio 0.2, cosine decay ratio 0.8) does the reverse. ``split`` picks one:

    - ``authors_code`` (default): the recent window is 0.2 of the first layer's budget, the same
      count in every layer (so heavy hitters get ~80% of the budget); only the heavy share decays,
      to 0.8 of itself at the last layer, so the layer budgets go from 1 to ``0.2 + 0.8 · 0.8 = 0.84``
      (our cosine runs over ``l/(L−1)``, the code's over ``l/L``: the last layer gets slightly less).
    - ``paper_text``: the sentence read literally: recent 80% : heavy 20% of each layer's budget,
      layer budgets shrinking to 0.2 of the first layer's.

    Parameters:
        split: ``authors_code`` or ``paper_text`` (above); sets the defaults of the next two.
        recent_ratio: recent share (``authors_code``: of the first layer's budget, 0.2;
            ``paper_text``: of each layer's budget, 0.8). None = the split's.
        sinks: first tokens always kept (4).
        min_ratio: last-layer / first-layer budget of the cosine schedule (0.84 / 0.2 by split).
            None = the split's.
        online: keep the budgets during decoding too.
    """

    name: ClassVar[str] = "h2o_cosine"
    description: ClassVar[str] = (
        "H2O scores, cosine layer budgets, 4 sinks; split=authors_code (recent 0.2, layers to 0.84) or paper_text"
    )
    paper: ClassVar[str] = PAPER + " (App. B.3); Zhang et al. 2023, H2O; Yang et al. 2024, PyramidInfer"
    SPLITS: ClassVar[dict[str, tuple[float, float]]] = {"authors_code": (0.2, 0.84), "paper_text": (0.8, 0.2)}
    """split → (recent_ratio, min_ratio)."""
    recent_ratio: float | None = None
    sinks: int = 4
    min_ratio: float | None = None
    online: bool = True
    split: str = "authors_code"

    def validate(self) -> None:
        if self.split not in self.SPLITS:
            raise SpecError(f"h2o_cosine: split must be one of {', '.join(self.SPLITS)}; got {self.split!r}")
        if not 0.0 <= self.recent_share <= 1.0:
            raise SpecError(f"h2o_cosine: recent_ratio must be in [0, 1]; got {self.recent_share}")
        if self.sinks < 0:
            raise SpecError(f"h2o_cosine: sinks must be ≥ 0; got {self.sinks}")
        if not 0.0 < self.layer_ratio <= 1.0:
            raise SpecError(f"h2o_cosine: min_ratio must be in (0, 1]; got {self.layer_ratio}")

    @property
    def recent_share(self) -> float:
        """``recent_ratio``, or the split's."""
        return self.SPLITS[self.split][0] if self.recent_ratio is None else self.recent_ratio

    @property
    def layer_ratio(self) -> float:
        """``min_ratio``, or the split's."""
        return self.SPLITS[self.split][1] if self.min_ratio is None else self.min_ratio

    def recent_counts(self, budget: Tensor) -> Tensor:
        """Recent tokens kept out of a budget: ``⌊recent_share · budget⌋``."""
        return torch.floor(budget.double() * self.recent_share).long()

    def recent_windows(self, ctx: CompressionContext) -> list[Tensor]:
        """Recent tokens kept per layer, ``(B,)`` each: ``paper_text`` a share of the layer's own
        budget; ``authors_code`` a share of the largest layer budget, the same in every layer
        (never more than the layer's budget less its sinks)."""
        budgets = self.layer_budgets(ctx)
        if self.split == "paper_text":
            return [self.recent_counts(b) for b in budgets]
        folded = [i for i, _ in ctx.cache.folded_layers]
        top = torch.stack([budgets[i] for i in folded]).amax(0) if folded else ctx.row_budgets
        window = self.recent_counts(top)
        return [torch.minimum(window, (b - self.sinks).clamp_min(0)) for b in budgets]

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        valid = layer.valid_mask()
        recent = self.recent_windows(ctx)[layer_idx]
        return last_valid(valid, recent) | first_valid(valid, self.sinks)

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        memo = ctx.memo.get("h2o_cosine_budgets")
        if memo is not None:
            return [b.clone() for b in memo]
        folded = [i for i, _ in ctx.cache.folded_layers]
        budgets = [ctx.row_budgets.clone() for _ in range(ctx.num_layers)]
        rows = zip(ctx.row_budgets.tolist(), ctx.context_lengths.tolist(), strict=True)
        per_row = [  # one schedule per batch row, (L_folded,) each
            cosine_layer_budgets(avg, len(folded), self.layer_ratio, context_tokens=n, min_budget=self.sinks + 1)
            for avg, n in rows
        ]
        table = torch.tensor(per_row, dtype=torch.long).T  # (L_folded, B)
        for j, layer_idx in enumerate(folded):
            budgets[layer_idx] = table[j].clone()
        ctx.memo["h2o_cosine_budgets"] = budgets
        return [b.clone() for b in budgets]

    def online_policy(self, ctx: CompressionContext) -> LayerPolicies | None:
        if not self.online:
            return None
        budgets = self.layer_budgets(ctx)
        windows = self.recent_windows(ctx)
        policies = {}
        for layer_idx, _ in ctx.cache.folded_layers:
            limit = int(budgets[layer_idx].max())
            recent = int(windows[layer_idx].max())
            policies[layer_idx] = H2OOnline({layer_idx: limit}, recent=recent, sinks=self.sinks)
        return LayerPolicies(policies)
