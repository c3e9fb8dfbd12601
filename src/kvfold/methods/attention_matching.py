"""Attention Matching compaction: ``am_omp``, ``am_omp_fast``, ``am_highest``, ``am_highest_fast``
and the ``am_fit`` folder.

Zweiger et al. 2026, "Fast KV Compaction via Attention Matching" (``papers/attention-matching.md``),
§2–3, Appendices A, C, E, F. A span of every KV head's cache is replaced by ``t`` entries
``(C_k, β, C_v)`` that reproduce, on reference queries, both the span's attention mass (eq. 2)
and its locally normalised attention output (eq. 1). By the mixture identity (App. A.2, eq. 5)
the compacted span then behaves right next to any other entries, including tokens appended
later. Keys are a subset of the span's own keys (§3.3), so their RoPE phases and the cache's
logical length are unchanged: appended tokens get the positions they would have had.

Pieces: reference queries (:mod:`kvfold.methods.am_queries`), the batched fits
(:mod:`kvfold.methods.am_solve`), nonuniform head budgets (:mod:`kvfold.methods.am_schedule`);
here: spans and chunks of a layer, the registered variants (§4 "Compared Variants"), online
compaction (App. F.3) and the β-and-value refit after any selector (``snapkv+am_fit``).

Variants (§4): ``am_omp`` (OMP keys, self-study + repeat-prefill queries), ``am_omp_fast`` (OMP
with k = 4 keys per step, refit every τ = 2 steps, App. C.1), ``am_highest`` (highest-attention
keys, NNLS β boxed to [−3, 3], self-study + repeat-prefill), ``am_highest_fast`` (the same with
repeat-prefill queries only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.cache import NEG_INF, FoldedCache, FoldedLayer
from kvfold.methods.am_queries import (
    QueryOptions,
    ReferenceQueries,
    captured_reference_queries,
    extract_reference_queries,
    parse_sources,
    pool_gqa_queries,
)
from kvfold.methods.am_solve import Compacted, FitConfig, fit_problems
from kvfold.methods.base import CompressionContext, Folder, Standalone, register
from kvfold.methods.spec import SpecError

Tensor = torch.Tensor

__all__ = [
    "AMFit",
    "AMHighest",
    "AMHighestFast",
    "AMOmp",
    "AMOmpFast",
    "AttentionMatchingOnline",
    "compact_layers",
    "parse_span",
]

KEPT_QUERY_WINDOW = 64
"""Prefill queries left in a layer after compaction (the pipeline's default snapshot window)."""


# ---------------------------------------------------------------------------- helpers


def parse_span(text: str, owner: str = "am") -> tuple[int | None, int | None]:
    """``"a:b"`` → ``(a, b)`` (Python slice over each row's valid entries; negatives count from
    the end; empty = open). ``":"`` is the whole cache, ``":-20"`` all but the last 20 entries."""
    parts = text.strip().split(":")
    if len(parts) != 2:
        raise SpecError(f"{owner}: span must be written start:end (e.g. 4:-32, : or :-20); got {text!r}")
    try:
        return tuple(int(p) if p.strip() else None for p in parts)  # type: ignore[return-value]
    except ValueError:
        raise SpecError(f"{owner}: span bounds must be integers; got {text!r}") from None


def layer_scalings(model) -> dict[int, float]:
    """Logit scale of every attention module (``module.scaling``), by layer index."""
    found: dict[int, float] = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            scale = getattr(module, "scaling", None)
            if scale is not None:
                found.setdefault(int(module.layer_idx), float(scale))
    return found


def _scaling(ctx: CompressionContext, layer_idx: int, layer: FoldedLayer) -> float:
    scales = ctx.memo.get("am_scaling")
    if scales is None:
        scales = ctx.memo["am_scaling"] = layer_scalings(ctx.model)
    return scales.get(layer_idx, layer.head_dim**-0.5)


def _bounds(span: tuple[int | None, int | None], n_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Span ``[a, e)`` per row in valid-entry coordinates, clamped to ``[0, n_valid]``."""

    def resolve(value: int | None, default: Tensor) -> Tensor:
        if value is None:
            return default
        out = torch.full_like(n_valid, value) if value >= 0 else n_valid + value
        return out.clamp(min=0).minimum(n_valid)

    start = resolve(span[0], torch.zeros_like(n_valid))
    end = resolve(span[1], n_valid)
    return start, torch.maximum(start, end)


def _split_budget(total: Tensor, sizes: Tensor) -> Tensor:
    """Split ``total`` ``(B, H)`` entries over chunks of ``sizes`` ``(B, H, C)``: one per non-empty
    chunk first (when there are enough), the rest proportional to size by largest remainder."""
    nonempty = sizes > 0
    n_nonempty = nonempty.sum(-1)
    first = (total >= n_nonempty).long()[..., None] * nonempty.long()
    rest = (total - first.sum(-1)).clamp_min(0)
    room = sizes - first
    real = rest[..., None].double() * room.double() / room.sum(-1, keepdim=True).clamp_min(1).double()
    base = real.floor().long()
    left = rest - base.sum(-1)
    order = torch.argsort(real - base, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(sizes.shape[-1], device=sizes.device).expand_as(order)
    )
    bonus = (rank < left[..., None]).long()
    return torch.minimum(first + base + bonus, sizes)


@dataclass
class _LayerPlan:
    """How one layer is cut into problems (B·H·C blocks) and put back together."""

    keys: Tensor  # (B, H, C, T, D)
    values: Tensor
    log_mass: Tensor  # (B, H, C, T), −inf = not in the block
    slots: Tensor  # (B, H, C, T) long, the layer slot of each block entry
    counts: Tensor  # (B, H, C) entries to keep per block
    outside: Tensor  # (B, H, N) bool, valid entries kept as they are
    rank: Tensor  # (B, H, N) rank among valid entries
    start: Tensor  # (B, H) span start (valid-entry coordinates)
    span_len: Tensor  # (B, H)


def _plan_layer(layer: FoldedLayer, total: Tensor, span: tuple[int | None, int | None], chunks: int) -> _LayerPlan:
    """Cut a layer's span into ``chunks`` contiguous blocks per row, with their budgets."""
    keys, values, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    batch, heads, length, dim = keys.shape
    n_valid = valid.sum(-1)
    rank = valid.long().cumsum(-1) - 1
    start, end = _bounds(span, n_valid)
    span_len = end - start
    member = valid & (rank >= start[..., None]) & (rank < end[..., None])
    fixed = n_valid - span_len
    budget = torch.maximum(total.to(keys.device) - fixed, torch.minimum(span_len, torch.ones_like(span_len)))
    budget = torch.minimum(budget, span_len)
    chunks = max(1, min(chunks, int(span_len.max()) if span_len.numel() else 1))
    chunk_id = ((rank - start[..., None]).clamp_min(0) * chunks) // span_len.clamp_min(1)[..., None]
    chunk_id = torch.where(member, chunk_id, torch.full_like(chunk_id, chunks))
    sizes = torch.stack([(chunk_id == c).sum(-1) for c in range(chunks)], dim=-1)  # (B, H, C)
    counts = _split_budget(budget, sizes)
    width = max(1, int(sizes.max()))
    slot = torch.arange(length, device=keys.device)
    order = torch.stack(
        [
            torch.sort(torch.where(chunk_id == c, slot, slot + length), dim=-1).indices[..., :width]
            for c in range(chunks)
        ],
        dim=2,
    )  # (B, H, C, T): the chunk's slots first, in position order
    in_block = torch.arange(width, device=keys.device) < sizes[..., None]
    flat = order.reshape(batch, heads, chunks * width)
    k = keys.gather(2, flat[..., None].expand(-1, -1, -1, dim)).reshape(batch, heads, chunks, width, dim)
    v = values.gather(2, flat[..., None].expand(-1, -1, -1, values.shape[-1]))
    v = v.reshape(batch, heads, chunks, width, values.shape[-1])
    lm = log_mass.gather(2, flat).reshape(batch, heads, chunks, width)
    lm = torch.where(in_block, lm, torch.full_like(lm, NEG_INF))
    return _LayerPlan(k, v, lm, order, counts, valid & ~member, rank, start, span_len)


def _write_layer(layer: FoldedLayer, plan: _LayerPlan, result: Compacted) -> None:
    """``[entries before the span] + [compacted chunks in order] + [entries after]`` per row."""
    keys, values, log_mass, _ = layer.padded()
    batch, heads, length, dim = keys.shape
    lens = result.lengths  # (B, H, C)
    kept = lens.sum(-1)
    before = plan.start
    after = plan.outside.sum(-1) - before
    total = before + kept + after
    width = max(1, int(total.max()))
    dump = width  # a scratch slot for everything that is not written
    out_k = keys.new_zeros(batch, heads, width + 1, dim)
    out_v = values.new_zeros(batch, heads, width + 1, values.shape[-1])
    out_lm = torch.full((batch, heads, width + 1), NEG_INF, dtype=torch.float32, device=keys.device)
    # entries outside the span keep their keys, values and β
    dest = torch.where(plan.rank < before[..., None], plan.rank, plan.rank - plan.span_len[..., None] + kept[..., None])
    dest = torch.where(plan.outside, dest, torch.full_like(dest, dump))
    out_k.scatter_(2, dest[..., None].expand(-1, -1, -1, dim), keys)
    out_v.scatter_(2, dest[..., None].expand(-1, -1, -1, values.shape[-1]), values)
    out_lm.scatter_(2, dest, log_mass.float())
    # compacted entries: C_k = the selected keys (RoPE phases unchanged), fitted β and C_v
    t = result.index.shape[-1]
    offsets = before[..., None] + lens.cumsum(-1) - lens  # (B, H, C)
    j = torch.arange(t, device=keys.device)
    in_use = j < lens[..., None]
    dest_c = torch.where(in_use, offsets[..., None] + j, torch.full_like(in_use, dump, dtype=torch.long))
    src_slot = plan.slots.gather(3, result.index)  # (B, H, C, t) layer slots of the chosen keys
    c_k = keys.gather(2, src_slot.reshape(batch, heads, -1)[..., None].expand(-1, -1, -1, dim))
    flat_dest = dest_c.reshape(batch, heads, -1)
    out_k.scatter_(2, flat_dest[..., None].expand(-1, -1, -1, dim), c_k)
    out_v.scatter_(
        2,
        flat_dest[..., None].expand(-1, -1, -1, values.shape[-1]),
        result.values.reshape(batch, heads, -1, values.shape[-1]).to(values.dtype),
    )
    out_lm.scatter_(2, flat_dest, result.log_mass.reshape(batch, heads, -1).float())
    layer.replace(out_k[:, :, :width], out_v[:, :, :width], out_lm[:, :, :width], lengths=total)


def compact_layers(
    targets: list[tuple[int, FoldedLayer]],
    queries: dict[int, ReferenceQueries],
    totals: dict[int, Tensor],
    scalings: dict[int, float],
    config: FitConfig,
    span: tuple[int | None, int | None] = (None, None),
    chunks: int = 1,
) -> dict[str, float]:
    """Compact the span of every row of several layers at once (KV-based chunks, §3.5, App. C.3).

    All layers' problems (rows × KV heads × chunks) are stacked and fitted together by
    :func:`kvfold.methods.am_solve.fit_problems` (memory-bounded groups), then each layer is
    rewritten as ``[entries before the span] + [compacted chunk 1] + … + [entries after]``; kept
    entries outside the span are bit-identical, chunks are compacted independently (each keeps
    its share of the budget, proportional to its size), and the logical length is unchanged.

    Args:
        targets: ``(layer_idx, layer)`` pairs.
        queries: reference queries per layer.
        totals: entries each row ``(B, H)`` keeps in total (outside-span entries included).
        scalings: logit scale per layer.
        config: the fit.
        span: ``(start, end)`` over each row's valid entries (see :func:`parse_span`).
        chunks: contiguous blocks the span is split into.

    Returns:
        Mean relative mass and output residuals on the reference queries over fitted blocks.
    """
    plans = {i: _plan_layer(layer, totals[i], span, chunks) for i, layer in targets}
    if not plans:
        return {}
    width = max(p.keys.shape[3] for p in plans.values())
    n = max(queries[i].queries.shape[2] for i in plans)
    stack: dict[str, list[Tensor]] = {name: [] for name in ("k", "v", "lm", "q", "qv", "counts", "scale")}
    for i, plan in plans.items():
        b, h, c, t, d = plan.keys.shape
        pad = width - t
        stack["k"].append(torch.nn.functional.pad(plan.keys, (0, 0, 0, pad)))
        stack["v"].append(torch.nn.functional.pad(plan.values, (0, 0, 0, pad)))
        stack["lm"].append(torch.nn.functional.pad(plan.log_mass, (0, pad), value=NEG_INF))
        ref = queries[i]
        qn = ref.queries.shape[2]
        q = torch.nn.functional.pad(ref.queries, (0, 0, 0, n - qn))[:, :, None].expand(-1, -1, c, -1, -1)
        qv = torch.nn.functional.pad(ref.valid, (0, n - qn), value=False)[:, :, None].expand(-1, -1, c, -1)
        stack["q"].append(q)
        stack["qv"].append(qv)
        stack["counts"].append(plan.counts)
        stack["scale"].append(torch.full(plan.counts.shape, scalings[i], dtype=torch.float64))
    cat = {name: torch.cat([t.reshape(-1, *t.shape[3:]) for t in tensors]) for name, tensors in stack.items()}
    device = cat["k"].device
    result = fit_problems(
        cat["k"],
        cat["v"],
        cat["lm"],
        cat["q"].to(device),
        cat["qv"].to(device),
        cat["counts"].reshape(-1),
        cat["scale"].reshape(-1).to(device),
        config,
    )
    offset = 0
    for i, layer in targets:
        plan = plans[i]
        b, h, c = plan.counts.shape
        rows = slice(offset, offset + b * h * c)
        offset += b * h * c
        t = plan.keys.shape[3]
        part = Compacted(
            index=result.index[rows].clamp_max(t - 1).reshape(b, h, c, -1),
            log_mass=result.log_mass[rows].reshape(b, h, c, -1),
            values=result.values[rows].reshape(b, h, c, *result.values.shape[-2:]),
            lengths=result.lengths[rows].reshape(b, h, c),
            mass_error=result.mass_error[rows],
            output_error=result.output_error[rows],
        )
        _write_layer(layer, plan, part)
    fitted = cat["counts"].reshape(-1) < torch.isfinite(cat["lm"]).sum(-1)
    if not bool(fitted.any()):
        return {"mass_error": 0.0, "output_error": 0.0, "blocks": 0}
    return {
        "mass_error": float(result.mass_error[fitted].mean()),
        "output_error": float(result.output_error[fitted].mean()),
        "blocks": int(fitted.sum()),
    }


def _trim_captured(cache: FoldedCache) -> None:
    """Drop all but the last few prefill queries kept for context reference queries (memory)."""
    for _, layer in cache.folded_layers:
        q = layer.captured_queries
        if q is not None and q.shape[2] > KEPT_QUERY_WINDOW:
            layer.captured_queries = q[:, :, -KEPT_QUERY_WINDOW:].clone()


# ---------------------------------------------------------------------------- online (App. F.3)


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
    """

    needs_attention = False

    def __init__(
        self,
        limits: dict[int, int],
        scalings: dict[int, float],
        config: FitConfig,
        recent: int = 20,
        factor: float = 0.5,
        max_queries: int = 1024,
        initial: dict[int, ReferenceQueries] | None = None,
    ) -> None:
        self.limits = limits
        self.scalings = scalings
        self.config = config
        self.recent = recent
        self.factor = factor
        self.max_queries = max_queries
        self.buffers: dict[int, ReferenceQueries] = dict(initial or {})
        self.compactions: dict[int, int] = {i: 0 for i in limits}

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
        span_len = (n_valid - self.recent).clamp_min(0)
        keep = torch.ceil(span_len.double() * self.factor).long().clamp_min(1).minimum(span_len)
        totals = keep + (n_valid - span_len)
        compact_layers(
            [(layer_idx, layer)],
            {layer_idx: buf},
            {layer_idx: totals},
            self.scalings,
            self.config,
            span=(None, -self.recent if self.recent else None),
        )
        self.compactions[layer_idx] += 1


# ---------------------------------------------------------------------------- registered methods


@dataclass
class _AttentionMatching(Standalone):
    """Shared options of the four AM variants (see the module docstring).

    Parameters:
        queries: reference-query sources joined by ``+``: ``context``, ``repeat``, ``selfstudy``,
            ``random`` (§3.1).
        max_queries: reference queries kept per KV head and layer (a seeded random subset; the
            authors' code keeps up to 10k for repeat-prefill, 50k with self-study).
        nnls_iters: projected-gradient steps of the β fit (Algorithm 3).
        beta_min, beta_max: bounds on β − β⁰ (App. C.2 "Stabilizing β").
        on_policy: compact layers in order, re-extracting repeat / self-study queries with the
            earlier layers already compacted (§3.1 "On-policy queries"; one pass per layer).
        span: the entries compacted, ``start:end`` over each row's valid entries (``:`` = all,
            ``4:-32`` keeps the first 4 and the last 32 as they are).
        chunks: contiguous chunks compacted independently (§3.5).
        chunking: ``kv`` (slice the prefilled cache, the paper's default) or ``text`` (prefill
            and compact each chunk alone, then shift its keys' RoPE phase to the global offset).
        schedule: a head-budget schedule JSON file (§3.4, Appendix E; see
            :mod:`kvfold.methods.am_schedule`); uniform budgets when unset.
        online: keep compacting during decoding (App. F.3).
        recent, factor: online compaction keeps the ``recent`` newest entries and compacts the
            rest to ``factor`` of its size whenever the cache exceeds the budget.
        selfstudy_tokens: tokens sampled per self-study answer.
        context_window: context-prefill queries: the last this-many context tokens.
        fit_values: refit values by least squares (False keeps the selected keys' values).
        solver: ``gram`` (normal equations, fast) or ``exact`` (the reference solvers).
    """

    paper: ClassVar[str] = "Zweiger et al. 2026, Fast KV Compaction via Attention Matching"
    supports_chunked_prefill: ClassVar[bool] = True
    key_selection: ClassVar[str] = "highest"
    queries: str = "repeat+selfstudy"
    max_queries: int = 4096
    nnls_iters: int = 2
    beta_min: float = -3.0
    beta_max: float = 3.0
    on_policy: bool = False
    span: str = ":"
    chunks: int = 1
    chunking: str = "kv"
    schedule: str | None = None
    online: bool = False
    recent: int = 20
    factor: float = 0.5
    selfstudy_tokens: int = 64
    context_window: int = 8192
    fit_values: bool = True
    solver: str = "gram"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.context_window if "context" in parse_sources(self.queries, self.name) else 0

    def validate(self) -> None:
        parse_sources(self.queries, self.name)
        parse_span(self.span, self.name)
        if self.max_queries < 1 or self.chunks < 1 or self.context_window < 1 or self.selfstudy_tokens < 0:
            raise SpecError(f"{self.name}: max_queries, chunks and context_window must be ≥ 1")
        if self.nnls_iters < 0 or self.recent < 0 or not 0.0 < self.factor < 1.0:
            raise SpecError(f"{self.name}: nnls_iters and recent must be ≥ 0 and factor in (0, 1)")
        if self.beta_min > self.beta_max:
            raise SpecError(f"{self.name}: beta_min must be ≤ beta_max")
        if self.chunking not in ("kv", "text") or self.solver not in ("gram", "exact"):
            raise SpecError(f"{self.name}: chunking must be kv or text and solver gram or exact")

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
            solver=self.solver,  # type: ignore[arg-type]
        )

    def query_options(self, sources: tuple[str, ...] | None = None) -> QueryOptions:
        return QueryOptions(
            sources=sources or parse_sources(self.queries, self.name),
            max_queries=self.max_queries,
            context_window=self.context_window,
            selfstudy_tokens=self.selfstudy_tokens,
            random_queries=self.max_queries,
        )

    def totals(self, ctx: CompressionContext) -> dict[int, Tensor]:
        """Entries each row ``(B, H)`` keeps per layer: the budget, or the head schedule's share."""
        layers = ctx.cache.folded_layers
        if self.schedule:
            from kvfold.methods.am_schedule import HeadSchedule

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
        scalings = {i: _scaling(ctx, i, layer) for i, layer in layers}
        config = self.fit_config()
        span = parse_span(self.span, self.name)
        report = ctx.report.setdefault("am", {})
        if self.chunking == "text":
            from kvfold.methods.am_text_chunks import compact_text_chunks

            stats = compact_text_chunks(self, ctx, totals, scalings, config)
            report.update(stats)
            report["seconds"] = time.perf_counter() - start
            _trim_captured(ctx.cache)
            return
        sources = parse_sources(self.queries, self.name)
        passes = tuple(s for s in sources if s in ("repeat", "selfstudy"))
        if self.on_policy and passes:
            static = tuple(s for s in sources if s not in passes)
            fixed = extract_reference_queries(ctx, self.query_options(static)) if static else {}
            query_seconds = time.perf_counter() - start
            stats = []
            for i, layer in layers:  # §3.1: layer ℓ's queries with layers < ℓ already compacted
                t0 = time.perf_counter()
                q = extract_reference_queries(ctx, self.query_options(passes), layers=[i])[i]
                if i in fixed:
                    q = q.cat(fixed[i]).subsample(self.max_queries, torch.Generator().manual_seed(ctx.seed + i))
                query_seconds += time.perf_counter() - t0
                stats.append(compact_layers([(i, layer)], {i: q}, totals, scalings, config, span, self.chunks))
            report["query_seconds"] = query_seconds
            report["mass_error"] = sum(s.get("mass_error", 0.0) for s in stats) / max(1, len(stats))
            report["output_error"] = sum(s.get("output_error", 0.0) for s in stats) / max(1, len(stats))
        else:
            queries = extract_reference_queries(ctx, self.query_options(), reuse=True)
            report["query_seconds"] = time.perf_counter() - start
            report["queries_per_head"] = float(torch.stack([q.counts.float().mean() for q in queries.values()]).mean())
            report.update(compact_layers(layers, queries, totals, scalings, config, span, self.chunks))
        report["seconds"] = time.perf_counter() - start
        _trim_captured(ctx.cache)

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
            {i: _scaling(ctx, i, layer) for i, layer in layers},
            self.fit_config(),
            recent=self.recent,
            factor=self.factor,
            max_queries=self.max_queries,
            initial=initial,
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
            limit — see :func:`kvfold.methods.am_solve.omp_keys`).
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


# ---------------------------------------------------------------------------- the folder


@register
@dataclass
class AMFit(Folder):
    """Attention Matching's β-and-value refit (§3.2) after any selector: the kept keys stay, their
    β is fitted by box-NNLS to the attention mass of the whole cache and their values by least
    squares to its attention output, on reference queries. ``am_fit`` alone means ``snapkv+am_fit``.

    Parameters:
        queries: reference-query sources (default ``context``: the prefill's own queries).
        max_queries: reference queries kept per KV head.
        nnls_iters, beta_min, beta_max: the β fit (Algorithm 3, box [−3, 3] as for AM-HighestAttnKeys).
        fit_values: refit the values (False: β only).
        selfstudy_tokens, context_window: as for the AM variants.
        solver: ``gram`` or ``exact``.
    """

    name: ClassVar[str] = "am_fit"
    description: ClassVar[str] = "refit biases (NNLS on attention mass) and values (least squares) of kept entries"
    paper: ClassVar[str] = "Zweiger et al. 2026, Fast KV Compaction via Attention Matching"
    supports_chunked_prefill: ClassVar[bool] = True
    queries: str = "context"
    max_queries: int = 4096
    nnls_iters: int = 2
    beta_min: float = -3.0
    beta_max: float = 3.0
    fit_values: bool = True
    selfstudy_tokens: int = 64
    context_window: int = 8192
    solver: str = "gram"

    @classmethod
    def default_selector(cls) -> str | None:
        return "snapkv"

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.context_window if "context" in parse_sources(self.queries, self.name) else 0

    def validate(self) -> None:
        parse_sources(self.queries, self.name)
        if self.max_queries < 1 or self.nnls_iters < 0 or self.beta_min > self.beta_max:
            raise SpecError("am_fit: max_queries must be ≥ 1, nnls_iters ≥ 0 and beta_min ≤ beta_max")
        if self.solver not in ("gram", "exact"):
            raise SpecError(f"am_fit: solver must be gram or exact; got {self.solver!r}")

    def prepare(self, ctx: CompressionContext) -> None:
        options = QueryOptions(
            sources=parse_sources(self.queries, self.name),
            max_queries=self.max_queries,
            context_window=self.context_window,
            selfstudy_tokens=self.selfstudy_tokens,
            random_queries=self.max_queries,
        )
        start = time.perf_counter()
        ctx.memo["am_fit_queries"] = extract_reference_queries(ctx, options, reuse=True)
        ctx.report.setdefault("am_fit", {})["query_seconds"] = time.perf_counter() - start

    def fold(
        self, layer_idx: int, layer: FoldedLayer, keep: Tensor, lengths: Tensor, scores: Tensor, ctx: CompressionContext
    ) -> None:
        keys, values, log_mass, _ = layer.padded()
        queries = ctx.memo["am_fit_queries"][layer_idx]
        slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
        given = torch.where(slot, keep, torch.full_like(keep, -1))
        config = FitConfig(
            keys="highest",
            nnls_iters=self.nnls_iters,
            beta_min=self.beta_min,
            beta_max=self.beta_max,
            fit_values=self.fit_values,
            solver=self.solver,  # type: ignore[arg-type]
        )
        result = fit_problems(
            keys,
            values,
            log_mass,
            queries.queries,
            queries.valid,
            lengths,
            _scaling(ctx, layer_idx, layer),
            config,
            given=given,
        )
        idx = result.index
        c_k = keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))
        layer.replace(c_k, result.values.to(values.dtype), result.log_mass.float(), lengths=result.lengths)
        report = ctx.report.setdefault("am_fit", {})
        report.setdefault("mass_error", []).append(float(result.mass_error.mean()))
        report.setdefault("output_error", []).append(float(result.output_error.mean()))
