"""The ``am_fit`` folder: Attention Matching's β-and-value refit (§3.2) after any selector
(``snapkv+am_fit``, ``kvzip+am_fit``).

Zweiger et al. 2026 (``papers/attention-matching.md``): the selector's kept keys stay and their β
and values are fitted to the whole cache's attention mass and output on reference queries (§3.1,
§3.2), by repeat chunk for long contexts (§3.5, :mod:`.fit_chunks`); with ``preselect`` the keys
are chosen among a larger selection by highest attention (§3.3, App. F.1). The standalone
variants are in :mod:`.method`; see :mod:`kvfold.methods.compaction.attention_matching`.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.compaction.attention_matching.compact import verbatim_prefix
from kvfold.methods.compaction.attention_matching.fit_chunks import (
    fit_chunk_tokens,
    fit_given_by_chunk,
    layer_chunks,
    parse_fit_chunk,
)
from kvfold.methods.compaction.attention_matching.options import RANDOM_QUERIES, check_fit_options, query_cap
from kvfold.methods.compaction.attention_matching.queries import (
    QueryOptions,
    extract_reference_queries,
    parse_sources,
)
from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
from kvfold.methods.core.base import Folder, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.repeat import REPEAT_CHUNK
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quantize import roundtrip_keys

Tensor = torch.Tensor


@register
@dataclass
class AMFit(Folder):
    """Attention Matching's β-and-value refit (§3.2) after any selector: the kept keys stay, their
    β is fitted by box-NNLS to the attention mass of the whole cache and their values by least
    squares to its attention output, on reference queries. ``am_fit`` alone means ``snapkv+am_fit``.

    Parameters:
        queries: reference-query sources; ``auto`` (default) is ``repeat`` after a query-agnostic
            selector (``kvzip``, ``knorm``, ``random``, ``streamingllm``: the fit then sees the
            queries the selector scored with, including the few that read a rare fact) and
            ``context`` (the prefill's own queries) after any other.
        max_queries: reference queries kept per KV head (None: all, the default).
        nnls_iters, beta_min, beta_max: the β fit (Algorithm 3) boxed to ``β − β⁰ ∈ [beta_min,
            beta_max]``; ``beta_min=0`` (default) means a kept entry never receives less mass than
            it had (``beta_min=-inf`` is the paper's plain NNLS, ``-3`` AM-HighestAttnKeys' box);
            ``beta_max=8`` (default) lets a kept entry stand for up to e⁸ ≈ 3,000 entries. App. C.2's
            box for AM-HighestAttnKeys is 3 (e³ ≈ 20): at keep 1/16 it binds for every entry that
            stands for more than the average, and the fit moved the values a question reads. 4 was
            the default from 2026-11-26 to 2026-12-02; within 1/64 of the bytes, where KVzip's global
            ranking leaves rows of a dozen entries each standing for hundreds, 4 binds too, and 8
            kept more at 4K and as much at 2K (docs/methods.md).
        mass_weight: ``relative`` (default): each query's mass residual is divided by its mass,
            so the few queries that attend to one rare entry count as much as diffuse ones;
            ``none`` is the paper's unweighted ``‖Φ_S w − m‖²``.
        value_ridge: ridge of the value fit toward the kept values (None: the solver's tiny ridge).
        fit_values: refit the values (False: β only).
        template, sinks: with ``template=true``, kept entries among the chat template before the
            context text and the first ``sinks`` tokens stay verbatim (not refitted; the fit
            matches the rest of the cache), as the AM variants keep them outside their span. Off
            by default: refitting them kept more on RULER at 2K (README, "Attention Matching
            after KVzip").
        selfstudy_tokens, context_window: as for the AM variants.
        solver: ``gram`` or ``exact``.
        fit_chunk: ``auto`` (default), ``none`` or a number of tokens: the kept entries of each
            repeat chunk are fitted to that chunk's entries on the queries recorded while it was
            repeated, so the fit grows linearly with the context (§3.5 chunked compaction on the
            repeat pass's chunks); ``auto`` does so from 4,096 context tokens on with repeat
            queries and fits shorter contexts in one piece, exactly as ``none`` (see
            :mod:`kvfold.methods.compaction.attention_matching.fit_chunks`).
        preselect: 1 (default): the selector's entries are the kept keys. ``f > 1``: the selector
            keeps ``f`` times the budget and Attention Matching chooses each head's keys among
            them by highest attention over the reference queries (§3.3, App. F.1: the RMS of the
            attention weights), the head's count being the selector's allocation at the budget
            (KVzip's global ranking; other selectors' shape scaled), then fits β and the values;
            the selector's protected entries (sinks) stay. Fits in one piece (``fit_chunk`` must
            resolve to none) and follows no wrapper.
        top_verbatim: fraction of each head's kept entries, those the selector scored highest
            (KVzip: the entries some repeat query attends to most, where a rare fact sits), kept as
            they are: not refitted, the fit matching the rest of the cache with them in place, as
            it does around the sinks (0, the default: every kept entry is fitted). Not in the
            paper: a guard against a fit that answers the reference queries by moving the one
            entry a question needs; with ``preselect`` it must be 0.
        quant_order: when the cache is stored quantized (``METHOD@int4``): ``before`` (default)
            fits β and the values to the kept keys as quantized storage gives them back, so the
            fit absorbs the keys' quantization error, and the fitted values are quantized after;
            ``after`` fits to the keys as they are and quantizes everything after the fit. Not in
            the paper (Attention Matching does not quantize).
        value_feedback: when the cache is stored in integer codes, round the fitted values to their
            grid entry by entry, moving each one's error onto the entries not rounded yet through the
            fit's Gram matrix (GPTQ's update, :mod:`.value_rounding`), so the output on the reference
            queries absorbs the values' codes as it absorbs the keys' (``quant_order=before``).
            Off by default until it is measured at 4K (docs/memory.md). Not in the paper.
        verbatim_rows: a layer whose rows keep on average at most this many entries (KVzip's global
            ranking leaves some layers a few entries a head) is not fitted: its kept entries keep the
            selector's values and β, as ``kvzip`` alone keeps them; the other layers are fitted as
            usual (0, the default: every layer is fitted). A layer with no entry left to fit (this
            option, ``top_verbatim=1``, or only sinks kept) is not solved and is listed in the
            report's ``am_fit.verbatim_layers``. Not in the paper. Built for rows of a dozen
            entries each standing for hundreds, where ``beta_max=4`` bound β and the fit moved the
            values a question reads: within 1/64, 32 kept more at 4K and less at 2K, and
            ``beta_max=8`` (now the default) more than either (docs/memory.md).
        shared_queries: under a chunked fit (``fit_chunk``), this many of the repeat queries,
            evenly spaced over the whole context, are read by every chunk's fit beside the chunk's
            own (0, the default: each chunk's own only), so an entry is also fitted on queries that
            read it from other chunks, as a question reads a fact from afar. Each chunk's target
            stays its own entries' mass and output (§2). Costs ``Σ_i (n_i + s)·t_i²``: linear in
            the context for a fixed ``s``. Not in the paper (§3.5 fits each chunk on its own pass).
        chunk_weights: under a chunked fit, ``share`` (default) weights each query's residuals
            in a chunk's fit by the chunk's share of the query's attention, so the chunks' fits add
            up to the fit on every query less the products between chunks
            (:func:`.fit_chunks.fit_given_by_chunk`); ``own`` counts them relative to the chunk's
            own mass and output, as if the chunk were the whole cache (§3.5's chunks, which the
            default beat at 8K: docs/methods.md). Not in the paper.
    """

    name: ClassVar[str] = "am_fit"
    description: ClassVar[str] = "refit biases (NNLS on attention mass) and values (least squares) of kept entries"
    paper: ClassVar[str] = "Zweiger et al. 2026, Fast KV Compaction via Attention Matching"
    supports_chunked_prefill: ClassVar[bool] = True
    fits_by_attention_matching: ClassVar[bool] = True
    queries: str = "auto"
    max_queries: int | None = None
    nnls_iters: int = 2
    beta_min: float = 0.0
    beta_max: float = 8.0
    mass_weight: str = "relative"
    value_ridge: float | None = None
    fit_values: bool = True
    template: bool = False
    sinks: int = 0
    selfstudy_tokens: int = 64
    context_window: int = 8192
    solver: str = "gram"
    fit_chunk: str = "auto"
    preselect: float = 1.0
    top_verbatim: float = 0.0
    quant_order: str = "before"
    value_feedback: bool = False
    verbatim_rows: int = 0
    shared_queries: int = 0
    chunk_weights: str = "share"

    def __post_init__(self) -> None:
        self._selector_agnostic = False
        self._selector = None

    @classmethod
    def default_selector(cls) -> str | None:
        return "snapkv"

    def bind_selector(self, selector) -> None:
        self._selector_agnostic = bool(getattr(selector, "query_agnostic", False))
        self._selector = selector

    def check_wrappers(self, wrappers) -> None:
        if self.preselect != 1.0 and wrappers:
            raise SpecError("am_fit[preselect] follows a plain selector: a wrapper's budgets cannot be cut back")

    @property
    def sources(self) -> tuple[str, ...]:
        """The reference-query sources, ``auto`` resolved for the selector this folder follows."""
        if self.queries.strip().lower() == "auto":
            return ("repeat",) if self._selector_agnostic else ("context",)
        return parse_sources(self.queries, self.name)

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.context_window if "context" in self.sources else 0

    @property
    def uses_repeat_pass(self) -> bool:  # type: ignore[override]
        return "repeat" in self.sources

    def repeat_records(self, ctx: CompressionContext | None = None) -> frozenset[str]:
        return frozenset({"queries"}) if self.uses_repeat_pass else frozenset()

    def validate(self) -> None:
        if self.queries.strip().lower() != "auto":
            parse_sources(self.queries, self.name)
        check_fit_options(self.name, self.mass_weight, self.value_ridge)
        bad_cap = self.max_queries is not None and self.max_queries < 1
        bad_counts = self.nnls_iters < 0 or self.sinks < 0 or self.verbatim_rows < 0 or self.shared_queries < 0
        if bad_cap or bad_counts or self.beta_min > self.beta_max:
            raise SpecError(
                "am_fit: max_queries must be ≥ 1 (or none), nnls_iters, sinks, verbatim_rows and shared_queries ≥ 0 "
                "and beta_min ≤ beta_max"
            )
        if self.chunk_weights not in ("own", "share"):
            raise SpecError(f"am_fit: chunk_weights must be own or share; got {self.chunk_weights!r}")
        if self.solver not in ("gram", "exact"):
            raise SpecError(f"am_fit: solver must be gram or exact; got {self.solver!r}")
        parse_fit_chunk(self.fit_chunk, self.name)
        if not self.preselect >= 1.0:
            raise SpecError(f"am_fit: preselect must be ≥ 1 (times the budget); got {self.preselect}")
        if not 0.0 <= self.top_verbatim <= 1.0:
            raise SpecError(f"am_fit: top_verbatim must be a fraction in [0, 1]; got {self.top_verbatim}")
        if self.quant_order not in ("before", "after"):
            raise SpecError(f"am_fit: quant_order must be before or after; got {self.quant_order!r}")
        if (self.top_verbatim or self.verbatim_rows) and self.preselect != 1.0:
            raise SpecError(
                "am_fit: top_verbatim and verbatim_rows apply to the selector's own entries; use them without preselect"
            )

    def fit_config(self, ctx: CompressionContext | None = None, lengths: Tensor | None = None) -> FitConfig:
        """The fit's settings; with ``value_feedback`` and a layer stored in integer codes (``ctx.quant``,
        as :meth:`~kvfold.runtime.quant_config.QuantConfig.layer_format` gives it for rows of ``lengths``
        entries), the values are rounded to that storage's grid by the fit."""
        config = FitConfig(
            keys="highest",
            nnls_iters=self.nnls_iters,
            beta_min=self.beta_min,
            beta_max=self.beta_max,
            fit_values=self.fit_values,
            mass_weight=self.mass_weight,  # type: ignore[arg-type]
            value_ridge=self.value_ridge,
            solver=self.solver,  # type: ignore[arg-type]
        )
        quant = None if ctx is None or ctx.quant is None or lengths is None else ctx.quant.layer_format(lengths)
        if self.value_feedback and quant is not None and not quant.is_float:
            config = dataclasses.replace(config, value_storage=quant)
        return config

    def prepare(self, ctx: CompressionContext) -> None:
        tokens = fit_chunk_tokens(self.fit_chunk, self.name, ctx, self.sources)
        if self.preselect != 1.0:
            if tokens:
                raise SpecError(
                    f"am_fit[preselect] fits in one piece; this context's fits are chunked ({tokens} tokens): "
                    "add fit_chunk=none"
                )
            ctx.selection_scale = self.preselect  # before the selector prepares: it keeps f × the budget
        options = QueryOptions(
            sources=self.sources,
            max_queries=query_cap(self.max_queries),
            repeat_span=tokens or REPEAT_CHUNK,
            context_window=self.context_window,
            selfstudy_tokens=self.selfstudy_tokens,
            random_queries=self.max_queries or RANDOM_QUERIES,
        )
        start = time.perf_counter()
        ctx.memo["am_fit_queries"] = extract_reference_queries(ctx, options)
        ctx.memo["am_fit_chunk"] = tokens
        report = ctx.report.setdefault("am_fit", {})
        report["query_seconds"] = time.perf_counter() - start
        report["queries"] = "+".join(self.sources)
        report["fit_chunk"] = tokens

    def reselect(self, layer_idx, layer, keep, lengths, scores, protected, valid, ctx) -> tuple[Tensor, Tensor]:
        if self.preselect != 1.0 and protected is not None:  # the pre-selection's sinks stay (see fold)
            ctx.memo[("am_fit_protected", layer_idx)] = protected
        return keep, lengths

    def fold(
        self, layer_idx: int, layer: FoldedLayer, keep: Tensor, lengths: Tensor, scores: Tensor, ctx: CompressionContext
    ) -> None:
        if self.preselect != 1.0:
            self._fold_preselected(layer_idx, layer, keep, lengths, ctx)
            return
        keys, values, log_mass, _ = layer.padded()
        slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
        # kept entries of the template and the sinks stay verbatim: the fit matches the rest
        in_prefix = self._verbatim_entries(layer_idx, log_mass, ctx)
        fixed = slot & in_prefix.gather(2, keep)  # (B, H, K): kept, verbatim
        if self.top_verbatim:
            fixed |= top_scored(scores.gather(2, keep), slot & ~fixed, self.top_verbatim)
        if self.verbatim_rows:  # a layer of few entries a row (per sequence) stays as selected
            fixed |= slot & (lengths.float().mean(-1) <= self.verbatim_rows)[:, None, None]
        result = None
        if bool((slot & ~fixed).any()):
            result = self._fit_kept(layer_idx, layer, (keys, values, log_mass), keep, lengths, slot, fixed, ctx)
        else:  # nothing left to fit: every kept entry as the selector left it
            ctx.report.setdefault("am_fit", {}).setdefault("verbatim_layers", []).append(layer_idx)
        # every kept entry where it was (keep ascends): verbatim ones as they are, the others as the
        # fit gives them back (the m-th fitted = the m-th kept entry not verbatim)
        c_k = keys.gather(2, keep[..., None].expand(-1, -1, -1, keys.shape[-1]))
        c_v = values.gather(2, keep[..., None].expand(-1, -1, -1, values.shape[-1]))
        beta = log_mass.float().gather(2, keep)
        if result is not None:
            _report_errors(ctx, result)
        if result is not None and result.index.shape[-1]:  # (no column: no kept entry had mass to fit)
            fitted_slot = ((slot & ~fixed).long().cumsum(-1) - 1).clamp(0, result.index.shape[-1] - 1)
            v_fit = result.values.to(values.dtype).gather(2, fitted_slot[..., None].expand_as(c_v))
            c_v = torch.where(fixed[..., None], c_v, v_fit)
            beta = torch.where(fixed, beta, result.log_mass.float().gather(2, fitted_slot))
        layer.replace(c_k, c_v, beta.masked_fill(~slot, float("-inf")), lengths=lengths)

    def _fit_kept(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        padded: tuple[Tensor, Tensor, Tensor],
        keep: Tensor,
        lengths: Tensor,
        slot: Tensor,
        fixed: Tensor,
        ctx: CompressionContext,
    ):
        """The fit of a layer's kept entries not ``fixed`` to the attention of the cache around the
        fixed ones (§3.2; by repeat chunk under ``fit_chunk``, §3.5): a ``FitResult`` whose m-th
        entry is the m-th kept entry not fixed. ``padded``: the layer's ``(keys, values, log_mass)``
        as :meth:`FoldedLayer.padded` gave them to :meth:`fold` (a copy for stored rows: built once)."""
        keys, values, log_mass = padded
        queries = ctx.memo["am_fit_queries"][layer_idx].on(keys.device)  # one layer's on the device at a time
        # (padded slots of ``keep`` repeat an index: only the used ones may write)
        n = log_mass.shape[-1]
        at = torch.where(fixed, keep, torch.full_like(keep, n))
        kept_fixed = torch.zeros(*keep.shape[:2], n + 1, dtype=torch.bool, device=keep.device)
        kept_fixed = kept_fixed.scatter_(2, at, True)[..., :n]
        span_mass = log_mass.masked_fill(kept_fixed, float("-inf"))
        given = torch.where(slot & ~fixed, keep, torch.full_like(keep, -1))
        scaling = layer_scaling(ctx, layer_idx, layer)
        tokens = ctx.memo.get("am_fit_chunk", 0)
        chunk_of = layer_chunks(ctx, layer, tokens) if tokens else None
        compact = self._stored_keys(keys, keep, lengths, ctx)
        config = self.fit_config(ctx, lengths)
        if chunk_of is not None:  # §3.5: each repeat chunk's kept entries on that chunk's queries
            queries = queries.share_across_chunks(self.shared_queries)
            by_share = self.chunk_weights == "share"
            args = (keys, values, span_mass, queries, chunk_of, given, scaling, config, compact)
            matched = by_share and not bool(kept_fixed.any())  # the repeat pass's mass over the context is the total
            return fit_given_by_chunk(*args, by_share=by_share, context_is_matched=matched)
        return fit_problems(
            keys,
            values,
            span_mass,
            queries.queries,
            queries.valid,
            lengths,
            scaling,
            config,
            given=given,
            compact_keys=compact,
        )

    def _stored_keys(self, keys: Tensor, keep: Tensor, lengths: Tensor, ctx: CompressionContext) -> Tensor | None:
        """``(B, H, N, D)`` the cache's keys with each kept entry's key as quantized storage will
        give it back (``ctx.quant``, ``quant_order=before``), or None (no quantization, or
        ``quant_order=after``: fit to the keys as they are, quantize after)."""
        own = None if ctx.quant is None else ctx.quant.layer_format(lengths)
        if own is None or self.quant_order == "after":
            return None
        b, h, k = keep.shape
        d = keys.shape[-1]
        kept = keys.gather(2, keep[..., None].expand(-1, -1, -1, d))
        stored = roundtrip_keys(kept.reshape(b * h, k, d), lengths.reshape(-1), own).view(b, h, k, d)
        # padded slots of ``keep`` repeat the last kept index: give them that entry's stored key
        last = (lengths - 1).clamp_min(0)[..., None]
        slot = torch.minimum(torch.arange(k, device=keep.device)[None, None, :], last)
        stored = stored.gather(2, slot[..., None].expand(-1, -1, -1, d))
        at = torch.where(lengths[..., None] > 0, keep, torch.full_like(keep, keys.shape[2]))
        out = torch.cat([keys, keys[:, :, :1]], 2).clone()
        out.scatter_(2, at[..., None].expand(-1, -1, -1, d), stored.to(keys.dtype))
        return out[:, :, : keys.shape[2]]

    def _verbatim_entries(self, layer_idx: int, log_mass: Tensor, ctx: CompressionContext) -> Tensor:
        """``(B, H, N)`` the valid entries kept as they are: the template and sinks (``template``,
        ``sinks``) and a conversation's pinned document (``ctx.pinned``)."""
        valid = torch.isfinite(log_mass)
        rank = valid.long().cumsum(-1) - 1
        prefix = verbatim_prefix(ctx, self.template, self.sinks).to(log_mass.device)[:, None]
        if ctx.pinned is not None:  # a conversation's compressed document stays as it is too
            prefix = torch.maximum(prefix, ctx.pinned[layer_idx].to(log_mass.device))
        return valid & (rank < prefix[..., None])

    def _fold_preselected(
        self, layer_idx: int, layer: FoldedLayer, keep: Tensor, lengths: Tensor, ctx: CompressionContext
    ) -> None:
        """``preselect > 1``: the selector kept ``keep`` (``preselect`` times the budget); each head
        keeps its target count (:meth:`Selector.target_counts`): the selector's protected entries,
        the verbatim prefix and pinned entries as they are, the rest chosen among the pre-selected
        by highest attention over the reference queries (§3.3, App. F.1) with β and values fitted
        to the whole cache's attention (§3.2), as AM-HighestAttnKeys does over every entry."""
        keys, values, log_mass, _ = layer.padded()
        b, h, n = log_mass.shape
        slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
        at = torch.where(slot, keep, torch.full_like(keep, n))
        candidates = torch.zeros(b, h, n + 1, dtype=torch.bool, device=keep.device).scatter_(2, at, True)[..., :n]
        forced = candidates & self._verbatim_entries(layer_idx, log_mass, ctx)
        protected = ctx.memo.pop(("am_fit_protected", layer_idx), None)
        if protected is not None:
            forced |= candidates & protected.to(keep.device)
        target = self._selector.target_counts(layer_idx, layer, lengths, ctx).to(keep.device)
        fit_counts = (target - forced.sum(-1)).clamp(min=0)
        queries = ctx.memo["am_fit_queries"][layer_idx].on(keys.device)
        span_mass = log_mass.masked_fill(forced, float("-inf"))
        result = fit_problems(
            keys,
            values,
            span_mass,
            queries.queries,
            queries.valid,
            fit_counts,
            layer_scaling(ctx, layer_idx, layer),
            self.fit_config(ctx, target),
            candidates=candidates & ~forced,
        )
        # every kept entry in position order: forced ones as they were, chosen ones as fitted
        t = result.index.shape[-1]
        chosen = torch.arange(t, device=keep.device)[None, None, :] < result.lengths[..., None]
        at = torch.where(chosen, result.index, torch.full_like(result.index, n))
        fitted_values = values.new_zeros(b, h, n + 1, values.shape[-1])
        fitted_values.scatter_(2, at[..., None].expand(-1, -1, -1, values.shape[-1]), result.values.to(values.dtype))
        fitted_beta = log_mass.float().new_full((b, h, n + 1), float("-inf"))
        fitted_beta.scatter_(2, at, result.log_mass.float())
        is_chosen = torch.zeros(b, h, n + 1, dtype=torch.bool, device=keep.device).scatter_(2, at, True)[..., :n]
        kept = forced | is_chosen
        new_lengths = kept.sum(-1)
        width = max(int(new_lengths.max()), 1)
        order = torch.where(kept, torch.arange(n, device=keep.device), n).sort(-1).values[..., :width]
        in_row = torch.arange(width, device=keep.device)[None, None, :] < new_lengths[..., None]
        order = torch.where(in_row, order, order[..., :1])
        take_k = order[..., None].expand(-1, -1, -1, keys.shape[-1])
        take_v = order[..., None].expand(-1, -1, -1, values.shape[-1])
        from_forced = forced.gather(2, order)[..., None]
        c_k = keys.gather(2, take_k)
        c_v = torch.where(from_forced, values.gather(2, take_v), fitted_values.gather(2, take_v))
        beta = torch.where(from_forced[..., 0], log_mass.float().gather(2, order), fitted_beta.gather(2, order))
        layer.replace(c_k, c_v, beta.masked_fill(~in_row, float("-inf")), lengths=new_lengths)
        _report_errors(ctx, result)


def top_scored(scores: Tensor, among: Tensor, fraction: float) -> Tensor:
    """``(B, H, K)`` the ``ceil(fraction · count)`` entries of each head with the highest ``scores``
    among those marked in ``among`` (``count`` = how many are marked; ties to the earlier entry)."""
    count = torch.ceil(among.sum(-1).double() * fraction).long()
    ranked = scores.masked_fill(~among, float("-inf"))
    order = ranked.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    return among & (rank < count[..., None])


def _report_errors(ctx: CompressionContext, result) -> None:
    """Record a layer's mean mass and output errors of the fit in ``ctx.report["am_fit"]``."""
    report = ctx.report.setdefault("am_fit", {})
    report.setdefault("mass_error", []).append(float(result.mass_error.mean()))
    report.setdefault("output_error", []).append(float(result.output_error.mean()))
