"""Ada-KV: a layer's budget spread over its heads by score (with a safeguard share per head).

Feng et al. 2024, *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for
Efficient LLM Inference*. Per-head lengths are stored paged, so the memory is really freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Wrapper, register
from kvfold.methods.core.selection import as_counts, priority_order
from kvfold.methods.core.spec import SpecError

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- budgets


def adakv_head_budgets(
    scores: Tensor,
    layer_budget_per_head: int | Tensor,
    alpha: float = 0.2,
    protected: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """AdaKV per-head budgets (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive
    Budget Allocation for Efficient LLM Inference", arXiv:2407.11550, with its α safeguard).

    The layer's ``H · b`` entries are chosen jointly across its heads by score. Safeguard: each
    head first gets ``floor_h = p_h + ⌊α · (b − p_h)⌋`` entries (its ``p_h`` protected ones plus
    ``α`` of the rest of its budget, as AdaKV applies ``α`` outside the observation window),
    at most ``b`` and at most its valid entries; the remaining ``H · b − Σ floor_h`` go to the
    highest-scored not-yet-chosen entries of the whole layer. A head's count is its floor plus
    its share of that joint top. Each head's kept set is then exactly ``topk_keep(scores,
    counts, protected, valid)`` on that head (same order: protected, score, lower position).

    Args:
        scores: ``(B, H, N)`` scores comparable across the heads of the layer (e.g. SnapKV).
        layer_budget_per_head: ``b``: an int, ``(B,)`` per batch row, or ``(B, H)`` (then the
            layer total is ``Σ_h b_h`` and floors use each head's ``b_h``).
        alpha: safeguard fraction ``α`` in ``[0, 1]`` (0.2 in AdaKV; 1 = uniform budgets).
        protected: ``(B, H, N)`` bool or None; protected entries count inside the floor.
        valid: ``(B, H, N)`` bool or None; padding is never counted.

    Returns:
        ``(B, H)`` long counts, each in ``[floor_h, #valid_h]``, summing per batch row to ``Σ_h b_h``
        (less only when the layer has fewer valid entries than that).

    Ties in the joint selection go to the lower head, then the lower position.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1]; got {alpha}")
    batch, heads, length = scores.shape
    device = scores.device
    per_head = as_counts(layer_budget_per_head, batch, heads, device)
    valid_b = torch.ones(batch, heads, length, dtype=torch.bool, device=device) if valid is None else valid.bool()
    prot = torch.zeros_like(valid_b) if protected is None else protected.bool() & valid_b
    n_valid = valid_b.sum(dim=-1)
    n_prot = prot.sum(dim=-1)
    # safeguard: floor_h = p_h + ⌊α (b_h − p_h)⌋, capped by b_h and by the head's valid entries
    rest = (per_head - n_prot).clamp_min(0)
    floor = torch.minimum(n_prot + torch.floor(rest.double() * alpha).long(), per_head)
    floor = torch.minimum(floor, n_valid)
    order = priority_order(scores, prot, valid_b)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=device).expand_as(order))
    in_pool = valid_b & (rank >= floor[..., None])  # not taken by the floors
    # joint top over the layer: flatten heads, same priority rule (protected, score, index)
    pool_order = priority_order(
        scores.reshape(batch, 1, heads * length),
        prot.reshape(batch, 1, heads * length),
        in_pool.reshape(batch, 1, heads * length),
    )
    pool_rank = torch.empty_like(pool_order).scatter_(
        -1, pool_order, torch.arange(heads * length, device=device).expand_as(pool_order)
    )
    remaining = (per_head.sum(dim=-1) - floor.sum(dim=-1)).clamp_min(0)  # (B,)
    taken = in_pool.reshape(batch, 1, -1) & (pool_rank < remaining[:, None, None])
    return floor + taken.reshape(batch, heads, length).sum(dim=-1)


# ---------------------------------------------------------------------------- wrappers


@register
@dataclass
class AdaKV(Wrapper):
    """Ada-KV (Feng et al. 2024, arXiv:2407.11550, §3–4, Algorithm 1): the layer's budget is
    spread over its KV heads by choosing the top entries of all heads jointly, with the α
    safeguard (each head first gets ``α`` of its uniform share). Rows of different lengths are
    stored paged, so the memory held follows the per-head budgets (nothing is masked).

    Parameters:
        alpha: safeguard fraction (0.2 in the paper; 1 = uniform budgets).
    """

    name: ClassVar[str] = "adakv"
    description: ClassVar[str] = "per-head budgets across the heads of a layer (alpha safeguard 0.2), real lengths"
    paper: ClassVar[str] = (
        "Feng et al. 2024, Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient "
        "LLM Inference"
    )
    alpha: float = 0.2

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"adakv: alpha must be in [0, 1]; got {self.alpha}")

    def allocate(self, layer_idx, layer, scores, counts, protected, ctx) -> Tensor:
        valid = layer.valid_mask()
        return adakv_head_budgets(scores, counts, alpha=self.alpha, protected=protected, valid=valid)
