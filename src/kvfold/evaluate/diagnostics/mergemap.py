"""Merge maps and carrier load: which retained entry absorbed which evicted token (``kvfold mergemap``).

GRKV (``papers/grkv.md``, §1, Figure 1 and Appendix A) argues that local merging rules, under
span-based retention such as SnapKV's, funnel the evicted tokens into a few **carriers** at the
boundaries of the retained spans, which then over-merge. This module makes that visible and
measurable for any method spec:

* **merge map** (Figure 1): for one layer and KV head, every (retained carrier, evicted token)
  pair a method recorded, coloured by the cosine similarity of their keys, with the retained
  spans drawn as black bars along the carrier axis;
* **carrier load**: per layer and KV head, the load ``ℓ_i`` of every retained entry (the number of
  evicted tokens it absorbed, shares counted as fractions) and how concentrated it is — the share
  taken by the top 1% and 10% of retained entries, the Gini coefficient, the largest load over
  the mean (Appendix A, eq. 14: ``max ℓ ≥ ⌈e/b⌉``), the share landing on span-boundary entries;
* **update magnitude** for every method, merging or not (GRKV rewrites K and V globally and has
  no pairs): ``‖Δk_i‖`` and ``‖Δv_i‖`` of each retained entry against its uncompressed self,
  with the same concentration measures.

How methods report (``CompressionContext.merge_recorder``, a :class:`MergeRecorder` here):
``ComposedMethod`` records each layer's kept slots itself; folders that assign evicted tokens to
carriers call ``ctx.record_merges(layer_idx, carrier, absorbed, share)`` with ``(B, H, M)``
tensors of slot indices (the layer's slots before compression; ``absorbed < 0`` = no pair);
standalone methods also call ``ctx.record_kept(layer_idx, keep, lengths)``. Without a recorder
both calls do nothing.

Example:
    >>> from kvfold import load_model, prefill
    >>> model, tokenizer = load_model()
    >>> context = prefill(model, tokenizer, text, methods="snapkv+cam,snapkv+d2o_merge")
    >>> result = merge_maps(context, ["snapkv+cam", "snapkv+d2o_merge"], 0.1, out_dir="runs/mergemap")
    >>> result.records[0]["summary"]["top10_share"]
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfold.methods.core.base import CompressionContext, build_method
from kvfold.pipeline.context import PrefilledContext
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache, FoldedLayer

__all__ = [
    "MergeRecorder",
    "MergeMapResult",
    "carrier_load",
    "compress_recorded",
    "gini",
    "lorenz_curve",
    "merge_maps",
    "span_boundaries",
    "top_share",
]

TOP_FRACTIONS = (0.01, 0.1)
LORENZ_POINTS = 101
CHANGED_TOL = 1e-6
"""A retained entry counts as updated when ‖Δ‖ exceeds this fraction of its norm."""


# ---------------------------------------------------------------------------- the recorder


class MergeRecorder:
    """Collects, during one compression, the kept slots and (carrier, absorbed, share) pairs per layer.

    Attributes:
        kept_slots: ``layer → (keep (B, H, K), lengths (B, H))`` on CPU (the last call wins).
        pairs: ``layer → [(carrier, absorbed, share), …]`` ``(B, H, M)`` CPU tensors.
    """

    def __init__(self) -> None:
        self.kept_slots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}

    def kept(self, layer_idx: int, keep: torch.Tensor, lengths: torch.Tensor) -> None:
        self.kept_slots[layer_idx] = (keep.detach().long().cpu().clone(), lengths.detach().long().cpu().clone())

    def merges(
        self, layer_idx: int, carrier: torch.Tensor, absorbed: torch.Tensor, share: torch.Tensor | None = None
    ) -> None:
        if carrier.shape != absorbed.shape:
            shapes = f"{tuple(carrier.shape)} and {tuple(absorbed.shape)}"
            raise ValueError(f"record_merges: carrier and absorbed must have one shape; got {shapes}")
        share = torch.ones_like(absorbed, dtype=torch.float64) if share is None else share.double()
        self.pairs.setdefault(layer_idx, []).append(
            (carrier.detach().long().cpu(), absorbed.detach().long().cpu(), share.detach().cpu())
        )


def compress_recorded(
    prefilled: PrefilledContext, spec: str, budget: float | int | str | Budget, seed: int = 0
) -> tuple[FoldedCache, MergeRecorder, dict[str, Any]]:
    """Compress a copy of a prefilled cache (as :meth:`PrefilledContext.compress`) with a recorder.

    Results shared between compressions of the context (KVzip's repeat pass) are reused, as there.

    Returns:
        ``(compressed cache, recorder, the method's report)``.
    """
    composed = build_method(spec)
    parsed = Budget.parse(budget)
    cache = prefilled.cache.copy()
    recorder = MergeRecorder()
    ctx = CompressionContext(
        model=prefilled.model,
        cache=cache,
        input_ids=prefilled.input_ids,
        attention_mask=prefilled.attention_mask,
        budget=parsed,
        seed=seed,
        tokenizer=prefilled.tokenizer,
        shared=prefilled.shared,
        merge_recorder=recorder,
    )
    with torch.inference_mode():
        if not composed.is_identity and not parsed.is_full:
            composed.compress(ctx)
    return cache, recorder, ctx.report


# ---------------------------------------------------------------------------- load measures


def gini(load: np.ndarray) -> float:
    """Gini coefficient of non-negative loads: 0 = all equal, ``(n−1)/n`` = all on one entry."""
    x = np.sort(np.asarray(load, dtype=np.float64))
    n, total = x.size, x.sum()
    if n == 0 or total <= 0:
        return 0.0
    ranks = np.arange(1, n + 1)
    return float(2.0 * (ranks * x).sum() / (n * total) - (n + 1) / n)


def top_share(load: np.ndarray, fraction: float) -> float:
    """Share of the total load held by the ``⌈fraction · n⌉`` most loaded entries."""
    x = np.sort(np.asarray(load, dtype=np.float64))[::-1]
    total = x.sum()
    if x.size == 0 or total <= 0:
        return 0.0
    return float(x[: max(1, math.ceil(fraction * x.size - 1e-9))].sum() / total)


def lorenz_curve(load: np.ndarray, points: int = LORENZ_POINTS) -> np.ndarray:
    """Top-``q`` share of the load at ``q = 0, 1/(points−1), …, 1`` (entries sorted by load, largest first)."""
    x = np.sort(np.asarray(load, dtype=np.float64))[::-1]
    grid = np.linspace(0.0, 1.0, points)
    if x.size == 0 or x.sum() <= 0:
        return np.full(points, np.nan)
    cumulative = np.concatenate([[0.0], np.cumsum(x) / x.sum()])
    return np.interp(grid * x.size, np.arange(x.size + 1), cumulative)


def span_boundaries(positions: np.ndarray) -> np.ndarray:
    """Bool per retained position (sorted ascending): first or last entry of a run of consecutive positions."""
    p = np.asarray(positions)
    if p.size == 0:
        return np.zeros(0, dtype=bool)
    starts = np.ones(p.size, dtype=bool)
    starts[1:] = np.diff(p) != 1
    ends = np.ones(p.size, dtype=bool)
    ends[:-1] = np.diff(p) != 1
    return starts | ends


def carrier_load(retained: np.ndarray, carriers: np.ndarray, shares: np.ndarray, evicted: int) -> dict[str, float]:
    """Concentration of the merges of one layer and head on its retained entries.

    Args:
        retained: ``(c,)`` positions of the retained entries, ascending.
        carriers: ``(M,)`` carrier position of every recorded pair (each in ``retained``).
        shares: ``(M,)`` share of the absorbed token given to that carrier.
        evicted: tokens evicted in this head (``e``).

    Returns:
        ``absorbed`` (Σ shares), ``merged_fraction`` (absorbed / e), ``active`` (share of retained
        entries with a load), ``top1_share``, ``top10_share``, ``gini``, ``max_load``,
        ``max_over_mean`` (largest load / mean load over all retained entries), ``boundary_share``
        (load on span-boundary entries) and ``boundary_fraction`` (boundary entries / c).
    """
    retained = np.asarray(retained)
    index = np.searchsorted(retained, carriers)
    if index.size and (index.max() >= retained.size or not np.array_equal(retained[index], carriers)):
        raise ValueError("a recorded carrier is not among the retained entries")
    load = np.bincount(index, weights=shares, minlength=retained.size).astype(np.float64)
    total = float(load.sum())
    boundary = span_boundaries(retained)
    mean = total / max(retained.size, 1)
    return {
        "absorbed": total,
        "merged_fraction": total / evicted if evicted else 0.0,
        "active": float((load > 0).mean()) if load.size else 0.0,
        "top1_share": top_share(load, 0.01),
        "top10_share": top_share(load, 0.1),
        "gini": gini(load),
        "max_load": float(load.max()) if load.size else 0.0,
        "max_over_mean": float(load.max() / mean) if mean > 0 else 0.0,
        "boundary_share": float(load[boundary].sum() / total) if total > 0 else 0.0,
        "boundary_fraction": float(boundary.mean()) if boundary.size else 0.0,
    }


def _update_load(
    key_change: np.ndarray, value_change: np.ndarray, key_rel: np.ndarray, value_rel: np.ndarray
) -> dict[str, float]:
    """Concentration of the update magnitudes ``‖Δk_i‖``, ``‖Δv_i‖`` over the retained entries."""
    return {
        "updated": float(((key_rel > CHANGED_TOL) | (value_rel > CHANGED_TOL)).mean()) if key_rel.size else 0.0,
        "dk_rel_mean": float(key_rel.mean()) if key_rel.size else 0.0,
        "dv_rel_mean": float(value_rel.mean()) if value_rel.size else 0.0,
        "dk_top10_share": top_share(key_change, 0.1),
        "dv_top10_share": top_share(value_change, 0.1),
        "dk_gini": gini(key_change),
        "dv_gini": gini(value_change),
    }


# ---------------------------------------------------------------------------- one method


@dataclass
class _HeadMap:
    """What one (layer, batch row, KV head) looks like after compression (token positions, no padding)."""

    retained: np.ndarray
    carriers: np.ndarray
    absorbed: np.ndarray
    shares: np.ndarray
    similarity: np.ndarray
    key_change: np.ndarray | None
    value_change: np.ndarray | None


@dataclass
class _MethodMap:
    method: str
    kv_ratio: float
    heads: dict[tuple[int, int, int], _HeadMap] = field(default_factory=dict)
    metrics: dict[tuple[int, int, int], dict[str, float]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    recorded: bool = True


def _analyse(prefilled: PrefilledContext, spec: str, budget: Budget, seed: int) -> _MethodMap:
    cache, recorder, report = compress_recorded(prefilled, spec, budget, seed)
    ratio = cache.nbytes() / cache.full_nbytes()
    result = _MethodMap(method=spec, kv_ratio=ratio, report=report, recorded=bool(recorder.kept_slots))
    pads = (prefilled.input_ids.shape[1] - prefilled.attention_mask.sum(-1)).cpu().tolist()
    for layer_idx, original in prefilled.cache.folded_layers:
        compressed = cache.layers[layer_idx]
        if layer_idx not in recorder.kept_slots or not isinstance(compressed, FoldedLayer):
            continue
        _analyse_layer(result, layer_idx, original, compressed, recorder, pads)
    return result


def _analyse_layer(
    result: _MethodMap,
    layer_idx: int,
    original: FoldedLayer,
    compressed: FoldedLayer,
    recorder: MergeRecorder,
    pads: list[int],
) -> None:
    keep, lengths = recorder.kept_slots[layer_idx]
    keys, values, log_mass, _ = original.padded()
    keys, values = keys.double().cpu(), values.double().cpu()
    n_valid = torch.isfinite(log_mass).sum(-1).cpu()
    new_keys, new_values, _, new_lengths = compressed.padded()
    aligned = bool(torch.equal(new_lengths.cpu(), lengths))
    unit = torch.nn.functional.normalize(keys, dim=-1)
    pairs = recorder.pairs.get(layer_idx, [])
    for b in range(keep.shape[0]):
        for h in range(keep.shape[1]):  # diagnostics: a loop over heads is fine here
            count = int(lengths[b, h])
            evicted = int(n_valid[b, h]) - count
            if evicted <= 0:
                continue
            slots = keep[b, h, :count]
            order = torch.argsort(slots)
            retained = (slots[order] - pads[b]).numpy()
            carrier_parts, absorbed_parts, share_parts = [], [], []
            for carrier, absorbed, share in pairs:
                hit = absorbed[b, h] >= 0
                carrier_parts.append(carrier[b, h][hit])
                absorbed_parts.append(absorbed[b, h][hit])
                share_parts.append(share[b, h][hit])
            carriers = torch.cat(carrier_parts) if carrier_parts else torch.zeros(0, dtype=torch.long)
            absorbed_slots = torch.cat(absorbed_parts) if absorbed_parts else torch.zeros(0, dtype=torch.long)
            shares = torch.cat(share_parts) if share_parts else torch.zeros(0, dtype=torch.float64)
            similarity = (unit[b, h, carriers] * unit[b, h, absorbed_slots]).sum(-1)
            key_change = value_change = None
            metrics = carrier_load(retained, (carriers - pads[b]).numpy(), shares.numpy(), evicted)
            if aligned:
                k0, v0 = keys[b, h, slots], values[b, h, slots]
                k1 = new_keys[b, h, :count].double().cpu()
                v1 = new_values[b, h, :count].double().cpu()
                key_change = (k1 - k0).norm(dim=-1)[order].numpy()
                value_change = (v1 - v0).norm(dim=-1)[order].numpy()
                key_rel = key_change / k0.norm(dim=-1)[order].clamp_min(1e-30).numpy()
                value_rel = value_change / v0.norm(dim=-1)[order].clamp_min(1e-30).numpy()
                metrics.update(_update_load(key_change, value_change, key_rel, value_rel))
            metrics["evicted"] = float(evicted)
            metrics["retained"] = float(count)
            result.metrics[(layer_idx, b, h)] = metrics
            result.heads[(layer_idx, b, h)] = _HeadMap(
                retained,
                (carriers - pads[b]).numpy(),
                (absorbed_slots - pads[b]).numpy(),
                shares.numpy(),
                similarity.numpy(),
                key_change,
                value_change,
            )


# ---------------------------------------------------------------------------- several methods


@dataclass
class MergeMapResult:
    """What :func:`merge_maps` produced.

    Attributes:
        records: one dict per method: ``method``, ``kv_ratio``, ``summary`` (means over layers,
            batch rows and KV heads that evicted something; the pair measures over those that
            merged), ``per_layer`` (the same per layer), ``lorenz`` (mean top-``q`` share curve of the
            merge loads, and of ``‖Δv‖``).
        plot: the (layer, KV head, batch row) drawn, and each method's map for it.
        out_dir: where the files were written, or None.
    """

    records: list[dict[str, Any]]
    plot: dict[str, Any]
    out_dir: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {"records": self.records, "plot": self.plot}


PAIR_KEYS = (
    "merged_fraction",
    "active",
    "top1_share",
    "top10_share",
    "gini",
    "max_load",
    "max_over_mean",
    "boundary_share",
    "boundary_fraction",
)
UPDATE_KEYS = ("updated", "dk_rel_mean", "dv_rel_mean", "dk_top10_share", "dv_top10_share", "dk_gini", "dv_gini")


def _mean_of(rows: Sequence[Mapping[str, float]], keys: Sequence[str]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for key in keys:
        values = [r[key] for r in rows if key in r]
        out[key] = float(np.mean(values)) if values else None
    return out


def _summarize(maps: Sequence[_MethodMap]) -> dict[str, Any]:
    """Means over every (sample, layer, row, head) of one method."""
    rows = [m for mm in maps for m in mm.metrics.values()]
    merging = [m for m in rows if m["absorbed"] > 0]
    summary = {
        "heads": len(rows),
        "merging_heads": len(merging),
        "evicted": float(np.mean([m["evicted"] for m in rows])) if rows else 0.0,
        "absorbed": float(np.mean([m["absorbed"] for m in rows])) if rows else 0.0,
    }
    summary.update(_mean_of(merging, PAIR_KEYS))
    summary.update(_mean_of(rows, UPDATE_KEYS))
    layers = sorted({key[0] for mm in maps for key in mm.metrics})
    per_layer = []
    for layer in layers:
        at = [m for mm in maps for key, m in mm.metrics.items() if key[0] == layer]
        entry = {
            "layer": layer,
            **_mean_of(
                [m for m in at if m["absorbed"] > 0], ("merged_fraction", "top10_share", "gini", "boundary_share")
            ),
        }
        entry.update(_mean_of(at, ("dv_top10_share", "dv_gini")))
        per_layer.append(entry)
    curves = {"merge": [], "value_update": []}
    for mm in maps:
        for head in mm.heads.values():
            if head.shares.size:
                load = np.bincount(
                    np.searchsorted(head.retained, head.carriers), weights=head.shares, minlength=head.retained.size
                )
                curves["merge"].append(lorenz_curve(load))
            if head.value_change is not None and head.value_change.sum() > 0:
                curves["value_update"].append(lorenz_curve(head.value_change))
    lorenz = {name: (np.nanmean(np.stack(c), axis=0).tolist() if c else None) for name, c in curves.items()}
    return {"summary": summary, "per_layer": per_layer, "lorenz": lorenz}


def _head_json(head: _HeadMap | None) -> dict[str, Any] | None:
    if head is None:
        return None
    return {
        "retained": head.retained.tolist(),
        "pairs": [
            [int(c), int(a), round(float(s), 6), round(float(q), 4)]
            for c, a, s, q in zip(head.carriers, head.absorbed, head.shares, head.similarity, strict=True)
        ],
        "key_change": None if head.key_change is None else [round(float(x), 6) for x in head.key_change],
        "value_change": None if head.value_change is None else [round(float(x), 6) for x in head.value_change],
    }


def merge_maps(
    prefilled: PrefilledContext | Sequence[PrefilledContext],
    methods: Sequence[str],
    budget: float | int | str | Budget,
    *,
    layer: int | None = None,
    head: int = 0,
    seed: int = 0,
    out_dir: str | Path | None = None,
    run_config: Mapping[str, Any] | None = None,
) -> MergeMapResult:
    """Merge maps and carrier-load measures of each method on one or more prefilled contexts.

    Args:
        prefilled: a prefilled context (batch rows are analysed separately), or several.
        methods: method specs (eviction-only specs give the retained spans and zero loads).
        budget: a fraction in (0, 1] or a token count.
        layer: the layer drawn (default: the middle compressed layer); head: the KV head drawn.
        seed: seed for randomized methods (CaM's Bernoulli draws).
        out_dir: where to write ``mergemap.json``, ``mergemap.md``, ``mergemap.png`` and
            ``carrier_load.png``.
        run_config: facts shown in the report (model, context, budget, …).

    Returns:
        A :class:`MergeMapResult`; the drawn map is that of the first context's first batch row.
    """
    contexts = [prefilled] if isinstance(prefilled, PrefilledContext) else list(prefilled)
    if not contexts or not methods:
        raise ValueError("merge_maps needs at least one prefilled context and one method")
    parsed = Budget.parse(budget)
    folded = [i for i, _ in contexts[0].cache.folded_layers]
    layer = folded[len(folded) // 2] if layer is None else layer
    if layer not in folded:
        raise ValueError(f"layer {layer} is not a compressed (full-attention) layer; choose one of {folded}")
    heads = contexts[0].cache.layers[layer].num_heads
    if not 0 <= head < heads:
        raise ValueError(f"head must be in [0, {heads}); got {head}")
    records, drawn = [], {}
    for spec in methods:
        maps = [_analyse(context, spec, parsed, seed) for context in contexts]
        record = {
            "method": spec,
            "budget": parsed.label(),
            "recorded": any(m.recorded for m in maps),
            "kv_ratio": float(np.mean([m.kv_ratio for m in maps])),
            **_summarize(maps),
        }
        records.append(record)
        drawn[spec] = _head_json(maps[0].heads.get((layer, 0, head))) if record["recorded"] else "unrecorded"
    plot = {"layer": layer, "head": head, "row": 0, "maps": drawn}
    result = MergeMapResult(records=records, plot=plot, out_dir=None if out_dir is None else Path(out_dir))
    if result.out_dir is not None:
        result.out_dir.mkdir(parents=True, exist_ok=True)
        info = dict(run_config or {})
        info.update({"budget": parsed.label(), "layer": layer, "head": head})
        payload = {"config": info, **result.to_json()}
        (result.out_dir / "mergemap.json").write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
        (result.out_dir / "mergemap.md").write_text(mergemap_markdown(records, plot, info), encoding="utf-8")
        plot_merge_maps(plot, result.out_dir / "mergemap.png")
        plot_carrier_load(records, result.out_dir / "carrier_load.png")
    return result


# ---------------------------------------------------------------------------- report and plots


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def mergemap_markdown(records: Sequence[Mapping[str, Any]], plot: Mapping[str, Any], info: Mapping[str, Any]) -> str:
    """The carrier-load report (one row per method) with the plots below it."""
    lines = ["# kvfold mergemap", ""]
    lines += [", ".join(f"{k}: {v}" for k, v in info.items()), ""]
    lines += [
        "Per layer and KV head, each retained entry's **load** is the number of evicted tokens it absorbed "
        "(fractions when a token is spread over several carriers). Pair measures are means over the heads "
        "that merged anything: `merged` = absorbed / evicted, `active` = retained entries with a load, "
        "`top 1%` / `top 10%` = share of the load on the most loaded 1% / 10% of retained entries, "
        "`Gini` of the loads, `max/mean` = largest load over the mean load, `boundary` = share of the load on "
        "the first/last entry of a retained span (with the share of retained entries that are boundaries). "
        "Update measures (every method, GRKV included): `‖Δv‖ top 10%` and `‖Δv‖ Gini` over the retained "
        "entries' value changes, `updated` = retained entries that changed, `‖Δk‖/‖k‖`, `‖Δv‖/‖v‖` means.",
        "",
        "| method | kv | evicted/head | merged | active | top 1% | top 10% | Gini | max/mean | boundary "
        "| updated | ‖Δk‖/‖k‖ | ‖Δv‖/‖v‖ | ‖Δv‖ top 10% | ‖Δv‖ Gini |",
        "|:---|" + "---:|" * 15,
    ]
    for r in records:
        s = r["summary"]
        if not r.get("recorded", True):
            lines.append(f"| `{r['method']}` | {r['kv_ratio']:.3f} | records no merge map" + " | –" * 13 + " |")
            continue
        boundary = (
            "–" if s.get("boundary_share") is None else (f"{s['boundary_share']:.2f} ({s['boundary_fraction']:.2f})")
        )
        cells = [
            f"`{r['method']}`",
            f"{r['kv_ratio']:.3f}",
            _fmt(s["evicted"], 4),
            _fmt(s.get("merged_fraction")),
            _fmt(s.get("active")),
            _fmt(s.get("top1_share")),
            _fmt(s.get("top10_share")),
            _fmt(s.get("gini")),
            _fmt(s.get("max_over_mean")),
            boundary,
            _fmt(s.get("updated")),
            _fmt(s.get("dk_rel_mean")),
            _fmt(s.get("dv_rel_mean")),
            _fmt(s.get("dv_top10_share")),
            _fmt(s.get("dv_gini")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Merge map: layer {plot['layer']}, KV head {plot['head']} (first context).",
        "",
        "![merge maps](mergemap.png)",
        "",
        "![carrier load](carrier_load.png)",
        "",
    ]
    return "\n".join(lines)


def _spans(retained: Sequence[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for p in retained:
        if spans and p == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], p)
        else:
            spans.append((p, p))
    return spans


def plot_merge_maps(plot: Mapping[str, Any], path: str | Path) -> Path:
    """GRKV Figure 1 per method: x = retained carrier position, y = absorbed (evicted) position,
    colour = key cosine similarity, black bars = retained spans. Methods with no pairs show their
    update magnitudes ``‖Δk‖``, ``‖Δv‖`` per retained position instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    maps = plot["maps"]
    names = list(maps)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.6 * rows), squeeze=False)
    scatter = None
    for ax, name in zip(axes.flat, names, strict=False):
        head = maps[name]
        ax.set_title(f"{name}", fontsize=10)
        if head is None or head == "unrecorded":
            text = "nothing evicted in this layer/head" if head is None else "this method records no merge map"
            ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        retained = head["retained"]
        top = max([*retained, *(p[1] for p in head["pairs"]), 1])
        if head["pairs"]:
            pairs = np.asarray(head["pairs"], dtype=np.float64)
            scatter = ax.scatter(
                pairs[:, 0], pairs[:, 1], c=pairs[:, 3], s=6, cmap="viridis", vmin=-1, vmax=1, linewidths=0
            )
            ax.plot([0, top], [0, top], "--", color="gray", linewidth=0.7)
            ax.set_ylabel("absorbed (evicted) token position")
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [-0.02 * top] * 2, color="black", linewidth=3, solid_capstyle="butt")
            ax.set_ylim(-0.05 * top, top * 1.02)
        elif head["value_change"] is not None and sum(head["value_change"]) > 0:
            ax.vlines(retained, 0, head["value_change"], color="tab:red", linewidth=0.6, label="‖Δv‖")
            ax.vlines(np.asarray(retained) + 0.3, 0, head["key_change"], color="tab:blue", linewidth=0.6, label="‖Δk‖")
            ax.legend(fontsize=8, loc="upper left")
            ax.set_ylabel("update magnitude of the retained entry")
            ymax = max(max(head["value_change"]), max(head["key_change"]), 1e-12)
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [-0.03 * ymax] * 2, color="black", linewidth=3, solid_capstyle="butt")
        else:
            for lo, hi in _spans(retained):
                ax.plot([lo, hi + 0.5], [0, 0], color="black", linewidth=3, solid_capstyle="butt")
            ax.text(
                0.5,
                0.5,
                "no merge and no update\nin this layer and head",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
            ax.set_yticks([])
        ax.set_xlim(-0.01 * top, top * 1.01)
        ax.set_xlabel("retained (carrier) token position")
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    if scatter is not None:
        fig.colorbar(scatter, ax=axes.ravel().tolist(), shrink=0.8, label="key cosine similarity")
    fig.suptitle(f"Merge maps, layer {plot['layer']}, KV head {plot['head']} (black bars: retained spans)")
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_carrier_load(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Lorenz-style curves: share of the load held by the most loaded fraction of retained entries
    (solid: merge loads; dashed: ‖Δv‖), mean over layers and heads; the diagonal is an even load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5))
    grid = np.linspace(0.0, 1.0, LORENZ_POINTS)
    cmap = plt.get_cmap("tab10")
    for i, r in enumerate(records):
        color = cmap(i % 10)
        if r["lorenz"].get("merge") is not None:
            ax.plot(grid, r["lorenz"]["merge"], color=color, label=f"{r['method']} (merges)")
        if r["lorenz"].get("value_update") is not None:
            ax.plot(grid, r["lorenz"]["value_update"], color=color, linestyle="--", label=f"{r['method']} (‖Δv‖)")
    ax.plot([0, 1], [0, 1], ":", color="gray", label="even load")
    ax.set_xlabel("fraction of retained entries (most loaded first)")
    ax.set_ylabel("share of the load")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("Carrier load concentration")
    path = Path(path)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- command line


def add_parsers(sub: Any) -> None:
    """The ``kvfold mergemap`` sub-parser."""
    from kvfold.cli.args import add_model_args

    p = sub.add_parser("mergemap", help="which retained entry absorbed which evicted token, and carrier load")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="file with the context text")
    src.add_argument("--dataset", help="ruler[:TASKS] (synthetic), PATH.jsonl, …: the contexts of its first samples")
    p.add_argument("--length", type=int, default=2048, help="context length in tokens for --dataset ruler (2048)")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="samples per task of --dataset; measures are averaged over their contexts (default 1)",
    )
    p.add_argument("--methods", required=True, help="comma-separated specs, e.g. snapkv,snapkv+cam,snapkv+grkv")
    p.add_argument("--budget", default="0.1", help="fraction in (0, 1] or token count (default 0.1)")
    p.add_argument("--layer", type=int, default=None, help="layer drawn (default: the middle one)")
    p.add_argument("--head", type=int, default=0, help="KV head drawn (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")


def run(args: Any) -> int:
    """``kvfold mergemap``: write mergemap.json, mergemap.md, mergemap.png and carrier_load.png."""
    import sys

    from kvfold.methods import split_specs
    from kvfold.pipeline.context import prefill
    from kvfold.runtime.models import load_model

    methods = split_specs(args.methods)
    for spec in methods:
        build_method(spec)
    budget = Budget.parse(args.budget)
    if args.samples < 1:
        raise ValueError(f"--samples must be ≥ 1; got {args.samples}")
    if args.context_file is not None and not args.context_file.is_file():
        raise ValueError(f"context file not found: {args.context_file}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.context_file is not None:
        texts = [(args.context_file.read_text(encoding="utf-8"), None)]
        source = str(args.context_file)
    else:
        from kvfold.evaluate.data.loaders import load_dataset_spec

        samples = load_dataset_spec(args.dataset, tokenizer, length=args.length, samples=args.samples, seed=args.seed)
        unique = list({s.context: s for s in samples}.values())  # one per context
        if not unique:
            raise ValueError(f"--dataset {args.dataset}: no samples")
        texts = [(s.context, None if s.chat_template else False) for s in unique]
        source = f"{args.dataset} @ {args.length}"
    contexts = [
        prefill(model, tokenizer, text, use_chat_template=template, methods=methods) for text, template in texts
    ]
    config = {
        "model": args.model,
        "context": source,
        "contexts": len(contexts),
        "context_tokens": [c.context_tokens for c in contexts],
        "seed": args.seed,
    }
    result = merge_maps(
        contexts, methods, budget, layer=args.layer, head=args.head, seed=args.seed, out_dir=args.out, run_config=config
    )
    for r in result.records:
        s = r["summary"]
        print(
            f"{r['method']:<28} merged {_fmt(s.get('merged_fraction'))}  top10% {_fmt(s.get('top10_share'))}  "
            f"gini {_fmt(s.get('gini'))}  boundary {_fmt(s.get('boundary_share'))}  "
            f"dv-gini {_fmt(s.get('dv_gini'))}"
        )
    print(f"wrote {args.out}/mergemap.json, mergemap.md, mergemap.png, carrier_load.png", file=sys.stderr)
    return 0


COMMANDS = {"mergemap": run}
"""The subcommand of this module, gathered by :mod:`kvfold.cli.main`."""
