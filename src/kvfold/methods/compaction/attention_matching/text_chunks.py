"""Text-based chunked Attention Matching (Zweiger et al. 2026, §3.5 and App. C.3).

Each chunk of the context text is prefilled **in isolation** as ``[template head] + [chunk]`` with
chunk-local positions, its reference queries are extracted and it is compacted on its own; the
compacted keys are then rotated by the RoPE phase ``Δ = p_global − p_local`` so that they sit at
the chunk's offset in the full context, and the chunks are concatenated after the row's own
template head (kept as is). RoPE rotations compose, ``R_{p+Δ} = R_Δ R_p``, so the rotation is
exact for the keys' positional part; what is approximate is the missing cross-chunk context
(the paper finds the KV-based default more faithful). Sliding-window layers (Gemma 3) keep the
full prefill's entries.
"""

from __future__ import annotations

import torch

from kvfold.methods.compaction.attention_matching.compact import compact_layers
from kvfold.methods.compaction.attention_matching.queries import QueryOptions, extract_reference_queries
from kvfold.methods.compaction.attention_matching.solve import FitConfig
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.prompts import context_text_ids
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor

__all__ = ["compact_text_chunks", "rotate_keys"]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_keys(model, layer_idx: int, keys: Tensor, delta: int) -> Tensor:
    """Shift post-RoPE keys by ``delta`` positions: ``k' = R_Δ k`` (transformers' rotate_half layout).

    The rotary module's ``attention_scaling`` (folded into its cos/sin) is divided out, so only
    the rotation is applied.
    """
    if delta == 0:
        return keys
    from kvfold.methods.core.model import rope_tables  # the model's own RoPE tables

    cos, sin = rope_tables(model, layer_idx, torch.tensor([delta], device=keys.device))
    dtype = torch.promote_types(keys.dtype, torch.float32)
    cos, sin = cos[0].to(dtype), sin[0].to(dtype)
    scale = (cos * cos + sin * sin).sqrt()
    cos, sin = cos / scale, sin / scale
    k = keys.to(dtype)
    return (k * cos + _rotate_half(k) * sin).to(keys.dtype)


def _prefill_piece(ctx: CompressionContext, options: QueryOptions, ids: Tensor, chunk: int) -> CompressionContext:
    """``ids`` = ``[template head] + [chunk]`` prefilled in isolation (chunk-local positions), with
    the prefill queries captured when the reference queries need them."""
    local = FoldedCache(ctx.model.config)
    local.capture_window = options.context_window if "context" in options.sources else 0
    with torch.no_grad():
        ctx.model(input_ids=ids, past_key_values=local, use_cache=True, logits_to_keep=1)
    local.capture_window = 0
    return CompressionContext(
        model=ctx.model,
        cache=local,
        input_ids=ids,
        attention_mask=None,
        budget=ctx.budget,
        seed=ctx.seed * 31 + chunk,
        tokenizer=ctx.tokenizer,
    )


def _compact_row(
    method, ctx: CompressionContext, b: int, totals: dict[int, Tensor], scalings: dict[int, float], config: FitConfig
) -> tuple[dict[int, tuple[Tensor, Tensor, Tensor]], list[dict[str, float]]]:
    """Row ``b`` chunk by chunk: each chunk compacted on its own prefill to its share of the row's
    budget, its keys rotated to the chunk's global offset, all after the row's own template head.
    Returns ``(keys, values, log_mass)`` per layer (``(H, N, D)``, ``(H, N)``) and the fits' statistics."""
    _, width = ctx.input_ids.shape
    length = int(ctx.context_lengths[b])
    options = method.query_options()
    row_ids = ctx.input_ids[b, width - length :].tolist()
    text, _ = context_text_ids(ctx.tokenizer, row_ids) if ctx.tokenizer is not None else (row_ids, False)
    head = row_ids[: len(row_ids) - len(text)]
    pieces = max(1, min(method.chunks, len(text)))
    bounds = [round(i * len(text) / pieces) for i in range(pieces + 1)]
    parts: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {i: [] for i, _ in ctx.cache.folded_layers}
    stats = []
    for c in range(pieces):
        piece = text[bounds[c] : bounds[c + 1]]
        local_ctx = _prefill_piece(ctx, options, torch.tensor([head + piece], device=ctx.input_ids.device), c)
        local = local_ctx.cache
        queries = extract_reference_queries(local_ctx, options)
        local_totals = {}
        for i, layer in local.folded_layers:
            span_budget = (totals[i][b] - len(head)).clamp_min(1).double()
            share = span_budget * len(piece) / max(1, len(text))
            local_totals[i] = (len(head) + share.round().long().clamp_min(1))[None].to(layer.device)
        stats.append(
            compact_layers(local.folded_layers, queries, local_totals, scalings, config, span=(len(head), None))
        )
        delta = bounds[c]  # p_global − p_local: the chunk starts at len(head) locally, len(head) + bounds[c] globally
        for i, layer in local.folded_layers:
            k, v, lm, _ = layer.padded()
            k, v, lm = k[0, :, len(head) :], v[0, :, len(head) :], lm[0, :, len(head) :]
            parts[i].append((rotate_keys(ctx.model, i, k, delta), v, lm))
    row = {}
    pad = width - length
    own = slice(pad, pad + len(head))  # the row's own template head, kept as prefilled
    for i, layer in ctx.cache.folded_layers:
        k_full, v_full, lm_full, _ = layer.padded()
        ks = [k_full[b, :, own]] + [p[0] for p in parts[i]]
        vs = [v_full[b, :, own]] + [p[1] for p in parts[i]]
        lms = [lm_full[b, :, own]] + [p[2] for p in parts[i]]
        row[i] = (torch.cat(ks, dim=1), torch.cat(vs, dim=1), torch.cat(lms, dim=1))
    return row, stats


def _replace_layers(
    layers: list[tuple[int, FoldedLayer]], rows: list[dict[int, tuple[Tensor, Tensor, Tensor]]]
) -> None:
    """Each layer rebuilt from its rows' entries, valid entries first (left-aligned)."""
    batch = len(rows)
    for i, layer in layers:
        longest = max(r[i][0].shape[1] for r in rows)
        heads, dim = layer.num_heads, layer.head_dim
        keys = torch.zeros(batch, heads, longest, dim, dtype=layer.dtype, device=layer.device)
        values = torch.zeros(batch, heads, longest, rows[0][i][1].shape[-1], dtype=layer.dtype, device=layer.device)
        log_mass = torch.full((batch, heads, longest), NEG_INF, device=layer.device)
        for b, r in enumerate(rows):
            k, v, lm = r[i]
            valid = torch.isfinite(lm)
            order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices  # valid entries first
            n = k.shape[1]
            keys[b, :, :n] = k.gather(1, order[..., None].expand(-1, -1, dim))
            values[b, :, :n] = v.gather(1, order[..., None].expand(-1, -1, v.shape[-1]))
            log_mass[b, :, :n] = lm.gather(1, order).float()
        lens = torch.isfinite(log_mass).sum(-1)
        layer.replace(keys, values, log_mass, lengths=lens)


def compact_text_chunks(
    method, ctx: CompressionContext, totals: dict[int, Tensor], scalings: dict[int, float], config: FitConfig
) -> dict[str, float]:
    """Compact every row of ``ctx.cache`` chunk by chunk from isolated prefills (see the module docstring).

    Args:
        method: the AM method (its ``chunks``, query options and ``compact`` settings are used).
        ctx: the compression context.
        totals: entries each row keeps per layer and head (the template head included).
        scalings: logit scale per layer.
        config: the fit.
    """
    rows: list[dict[int, tuple[Tensor, Tensor, Tensor]]] = []
    stats: list[dict[str, float]] = []
    for b in range(ctx.input_ids.shape[0]):
        row, row_stats = _compact_row(method, ctx, b, totals, scalings, config)
        rows.append(row)
        stats.extend(row_stats)
    _replace_layers(ctx.cache.folded_layers, rows)
    fitted = [s for s in stats if s.get("blocks")]
    return {
        "chunking": "text",
        "mass_error": sum(s["mass_error"] for s in fitted) / max(1, len(fitted)),
        "output_error": sum(s["output_error"] for s in fitted) / max(1, len(fitted)),
    }
