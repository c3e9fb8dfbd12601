"""KVMerger: merging sets of consecutive similar keys merged around a pivot (``kvmerger``, ``kvmerger_sets``).

Wang et al. 2024, "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on
Long-Context Tasks" (arXiv:2407.08454). Keys of consecutive tokens are often highly similar, so
the cache is cut into **merging sets** (the paper's merging-set identification): runs of
consecutive tokens whose neighbouring keys have a cosine similarity above a per-layer threshold.
Each set becomes one entry at its **pivot**, the token with the most attention, by the paper's
Gaussian-kernel weights around the pivot's key::

    set boundary between i and i+1   iff   cos(k_i, k_{i+1}) < τ_l           (τ_l: per layer)
    p = argmax_{i∈S} A_i
    w_i = exp(−‖k_i − k_p‖² / (2σ²))           (w_p = 1)
    k_S = Σ_i w_i k_i / Σ_i w_i,   v_S = Σ_i w_i v_i / Σ_i w_i

Two forms:

* ``kvmerger_sets`` (standalone; bare ``kvmerger`` is this one): merging sets replace eviction
  altogether (every token ends in some set) and the budget is met through the thresholds.
* ``SELECTOR+kvmerger`` (folder, e.g. ``snapkv+kvmerger``): the selector decides which entries
  are kept; KVMerger decides what happens to the evicted ones (see :class:`KVMerger`).

Design choices of the standalone (ours, where the method leaves room):

* **Per-layer threshold from the budget** ("the model tells you where to merge"): in each layer
  (per batch row) ``τ_l`` is the similarity above which exactly enough neighbouring pairs are
  joined for the layer to hold ``H · budget`` entries. The pairs joined are the most similar
  ones of the whole layer, so heads with more redundant keys end with fewer entries (real
  per-head lengths, stored paged). ``threshold`` sets a floor below which no pair is joined
  (then the layer may hold more than the budget).
* ``A`` is the attention of the last ``window`` prefill queries (GQA mean); the ``sinks`` first
  tokens and the window's own tokens are never merged (as every baseline here keeps them).
* ``σ`` (``sigma``): None = per set, the root-mean-square distance of its members to the pivot
  (a scale-free kernel; key norms vary by layer), or a fixed value.
* β: a pseudo-token stands for ``|S|`` tokens; KVMerger keeps no mass (β unchanged = the
  pivot's); ``log_mass=true`` sets ``β = log Σ_{i∈S} exp(β_i)`` (= log |S| on a fresh cache).

Design choices of the folder (ours): the merging sets use a **fixed** cosine threshold
(``threshold``, 0.8 as KeepKV's merge threshold) instead of the budget-driven one, since the
selector already meets the budget; an evicted token merges into a kept member of its set (the
set's pivot = its highest-attention *kept* member, or optionally the nearest kept member), and
is evicted when its set holds no kept member. Kept entries never merge into each other.

Reconstruction note: this follows the paper as we read it (Gaussian-kernel merging around the
pivot, consecutive-similarity sets, per-layer thresholds); docs/methods.md lists where it departs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.methods.core.base import Standalone, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import FoldSite, MergingFolder, compute_dtype, kept_mask, window_scores
from kvfold.methods.core.selection import protected_mask
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor

__all__ = [
    "CARRIERS",
    "KVMerger",
    "KVMergerSets",
    "gaussian_merge",
    "group_log_mass",
    "kept_carriers",
    "kvmerger_fold",
    "layer_joins",
    "merging_sets",
    "similar_runs",
]

CARRIERS = ("pivot", "nearest")
"""How the folder picks, among the kept members of a merging set, the one an evicted member joins."""


def layer_joins(
    similarity: Tensor, joinable: Tensor, joins: Tensor, floor: float | None = None
) -> tuple[Tensor, Tensor]:
    """Join the ``joins[b]`` most similar joinable neighbour pairs of each batch row's layer.

    Args:
        similarity: ``(B, H, N−1)`` ``cos(k_i, k_{i+1})``.
        joinable: ``(B, H, N−1)`` bool, pairs that may be joined (both tokens mergeable).
        joins: ``(B,)`` long, how many pairs to join in the layer (all heads together).
        floor: never join a pair less similar than this (None = no floor).

    Returns:
        ``(join (B, H, N−1) bool, threshold (B,))``: the joined pairs and ``τ_l``, the similarity of
        the least similar joined pair (``+inf`` when none is joined). Ties: lower head, then
        lower position first.
    """
    batch = similarity.shape[0]
    flat = similarity.masked_fill(~joinable, -torch.inf).reshape(batch, -1)
    order = torch.sort(flat, dim=-1, descending=True, stable=True).indices
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    join = (rank < joins[:, None]) & joinable.reshape(batch, -1)
    if floor is not None:
        join = join & (flat >= floor)
    join = join.view_as(similarity)
    threshold = torch.where(join, similarity, torch.full_like(similarity, torch.inf)).flatten(1).amin(-1)
    return join, threshold


def merging_sets(join: Tensor, valid: Tensor, scores: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Set index of every token, number of sets and each set's pivot (highest score, then first).

    Args:
        join: ``(B, H, N−1)`` bool, token ``i+1`` continues the set of token ``i``.
        valid: ``(B, H, N)`` bool.
        scores: ``(B, H, N)`` attention ``A`` (the pivot is the argmax within a set).

    Returns:
        ``(set_id (B, H, N) long (−1 on padding), count (B, H) long, pivot (B, H, S) long)`` with
        ``S = max count``; ``pivot[..., s]`` is the position of set ``s``'s pivot (sets in position
        order; rows with fewer sets repeat their last pivot).
    """
    starts = valid.clone()
    starts[..., 1:] &= ~join
    set_id = torch.where(valid, starts.long().cumsum(-1) - 1, torch.full_like(starts, -1, dtype=torch.long))
    count = starts.sum(-1)
    width = max(int(count.max()), 1)
    index = set_id.clamp(min=0)
    masked = scores.masked_fill(~valid, -torch.inf)
    best = torch.full((*valid.shape[:2], width), -torch.inf, dtype=scores.dtype, device=scores.device)
    best = best.scatter_reduce(-1, index, masked, "amax")
    length = valid.shape[-1]
    position = torch.arange(length, device=valid.device).expand_as(set_id)
    candidate = valid & (masked == torch.gather(best, -1, index))
    first = torch.where(candidate, position, torch.full_like(position, length))
    pivot = torch.full((*valid.shape[:2], width), length, dtype=torch.long, device=valid.device)
    pivot = pivot.scatter_reduce(-1, index, first, "amin")
    slot = torch.arange(width, device=valid.device)[None, None, :] < count[..., None]
    last = torch.gather(pivot, -1, (count - 1).clamp(min=0)[..., None])
    pivot = torch.where(slot, pivot, last).clamp(max=length - 1)
    return set_id, count, pivot


def gaussian_merge(
    keys: Tensor, values: Tensor, set_id: Tensor, pivot: Tensor, sigma: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Gaussian-kernel average of every set around its pivot key.

    Args:
        keys, values: ``(B, H, N, D)`` in the compute dtype.
        set_id: ``(B, H, N)`` (−1 = padding, left out).
        pivot: ``(B, H, S)`` pivot position per set.
        sigma: kernel width ``σ``; None = per set ``σ² = Σ_{i≠p} ‖k_i − k_p‖² / (|S| − 1)``.

    Returns:
        ``(keys (B, H, S, D), values (B, H, S, D), weights (B, H, N))`` with ``weights`` the
        normalized ``w_i / Σ w`` of each token in its set (0 on padding).
    """
    valid = set_id >= 0
    index = set_id.clamp(min=0)
    width = pivot.shape[-1]
    pivot_of = torch.gather(pivot, -1, index)  # (B, H, N) the pivot of each token's set
    pivot_keys = torch.gather(keys, 2, pivot_of[..., None].expand_as(keys))
    dist2 = (keys - pivot_keys).square().sum(-1).masked_fill(~valid, 0.0)  # ‖k_i − k_p‖²
    if sigma is None:
        members = torch.zeros(*set_id.shape[:2], width, dtype=keys.dtype, device=keys.device)
        members = members.scatter_add(-1, index, valid.to(keys.dtype))
        spread = torch.zeros_like(members).scatter_add(-1, index, dist2)
        var = spread / (members - 1).clamp(min=1)  # σ² per set (the pivot adds 0)
        var_of = torch.gather(var, -1, index)
    else:
        var_of = torch.full_like(dist2, float(sigma) ** 2)
    tiny = torch.finfo(keys.dtype).tiny
    weight = torch.where(var_of > tiny, torch.exp(-dist2 / (2 * var_of.clamp(min=tiny))), torch.ones_like(dist2))
    weight = weight * valid  # w_p = exp(0) = 1
    total = torch.zeros(*set_id.shape[:2], width, dtype=keys.dtype, device=keys.device)
    total = total.scatter_add(-1, index, weight)
    merged = []
    for tensor in (keys, values):
        acc = torch.zeros(*tensor.shape[:2], width, tensor.shape[-1], dtype=tensor.dtype, device=tensor.device)
        acc = acc.scatter_add(2, index[..., None].expand_as(tensor), tensor * weight[..., None])
        merged.append(acc / total.clamp(min=tiny)[..., None])
    normalized = weight / torch.gather(total, -1, index).clamp(min=tiny)
    return merged[0], merged[1], normalized


def group_log_mass(log_mass: Tensor, group: Tensor, width: int) -> Tensor:
    """``β_S = log Σ_{i∈S} exp(β_i)`` of every group (a merging set, or a carrier with what it absorbed).

    Args:
        log_mass: ``(B, H, N)`` β of every token.
        group: ``(B, H, N)`` long, each token's group in ``[0, width)`` (−1 = in none).
        width: number of groups per row.

    Returns:
        ``(B, H, width)`` (−inf for a group with no member); a single member keeps its β exactly.
    """
    member = group >= 0
    index = group.clamp(min=0)
    beta = torch.where(member, log_mass, torch.full_like(log_mass, -torch.inf))
    peak = torch.full((*group.shape[:2], width), -torch.inf, dtype=beta.dtype, device=beta.device)
    peak = peak.scatter_reduce(-1, index, beta, "amax")
    shifted = torch.exp(beta - torch.gather(peak, -1, index)).masked_fill(~member, 0.0)
    mass = torch.zeros_like(peak).scatter_add(-1, index, shifted)
    return peak + torch.log(mass.clamp(min=torch.finfo(mass.dtype).tiny))


def similar_runs(keys: Tensor, valid: Tensor, threshold: float) -> Tensor:
    """Merging sets with a fixed threshold: ``set_id`` of every token, sets in position order.

    Neighbours ``i, i+1`` (both valid) share a set iff ``cos(k_i, k_{i+1}) ≥ threshold``.

    Args:
        keys: ``(B, H, N, D)``; valid: ``(B, H, N)`` bool.
        threshold: cosine similarity in ``[−1, 1]``.

    Returns:
        ``(B, H, N)`` long set index (−1 on padding).
    """
    unit = F.normalize(keys, dim=-1)
    similarity = (unit[:, :, :-1] * unit[:, :, 1:]).sum(-1)  # cos(k_i, k_{i+1})
    join = valid[..., :-1] & valid[..., 1:] & (similarity >= threshold)
    starts = valid.clone()
    starts[..., 1:] &= ~join
    return torch.where(valid, starts.long().cumsum(-1) - 1, torch.full_like(starts, -1, dtype=torch.long))


def kept_carriers(set_id: Tensor, kept: Tensor, attention: Tensor, carrier: str = "pivot") -> Tensor:
    """The kept member of its merging set that each token would merge into (−1: its set keeps none).

    Args:
        set_id: ``(B, H, N)`` from :func:`similar_runs` (−1 on padding).
        kept: ``(B, H, N)`` bool, the entries the selector keeps.
        attention: ``(B, H, N)`` ``A``.
        carrier: ``pivot`` — the set's highest-attention kept member (first on ties), KVMerger's
            pivot restricted to what is kept; ``nearest`` — the closest kept member of the set
            along the sequence (ties: higher attention, then the earlier one).

    Returns:
        ``(B, H, N)`` long position of the carrier (a kept token is its own carrier).
    """
    if carrier not in CARRIERS:
        raise ValueError(f"kept_carriers: carrier must be one of {', '.join(CARRIERS)}; got {carrier!r}")
    length = set_id.shape[-1]
    member = set_id >= 0
    kept = kept & member
    index = set_id.clamp(min=0)
    position = torch.arange(length, device=set_id.device).expand_as(set_id)
    none = torch.full_like(position, -1)
    if carrier == "pivot":
        width = int(set_id.max()) + 1 if set_id.numel() else 1
        masked = attention.masked_fill(~kept, -torch.inf)
        best = torch.full((*set_id.shape[:2], max(width, 1)), -torch.inf, dtype=masked.dtype, device=masked.device)
        best = best.scatter_reduce(-1, index, masked, "amax")
        candidate = kept & (masked == torch.gather(best, -1, index))
        first = torch.where(candidate, position, torch.full_like(position, length))
        pivot = torch.full(best.shape, length, dtype=torch.long, device=set_id.device)
        pivot = pivot.scatter_reduce(-1, index, first, "amin")
        chosen = torch.gather(pivot, -1, index)
        chosen = torch.where(chosen < length, chosen, none)
        return torch.where(kept, position, torch.where(member, chosen, none))
    before = torch.where(kept, position, none).cummax(-1).values  # last kept position ≤ i
    after = torch.where(kept, position, torch.full_like(position, length)).flip(-1).cummin(-1).values.flip(-1)
    has_before = (before >= 0) & (torch.gather(set_id, -1, before.clamp(min=0)) == set_id)
    has_after = (after < length) & (torch.gather(set_id, -1, after.clamp(max=length - 1)) == set_id)
    gap_before, gap_after = position - before, after - position
    a_before = torch.gather(attention, -1, before.clamp(min=0))
    a_after = torch.gather(attention, -1, after.clamp(max=length - 1))
    prefer_before = (gap_before < gap_after) | ((gap_before == gap_after) & (a_before >= a_after))
    take_before = has_before & (~has_after | prefer_before)
    chosen = torch.where(take_before, before, torch.where(has_after, after, none))
    return torch.where(member, chosen, none)


def kvmerger_fold(
    keys: Tensor,
    values: Tensor,
    log_mass: Tensor,
    keep: Tensor,
    lengths: Tensor,
    attention: Tensor,
    threshold: float,
    sigma: float | None = None,
    carrier: str = "pivot",
    log_mass_sum: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """KVMerger as a folder: evicted members of a merging set join a kept member by Gaussian weights.

    Each carrier ``c`` with the evicted tokens ``E_c`` it absorbs becomes (``w_c = 1``)::

        w_e = exp(−‖k_e − k_c‖² / (2σ²)),   k_c ← (k_c + Σ_e w_e k_e) / (1 + Σ_e w_e)   (same for v)

    with ``σ² = Σ_e ‖k_e − k_c‖² / |E_c|`` when ``sigma`` is None (as :func:`gaussian_merge`).

    Args:
        keys, values: ``(B, H, N, D)`` all entries (compute dtype); log_mass: ``(B, H, N)`` β
            (−inf on padding).
        keep: ``(B, H, K)`` kept slots; lengths: ``(B, H)``.
        attention: ``(B, H, N)`` ``A`` (picks the pivot among a set's kept members).
        threshold: cosine similarity at which neighbours share a merging set.
        sigma: kernel width, or None (per carrier).
        carrier: ``pivot`` or ``nearest`` (see :func:`kept_carriers`).
        log_mass_sum: β of a carrier = ``log Σ exp β`` over it and what it absorbed (else unchanged).

    Returns:
        ``(keys (B, H, K, D), values (B, H, K, D), β (B, H, K), carrier (B, H, N), merged (B, H, N))``:
        the kept entries in ``keep`` order (a carrier that absorbs nothing is returned exactly),
        the carrier position of every merged token (−1 for all others) and which tokens merged.
    """
    valid = torch.isfinite(log_mass)
    length = valid.shape[-1]
    width = keep.shape[-1]
    kept = kept_mask(keep, lengths, length) & valid
    set_id = similar_runs(keys, valid, threshold)
    carrier_of = kept_carriers(set_id, kept, attention, carrier)
    merged = valid & ~kept & (carrier_of >= 0)
    slot = torch.arange(width, device=keep.device)[None, None, :].expand_as(keep)
    target = torch.where(slot < lengths[..., None], keep, torch.full_like(keep, length))  # spare slots: a dump
    slot_of = torch.full((*keep.shape[:2], length + 1), -1, dtype=torch.long, device=keep.device)
    slot_of = slot_of.scatter(-1, target, slot)[..., :length]  # kept position → its entry
    position = torch.arange(length, device=keep.device).expand_as(carrier_of)
    group = torch.where(merged, torch.gather(slot_of, -1, carrier_of.clamp(min=0)), torch.full_like(position, -1))
    group = torch.where(kept, slot_of, group)
    new_keys, new_values, _ = gaussian_merge(keys, values, group, keep, sigma)
    in_row = slot < lengths[..., None]
    # β_c = log Σ_{i∈{c}∪E_c} exp(β_i) with log_mass_sum, else the carrier's own
    beta = group_log_mass(log_mass, group, width) if log_mass_sum else torch.gather(log_mass, -1, keep)
    beta = torch.where(in_row, beta, torch.full_like(beta, -torch.inf))
    carrier_of = torch.where(merged, carrier_of, torch.full_like(carrier_of, -1))
    return new_keys, new_values, beta, carrier_of, merged


@register
@dataclass
class KVMergerSets(Standalone):
    """KVMerger (Wang et al. 2024) as a complete method: runs of consecutive tokens with highly
    similar keys merge into one entry at their highest-attention pivot by Gaussian-kernel weights;
    per-layer similarity thresholds are set so that each layer meets the budget (see the module
    docstring). Bare ``kvmerger`` runs this method.

    Parameters:
        window: prefill queries whose attention picks the pivots; their tokens are never merged (32).
        sinks: first tokens never merged (4).
        sigma: Gaussian kernel width; None = per set, the RMS distance of its keys to the pivot.
        threshold: least cosine similarity at which neighbours may join (None = whatever the
            budget needs; with a floor the layer may keep more than the budget).
        log_mass: β of a merged entry = log of the tokens it stands for (off: KVMerger has no β).
    """

    name: ClassVar[str] = "kvmerger_sets"
    description: ClassVar[str] = (
        "merge runs of consecutive similar keys into their top-attention pivot (Gaussian kernel), per-layer "
        "thresholds meeting the budget (= bare kvmerger)"
    )
    paper: ClassVar[str] = (
        "Wang et al. 2024, Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on Long-Context Tasks"
    )
    window: int = 32
    sinks: int = 4
    sigma: float | None = None
    threshold: float | None = None
    log_mass: bool = False

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        if self.window < 1 or self.sinks < 0:
            raise SpecError(f"{self.name}: window must be ≥ 1 and sinks ≥ 0; got {self.window}, {self.sinks}")
        if self.sigma is not None and not self.sigma > 0:
            raise SpecError(f"{self.name}: sigma must be > 0 (or none); got {self.sigma}")
        if self.threshold is not None and not -1.0 <= self.threshold <= 1.0:
            raise SpecError(f"{self.name}: threshold is a cosine similarity in [-1, 1]; got {self.threshold}")

    def compress(self, ctx: CompressionContext) -> None:
        budgets = ctx.row_budgets
        report = ctx.report.setdefault("kvmerger", {})
        for layer_idx, layer in ctx.cache.folded_layers:
            info = self._compress_layer(layer_idx, layer, budgets, ctx)
            if info is not None:
                report[layer_idx] = info

    def _compress_layer(
        self, layer_idx: int, layer: FoldedLayer, budgets: Tensor, ctx: CompressionContext
    ) -> dict | None:
        keys, values, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        n_valid = valid.sum(-1)  # (B, H)
        target = torch.minimum(budgets.to(valid.device)[:, None].expand_as(n_valid), n_valid).sum(-1)  # (B,)
        joins = n_valid.sum(-1) - target  # pairs to join per batch row
        if bool((joins <= 0).all()):
            return None
        dtype = compute_dtype(keys)
        k, v = keys.to(dtype), values.to(dtype)
        attention, _ = window_scores(ctx, layer_idx, layer, self.window, self.name)
        protected = protected_mask(*valid.shape, sinks=self.sinks, recent=self.window, valid=valid)
        mergeable = valid & ~protected
        unit = F.normalize(k, dim=-1)
        similarity = (unit[:, :, :-1] * unit[:, :, 1:]).sum(-1)  # cos(k_i, k_{i+1})
        joinable = mergeable[..., :-1] & mergeable[..., 1:]
        join, threshold = layer_joins(similarity, joinable, joins.clamp(min=0), self.threshold)
        set_id, count, pivot = merging_sets(join, valid, attention)
        new_keys, new_values, weight = gaussian_merge(k, v, set_id, pivot, self.sigma)
        index = set_id.clamp(min=0)
        if self.log_mass:  # β_S = log Σ_{i∈S} exp(β_i)
            new_beta = group_log_mass(log_mass, set_id, pivot.shape[-1])
        else:
            new_beta = torch.gather(log_mass, -1, pivot)
        layer.replace(new_keys.to(keys.dtype), new_values.to(values.dtype), new_beta, lengths=count)
        ctx.record_kept(layer_idx, pivot, count)
        if ctx.merge_recorder is not None:
            carrier = torch.gather(pivot, -1, index)
            position = torch.arange(valid.shape[-1], device=valid.device).expand_as(carrier)
            absorbed = torch.where(valid & (position != carrier), position, torch.full_like(position, -1))
            ctx.record_merges(layer_idx, carrier, absorbed)
        sizes = torch.zeros(pivot.shape, dtype=torch.long, device=valid.device).scatter_add(-1, index, valid.long())
        return {
            "threshold": [float(t) for t in threshold.tolist()],
            "entries": count.tolist(),
            "largest_set": int(sizes.max()),
            "mean_pivot_weight": float(weight.gather(-1, pivot).mean()),
        }


@register
@dataclass
class KVMerger(MergingFolder):
    """KVMerger's merging after any selector (``snapkv+kvmerger``, ``h2o[online=false]+kvmerger``).

    The selector decides which entries are kept. The merging sets are runs of consecutive tokens
    whose neighbouring keys have ``cos(k_i, k_{i+1}) ≥ threshold`` (the paper's merging-set
    identification, with a fixed threshold: the selector already meets the budget). An evicted
    token whose set holds a kept member merges into it by the paper's Gaussian-kernel weights
    around the carrier's key (carrier weight 1, ``σ`` as in the standalone, computed per
    carrier); one whose set keeps nothing is evicted. Kept entries stay distinct entries: with
    ``carrier=pivot`` (default) every evicted member joins the set's highest-attention kept member
    (KVMerger's pivot among what is kept), with ``carrier=nearest`` the closest kept member along
    the sequence (ties: higher attention). See :func:`kvmerger_fold`.

    Bare ``kvmerger`` is the standalone :class:`KVMergerSets` (per-layer thresholds from the
    budget), so that name keeps its meaning; its options are that method's.

    Parameters:
        threshold: cosine similarity at which neighbouring keys share a merging set (0.8, the
            merge threshold KeepKV uses; ours — the paper sets a per-layer threshold).
        window: prefill queries whose attention ``A`` picks the pivot (the last 32, GQA mean).
        sigma: Gaussian kernel width; None = per carrier, the RMS distance of its absorbed keys.
        carrier: ``pivot`` or ``nearest`` (above).
        log_mass: β of a carrier = ``log Σ exp β`` over it and what it absorbed (off: unchanged).
    """

    name: ClassVar[str] = "kvmerger"
    description: ClassVar[str] = (
        "merge evicted tokens into the top-attention kept member of their run of consecutive similar keys "
        "(Gaussian kernel); bare kvmerger = kvmerger_sets"
    )
    paper: ClassVar[str] = KVMergerSets.paper
    threshold: float = 0.8
    window: int = 32
    sigma: float | None = None
    carrier: str = "pivot"
    log_mass: bool = False
    selector_spec: ClassVar[str] = KVMergerSets.name

    def validate(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise SpecError(f"{self.name}: threshold is a cosine similarity in [-1, 1]; got {self.threshold}")
        if self.window < 1:
            raise SpecError(f"{self.name}: window must be ≥ 1; got {self.window}")
        if self.sigma is not None and not self.sigma > 0:
            raise SpecError(f"{self.name}: sigma must be > 0 (or none); got {self.sigma}")
        if self.carrier not in CARRIERS:
            raise SpecError(f"{self.name}: carrier must be one of {', '.join(CARRIERS)}; got {self.carrier!r}")

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        layer_idx, layer, keep, lengths = site.layer_idx, site.layer, site.keep, site.lengths
        keys, values, log_mass = site.keys, site.values, site.log_mass
        dtype = compute_dtype(keys)
        attention, _ = window_scores(ctx, layer_idx, layer, self.window, self.name)
        new_keys, new_values, beta, carrier, merged = kvmerger_fold(
            keys.to(dtype),
            values.to(dtype),
            log_mass,
            keep,
            lengths,
            attention,
            self.threshold,
            self.sigma,
            self.carrier,
            self.log_mass,
        )
        layer.replace(new_keys.to(keys.dtype), new_values.to(values.dtype), beta, lengths=lengths)
        evicted = int(torch.isfinite(log_mass).sum() - lengths.sum())
        ctx.report.setdefault("kvmerger", {})[layer_idx] = {"evicted": evicted, "merged": int(merged.sum())}
        site.record_merges(ctx, carrier, merged)
