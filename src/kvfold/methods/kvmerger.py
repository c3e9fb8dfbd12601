"""KVMerger: merging sets of consecutive similar keys into their highest-attention pivot (``kvmerger``).

Wang et al. 2024, "Model Tells You Where to Merge: Adaptive KV Cache Merging for LLMs on
Long-Context Tasks" (arXiv:2407.08454). Keys of consecutive tokens are often highly similar, so
the cache is cut into **merging sets**: runs of consecutive tokens whose neighbouring keys have a
cosine similarity above a per-layer threshold. Each set becomes one entry at its **pivot**, the
token with the most attention, by Gaussian-kernel weights around the pivot's key::

    set boundary between i and i+1   iff   cos(k_i, k_{i+1}) < τ_l           (τ_l: per layer)
    p = argmax_{i∈S} A_i
    w_i = exp(−‖k_i − k_p‖² / (2σ²))           (w_p = 1)
    k_S = Σ_i w_i k_i / Σ_i w_i,   v_S = Σ_i w_i v_i / Σ_i w_i

Design choices (ours, where the method leaves room):

* **Standalone.** Merging sets replace eviction altogether (every token ends in some set), so
  there is no selector to compose with; the budget is met through the thresholds instead.
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

Reconstruction note: the KVMerger paper is not in ``shared/papers``; this follows the paper as we
read it (Gaussian-kernel merging around the pivot, consecutive-similarity sets, per-layer
thresholds) and ``shared/guide/methods.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.cache import FoldedLayer
from kvfold.methods.base import CompressionContext, Standalone, register
from kvfold.methods.merging import compute_dtype, window_scores
from kvfold.methods.scoring import protected_mask
from kvfold.methods.spec import SpecError

Tensor = torch.Tensor

__all__ = ["KVMerger", "gaussian_merge", "layer_joins", "merging_sets"]


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


@register
@dataclass
class KVMerger(Standalone):
    """KVMerger (Wang et al. 2024): runs of consecutive tokens with highly similar keys merge into
    one entry at their highest-attention pivot by Gaussian-kernel weights; per-layer similarity
    thresholds are set so that each layer meets the budget (see the module docstring).

    Parameters:
        window: prefill queries whose attention picks the pivots; their tokens are never merged (32).
        sinks: first tokens never merged (4).
        sigma: Gaussian kernel width; None = per set, the RMS distance of its keys to the pivot.
        threshold: least cosine similarity at which neighbours may join (None = whatever the
            budget needs; with a floor the layer may keep more than the budget).
        log_mass: β of a merged entry = log of the tokens it stands for (off: KVMerger has no β).
    """

    name: ClassVar[str] = "kvmerger"
    description: ClassVar[str] = (
        "merge runs of consecutive similar keys into their top-attention pivot (Gaussian kernel), per-layer thresholds"
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
            raise SpecError(f"kvmerger: window must be ≥ 1 and sinks ≥ 0; got {self.window}, {self.sinks}")
        if self.sigma is not None and not self.sigma > 0:
            raise SpecError(f"kvmerger: sigma must be > 0 (or none); got {self.sigma}")
        if self.threshold is not None and not -1.0 <= self.threshold <= 1.0:
            raise SpecError(f"kvmerger: threshold is a cosine similarity in [-1, 1]; got {self.threshold}")

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
        beta = torch.where(valid, log_mass, torch.full_like(log_mass, -torch.inf))
        if self.log_mass:  # β_S = log Σ_{i∈S} exp(β_i)
            peak = torch.full(pivot.shape, -torch.inf, dtype=beta.dtype, device=beta.device)
            peak = peak.scatter_reduce(-1, index, beta, "amax")
            shifted = torch.exp(beta - torch.gather(peak, -1, index)).masked_fill(~valid, 0.0)
            mass = torch.zeros_like(peak).scatter_add(-1, index, shifted)
            new_beta = peak + torch.log(mass.clamp(min=torch.finfo(mass.dtype).tiny))
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
