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

The load measures are in :mod:`~kvfold.evaluate.diagnostics.concentration`, the report and plots in
:mod:`~kvfold.evaluate.diagnostics.mergemap_report`, the command line in :mod:`kvfold.cli.diagnostics`.

Example:
    >>> from kvfold import load_model, prefill
    >>> model, tokenizer = load_model()
    >>> context = prefill(model, tokenizer, text, methods="snapkv+cam,snapkv+d2o_merge")
    >>> result = merge_maps(context, ["snapkv+cam", "snapkv+d2o_merge"], 0.1, out_dir="runs/mergemap")
    >>> result.records[0]["summary"]["top10_share"]
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfold.evaluate.diagnostics.concentration import carrier_load, lorenz_curve, update_load
from kvfold.evaluate.diagnostics.mergemap_report import mergemap_markdown, plot_carrier_load, plot_merge_maps
from kvfold.methods import build_method
from kvfold.pipeline.context import PrefilledContext
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.files import DirectoryLock, atomic_write_text
from kvfold.runtime.folded_layer import FoldedLayer

__all__ = [
    "MergeMapResult",
    "MergeRecorder",
    "compress_recorded",
    "merge_maps",
]


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
    ctx = prefilled.compression_context(cache, parsed, seed=seed, shared=prefilled.shared, merge_recorder=recorder)
    with torch.inference_mode():
        if not composed.is_identity and not parsed.is_full:
            composed.compress(ctx)
    return cache, recorder, ctx.report


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
                metrics.update(update_load(key_change, value_change, key_rel, value_rel))
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
        raise UserError("merge_maps needs at least one prefilled context and one method")
    parsed = Budget.parse(budget)
    folded = [i for i, _ in contexts[0].cache.folded_layers]
    layer = folded[len(folded) // 2] if layer is None else layer
    if layer not in folded:
        raise UserError(f"layer {layer} is not a compressed (full-attention) layer; choose one of {folded}")
    heads = contexts[0].cache.layers[layer].num_heads
    if not 0 <= head < heads:
        raise UserError(f"head must be in [0, {heads}); got {head}")
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
        info = dict(run_config or {})
        info.update({"budget": parsed.label(), "layer": layer, "head": head})
        _write_files(result, info)
    return result


def _write_files(result: MergeMapResult, info: Mapping[str, Any]) -> None:
    """``mergemap.json``, ``mergemap.md`` and the two plots, each atomically, the folder held meanwhile.

    Raises:
        OutputError: the folder is in use by another kvfold, or a file cannot be written.
    """
    out_dir = result.out_dir
    with DirectoryLock(out_dir):
        payload = {"config": dict(info), **result.to_json()}
        atomic_write_text(out_dir / "mergemap.json", json.dumps(payload, indent=1) + "\n")
        atomic_write_text(out_dir / "mergemap.md", mergemap_markdown(result.records, result.plot, info))
        plot_merge_maps(result.plot, out_dir / "mergemap.png")
        plot_carrier_load(result.records, out_dir / "carrier_load.png")
