"""Selection: which entries a row keeps, given scores, per-head counts and protected entries.

Protected entries (sinks, observation windows) are kept first whatever their score; padding is
never kept. :func:`topk_keep` returns ``(keep (B, H, K), lengths (B, H))`` in position order, the
form every folder and the cache take.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- selection


def protected_mask(
    batch: int,
    heads: int,
    length: int,
    sinks: int = 0,
    recent: int = 0,
    valid: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Entries that are kept whatever their score: attention sinks and the recent window.

    Sinks are the first ``sinks`` **valid** entries of each row (so left padding is skipped,
    StreamingLLM's "first tokens"); recent are the last ``recent`` valid entries (SnapKV's
    observation window, H2O's local window). Padding is never protected.

    Args:
        batch, heads, length: shape ``(B, H, N)`` of the mask.
        sinks: number of leading valid entries to protect (≥ 0).
        recent: number of trailing valid entries to protect (≥ 0).
        valid: ``(B, H, N)`` bool or None (all valid).
        device: device of the mask when ``valid`` is None.

    Returns:
        ``(B, H, N)`` bool.
    """
    if sinks < 0 or recent < 0:
        raise ValueError(f"sinks and recent must be ≥ 0; got sinks={sinks}, recent={recent}")
    if valid is None:
        valid = torch.ones(batch, heads, length, dtype=torch.bool, device=device)
    else:
        valid = valid.to(torch.bool)
        if tuple(valid.shape) != (batch, heads, length):
            raise ValueError(f"valid has shape {tuple(valid.shape)}; expected {(batch, heads, length)}")
    count = valid.long()
    rank_from_start = count.cumsum(dim=-1)  # 1 for the first valid entry
    rank_from_end = count.flip(-1).cumsum(dim=-1).flip(-1)  # 1 for the last valid entry
    return valid & ((rank_from_start <= sinks) | (rank_from_end <= recent))


def priority_order(scores: Tensor, protected: Tensor | None, valid: Tensor | None) -> Tensor:
    """Per row, all positions in keep-first order: the rule of :func:`topk_keep`, shared by the
    allocations that rank entries before choosing them (AdaKV, global budgets, KeepKV).

    Order: protected valid entries, most recent first; then other valid entries by score
    (descending, NaN as ``-inf``), ties by lower position; then padding. Two stable sorts.

    Args:
        scores: ``(B, H, N)``, higher = keep first.
        protected, valid: ``(B, H, N)`` bool (or broadcastable) or None.

    Returns:
        ``(B, H, N)`` long: positions, first kept first.
    """
    length = scores.shape[-1]
    key = torch.nan_to_num(scores.to(torch.float64), nan=float("-inf"))
    tier = torch.ones_like(scores, dtype=torch.long)
    if valid is not None:
        valid = valid.to(torch.bool).expand_as(scores)
        tier = valid.long()
    if protected is not None:
        protected = protected.to(torch.bool).expand_as(scores)
        positions = torch.arange(length, device=scores.device, dtype=torch.float64).expand_as(key)
        key = torch.where(protected, positions, key)  # protected: later position first
        tier = tier + (protected & (tier > 0)).long()
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    by_tier = torch.sort(tier.gather(-1, order), dim=-1, descending=True, stable=True).indices
    return order.gather(-1, by_tier)


def as_counts(counts: int | Tensor, batch: int, heads: int, device: torch.device) -> Tensor:
    """Counts as a ``(B, H)`` long tensor; an int, ``(B,)`` (per batch row) or ``(B|1, H|1)``.

    Raises:
        ValueError: non-integer or negative counts, or a 1-D tensor that is not one per batch row.
    """
    counts_t = torch.as_tensor(counts, device=device)
    if counts_t.is_floating_point() or counts_t.dtype == torch.bool:
        raise ValueError(f"counts must be integers; got dtype {counts_t.dtype}")
    counts_t = counts_t.long()
    if counts_t.dim() == 1:
        if counts_t.shape[0] != batch:
            raise ValueError(f"1-D counts must have one entry per batch row ({batch}); got {counts_t.shape[0]}")
        counts_t = counts_t[:, None]
    if bool((counts_t < 0).any()):
        raise ValueError("counts must be ≥ 0")
    return counts_t.expand(batch, heads).clone()


def topk_keep(
    scores: Tensor,
    counts: int | Tensor,
    protected: Tensor | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Per row ``(b, h)``, the positions of the ``counts[b, h]`` entries to keep.

    Rules (deterministic):

    1. padding (``valid`` False) is never kept: ``lengths = min(counts, #valid)``;
    2. protected entries come first; if ``counts`` is smaller than the number of protected
       entries, the **most recent** protected ones are kept (the window before the sinks);
    3. the rest by score, highest first; ties broken by lower position first (stable sort);
       NaN scores rank as ``-inf``.

    Args:
        scores: ``(B, H, N)`` higher = keep.
        counts: an int, or a ``(B, H)`` (or ``(B, 1)``, ``(B,)``) integer tensor of per-head budgets.
        protected: ``(B, H, N)`` bool or None.
        valid: ``(B, H, N)`` bool or None.

    Returns:
        ``keep_idx`` ``(B, H, K)`` long, ``K = max(lengths)``: kept positions sorted ascending; slots
        past a row's length repeat the row's last kept index (0 for a row that keeps nothing).
        ``lengths`` ``(B, H)`` long: number of entries kept per row.

    Example:
        >>> keep, lengths = topk_keep(torch.tensor([[[0.1, 0.9, 0.5, 0.9]]]), 2)
        >>> keep.tolist(), lengths.tolist()
        ([[[1, 3]]], [[2]])
    """
    batch, heads, length = scores.shape
    device = scores.device
    counts_t = as_counts(counts, batch, heads, device)
    available = valid.to(torch.bool).sum(dim=-1) if valid is not None else torch.full_like(counts_t, length)
    lengths = torch.minimum(counts_t, available.expand(batch, heads))
    width = int(lengths.max()) if lengths.numel() else 0
    order = priority_order(scores, protected, valid)[..., :width]
    slot = torch.arange(width, device=device)
    in_row = slot[None, None, :] < lengths[..., None]
    keep = torch.where(in_row, order, torch.full_like(order, length)).sort(dim=-1).values
    if width == 0:  # no row keeps anything (a streamed chunk whose share went to other layers)
        return keep, lengths
    last = keep.gather(-1, (lengths - 1).clamp_min(0)[..., None])
    last = torch.where(lengths[..., None] > 0, last, torch.zeros_like(last))
    return torch.where(in_row, keep, last), lengths


# END
