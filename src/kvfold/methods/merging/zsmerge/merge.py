"""ZSMerge's offline algorithm: the budget split (eq. 3), contribution scores (eq. 5) and
Algorithm 1 over a prompt (residual slots, eqs. 6–8), vectorized over layers, rows and heads.
See :mod:`kvfold.methods.merging.zsmerge`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfold.methods.core.scoring import compute_dtype, pool_gqa, pool_tokens, window_attention
from kvfold.methods.core.selection import topk_keep
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor

SCORE = "zsmerge.score"
COUNT = "zsmerge.count"
POSITION = "zsmerge.position"
"""``layer.entry_stats`` keys written by the one-shot compression and read by the online policy:
contribution score s (float32), merge count w (1 for plain tokens) and token position
(:data:`RESIDUAL` for residual slots)."""
RESIDUAL = -1
STACK_ELEMENTS = 1 << 27
"""At most this many key elements are stacked into one stream (layers are grouped below it)."""


# ---------------------------------------------------------------------------- budget split (§3.2)


@dataclass(frozen=True)
class BudgetSplit:
    """``B = B_p + B_c + B_r`` per batch row (eq. 3); ``(B,)`` long tensors."""

    proximity: Tensor
    context: Tensor
    residual: Tensor

    @property
    def total(self) -> Tensor:
        return self.proximity + self.context + self.residual


def _round_half_up(x: Tensor) -> Tensor:
    return torch.floor(x + 0.5).long()


def split_budget(budgets: Tensor, proximity: float, residual: float) -> BudgetSplit:
    """Split per-row budgets into proximity, context and residual parts (§3.2, App. C.2).

    The paper's hierarchy: ``B_p`` first (``proximity`` = ``B_p/B`` when < 1, a token count when
    ≥ 1), then ``B_r`` out of the rest (``residual`` = ``B_r/(B − B_p)``, the "cache dense
    parameter", when < 1 — at least one slot when positive — or a slot count when ≥ 1), and
    ``B_c`` takes what remains.

    Args:
        budgets: ``(B,)`` entries per KV head.
        proximity: ``B_p`` as a fraction of ``B`` (< 1) or a count (≥ 1).
        residual: ``B_r`` as a fraction of ``B − B_p`` (< 1) or a count (≥ 1); 0 = pure eviction.

    Returns:
        The three parts, each clamped so that they sum to ``B``.
    """
    b = budgets.long()
    b_p = torch.full_like(b, int(proximity)) if proximity >= 1 else _round_half_up(b.double() * proximity)
    b_p = torch.minimum(b_p, b)
    rest = b - b_p
    if residual >= 1:
        b_r = torch.full_like(b, int(residual))
    elif residual > 0:
        b_r = _round_half_up(rest.double() * residual).clamp_min(1)
    else:
        b_r = torch.zeros_like(b)
    b_r = torch.minimum(b_r, rest)
    return BudgetSplit(proximity=b_p, context=rest - b_r, residual=b_r)


# ---------------------------------------------------------------------------- contribution scores (§3.3)


def prefill_scores(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    decay: float = 0.98,
    kernel: int = 5,
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Contribution scores after a prefill: eq. 5 run over the last ``W`` prompt steps (App. B).

    ``s_t = Σ_w λ^{W−1−w} · a_t^{(w)}`` where ``a^{(w)}`` is the attention of the ``w``-th of the last
    ``W`` queries (causal: a token receives attention from the steps at and after its own), then
    max-pooled along the tokens with ``kernel`` (per query head, as the authors' code) and averaged
    over each KV head's query heads.

    Args:
        queries: ``(B, H_q, W, D)`` post-RoPE queries of the last ``W`` tokens.
        keys: ``(B, H_kv, N, D)``, ``N ≥ W``; the window's tokens are the last ``W`` slots.
        scaling: logit scale.
        decay: λ of eq. 5.
        kernel: odd max-pooling kernel (1 = none).
        log_mass: β ``(B, H_kv, N)`` or None.
        valid: ``(B, H_kv, N)`` bool or None.

    Returns:
        ``(B, H_kv, N)`` float32 (float64 for float64 inputs), ``-inf`` on padding.
    """
    probs = window_attention(queries, keys, scaling, log_mass=log_mass, valid=valid)  # eq. 2, (B, H_q, W, N)
    width = probs.shape[2]
    steps = torch.arange(width - 1, -1, -1, device=probs.device, dtype=probs.dtype)
    weights = torch.pow(torch.as_tensor(decay, dtype=probs.dtype, device=probs.device), steps)  # λ^{W−1−w}
    s = (probs * weights[:, None]).sum(dim=2)  # eq. 5 unrolled over the window
    s = pool_gqa(pool_tokens(s, kernel, "max"), keys.shape[1], "mean")
    return s if valid is None else s.masked_fill(~valid.bool(), float("-inf"))


def decayed_scores(scores: Tensor, probs: Tensor, decay: float) -> Tensor:
    """Eq. 5 over the ``q`` queries of one forward: ``s ← λ^q·s + Σ_i λ^{q−1−i}·a_i``.

    Args:
        scores: ``(B, H_kv, N_old)`` scores before the forward; entries appended since (the last
            ``N − N_old``) start from 0.
        probs: ``(B, H_q, q, N)`` attention probabilities of the forward's queries.
        decay: λ.

    Returns:
        ``(B, H_kv, N)`` in the dtype of ``scores`` promoted with float32.
    """
    dtype = torch.promote_types(torch.promote_types(scores.dtype, probs.dtype), torch.float32)
    a = pool_gqa(probs.to(dtype), scores.shape[1], "mean")  # (B, H_kv, q, N)
    q, n = a.shape[2], a.shape[3]
    lam = torch.as_tensor(decay, dtype=dtype, device=a.device)
    weights = torch.pow(lam, torch.arange(q - 1, -1, -1, device=a.device, dtype=dtype))
    base = F.pad(scores.to(dtype) * torch.pow(lam, q), (0, n - scores.shape[-1]))
    return base + (a * weights[:, None]).sum(dim=2)


# ---------------------------------------------------------------------------- Algorithm 1 over a prompt


@dataclass
class Residuals:
    """Result of :func:`residual_stream` for ``R`` rows.

    Attributes:
        kept: ``(R, N)`` bool, the proximity and context tokens kept as they are.
        keys: ``(R, S, D)`` residual slot keys (mean of the merged keys), in the order the slots
            were opened; float32 (float64 for float64 inputs).
        values: ``(R, S, D)`` the same for values.
        counts: ``(R, S)`` merge counts ``w`` (0 for a slot never opened).
        founders: ``(R, S)`` position of the token that opened each slot (Algorithm 1, line 13: the
            first victim *is* the slot), −1 for a slot never opened; None in ``pool`` mode.
        merged: ``(R, E)`` positions of the later victims merged into a slot (−1 = none), and
        merged_slot: ``(R, E)`` the slot each joined; None in ``pool`` mode. For the merge map.
    """

    kept: Tensor
    keys: Tensor
    values: Tensor
    counts: Tensor
    founders: Tensor | None = None
    merged: Tensor | None = None
    merged_slot: Tensor | None = None


SLOT_METRICS = ("dot", "l2")
"""How a victim picks its residual slot: ``dot`` (eq. 6, ``argmax_r k_r·k_t``) or ``l2`` (the
nearest slot key, ``argmin_r ‖k_r − k_t‖²``, an option of the authors' code)."""


def slot_affinity(dots: Tensor, res_k: Tensor, metric: str) -> Tensor:
    """The score a victim maximizes over the slots, from ``dots = k_r·k_t`` ``(..., S)`` and the slot
    keys ``res_k`` ``(..., S, D)``: ``dot`` = the dots; ``l2`` = ``2 k_r·k_t − ‖k_r‖²``, which is
    ``‖k_t‖² − ‖k_r − k_t‖²`` (the same argmax as the nearest slot)."""
    if metric == "l2":
        return 2.0 * dots - res_k.square().sum(-1)
    return dots


def _last_valid(valid: Tensor, count: Tensor) -> Tensor:
    """``(R, N)`` bool: the last ``count[r]`` valid entries of each row."""
    from_end = valid.long().flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid entry
    return valid & (from_end <= count[:, None])


def residual_stream(
    keys: Tensor,
    values: Tensor,
    scores: Tensor,
    valid: Tensor,
    split: BudgetSplit,
    mode: str = "merge",
    slot_metric: str = "dot",
) -> Residuals:
    """Bring rows of a prompt to budget with Algorithm 1 (or the authors' pooling).

    Tokens enter in position order; the last ``B_p`` valid ones stay in the proximity part, the
    others stream through the context set, whose lowest-scored member (ties: the newest) is
    evicted whenever it holds more than ``B_c``. With ``mode="merge"`` (Algorithm 1, lines 10–15)
    an evicted token opens a residual slot while fewer than ``B_r`` exist, otherwise it joins
    the slot of largest ``k_r·k_t`` (eq. 6; ties: the first slot; ``slot_metric="l2"``: the nearest
    slot key) by eq. 7. Exact with respect to
    that sequential algorithm: one loop over stream steps, each vectorized over all rows.
    ``mode="pool"`` keeps the same tokens and mean-pools the evicted ones, in position order, into
    ``B_r`` contiguous groups (the authors' released code).

    Args:
        keys, values: ``(R, N, D)`` (rows = layers × batch × KV heads); any float dtype.
        scores: ``(R, N)`` contribution scores (higher = kept).
        valid: ``(R, N)`` bool, False for padding.
        split: the budget split per row, ``(R,)`` tensors.
        mode: ``"merge"`` or ``"pool"``.
        slot_metric: ``"dot"`` or ``"l2"`` (:data:`SLOT_METRICS`).

    Returns:
        :class:`Residuals`.
    """
    if mode not in ("merge", "pool"):
        raise ValueError(f"mode must be 'merge' or 'pool'; got {mode!r}")
    rows, n, dim = keys.shape
    device = keys.device
    acc = compute_dtype(keys)  # score / slot arithmetic: float32, or float64 for float64 inputs
    b_p, b_c, b_r = (t.to(device) for t in (split.proximity, split.context, split.residual))
    valid = valid.bool()
    proximity = _last_valid(valid, b_p)
    stream = valid & ~proximity
    slots = int(b_r.max()) if rows else 0
    res_k = torch.zeros(rows, slots, dim, dtype=acc, device=device)
    res_v = torch.zeros(rows, slots, values.shape[-1], dtype=acc, device=device)
    res_w = torch.zeros(rows, slots, dtype=acc, device=device)
    key = torch.where(stream, scores.to(torch.float64), torch.full_like(scores, float("-inf"), dtype=torch.float64))
    if mode == "pool":
        context = _top_context(key, stream, b_c)
        _pool_evicted(keys, values, stream & ~context, b_r, res_k, res_v, res_w)
        return Residuals(kept=proximity | context, keys=res_k, values=res_v, counts=res_w)
    context, founders, merged, merged_slot = _merge_stream(
        keys, values, key, stream, b_c, b_r, res_k, res_v, res_w, slot_metric
    )
    return Residuals(
        kept=proximity | (context & stream),
        keys=res_k,
        values=res_v,
        counts=res_w,
        founders=founders,
        merged=merged,
        merged_slot=merged_slot,
    )


def _merge_stream(
    keys: Tensor,
    values: Tensor,
    key: Tensor,
    stream: Tensor,
    b_c: Tensor,
    b_r: Tensor,
    res_k: Tensor,
    res_v: Tensor,
    res_w: Tensor,
    slot_metric: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Algorithm 1, lines 9–15, over the stream tokens of every row (:func:`residual_stream`'s
    ``merge`` mode): one loop over stream steps, each vectorized over the rows. The residual slots
    ``res_k``, ``res_v``, ``res_w`` ``(R, S[, D])`` are filled in place.

    Args:
        keys, values: ``(R, N, D)``.
        key: ``(R, N)`` float64 scores of the stream tokens (``-inf`` elsewhere).
        stream: ``(R, N)`` bool, the tokens that pass through the context set.
        b_c, b_r: ``(R,)`` ``B_c`` and ``B_r``.
        res_k, res_v, res_w: the zeroed residual slots (their dtype is the arithmetic's).
        slot_metric: ``"dot"`` or ``"l2"``.

    Returns:
        ``(context, founders, merged, merged_slot)``: the context set left at the end ``(R, N)``
        bool, and the bookkeeping of :class:`Residuals`.
    """
    rows, n, dim = keys.shape
    device = keys.device
    acc = res_k.dtype
    slots = res_k.shape[1]
    # Stream order: positions of the stream tokens, ascending, packed to the left.
    order = torch.sort((~stream).to(torch.uint8), dim=-1, stable=True).indices
    stream_len = stream.sum(-1)
    steps = int(stream_len.max()) if rows else 0
    width = int(b_c.max()) + 1 if rows else 1
    member = torch.full((rows, width), -1, dtype=torch.long, device=device)  # the context set (positions)
    member_score = torch.full((rows, width), float("inf"), dtype=torch.float64, device=device)
    fill = torch.zeros(rows, dtype=torch.long, device=device)
    row_ids = torch.arange(rows, device=device)
    slot_ids = torch.arange(slots, device=device)
    flat_keys = keys.reshape(rows * n, dim)
    flat_values = values.reshape(rows * n, values.shape[-1])
    founders = torch.full((rows, slots), -1, dtype=torch.long, device=device)
    merged = torch.full((rows, steps), -1, dtype=torch.long, device=device)
    merged_slot = torch.full((rows, steps), -1, dtype=torch.long, device=device)
    for i in range(steps):
        active = i < stream_len
        pos = order[:, i]
        # line 9: the token leaving the proximity part joins the context set (in a free cell)
        cell = (member < 0).to(torch.uint8).argmax(-1)
        member[row_ids, cell] = torch.where(active, pos, member[row_ids, cell])
        member_score[row_ids, cell] = torch.where(active, key[row_ids, pos], member_score[row_ids, cell])
        # lines 10–11: over B_c → evict the lowest score ĉ = argmin_c s_c (ties: the newest)
        evict = active & ((member >= 0).sum(-1) > b_c)
        lowest = member_score.amin(-1, keepdim=True)
        cell = torch.where(member_score == lowest, member, -1).argmax(-1)
        victim = member[row_ids, cell].clamp_min(0)
        member[row_ids, cell] = torch.where(evict, -1, member[row_ids, cell])
        member_score[row_ids, cell] = torch.where(evict, float("inf"), member_score[row_ids, cell])
        if slots:  # lines 12–15 (index_select on flat rows: advanced indexing is slow on CPU)
            flat = row_ids * n + victim
            k_t = flat_keys.index_select(0, flat).to(acc)
            v_t = flat_values.index_select(0, flat).to(acc)
            joins = evict & (b_r > 0)
            opens = joins & (fill < b_r)
            target = merge_into_slots(res_k, res_v, res_w, fill, k_t, v_t, joins, b_r, slot_ids, slot_metric)
            founders[row_ids, target] = torch.where(opens, victim, founders[row_ids, target])
            merged[:, i] = torch.where(joins & ~opens, victim, -1)
            merged_slot[:, i] = torch.where(joins & ~opens, target, -1)
    context = torch.zeros(rows, n + 1, dtype=torch.bool, device=device)
    context.scatter_(1, torch.where(member >= 0, member, n), True)  # empty cells land in a dropped column
    return context[:, :n], founders, merged, merged_slot


def merge_into_slots(
    res_k: Tensor,
    res_v: Tensor,
    res_w: Tensor,
    fill: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    act: Tensor,
    b_r: Tensor,
    slot_ids: Tensor,
    slot_metric: str = "dot",
) -> Tensor:
    """Algorithm 1 lines 12–15 for every row at once, in place; returns the slot used per row.

    Rows with ``act`` add ``(k_t, v_t)``: into a new slot while ``fill < B_r`` (eq. 7 with w = 0 is
    the token itself), else into ``r̂ = argmax_{r < fill} k_r·k_t`` (eq. 6) by the incremental mean
    of eq. 7; ``w_r̂ += 1``.

    Args:
        res_k, res_v: ``(..., S, D)`` residual slot means; res_w: ``(..., S)`` their counts ``w``.
        fill: ``(...)`` slots opened so far (incremented where a slot opens).
        k_t, v_t: ``(..., D)`` each row's victim, in the slots' dtype.
        act: ``(...)`` bool, the rows that merge a victim.
        b_r: ``B_r``, broadcastable to ``fill``.
        slot_ids: ``arange(S)``.
        slot_metric: ``"dot"`` or ``"l2"`` (:func:`slot_affinity`).
    """
    slots = res_k.shape[-2]
    opened = slot_ids[None, :] < fill[..., None]  # (..., S)
    dots = slot_affinity((res_k @ k_t[..., None])[..., 0], res_k, slot_metric)  # eq. 6: k_r·k_t
    dots = dots.masked_fill(~opened, float("-inf"))
    target = torch.where(fill < b_r, fill.clamp(max=slots - 1), dots.argmax(-1))
    idx = target[..., None]
    w = res_w.gather(-1, idx)  # (..., 1)
    k_old = res_k.gather(-2, idx[..., None].expand(*idx.shape, res_k.shape[-1]))[..., 0, :]
    v_old = res_v.gather(-2, idx[..., None].expand(*idx.shape, res_v.shape[-1]))[..., 0, :]
    k_new = (w * k_old + k_t) / (w + 1)  # eq. 7
    v_new = (w * v_old + v_t) / (w + 1)
    a = act[..., None]
    res_k.scatter_(-2, idx[..., None].expand(*idx.shape, res_k.shape[-1]), torch.where(a, k_new, k_old)[..., None, :])
    res_v.scatter_(-2, idx[..., None].expand(*idx.shape, res_v.shape[-1]), torch.where(a, v_new, v_old)[..., None, :])
    res_w.scatter_(-1, idx, w + a.to(w.dtype))  # step 3: w_r̂ ← w_r̂ + 1
    fill += (act & (fill < b_r)).long()
    return target


def join_nearest_slot(
    res_k: Tensor,
    res_v: Tensor,
    res_w: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    closed: Tensor | None = None,
    slot_metric: str = "dot",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Algorithm 1 lines 12–14 once every residual slot is open (a steady decode step), in place and
    with no masked writes: each row's victim ``(k_t, v_t)`` joins ``r̂ = argmax_r k_r·k_t`` (eq. 6)
    by the incremental mean of eq. 7, ``w_r̂ ← w_r̂ + 1``. Any leading dims: one layer ``(B, H)``,
    or every layer of a batched step ``(L, B, H)``.

    Args:
        res_k, res_v: ``(..., S, D)`` residual slot means; res_w: ``(..., S)`` their counts ``w``.
        k_t, v_t: ``(..., D)`` the victims, in the slots' dtype.
        closed: ``(..., S)`` bool, slots a row cannot use (past its ``B_r``), or None.
        slot_metric: ``"dot"`` or ``"l2"`` (:func:`slot_affinity`).

    Returns:
        ``(r̂ (..., 1), k_r̂ (..., 1, D), v_r̂ (..., 1, D), w_r̂ (..., 1))`` after the merge.
    """
    dots = torch.matmul(res_k, k_t.unsqueeze(-1)).squeeze(-1)  # eq. 6: k_r·k_t
    dots = slot_affinity(dots, res_k, slot_metric)
    if closed is not None:
        dots = dots.masked_fill(closed, float("-inf"))
    target = dots.argmax(-1, keepdim=True)  # (..., 1)
    index_k = target.unsqueeze(-1).expand(*target.shape, k_t.shape[-1])
    index_v = target.unsqueeze(-1).expand(*target.shape, v_t.shape[-1])
    w = res_w.gather(-1, target)
    k_old = res_k.gather(-2, index_k).squeeze(-2)
    v_old = res_v.gather(-2, index_v).squeeze(-2)
    w_new = w + 1.0  # w_r̂ ← w_r̂ + 1
    k_new = ((w * k_old + k_t) / w_new).unsqueeze(-2)  # eq. 7
    v_new = ((w * v_old + v_t) / w_new).unsqueeze(-2)
    res_k.scatter_(-2, index_k, k_new)
    res_v.scatter_(-2, index_v, v_new)
    res_w.scatter_(-1, target, w_new)
    return target, k_new, v_new, w_new


def _top_context(key: Tensor, stream: Tensor, b_c: Tensor) -> Tensor:
    """Top-``B_c`` stream tokens by score, ties to the older token: the set the stream keeps."""
    keep, lengths = topk_keep(key[:, None], b_c[:, None], valid=stream[:, None])
    n = key.shape[-1]
    mask = torch.arange(keep.shape[-1], device=key.device) < lengths[..., None]
    context = torch.zeros(key.shape[0], 1, n + 1, dtype=torch.bool, device=key.device)
    context.scatter_(-1, torch.where(mask, keep, n), True)  # unused cells land in a dropped column
    return context[:, 0, :n]


def _pool_evicted(
    keys: Tensor, values: Tensor, evicted: Tensor, b_r: Tensor, res_k: Tensor, res_v: Tensor, res_w: Tensor
) -> None:
    """Mean-pool evicted tokens, in position order, into ``min(B_r, E)`` contiguous groups."""
    if res_k.shape[1] == 0:
        return
    count = evicted.sum(-1, keepdim=True)  # E
    groups = torch.minimum(b_r[:, None], count)
    rank = evicted.long().cumsum(-1) - 1
    group = torch.div(rank * groups, count.clamp_min(1), rounding_mode="floor").clamp(0, res_k.shape[1] - 1)
    weight = (evicted & (b_r[:, None] > 0)).to(res_k.dtype)  # rows without residual slots only evict
    res_w.scatter_add_(1, group, weight)
    res_k.scatter_add_(1, group[..., None].expand(-1, -1, keys.shape[-1]), keys.to(res_k.dtype) * weight[..., None])
    res_v.scatter_add_(1, group[..., None].expand(-1, -1, values.shape[-1]), values.to(res_v.dtype) * weight[..., None])
    res_k /= res_w.clamp_min(1)[..., None]
    res_v /= res_w.clamp_min(1)[..., None]


# ---------------------------------------------------------------------------- one-shot on cache layers


def fold_layers(
    layers: list[FoldedLayer],
    scores: list[Tensor],
    split: BudgetSplit,
    alpha: float,
    mode: str,
    position_offsets: list[int] | None = None,
    record: Callable[[int, Tensor, Tensor, Residuals], None] | None = None,
    slot_metric: str = "dot",
) -> None:
    """Run :func:`residual_stream` on plain layers (β ∈ {0, −inf}) and write the results back.

    Layers of the same shape are stacked into one stream (up to :data:`STACK_ELEMENTS` key
    elements), so the stream's loop runs once for all of them. ``record(i, keep, lengths,
    residuals)`` receives, for layer ``i`` of ``layers``, the prefill slots the layer holds
    afterwards and the stream's residual bookkeeping (the merge map).
    """
    offsets = position_offsets or [0] * len(layers)
    groups: list[list[int]] = []
    for i, layer in enumerate(layers):
        shape = (layer.physical_length, layer.head_dim, layer.dtype)
        size = layer.batch_size * layer.num_heads * layer.physical_length * layer.head_dim
        last = groups[-1] if groups else None
        if last is not None:
            first = layers[last[0]]
            same = (first.physical_length, first.head_dim, first.dtype) == shape
            if same and size * (len(last) + 1) <= STACK_ELEMENTS:
                last.append(i)
                continue
        groups.append([i])
    for group in groups:
        contents = [layers[i].padded() for i in group]
        for _, _, log_mass, _ in contents:
            finite = log_mass[torch.isfinite(log_mass)]
            if bool((finite != 0).any()):
                raise UserError(
                    "zsmerge brings a plain (uncompressed) cache to budget; this layer already holds merged "
                    "entries. Compress a freshly prefilled cache."
                )
        b, h = layers[group[0]].batch_size, layers[group[0]].num_heads
        rows = len(group) * b * h
        k = torch.stack([c[0] for c in contents]).reshape(rows, *contents[0][0].shape[2:])
        v = torch.stack([c[1] for c in contents]).reshape(rows, *contents[0][1].shape[2:])
        valid = torch.stack([torch.isfinite(c[2]) for c in contents]).reshape(rows, -1)
        s = torch.stack([scores[i] for i in group]).reshape(rows, -1)
        row_split = BudgetSplit(
            *(
                t.to(k.device).repeat_interleave(h).repeat(len(group))
                for t in (split.proximity, split.context, split.residual)
            )
        )
        result = residual_stream(k, v, s, valid, row_split, mode, slot_metric)
        for j, i in enumerate(group):
            part = slice(j * b * h, (j + 1) * b * h)
            fields = (result.kept, result.keys, result.values, result.counts)
            extra = (result.founders, result.merged, result.merged_slot)
            row = Residuals(
                *(t[part].view(b, h, *t.shape[1:]) for t in fields),
                *(None if t is None else t[part].view(b, h, *t.shape[1:]) for t in extra),
            )
            keep, lengths = _write_layer(
                layers[i], contents[j][0], contents[j][1], s[part].view(b, h, -1), row, alpha, offsets[i]
            )
            if record is not None:
                record(i, keep, lengths, row)


def _write_layer(
    layer: FoldedLayer, keys: Tensor, values: Tensor, scores: Tensor, res: Residuals, alpha: float, offset: int
) -> tuple[Tensor, Tensor]:
    """Kept tokens (position order) then residual slots; β = α·log w (eq. 8); statistics for online.

    Returns the prefill slot each new entry comes from ``(B, H, K)`` (a residual slot: the token
    that opened it, −1 in ``pool`` mode) and the lengths ``(B, H)``.
    """
    n = keys.shape[2]
    acc = compute_dtype(keys)  # the layer's dtype: float32, or float64 for a float64 cache
    n_kept = res.kept.sum(-1)  # (B, H)
    fill = (res.counts > 0).sum(-1)
    lengths = n_kept + fill
    width = max(int(lengths.max()), 1)
    slot = torch.arange(width, device=keys.device)[None, None, :]
    order = torch.sort((~res.kept).to(torch.uint8), dim=-1, stable=True).indices[..., :width]  # kept first
    is_kept = slot < n_kept[..., None]
    is_res = ~is_kept & (slot < lengths[..., None])
    # residual slots are appended as extra rows of the key / value tensors
    counts = F.pad(res.counts.to(acc), (0, 1), value=1.0)  # a spare cell so that the gather is never empty
    res_slot = (slot - n_kept[..., None]).clamp(0, counts.shape[-1] - 1)
    src = torch.where(is_kept, order, torch.where(is_res, n + res_slot, 0))
    idx = src[..., None]
    all_k = torch.cat([keys, res.keys.to(keys.dtype)], dim=2)
    all_v = torch.cat([values, res.values.to(values.dtype)], dim=2)
    new_k = all_k.gather(2, idx.expand(-1, -1, -1, all_k.shape[-1]))
    new_v = all_v.gather(2, idx.expand(-1, -1, -1, all_v.shape[-1]))
    w = torch.where(is_res, counts.gather(2, res_slot), 1.0)
    log_mass = torch.where(is_kept | is_res, alpha * torch.log(w), NEG_INF)  # eq. 8: β = α·log w
    layer.replace(new_k, new_v, log_mass, lengths)
    layer.entry_stats = {
        SCORE: torch.where(is_kept, scores.to(acc).gather(2, order), 0.0),
        COUNT: torch.where(is_kept | is_res, w, 0.0),
        POSITION: torch.where(is_kept, order + offset, RESIDUAL),
    }
    founders = res.founders if res.founders is not None else torch.full_like(res.counts, -1, dtype=torch.long)
    founders = F.pad(founders, (0, 1), value=-1)
    source = torch.where(is_kept, order, torch.where(is_res, founders.gather(2, res_slot), -1))
    return source, lengths
