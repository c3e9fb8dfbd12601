"""Attention Matching on a layer: spans and chunks of every KV head, their budgets, the batched fit
and the compacted entries written back. See :mod:`kvfold.methods.compaction.attention_matching`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfold.methods.compaction.attention_matching.queries import (
    ReferenceQueries,
)
from kvfold.methods.compaction.attention_matching.solve import Compacted, FitConfig, fit_problems
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.prompts import context_text_ids
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor

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


def verbatim_prefix(ctx: CompressionContext, template: bool, sinks: int) -> Tensor:
    """Context tokens per row ``(B,)`` kept verbatim, outside the compacted span: the chat template
    before the context text (when the row was prefilled with it and ``template``), at least the
    first ``sinks`` tokens (attention sinks). The authors' code keeps both as they are."""
    key = ("verbatim_prefix", template, sinks)
    if key not in ctx.memo:
        batch, width = ctx.input_ids.shape
        lengths = ctx.context_lengths.tolist()
        out = []
        for b in range(batch):
            row = ctx.input_ids[b, width - lengths[b] :].tolist()
            head = 0
            if template and ctx.tokenizer is not None:
                text, templated = context_text_ids(ctx.tokenizer, row)
                head = len(row) - len(text) if templated else 0
            out.append(min(lengths[b], max(head, sinks)))
        ctx.memo[key] = torch.tensor(out, dtype=torch.long)
    return ctx.memo[key]


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


def _plan_layer(
    layer: FoldedLayer,
    total: Tensor,
    span: tuple[int | None, int | None],
    chunks: int,
    verbatim: Tensor | None = None,
    chunk_of: Tensor | None = None,
) -> _LayerPlan:
    """Cut a layer's span into ``chunks`` contiguous blocks per row, with their budgets; the first
    ``verbatim`` ``(B,)`` valid entries of each row stay outside the span. ``chunk_of`` ``(B, N)``
    (the repeat chunk of every slot) replaces the equal blocks: block ``c`` is the span's entries
    of repeat chunk ``c``, and ``chunks`` is their number."""
    keys, values, log_mass, _ = layer.padded()
    valid = torch.isfinite(log_mass)
    batch, heads, length, dim = keys.shape
    n_valid = valid.sum(-1)
    rank = valid.long().cumsum(-1) - 1
    start, end = _bounds(span, n_valid)
    if verbatim is not None:
        start = torch.maximum(start, verbatim.to(start.device)[:, None].minimum(n_valid))
        end = torch.maximum(start, end)
    span_len = end - start
    member = valid & (rank >= start[..., None]) & (rank < end[..., None])
    fixed = n_valid - span_len
    budget = torch.maximum(total.to(keys.device) - fixed, torch.minimum(span_len, torch.ones_like(span_len)))
    budget = torch.minimum(budget, span_len)
    if chunk_of is not None:
        chunk_id = chunk_of.to(keys.device)[:, None, :].expand(batch, heads, length)
    else:
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


def _block_queries(ref: ReferenceQueries, chunks: int, by_chunk: bool) -> tuple[Tensor, Tensor]:
    """``(B, H, C, n, D)`` queries of each block and their validity: every query for every block, or
    (``by_chunk``) each repeat chunk's own queries (:meth:`ReferenceQueries.by_chunk`)."""
    if by_chunk:
        return ref.by_chunk(chunks)
    return ref.queries[:, :, None].expand(-1, -1, chunks, -1, -1), ref.valid[:, :, None].expand(-1, -1, chunks, -1)


def _stack_problems(
    plans: dict[int, _LayerPlan],
    queries: dict[int, ReferenceQueries],
    scalings: dict[int, float],
    by_chunk: bool = False,
) -> dict[str, Tensor]:
    """Every layer's blocks (rows × KV heads × chunks) as one stack of problems: keys, values and β⁰
    padded to the widest block, each block with its row's and head's reference queries (padded to
    the most queries, invalid; with ``by_chunk`` each block's repeat chunk's queries), its budget
    and its layer's logit scale."""
    width = max(p.keys.shape[3] for p in plans.values())
    blocks = {i: _block_queries(queries[i], plan.keys.shape[2], by_chunk) for i, plan in plans.items()}
    n = max(q.shape[3] for q, _ in blocks.values())
    stack: dict[str, list[Tensor]] = {name: [] for name in ("k", "v", "lm", "q", "qv", "counts", "scale")}
    for i, plan in plans.items():
        b, h, c, t, d = plan.keys.shape
        pad = width - t
        stack["k"].append(torch.nn.functional.pad(plan.keys, (0, 0, 0, pad)))
        stack["v"].append(torch.nn.functional.pad(plan.values, (0, 0, 0, pad)))
        stack["lm"].append(torch.nn.functional.pad(plan.log_mass, (0, pad), value=NEG_INF))
        q, qv = blocks[i]
        qn = q.shape[3]
        stack["q"].append(torch.nn.functional.pad(q, (0, 0, 0, n - qn)))
        stack["qv"].append(torch.nn.functional.pad(qv, (0, n - qn), value=False))
        stack["counts"].append(plan.counts)
        stack["scale"].append(torch.full(plan.counts.shape, scalings[i], dtype=torch.float64))
    return {name: torch.cat([t.reshape(-1, *t.shape[3:]) for t in tensors]) for name, tensors in stack.items()}


def _write_layers(targets: list[tuple[int, FoldedLayer]], plans: dict[int, _LayerPlan], result: Compacted) -> None:
    """Each layer's share of the stacked ``result`` (in :func:`_stack_problems`' order) written back."""
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


def compact_layers(
    targets: list[tuple[int, FoldedLayer]],
    queries: dict[int, ReferenceQueries],
    totals: dict[int, Tensor],
    scalings: dict[int, float],
    config: FitConfig,
    span: tuple[int | None, int | None] = (None, None),
    chunks: int = 1,
    verbatim: Tensor | None = None,
    chunk_of: Tensor | None = None,
) -> dict[str, float]:
    """Compact the span of every row of several layers at once (KV-based chunks, §3.5, App. C.3).

    All layers' problems (rows × KV heads × chunks) are stacked and fitted together by
    :func:`kvfold.methods.compaction.attention_matching.solve.fit_problems` (memory-bounded groups), then each layer is
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
        verbatim: ``(B,)`` leading valid entries of each row kept as they are (template, sinks):
            the span starts after them at the latest.
        chunk_of: ``(B, N)`` the repeat chunk of every slot (:func:`.fit_chunks.layer_chunks`):
            the span's entries of each repeat chunk are one block fitted on the queries recorded
            while that chunk was repeated (``chunks`` is then ignored; see :mod:`.fit_chunks`).

    Returns:
        Mean relative mass and output residuals on the reference queries over fitted blocks.
    """
    if chunk_of is not None:
        chunks = int(chunk_of.max()) + 1
    plans = {i: _plan_layer(layer, totals[i], span, chunks, verbatim, chunk_of) for i, layer in targets}
    if not plans:
        return {}
    sums = {"mass_error": 0.0, "output_error": 0.0, "blocks": 0}
    device = next(layer.keys.device for _, layer in targets)
    for group in layer_groups({i: queries[i].queries for i in plans}, STACK_BYTES):
        plan = {i: plans[i] for i in group}
        held = {i: queries[i].on(device) for i in group}  # on the device while the group is fitted
        cat = _stack_problems(plan, held, scalings, by_chunk=chunk_of is not None)
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
        _write_layers([(i, layer) for i, layer in targets if i in plan], plan, result)
        fitted = cat["counts"].reshape(-1) < torch.isfinite(cat["lm"]).sum(-1)
        sums["mass_error"] += float(result.mass_error[fitted].sum())
        sums["output_error"] += float(result.output_error[fitted].sum())
        sums["blocks"] += int(fitted.sum())
    if not sums["blocks"]:
        return sums
    return {**{k: sums[k] / sums["blocks"] for k in ("mass_error", "output_error")}, "blocks": sums["blocks"]}


STACK_BYTES = 256 << 20
"""Reference-query bytes of the layers :func:`compact_layers` stacks into one fit: the stack copies
its layers' queries (grouped by chunk, padded, concatenated), so stacking every layer at once held
the model's queries several times over (4× at 8K tokens). Layers are fitted in groups of at most
this many bytes of queries (one layer at least): one group below about 3K tokens on SmolLM2."""


def layer_groups(queries: dict[int, Tensor], limit: int) -> list[list[int]]:
    """The layers in order, in consecutive groups whose ``queries`` hold at most ``limit`` bytes
    together (a layer above it alone)."""
    groups: list[list[int]] = []
    held = limit + 1
    for i, q in queries.items():
        size = q.numel() * q.element_size()
        if held + size > limit:
            groups.append([])
            held = 0
        groups[-1].append(i)
        held += size
    return groups


def trim_captured(cache: FoldedCache) -> None:
    """Drop all but the last few prefill queries kept for context reference queries (memory)."""
    for _, layer in cache.folded_layers:
        q = layer.captured_queries
        if q is not None and q.shape[2] > KEPT_QUERY_WINDOW:
            layer.captured_queries = q[:, :, -KEPT_QUERY_WINDOW:].clone()
