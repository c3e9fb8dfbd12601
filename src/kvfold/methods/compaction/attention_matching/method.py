"""The registered Attention Matching variants (§4): ``am_highest``, ``am_highest_fast``, ``am_omp``,
``am_omp_fast``, and their online compaction (App. F.3). The ``am_fit`` folder is in
:mod:`.fit_folder`. See :mod:`kvfold.methods.compaction.attention_matching`.
"""

from __future__ import annotations

import time
from dataclasses import InitVar, dataclass, field
from typing import ClassVar

import torch

from kvfold.methods.compaction.attention_matching.compact import (
    compact_layers,
    parse_span,
    trim_captured,
    verbatim_prefix,
)
from kvfold.methods.compaction.attention_matching.fit_chunks import fit_chunk_tokens, layer_chunks, parse_fit_chunk
from kvfold.methods.compaction.attention_matching.options import RANDOM_QUERIES, check_fit_options, query_cap
from kvfold.methods.compaction.attention_matching.queries import (
    QueryOptions,
    ReferenceQueries,
    captured_reference_queries,
    extract_reference_queries,
    parse_sources,
    pool_gqa_queries,
)
from kvfold.methods.compaction.attention_matching.solve import FitConfig
from kvfold.methods.core.base import Standalone, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.head_schedule import HeadSchedule
from kvfold.methods.core.model import layer_scaling
from kvfold.methods.core.repeat import REPEAT_CHUNK
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

ONLINE_QUERIES = 4096
"""Most recent queries per KV head online compaction keeps when ``max_queries`` is None."""


# ---------------------------------------------------------------------------- online (App. F.3)


@dataclass(eq=False)
class AttentionMatchingOnline:
    """Online compaction (App. F.3): whenever a layer's physical cache exceeds ``limit`` entries,
    everything but the ``recent`` newest entries is compacted to ``factor`` of its size.

    Reference queries are the queries the layer actually received most recently (the last
    prefill queries kept in the cache, then every decoded token's queries, up to ``max_queries``
    per KV head): a model pass cannot run inside the attention, so the paper's repeat-prefill of
    the trajectory is replaced by these context-style queries.

    Args:
        limits: the physical cap per layer.
        scalings: logit scale per layer.
        config: the fit (the method's key selection and β bounds).
        recent: newest entries never compacted (20 in the paper).
        factor: size of the compacted part relative to what it replaces (0.5 in the paper).
        max_queries: reference queries kept per KV head.
        initial: initial reference queries per layer (the prefill's last queries), or empty.
        verbatim: ``(B,)`` leading entries never compacted (template, sinks).
    """

    needs_attention: ClassVar[bool] = False

    limits: dict[int, int]
    scalings: dict[int, float]
    config: FitConfig
    recent: int = 20
    factor: float = 0.5
    max_queries: int = 1024
    initial: InitVar[dict[int, ReferenceQueries] | None] = None
    verbatim: Tensor | None = None
    buffers: dict[int, ReferenceQueries] = field(init=False)
    compactions: dict[int, int] = field(init=False)

    def __post_init__(self, initial: dict[int, ReferenceQueries] | None) -> None:
        self.buffers = dict(initial or {})
        self.compactions = {i: 0 for i in self.limits}

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        if layer_idx not in self.limits:
            return
        dtype = torch.float64 if layer.dtype == torch.float64 else torch.float32
        pooled = pool_gqa_queries(query.detach().to(dtype), layer.num_heads)
        new = ReferenceQueries(pooled, torch.ones(pooled.shape[:3], dtype=torch.bool, device=pooled.device))
        old = self.buffers.get(layer_idx)
        buf = new if old is None else old.cat(new)
        if buf.queries.shape[2] > self.max_queries:  # keep the most recent queries
            buf = ReferenceQueries(buf.queries[:, :, -self.max_queries :], buf.valid[:, :, -self.max_queries :])
        self.buffers[layer_idx] = buf
        if layer.physical_length <= self.limits[layer_idx]:
            return
        n_valid = layer.row_lengths()
        fixed = self.recent if self.verbatim is None else self.recent + self.verbatim.to(n_valid.device)[:, None]
        span_len = (n_valid - fixed).clamp_min(0)
        keep = torch.ceil(span_len.double() * self.factor).long().clamp_min(1).minimum(span_len)
        totals = keep + (n_valid - span_len)
        compact_layers(
            [(layer_idx, layer)],
            {layer_idx: buf},
            {layer_idx: totals},
            self.scalings,
            self.config,
            span=(None, -self.recent if self.recent else None),
            verbatim=self.verbatim,
        )
        self.compactions[layer_idx] += 1


# ---------------------------------------------------------------------------- registered methods


@dataclass
class _AttentionMatching(Standalone):
    """Shared options of the four AM variants (see the module docstring).

    Parameters:
        queries: reference-query sources joined by ``+``: ``context``, ``repeat``, ``selfstudy``,
            ``random`` (§3.1).
        max_queries: reference queries kept per KV head and layer, a seeded random subset (None:
            all of them, the default; the authors' code keeps up to 10k for repeat-prefill, 50k with
            self-study, i.e. all of them at 2K–8K tokens).
        nnls_iters: projected-gradient steps of the β fit (Algorithm 3).
        beta_min, beta_max: bounds on β − β⁰ (App. C.2 "Stabilizing β").
        on_policy: compact layers in order, re-extracting repeat / self-study queries with the
            earlier layers already compacted (§3.1 "On-policy queries"; one pass per layer).
        span: the entries compacted, ``start:end`` over each row's valid entries (``:`` = all,
            ``4:-32`` keeps the first 4 and the last 32 as they are).
        template, sinks: the chat template before the context text (``template=true``) and at
            least the first ``sinks`` tokens stay verbatim, outside the span (still counted in the
            budget), as in the authors' code; ``template=false,sinks=0`` compacts them too.
        chunks: contiguous chunks compacted independently (§3.5), each on every reference query.
        fit_chunk: ``auto`` (default), ``none`` or a number of tokens: the span's entries of each
            repeat chunk compacted on the queries recorded while that chunk was repeated, so the
            fit grows linearly with the context; ``auto`` does so from 4,096 context tokens on
            with repeat queries and ``chunks=1`` (see
            :mod:`kvfold.methods.compaction.attention_matching.fit_chunks`).
        chunking: ``kv`` (slice the prefilled cache, the paper's default) or ``text`` (prefill
            and compact each chunk alone, then shift its keys' RoPE phase to the global offset).
        schedule: a head-budget schedule JSON file (§3.4, Appendix E; see
            :mod:`kvfold.methods.compaction.attention_matching.schedule`); uniform budgets when unset.
        online: keep compacting during decoding (App. F.3).
        recent, factor: online compaction keeps the ``recent`` newest entries and compacts the
            rest to ``factor`` of its size whenever the cache exceeds the budget.
        selfstudy_tokens: tokens sampled per self-study answer.
        context_window: context-prefill queries: the last this-many context tokens.
        fit_values: refit values by least squares (False keeps the selected keys' values).
        mass_weight: ``none`` (the paper's ``‖Φ_S w − m‖²``) or ``relative`` (each query's mass
            residual divided by its mass; see :class:`~.solve.FitConfig`).
        value_ridge: ridge of the value fit toward the kept values (None: the solver's tiny ridge).
        solver: ``gram`` (normal equations, fast) or ``exact`` (the reference solvers).
    """

    paper: ClassVar[str] = "Zweiger et al. 2026, Fast KV Compaction via Attention Matching"
    supports_chunked_prefill: ClassVar[bool] = True
    fits_by_attention_matching: ClassVar[bool] = True
    key_selection: ClassVar[str] = "highest"
    queries: str = "repeat+selfstudy"
    max_queries: int | None = None
    nnls_iters: int = 2
    beta_min: float = -3.0
    beta_max: float = 3.0
    on_policy: bool = False
    span: str = ":"
    template: bool = True
    sinks: int = 4
    chunks: int = 1
    fit_chunk: str = "auto"
    chunking: str = "kv"
    schedule: str | None = None
    online: bool = False
    recent: int = 20
    factor: float = 0.5
    selfstudy_tokens: int = 64
    context_window: int = 8192
    fit_values: bool = True
    mass_weight: str = "none"
    value_ridge: float | None = None
    solver: str = "gram"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.context_window if "context" in parse_sources(self.queries, self.name) else 0

    @property
    def uses_repeat_pass(self) -> bool:  # type: ignore[override]
        return "repeat" in parse_sources(self.queries, self.name)

    def repeat_records(self, ctx: CompressionContext | None = None) -> frozenset[str]:
        return frozenset({"queries"}) if self.uses_repeat_pass else frozenset()

    def validate(self) -> None:
        parse_sources(self.queries, self.name)
        parse_span(self.span, self.name)
        check_fit_options(self.name, self.mass_weight, self.value_ridge)
        bad_cap = self.max_queries is not None and self.max_queries < 1
        if self.sinks < 0:
            raise SpecError(f"{self.name}: sinks must be ≥ 0; got {self.sinks}")
        if bad_cap or self.chunks < 1 or self.context_window < 1 or self.selfstudy_tokens < 0:
            raise SpecError(f"{self.name}: max_queries, chunks and context_window must be ≥ 1")
        if self.nnls_iters < 0 or self.recent < 0 or not 0.0 < self.factor < 1.0:
            raise SpecError(f"{self.name}: nnls_iters and recent must be ≥ 0 and factor in (0, 1)")
        if self.beta_min > self.beta_max:
            raise SpecError(f"{self.name}: beta_min must be ≤ beta_max")
        if self.chunking not in ("kv", "text") or self.solver not in ("gram", "exact"):
            raise SpecError(f"{self.name}: chunking must be kv or text and solver gram or exact")
        if parse_fit_chunk(self.fit_chunk, self.name) not in (None, "auto") and (
            self.chunks > 1 or self.chunking == "text"
        ):
            raise SpecError(f"{self.name}: fit_chunk=N chunks by repeat chunk: it cannot go with chunks>1 or text")

    def fit_config(self) -> FitConfig:
        return FitConfig(
            keys=self.key_selection,  # type: ignore[arg-type]
            k=getattr(self, "k", 1),
            tau=getattr(self, "tau", 1),
            nnls_iters=self.nnls_iters,
            beta_min=self.beta_min,
            beta_max=self.beta_max,
            refills=getattr(self, "refills", 0),
            fit_values=self.fit_values,
            mass_weight=self.mass_weight,  # type: ignore[arg-type]
            value_ridge=self.value_ridge,
            solver=self.solver,  # type: ignore[arg-type]
        )

    def query_options(self, sources: tuple[str, ...] | None = None, repeat_span: int = REPEAT_CHUNK) -> QueryOptions:
        return QueryOptions(
            sources=sources or parse_sources(self.queries, self.name),
            max_queries=query_cap(self.max_queries),
            repeat_span=repeat_span,
            context_window=self.context_window,
            selfstudy_tokens=self.selfstudy_tokens,
            random_queries=self.max_queries or RANDOM_QUERIES,
        )

    def totals(self, ctx: CompressionContext) -> dict[int, Tensor]:
        """Entries each row ``(B, H)`` keeps per layer: the budget, or the head schedule's share."""
        layers = ctx.cache.folded_layers
        if self.schedule:
            schedule = HeadSchedule.load(self.schedule, ctx.model)
            n_valid = {i: layer.row_lengths() for i, layer in layers}
            return schedule.counts(ctx.row_budgets, n_valid)
        return {
            i: ctx.row_budgets.to(layer.device)[:, None].expand(layer.batch_size, layer.num_heads).clone()
            for i, layer in layers
        }

    def compress(self, ctx: CompressionContext) -> None:
        start = time.perf_counter()
        layers = ctx.cache.folded_layers
        totals = self.totals(ctx)
        scalings = {i: layer_scaling(ctx, i, layer) for i, layer in layers}
        config = self.fit_config()
        span = parse_span(self.span, self.name)
        verbatim = verbatim_prefix(ctx, self.template, self.sinks)
        report = ctx.report.setdefault("am", {})
        if self.chunking == "text":
            from kvfold.methods.compaction.attention_matching.text_chunks import compact_text_chunks

            stats = compact_text_chunks(self, ctx, totals, scalings, config)
            report.update(stats)
            report["seconds"] = time.perf_counter() - start
            trim_captured(ctx.cache)
            return
        sources = parse_sources(self.queries, self.name)
        tokens = fit_chunk_tokens(self.fit_chunk, self.name, ctx, sources) if self.chunks == 1 else 0
        span_tokens = tokens or REPEAT_CHUNK
        report["fit_chunk"] = tokens
        passes = tuple(s for s in sources if s in ("repeat", "selfstudy"))
        if self.on_policy and passes:
            static = tuple(s for s in sources if s not in passes)
            fixed = extract_reference_queries(ctx, self.query_options(static, span_tokens)) if static else {}
            query_seconds = time.perf_counter() - start
            stats = []
            for i, layer in layers:  # §3.1: layer ℓ's queries with layers < ℓ already compacted
                t0 = time.perf_counter()
                options = self.query_options(passes, span_tokens)
                q = extract_reference_queries(ctx, options, layers=[i], shared=False)[i]
                if i in fixed:
                    generator = torch.Generator().manual_seed(ctx.seed + i)
                    q = q.cat(fixed[i]).subsample(query_cap(self.max_queries), generator)
                query_seconds += time.perf_counter() - t0
                chunk_of = layer_chunks(ctx, layer, tokens) if tokens else None
                part = compact_layers(
                    [(i, layer)], {i: q}, totals, scalings, config, span, self.chunks, verbatim, chunk_of
                )
                stats.append(part)
            report["query_seconds"] = query_seconds
            report["mass_error"] = sum(s.get("mass_error", 0.0) for s in stats) / max(1, len(stats))
            report["output_error"] = sum(s.get("output_error", 0.0) for s in stats) / max(1, len(stats))
        else:
            queries = extract_reference_queries(ctx, self.query_options(None, span_tokens))
            report["query_seconds"] = time.perf_counter() - start
            report["queries_per_head"] = float(torch.stack([q.counts.float().mean() for q in queries.values()]).mean())
            chunk_of = layer_chunks(ctx, layers[0][1], tokens) if tokens and layers else None
            report.update(
                compact_layers(layers, queries, totals, scalings, config, span, self.chunks, verbatim, chunk_of)
            )
        report["seconds"] = time.perf_counter() - start
        trim_captured(ctx.cache)

    def online_policy(self, ctx: CompressionContext) -> AttentionMatchingOnline | None:
        if not self.online:
            return None
        layers = ctx.cache.folded_layers
        limit = int(ctx.row_budgets.max())
        mask = ctx.attention_mask if ctx.attention_mask is not None else torch.ones_like(ctx.input_ids)
        initial = {  # the prefill's last queries, until decoding brings its own
            i: captured_reference_queries(layer, layer.captured_queries[:, :, -mask.shape[1] :], mask)
            for i, layer in layers
            if layer.captured_queries is not None
        }
        return AttentionMatchingOnline(
            {i: limit for i, _ in layers},
            {i: layer_scaling(ctx, i, layer) for i, layer in layers},
            self.fit_config(),
            recent=self.recent,
            factor=self.factor,
            max_queries=self.max_queries or ONLINE_QUERIES,
            initial=initial,
            verbatim=verbatim_prefix(ctx, self.template, self.sinks),
        )


@register
@dataclass
class AMHighest(_AttentionMatching):
    """AM-HighestAttnKeys (§3.3, §4): keys with the highest RMS attention over the reference
    queries, β by box-NNLS in [−3, 3] (2 projected-gradient steps), values by least squares;
    reference queries from self-study and repeat-prefill."""

    name: ClassVar[str] = "am_highest"
    description: ClassVar[str] = (
        "Attention Matching: highest-attention keys, fitted biases and values (repeat + self-study queries)"
    )


@register
@dataclass
class AMHighestFast(_AttentionMatching):
    """AM-HighestAttnKeys-fast (§4): as ``am_highest`` with repeat-prefill queries only."""

    name: ClassVar[str] = "am_highest_fast"
    description: ClassVar[str] = "Attention Matching: highest-attention keys, repeat-prefill queries only"
    queries: str = "repeat"


@register
@dataclass
class AMOmp(_AttentionMatching):
    """AM-OMP (§3.3 Algorithm 1, §4): keys and β chosen jointly by orthogonal matching pursuit on
    the attention mass (NNLS refit after every key; keys with β < −7 dropped, β ≤ 7), values by
    least squares; self-study + repeat-prefill queries.

    Parameters:
        k: keys added per greedy step (1).
        tau: greedy steps between NNLS refits (1).
        refills: times selection resumes after dropping keys with β < −7 (8; the paper has no
            limit — see :func:`kvfold.methods.compaction.attention_matching.solvers.omp_keys`).
    """

    name: ClassVar[str] = "am_omp"
    description: ClassVar[str] = "Attention Matching: OMP keys on the attention mass, fitted biases and values"
    key_selection: ClassVar[str] = "omp"
    nnls_iters: int = 0
    beta_min: float = -7.0
    beta_max: float = 7.0
    k: int = 1
    tau: int = 1
    refills: int = 8

    def validate(self) -> None:
        super().validate()
        if self.k < 1 or self.tau < 1 or self.refills < 0:
            raise SpecError(f"{self.name}: k and tau must be ≥ 1 and refills ≥ 0")


@register
@dataclass
class AMOmpFast(AMOmp):
    """AM-OMP-fast (App. C.1 Algorithm 2): OMP adding k = 4 keys per step, refit every τ = 2 steps."""

    name: ClassVar[str] = "am_omp_fast"
    description: ClassVar[str] = "Attention Matching: OMP with 4 keys per step and a refit every 2 steps"
    k: int = 4
    tau: int = 2
