"""ZSMerge / ZeroMerge: online residual merging with compensated attention (issue 5).

Liu, Liu and Tang, *ZSMerge: Zero-Shot KV Cache Compression for Memory-Efficient Long-Context
LLMs* (``papers/zsmerge.md`` §3) and its earlier version *ZeroMerge* (``papers/zeromerge.md`` §3).
Per KV head the budget is split three ways (§3.2, eq. 3), ``B = B_p + B_c + B_r``:

* **proximity** ``B_p`` — the most recent tokens (a FIFO);
* **context** ``B_c`` — the tokens with the highest contribution score, eq. 5:
  ``s_t ← λ·s_t + a_t`` with ``a_t`` the attention the step's query gives token ``t`` (GQA: mean
  over the query heads of the KV head), ``λ = 0.98``;
* **residual** ``B_r`` — slots that absorb the context tokens Algorithm 1 evicts: the first ``B_r``
  evicted tokens open the slots, each later one joins the slot of largest key dot product
  ``r̂ = argmax_r k_r·k_t`` (eq. 6) as an incremental mean of keys and values, ``w_r̂ += 1`` (eq. 7).

Compensated attention (§3.5, eq. 8) adds ``α·log w`` to the logit of every entry: that is the
cache's log-mass β, so the kvfold attention computes eq. 8 with no change. ``α = 1`` in ZSMerge,
``α = 0.6`` in ZeroMerge; for ``α ≤ 1`` Theorem 1 holds: an uncompressed token never receives less
attention than in the full cache (the property test in ``tests/methods/test_zsmerge.py``).

Two moments, one algorithm:

* **after prefill** (:meth:`ZSMerge.compress`) the cache is brought to budget. Scores are eq. 5
  run over the last ``window`` prefill queries (App. B: ``window_size = 8``), max-pooled along the
  tokens with ``kernel`` (the authors' code). ``prefill="merge"`` (default, the paper) then runs
  Algorithm 1 over the prompt: tokens pass, in position order, through the proximity FIFO into the
  context set; whenever the context set exceeds ``B_c`` its lowest-scored token is evicted into
  the residual slots. Only the end-of-prefill scores exist (per-step scores for every prompt
  token would cost O(N²)), so the stream uses them throughout: the context set kept is exactly the
  top-``B_c`` by score, and the evicted tokens are merged in the order Algorithm 1 evicts them
  (a priority-queue order, not position order). The stream is one loop over prompt tokens whose
  every step is vectorized over all layers, batch rows and KV heads at once
  (:func:`residual_stream`, checked token for token against a literal implementation of
  Algorithm 1 in the tests). ``prefill="pool"`` is the authors' code instead: the same tokens are
  kept and the evicted ones are mean-pooled, in position order, into ``B_r`` contiguous groups
  (weight = group size).
* **online** (:class:`ZSMergeOnline`, the attention's decode-time policy) every forward replays
  Algorithm 1 for its new tokens, in place in the layer's dense buffers: O(budget) work per
  token, one merge per token, and the cache never holds more than the budget. Residual slots are
  kept in float32 (float64 for float64 models) beside the cache, so a bf16 cache does not round
  away merges into a slot that already holds hundreds of tokens.
* **chunked prefill** (:mod:`kvfold.chunked`): the first chunk is a prompt brought to budget by
  the online policy (:meth:`ZSMergeOnline.adopt`: window scores, Algorithm 1 over it); every later
  token goes through Algorithm 1 with the scores of eq. 5 updated by its own query's attention
  (one masked minimum per token, the rest vectorized over the chunk), so the residual slots and
  their counts carry over from chunk to chunk.

``residual=0`` is pure eviction with the same scores (``B_c`` takes the residual's share, as in
§3.2: "this configuration subsumes eviction-based methods when B_r = 0"); ``alpha=0`` keeps the
merged slots but without compensation ("degenerating to an eviction-like policy").

Measured (``kvfold fidelity``, SmolLM2-135M, RULER 2K, 26 samples): with the paper's defaults the
attention-output error is only 1–2% below ``residual=0`` at 50–10% cache and 8% *above* it at 5%
(one residual slot absorbing ~1,900 tokens), far from §4.3's −60.5% / −43.8% / −37.4%. A larger
``residual`` share helps somewhat (≈10% at 20% cache with ``residual=0.5``); α > 1 hurts, so the
limit is the uniform mean of the merged values, not the mass compensation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.cache import NEG_INF, FoldedCache, FoldedLayer
from kvfold.methods.base import CompressionContext, Standalone, register
from kvfold.methods.scoring import pool_gqa, pool_tokens, topk_keep, window_attention
from kvfold.methods.spec import SpecError
from kvfold.methods.zsmerge_decode import ZSMergeLayerBatch

Tensor = torch.Tensor

__all__ = [
    "BudgetSplit",
    "Residuals",
    "ZSMerge",
    "ZSMergeOnline",
    "ZeroMerge",
    "decayed_scores",
    "prefill_scores",
    "residual_stream",
    "split_budget",
]

SCORE = "zsmerge.score"
COUNT = "zsmerge.count"
POSITION = "zsmerge.position"
"""``layer.entry_stats`` keys written by the one-shot compression and read by the online policy:
contribution score s (float32), merge count w (1 for plain tokens) and token position
(:data:`RESIDUAL` for residual slots)."""
RESIDUAL = -1
STEP_BLOCK = 64
"""Steps of a multi-token forward whose scores (eq. 5) are computed at once (bounds their memory)."""
STACK_ELEMENTS = 1 << 27
"""At most this many key elements are stacked into one stream (layers are grouped below it)."""


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Score / slot arithmetic dtype: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
) -> Residuals:
    """Bring rows of a prompt to budget with Algorithm 1 (or the authors' pooling).

    Tokens enter in position order; the last ``B_p`` valid ones stay in the proximity part, the
    others stream through the context set, whose lowest-scored member (ties: the newest) is
    evicted whenever it holds more than ``B_c``. With ``mode="merge"`` (Algorithm 1, lines 10–15)
    an evicted token opens a residual slot while fewer than ``B_r`` exist, otherwise it joins
    the slot of largest ``k_r·k_t`` (eq. 6; ties: the first slot) by eq. 7. Exact with respect to
    that sequential algorithm: one loop over stream steps, each vectorized over all rows.
    ``mode="pool"`` keeps the same tokens and mean-pools the evicted ones, in position order, into
    ``B_r`` contiguous groups (the authors' released code).

    Args:
        keys, values: ``(R, N, D)`` (rows = layers × batch × KV heads); any float dtype.
        scores: ``(R, N)`` contribution scores (higher = kept).
        valid: ``(R, N)`` bool, False for padding.
        split: the budget split per row, ``(R,)`` tensors.
        mode: ``"merge"`` or ``"pool"``.

    Returns:
        :class:`Residuals`.
    """
    if mode not in ("merge", "pool"):
        raise ValueError(f"mode must be 'merge' or 'pool'; got {mode!r}")
    rows, n, dim = keys.shape
    device = keys.device
    acc = _acc(keys.dtype)
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
            target = _merge_into(res_k, res_v, res_w, fill, k_t, v_t, joins, b_r, slot_ids)
            founders[row_ids, target] = torch.where(opens, victim, founders[row_ids, target])
            merged[:, i] = torch.where(joins & ~opens, victim, -1)
            merged_slot[:, i] = torch.where(joins & ~opens, target, -1)
    context = torch.zeros(rows, n + 1, dtype=torch.bool, device=device)
    context.scatter_(1, torch.where(member >= 0, member, n), True)  # empty cells land in a dropped column
    context = context[:, :n]
    return Residuals(
        kept=proximity | (context & stream),
        keys=res_k,
        values=res_v,
        counts=res_w,
        founders=founders,
        merged=merged,
        merged_slot=merged_slot,
    )


def _merge_into(
    res_k: Tensor,
    res_v: Tensor,
    res_w: Tensor,
    fill: Tensor,
    k_t: Tensor,
    v_t: Tensor,
    act: Tensor,
    b_r: Tensor,
    slot_ids: Tensor,
) -> Tensor:
    """Algorithm 1 lines 12–15 for every row at once, in place; returns the slot used per row.

    Rows with ``act`` add ``(k_t, v_t)``: into a new slot while ``fill < B_r`` (eq. 7 with w = 0 is
    the token itself), else into ``r̂ = argmax_{r < fill} k_r·k_t`` (eq. 6) by the incremental mean
    of eq. 7; ``w_r̂ += 1``.
    """
    slots = res_k.shape[-2]
    opened = slot_ids[None, :] < fill[..., None]  # (..., S)
    dots = (res_k @ k_t[..., None])[..., 0].masked_fill(~opened, float("-inf"))  # eq. 6: k_r·k_t
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


def _fold_layers(
    layers: list[FoldedLayer],
    scores: list[Tensor],
    split: BudgetSplit,
    alpha: float,
    mode: str,
    position_offsets: list[int] | None = None,
    record: Callable[[int, Tensor, Tensor, Residuals], None] | None = None,
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
                raise ValueError(
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
        result = residual_stream(k, v, s, valid, row_split, mode)
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
    acc = _acc(layer.dtype)
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


def _attention_scalings(model: torch.nn.Module) -> dict[int, float | None]:
    """Each attention module's logit scale (modules with ``layer_idx`` and ``o_proj``)."""
    found: dict[int, float | None] = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj"):
            scaling = getattr(module, "scaling", None)
            found.setdefault(int(module.layer_idx), None if scaling is None else float(scaling))
    return found


# ---------------------------------------------------------------------------- online policy


@dataclass
class _LayerState:
    """Per-slot bookkeeping of one layer, aligned with its dense buffers (capacity ≥ slots)."""

    score: Tensor  # (B, H, cap) s, eq. 5
    position: Tensor  # (B, H, cap) long token positions; RESIDUAL for residual, emptied and padding slots
    slot_id: Tensor  # (B, H, cap) long: the residual slot an entry is, or −1
    res_k: Tensor  # (B, H, S, D) residual means in the accumulation dtype
    res_v: Tensor
    res_w: Tensor  # (B, H, S) w
    fill: Tensor  # (B, H) residual slots opened
    steady: bool | None = None  # every row's B_r slots are open (and B_r > 0); None: not known yet
    closed: Tensor | None = None  # (B, H, S) slots a row cannot use (≥ its B_r) once steady; None: none

    def per_slot(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.score, self.position, self.slot_id

    def grow(self, capacity: int) -> None:
        if self.score.shape[-1] >= capacity:
            return
        extra = capacity - self.score.shape[-1]
        self.score = F.pad(self.score, (0, extra))
        self.position = F.pad(self.position, (0, extra), value=RESIDUAL)
        self.slot_id = F.pad(self.slot_id, (0, extra), value=-1)


class ZSMergeOnline:
    """Algorithm 1 at every forward, in place (the attention calls :meth:`after_forward`).

    Args:
        budgets: ``(B,)`` entries per KV head for each batch row.
        split: the split of ``budgets`` (§3.2).
        layers: layer index → logit scale (None = ``1/√D``) of every layer it manages.
        alpha: α of eq. 8.
        decay: λ of eq. 5.
        window, kernel: prefill scores, for a layer it first meets uncompressed (a prefill that
            ran with the policy attached).
        mode: ``"merge"`` or ``"pool"`` for such a layer.
    """

    needs_attention: bool = True

    def __init__(
        self,
        budgets: Tensor,
        split: BudgetSplit,
        layers: dict[int, float | None],
        alpha: float,
        decay: float,
        window: int = 8,
        kernel: int = 5,
        mode: str = "merge",
    ) -> None:
        self.budgets = budgets.long()
        self.split = split
        self.layers = layers
        self.alpha = alpha
        self.decay = decay
        self.window = window
        self.kernel = kernel
        self.mode = mode
        self.limit = int(self.budgets.max())
        self.steps = 0
        self._state: dict[int, _LayerState] = {}
        self._split_cache: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self._batch = ZSMergeLayerBatch(self)
        self._last = max(layers) if layers else -1
        self._held: list[tuple] = []  # this decode forward's layers, until its last one

    def _split_on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """``B_p``, ``B_c``, ``B_r`` as ``(B, 1)`` tensors on ``device`` (made once)."""
        found = self._split_cache.get(device)
        if found is None:
            split = self.split
            found = tuple(t.to(device)[:, None] for t in (split.proximity, split.context, split.residual))
            self._split_cache[device] = found
        return found

    # ------------------------------------------------------------------ entry point
    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        """Algorithm 1 on the layer's new tokens. A decode step of a layer with state waits for the
        forward's last layer: then every layer steps at once (:class:`ZSMergeLayerBatch`) or, where
        that cannot be done, each in layer order."""
        if layer_idx not in self.layers:
            return
        if self._held and layer_idx <= self._held[-1][0]:  # a new forward: the last one stopped early
            self._step_held()
        if query.shape[2] == 1 and probs is not None and layer_idx in self._state:
            self._held.append((layer_idx, layer, query, probs, logits))
            if layer_idx == self._last:
                self._step_held()
            return
        self._step_layer(layer_idx, layer, query, probs)

    def _step_held(self) -> None:
        held, self._held = self._held, []
        if self._batch.step(held):
            return
        for layer_idx, layer, query, probs, _ in held:
            self._step_layer(layer_idx, layer, query, probs)
        if not self._batch._is_stacked():
            self._batch.adopt()

    def _step_layer(self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None) -> None:
        """Algorithm 1 on one layer's new tokens (one decode step or a chunk)."""
        q_len = query.shape[2]
        n = layer.physical_length
        state = self._state.get(layer_idx)
        if state is None:
            if self._has_statistics(layer, n - q_len):
                state = self._state[layer_idx] = self._init_state(layer, n - q_len)
            else:  # a cache this policy has not seen: bring it to budget in one shot
                self._bring_to_budget(layer_idx, layer, query, probs)
                if layer_idx == min(self.layers):
                    self.steps += 1
                return
        state.grow(max(n, self.limit + 1))
        old = n - q_len
        start = layer.logical_length - q_len
        state.score.narrow(2, old, q_len).fill_(0.0)
        state.slot_id.narrow(2, old, q_len).fill_(-1)
        if q_len == 1:  # a decode step: Algorithm 1 for one token
            state.position.select(2, old).fill_(start)
            if probs is not None:  # lines 4–5: s ← λ·s + a (eq. 5), a GQA-pooled
                a = pool_gqa(probs.select(2, 0).to(state.score.dtype), layer.num_heads, "mean")
                state.score.narrow(2, 0, n).mul_(self.decay).add_(a)
            if self._arrive(layer, state, start):  # the steady step compacted the layer already
                if layer_idx == min(self.layers):
                    self.steps += 1
                return
        else:  # several tokens (a chunk): the same steps, vectorized where they allow it
            dev = state.position.device
            state.position[:, :, old:n] = torch.arange(start, start + q_len, device=dev)
            self._arrive_many(layer, state, probs, start, q_len)
            state.steady = None
        self._compact(layer, state)
        if layer_idx == min(self.layers):
            self.steps += 1

    def slots(self, layer_idx: int, layer: FoldedLayer) -> dict[str, Tensor]:
        """The policy's view of a layer (for inspection and tests).

        Returns:
            Per slot, ``(B, H, N)``: ``position`` (token position; −1 for residual slots),
            ``slot_id`` (the residual slot an entry holds, −1 for plain tokens), ``count`` (w),
            ``score`` (s), ``valid``. Per residual slot in the order they were opened,
            ``(B, H, S[, D])``: ``residual_keys``, ``residual_values``, ``residual_counts``.
        """
        state = self._state[layer_idx]
        n = layer.physical_length
        _, _, log_mass = layer.dense_buffers()
        valid = torch.isfinite(log_mass)
        sid = state.slot_id[:, :, :n]
        w = F.pad(state.res_w, (0, 1), value=1.0).gather(2, torch.where(sid >= 0, sid, state.res_w.shape[-1]))
        return {
            "position": state.position[:, :, :n].clone(),
            "slot_id": sid.clone(),
            "count": torch.where(valid, w, 0.0),
            "score": state.score[:, :, :n].clone(),
            "valid": valid,
            "residual_keys": state.res_k.clone(),
            "residual_values": state.res_v.clone(),
            "residual_counts": state.res_w.clone(),
        }

    def export_state(self, cache: FoldedCache) -> None:
        """Write each layer's state as the one-shot compression writes it (``SCORE``, ``COUNT``,
        ``POSITION`` in ``layer.entry_stats``), so that a fresh policy continues from it: the
        residual slots keep their merge counts (their means are the cache's keys and values)."""
        if self._held:
            self._step_held()
        for layer_idx, layer in cache.folded_layers:
            if layer_idx not in self._state:
                continue
            view = self.slots(layer_idx, layer)
            plain = view["valid"] & (view["position"] >= 0)
            layer.entry_stats = {
                **layer.entry_stats,
                SCORE: torch.where(plain, view["score"], 0.0),
                COUNT: view["count"],
                POSITION: view["position"],
            }

    # ------------------------------------------------------------------ state
    def _has_statistics(self, layer: FoldedLayer, count: int) -> bool:
        stats = layer.entry_stats
        shape = (layer.batch_size, layer.num_heads, count)
        return layer.paged is None and all(
            key in stats and tuple(stats[key].shape) == shape for key in (SCORE, COUNT, POSITION)
        )

    def _init_state(self, layer: FoldedLayer, count: int) -> _LayerState:
        keys, values, log_mass = layer.dense_buffers()
        acc = _acc(layer.dtype)
        b, h = layer.batch_size, layer.num_heads
        slots = int(self.split.residual.max())
        valid = torch.isfinite(log_mass[:, :, :count])
        position = layer.entry_stats[POSITION].to(torch.long)
        residual = valid & (position == RESIDUAL)
        slot_id = torch.where(residual, residual.long().cumsum(-1) - 1, -1)
        fill = residual.sum(-1)
        if bool((fill > self.split.residual.to(fill.device)[:, None]).any()):
            raise ValueError("the cache holds more residual slots than this policy's budget split allows")
        dump = torch.where(residual, slot_id, slots)  # non-residual entries land in a dropped cell
        res_k = torch.zeros(b, h, slots + 1, keys.shape[-1], dtype=acc, device=keys.device)
        res_v = torch.zeros(b, h, slots + 1, values.shape[-1], dtype=acc, device=keys.device)
        res_w = torch.zeros(b, h, slots + 1, dtype=acc, device=keys.device)
        res_k.scatter_(2, dump[..., None].expand(-1, -1, -1, keys.shape[-1]), keys[:, :, :count].to(acc))
        res_v.scatter_(2, dump[..., None].expand(-1, -1, -1, values.shape[-1]), values[:, :, :count].to(acc))
        res_w.scatter_(2, dump, layer.entry_stats[COUNT].to(acc))
        return _LayerState(
            score=layer.entry_stats[SCORE].to(acc).clone(),
            position=position.clone(),
            slot_id=slot_id,
            res_k=res_k[:, :, :slots].contiguous(),
            res_v=res_v[:, :, :slots].contiguous(),
            res_w=res_w[:, :, :slots].contiguous(),
            fill=fill,
        )

    def _bring_to_budget(self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None) -> None:
        """A layer without zsmerge statistics (e.g. a prefill run under the policy): score it and
        fold it to budget with :func:`residual_stream`, then continue online from there."""
        if probs is None:  # a fresh prefill: the window of its last queries (App. B)
            scores = self._window_scores(layer_idx, layer, query)
        else:
            keys, _, log_mass, _ = layer.padded()
            valid = torch.isfinite(log_mass)
            empty = torch.zeros(keys.shape[:2] + (0,), dtype=torch.float32, device=keys.device)
            scores = decayed_scores(empty, probs, self.decay).masked_fill(~valid, float("-inf"))
        offset = layer.logical_length - layer.physical_length
        _fold_layers([layer], [scores], self.split, self.alpha, self.mode, [offset])
        if layer.paged is None:
            self._state[layer_idx] = self._init_state(layer, layer.physical_length)

    def adopt(self, cache: FoldedCache) -> None:
        """Take over a freshly prefilled cache: bring every layer this policy has not seen to budget
        as :meth:`after_forward` does for a prefill run under the policy (scores from the window of
        the captured prefill queries, Algorithm 1 over the prompt), all layers in one stream.
        A chunked prefill calls it after its first chunk (:mod:`kvfold.chunked`).

        Raises:
            ValueError: a layer holds merged entries already, or the prefill kept no queries.
        """
        layers = [(i, layer) for i, layer in cache.folded_layers if i in self.layers and i not in self._state]
        scores = []
        for layer_idx, layer in layers:
            if layer.captured_queries is None:
                raise ValueError(
                    "zsmerge scores a prefill with its last queries, but this cache kept none "
                    "(set cache.capture_window before the forward pass)"
                )
            scores.append(self._window_scores(layer_idx, layer, layer.captured_queries))
        offsets = [layer.logical_length - layer.physical_length for _, layer in layers]
        _fold_layers([layer for _, layer in layers], scores, self.split, self.alpha, self.mode, offsets)
        for layer_idx, layer in layers:
            self._state[layer_idx] = self._init_state(layer, layer.physical_length)

    def _window_scores(self, layer_idx: int, layer: FoldedLayer, queries: Tensor) -> Tensor:
        """Prefill scores (eq. 5 over the last ``window`` queries, App. B) of a plain layer."""
        keys, _, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        width = min(self.window, queries.shape[2], keys.shape[2])
        scaling = self.layers[layer_idx] or layer.head_dim**-0.5
        return prefill_scores(queries[:, :, -width:], keys, scaling, self.decay, self.kernel, beta, valid)

    # ------------------------------------------------------------------ Algorithm 1, lines 6–15
    def _arrive(self, layer: FoldedLayer, state: _LayerState, now: int) -> bool:
        """Token ``now`` has joined the proximity part: move the FIFO's oldest to the context
        set and, if the context set exceeds ``B_c``, evict its lowest-scored token into R.

        Returns:
            True when the layer is compacted already (:meth:`_steady_step`).
        """
        keys, values, log_mass = layer.dense_buffers()
        n = keys.shape[2]
        score, position, slot_id = (t.narrow(2, 0, n) for t in state.per_slot())
        dev = keys.device
        b_p, b_c, b_r = self._split_on(dev)
        # Plain tokens are the slots with a position ≥ 0 (residual, emptied and padding slots hold
        # RESIDUAL); the context set is the plain tokens outside the B_p newest: lines 7–9.
        context = (position >= 0) & (position <= now - b_p.unsqueeze(-1))
        evict = context.sum(-1) > b_c  # line 10
        evicting = int(evict.sum())
        if not evicting:
            return False
        masked = torch.where(context, score, float("inf"))
        lowest = masked.amin(-1, keepdim=True)
        victim = torch.where(context & (masked == lowest), position, -1).argmax(-1, keepdim=True)  # line 11
        if evicting == evict.numel() and n - self.limit == 1 and self._is_steady(state, b_r):
            self._steady_step(keys, values, log_mass, state, victim, n)
            layer.truncate(n - 1)
            return True
        state.steady = None  # a slot may open
        slots = state.res_k.shape[-2]
        freed = evict.clone()
        if slots:
            acc = state.res_k.dtype
            k_t = keys.gather(2, victim[..., None].expand(-1, -1, -1, keys.shape[-1]))[:, :, 0].to(acc)
            v_t = values.gather(2, victim[..., None].expand(-1, -1, -1, values.shape[-1]))[:, :, 0].to(acc)
            opens = evict & (state.fill < b_r)
            merges = evict & ~opens & (b_r > 0)
            fill_before = state.fill.clone()
            target = _merge_into(
                state.res_k,
                state.res_v,
                state.res_w,
                state.fill,
                k_t,
                v_t,
                evict & (b_r > 0),
                b_r,
                torch.arange(slots, device=dev),
            )
            # line 13: the victim itself becomes the new residual slot (its k, v unchanged, w = 1)
            slot_id.scatter_(
                2, victim, torch.where(opens[..., None], fill_before[..., None], slot_id.gather(2, victim))
            )
            freed = evict & ~opens
            # line 15: write the merged slot back into the cache, β = α·log w (eq. 8)
            where = (slot_id == target[..., None]).to(torch.uint8).argmax(-1, keepdim=True)
            t = target[..., None]
            k_new = state.res_k.gather(2, t[..., None].expand(-1, -1, -1, keys.shape[-1]))
            v_new = state.res_v.gather(2, t[..., None].expand(-1, -1, -1, values.shape[-1]))
            w_new = state.res_w.gather(2, t)
            m = merges[..., None]
            k_old = keys.gather(2, where[..., None].expand(-1, -1, -1, keys.shape[-1]))
            v_old = values.gather(2, where[..., None].expand(-1, -1, -1, values.shape[-1]))
            m4 = m[..., None]
            keys.scatter_(2, where[..., None].expand_as(k_old), torch.where(m4, k_new.to(keys.dtype), k_old))
            values.scatter_(2, where[..., None].expand_as(v_old), torch.where(m4, v_new.to(values.dtype), v_old))
            beta = (self.alpha * torch.log(w_new)).to(log_mass.dtype)
            log_mass.scatter_(2, where, torch.where(m, beta, log_mass.gather(2, where)))
        # the victim leaves the plain tokens: it is a residual slot now, or its slot is emptied
        position.scatter_(2, victim, torch.where(evict[..., None], RESIDUAL, position.gather(2, victim)))
        log_mass.scatter_(2, victim, torch.where(freed[..., None], NEG_INF, log_mass.gather(2, victim)))
        return False

    def _is_steady(self, state: _LayerState, b_r: Tensor) -> bool:
        """Whether every row has opened all its ``B_r ≥ 1`` residual slots (then no slot opens again:
        every eviction merges, line 15). Known once per change of ``state.fill``."""
        if state.steady is None:
            state.steady = bool(((state.fill >= b_r) & (b_r > 0)).all())
            if state.steady:
                closed = torch.arange(state.res_k.shape[-2], device=b_r.device) >= state.fill.unsqueeze(-1)
                state.closed = closed if bool(closed.any()) else None
        return state.steady

    def _steady_step(
        self, keys: Tensor, values: Tensor, log_mass: Tensor, state: _LayerState, victim: Tensor, n: int
    ) -> None:
        """Lines 12–15 and the compaction of :meth:`_arrive` + :meth:`_compact` when every row evicts,
        every row's residual slots are all open and the layer is one entry over the limit (the
        decode steps once the cache is full), with the same arithmetic and no masked writes: the
        victim merges into ``r̂ = argmax_r k_r·k_t`` (eq. 6) by the incremental mean of eq. 7, that
        slot's cache entry gets the mean and β = α·log w (eq. 8), the victim's slot is emptied and
        the newest slot moves into the first empty one."""
        acc = state.res_k.dtype
        dim, dim_v = keys.shape[-1], values.shape[-1]
        k_t = keys.gather(2, victim.unsqueeze(-1).expand(-1, -1, 1, dim)).squeeze(2).to(acc)
        v_t = values.gather(2, victim.unsqueeze(-1).expand(-1, -1, 1, dim_v)).squeeze(2).to(acc)
        dots = torch.matmul(state.res_k, k_t.unsqueeze(-1)).squeeze(-1)  # eq. 6: k_r·k_t
        if state.closed is not None:
            dots = dots.masked_fill(state.closed, float("-inf"))
        target = dots.argmax(-1, keepdim=True)  # (B, H, 1)
        w = state.res_w.gather(-1, target)
        k_old = state.res_k.gather(-2, target.unsqueeze(-1).expand(-1, -1, 1, dim)).squeeze(2)
        v_old = state.res_v.gather(-2, target.unsqueeze(-1).expand(-1, -1, 1, dim_v)).squeeze(2)
        w_new = w + 1.0  # w_r̂ ← w_r̂ + 1
        k_new = ((w * k_old + k_t) / w_new).unsqueeze(2)  # eq. 7
        v_new = ((w * v_old + v_t) / w_new).unsqueeze(2)
        state.res_k.scatter_(-2, target.unsqueeze(-1).expand(-1, -1, 1, dim), k_new)
        state.res_v.scatter_(-2, target.unsqueeze(-1).expand(-1, -1, 1, dim_v), v_new)
        state.res_w.scatter_(-1, target, w_new)
        # line 15: the cache slot holding r̂ gets its mean, β = α·log w (eq. 8)
        slot_id = state.slot_id.narrow(2, 0, n)
        where = (slot_id == target).to(torch.uint8).argmax(-1, keepdim=True)
        keys.scatter_(2, where.unsqueeze(-1).expand(-1, -1, 1, dim), k_new.to(keys.dtype))
        values.scatter_(2, where.unsqueeze(-1).expand(-1, -1, 1, dim_v), v_new.to(values.dtype))
        log_mass.scatter_(2, where, (self.alpha * torch.log(w_new)).to(log_mass.dtype))
        # the victim leaves the plain tokens and its slot is emptied
        position = state.position.narrow(2, 0, n)
        position.scatter_(2, victim, RESIDUAL)
        log_mass.scatter_(2, victim, NEG_INF)
        # _compact: every row has an empty slot now; the newest slot moves into the first one
        free = log_mass.argmin(-1, keepdim=True)  # β = −inf is the minimum: the first empty slot
        last = n - 1
        index = free.unsqueeze(-1).expand(-1, -1, 1, dim)
        keys.scatter_(2, index, keys.narrow(2, last, 1).clone())
        if dim_v != dim:
            index = free.unsqueeze(-1).expand(-1, -1, 1, dim_v)
        values.scatter_(2, index, values.narrow(2, last, 1).clone())
        for tensor in (log_mass, state.score.narrow(2, 0, n), position, slot_id):
            tensor.scatter_(2, free, tensor.narrow(2, last, 1).clone())

    def _arrive_many(
        self, layer: FoldedLayer, state: _LayerState, probs: Tensor | None, start: int, q_len: int
    ) -> None:
        """Algorithm 1 for the ``q_len`` tokens ``start …`` of one forward: the result of one
        :meth:`_arrive` per token with the scores of eq. 5 updated by each token's query, in three passes.

        1. **Victims** (lines 4–11). The scores of every step come in blocks of
           :data:`STEP_BLOCK` steps, ``s_{i0+k} = λ^{k+1} s_{i0−1} + Σ_{j≤k} λ^{k−j} a_{i0+j}``, one
           matrix product per block; when the context set exceeds ``B_c`` is known in closed form
           (one token joins it per step, one leaves per eviction); each step is then a single
           masked minimum over the slots, sorted newest first so that ties evict the newest.
        2. **Merges** (lines 12–15): the victims join the residual slots in eviction order, one
           step at a time on the small slot tensors (slot sums and counts: eq. 7's incremental
           mean is their ratio; eq. 6 compares ``k_t`` with the means).
        3. **Cache edits**, once: victims leave the plain tokens (a new residual slot, or an
           emptied slot), merged slots get their means and β = α·log w (eq. 8).
        """
        keys, values, log_mass = layer.dense_buffers()
        n, dev, acc = keys.shape[2], keys.device, state.score.dtype
        b_p, b_c, b_r = (t[..., None] for t in self._split_on(dev))  # (B, 1, 1)
        position = state.position[:, :, :n]
        plain = position >= 0
        # the step at which each plain token joins the context set (lines 7–9): -1 = already in it
        joins = torch.where(plain, position + b_p - start, q_len).clamp(-1, q_len)
        joined = torch.zeros(*joins.shape[:2], q_len + 2, dtype=torch.long, device=dev)
        joined = joined.scatter_add_(-1, joins + 1, torch.ones_like(joins)).cumsum(-1)[..., 1 : q_len + 1]
        # evictions (line 10): one per step while the set holds more than B_c → X_i = min((|C_i| − B_c)⁺, i + 1)
        steps = torch.arange(1, q_len + 1, device=dev)
        evicted_by = torch.minimum((joined - b_c).clamp_min(0), steps)
        evict = torch.diff(evicted_by, dim=-1, prepend=torch.zeros_like(evicted_by[..., :1])) > 0  # (B, H, q)
        # 1. victims (line 11), over the slots sorted newest first (argmin's first minimum = the newest)
        order = torch.argsort(torch.where(plain, position, RESIDUAL - 1), dim=-1, descending=True)
        joins = joins.gather(-1, order)
        s = state.score[:, :, :n].gather(-1, order)
        gone = torch.zeros(*joins.shape[:2], n + 1, dtype=torch.bool, device=dev)  # column n: "no victim"
        chosen = []  # per block, (B, H, k) columns of the sorted slots
        for i0 in range(0, q_len, STEP_BLOCK):
            k = min(q_len, i0 + STEP_BLOCK) - i0
            if probs is not None:  # eq. 5 over the block: s_k = λ^{k+1} s + Σ_{j≤k} λ^{k−j} a_j
                a = pool_gqa(probs[:, :, i0 : i0 + k].to(acc), layer.num_heads, "mean")
                a = a.gather(-1, order[:, :, None, :].expand(-1, -1, k, -1))
                lag = torch.arange(k, device=dev, dtype=acc)
                lag = lag[:, None] - lag[None, :]
                decay = torch.where(lag >= 0, torch.pow(self.decay, lag.clamp_min(0)), 0.0)
                block = torch.pow(self.decay, torch.arange(1, k + 1, device=dev, dtype=acc))[:, None] * s[:, :, None]
                block = block + decay @ a
            else:  # no attention: the scores stay as they are
                block = s[:, :, None].expand(-1, -1, k, -1)
            s = block[:, :, -1]
            member = joins[:, :, None, :] <= torch.arange(i0, i0 + k, device=dev)[:, None]
            masked = block.masked_fill(~member | gone[:, :, None, :n], float("inf"))
            # step j's own spare column n + j wins its minimum when it evicts nothing
            spare = masked.new_full((*masked.shape[:3], k), float("inf"))
            spare.diagonal(dim1=2, dim2=3).copy_(torch.where(evict[:, :, i0 : i0 + k], float("inf"), float("-inf")))
            masked = torch.cat([masked, spare], dim=-1)
            picked = []
            for j in range(k):
                victim = masked[:, :, j].argmin(-1)
                if j + 1 < k:  # the victim leaves the set for the rest of the block
                    masked[:, :, j + 1 :].scatter_(
                        -1, victim[:, :, None, None].expand(-1, -1, k - j - 1, 1), float("inf")
                    )
                picked.append(victim)
            chosen.append(torch.stack(picked, dim=-1).clamp(max=n))  # a spare column: n, no victim
            gone.scatter_(-1, chosen[-1], True)
        state.score[:, :, :n] = torch.empty_like(s).scatter_(-1, order, s)
        victims = F.pad(order, (0, 1), value=n).gather(-1, torch.cat(chosen, dim=-1))  # slots, (B, H, q); n: none
        # 2. merges into the residual slots, in eviction order (lines 12–15: eq. 6, eq. 7)
        slots = state.res_k.shape[-2]
        merging = evict & (b_r > 0)
        fill_before = state.fill[..., None] + merging.long().cumsum(-1) - merging.long()
        opens = merging & (fill_before < b_r)  # line 13: the victim itself becomes a new slot
        if slots:  # sums instead of means: each step is one scatter-add per tensor
            at = victims.clamp(max=n - 1)
            k_t = keys.gather(2, at[..., None].expand(-1, -1, -1, keys.shape[-1])).to(acc) * merging[..., None]
            v_t = values.gather(2, at[..., None].expand(-1, -1, -1, values.shape[-1])).to(acc) * merging[..., None]
            added = merging.to(acc)
            key_sum = state.res_k * state.res_w[..., None]
            value_sum = state.res_v * state.res_w[..., None]
            weight = state.res_w.clone()
            closed = torch.arange(slots, device=dev) >= fill_before[..., None]  # (B, H, q, S): not opened yet
            new_slot = fill_before.clamp(max=slots - 1)
            for i in torch.nonzero(merging.flatten(0, 1).any(0)).flatten().tolist():
                dots = (key_sum @ k_t[:, :, i, :, None])[..., 0] / weight.clamp_min(1)  # eq. 6: k_r·k_t, k_r the mean
                nearest = dots.masked_fill(closed[:, :, i], float("-inf")).argmax(-1)  # ties: the first slot
                target = torch.where(opens[:, :, i], new_slot[:, :, i], nearest)[..., None]  # line 13 or line 15
                key_sum.scatter_add_(2, target[..., None].expand(-1, -1, 1, key_sum.shape[-1]), k_t[:, :, i, None])
                value_sum.scatter_add_(2, target[..., None].expand(-1, -1, 1, value_sum.shape[-1]), v_t[:, :, i, None])
                weight.scatter_add_(2, target, added[:, :, i, None])  # eq. 7: w_r̂ ← w_r̂ + 1
            state.res_k = key_sum / weight.clamp_min(1)[..., None]  # eq. 7: the means
            state.res_v = value_sum / weight.clamp_min(1)[..., None]
            state.res_w = weight
            state.fill += opens.sum(-1)
        # 3. the cache: victims leave the plain tokens; new slots are numbered; emptied slots go
        # (a spare column n takes the writes of the steps without a victim)
        padded = F.pad(state.slot_id[:, :, :n], (0, 1), value=-1)
        padded.scatter_(-1, torch.where(opens, victims, n), fill_before)
        state.slot_id[:, :, :n] = padded[..., :n]
        padded = F.pad(position, (0, 1)).scatter_(-1, victims, RESIDUAL)
        state.position[:, :, :n] = padded[..., :n]
        padded = F.pad(log_mass, (0, 1)).scatter_(-1, torch.where(evict & ~opens, victims, n), NEG_INF)
        log_mass.copy_(padded[..., :n])
        if slots:  # line 15: every residual slot holds its mean, β = α·log w (eq. 8)
            slot_id = state.slot_id[:, :, :n]
            is_slot = (slot_id >= 0) & torch.isfinite(log_mass)
            at = slot_id.clamp_min(0)
            for buffer, means in ((keys, state.res_k), (values, state.res_v)):
                mean = means.gather(2, at[..., None].expand(-1, -1, -1, buffer.shape[-1])).to(buffer.dtype)
                buffer.copy_(torch.where(is_slot[..., None], mean, buffer))
            beta = (self.alpha * torch.log(state.res_w.gather(2, at))).to(log_mass.dtype)
            log_mass.copy_(torch.where(is_slot, beta, log_mass))

    def _compact(self, layer: FoldedLayer, state: _LayerState) -> None:
        """Drop emptied slots so that the layer holds at most the budget."""
        n = layer.physical_length
        if n <= self.limit:
            return
        keys, values, log_mass = layer.dense_buffers()
        per_slot = [t[:, :, :n] for t in state.per_slot()]
        free = ~torch.isfinite(log_mass)
        if n - self.limit == 1 and bool(free.any(-1).all()):
            # one step: move the last slot into the first empty one (O(budget), no copy of the cache)
            target = free.to(torch.uint8).argmax(-1, keepdim=True)
            last = n - 1
            for tensor in (keys, values):
                tensor.scatter_(
                    2, target[..., None].expand(-1, -1, 1, tensor.shape[-1]), tensor[:, :, last : last + 1].clone()
                )
            for tensor in (log_mass, *per_slot):
                tensor.scatter_(2, target, tensor[:, :, last : last + 1].clone())
            layer.truncate(last)
            return
        keep = max(self.limit, int((~free).sum(-1).max()))
        if keep >= n:
            return
        order = torch.sort(free.to(torch.uint8), dim=-1, stable=True).indices[..., :keep]
        for tensor in (keys, values):
            tensor[:, :, :keep] = tensor.gather(2, order[..., None].expand(-1, -1, -1, tensor.shape[-1]))
        for tensor in (log_mass, *per_slot):
            tensor[:, :, :keep] = tensor.gather(2, order)
        layer.truncate(keep)


# ---------------------------------------------------------------------------- registered methods


@register
@dataclass
class ZSMerge(Standalone):
    """ZSMerge (``papers/zsmerge.md`` §3): proximity + context + residual slots with compensated
    attention β = α·log w; one-shot after prefill and online at every decoding step.

    Parameters:
        alpha: α of eq. 8 in [0, 1] (1 in ZSMerge; 0 = merged slots without compensation).
        residual: ``B_r``: a fraction (< 1) of ``B − B_p`` (App. C.2 recommends 0.02; at least one
            slot when > 0) or a slot count (≥ 1). 0 = pure eviction with the same scores.
        proximity: ``B_p``: a fraction (< 1) of the budget (App. C.2 recommends 0.5) or a count.
        decay: λ of eq. 5 (0.98).
        window: prefill queries that initialise the scores (App. B: 8).
        kernel: max-pooling kernel of the prefill scores, odd (the authors' code: 5; 1 = none).
        prefill: ``merge`` (Algorithm 1 over the prompt, the paper) or ``pool`` (evicted tokens
            mean-pooled into ``B_r`` contiguous groups, the authors' code).
        online: keep the budget during decoding (Algorithm 1 at every step).
    """

    name: ClassVar[str] = "zsmerge"
    description: ClassVar[str] = (
        "recent + top decayed-attention tokens; evicted ones merged into residual slots, β = α·log w (α=1); online"
    )
    supports_chunked_prefill: ClassVar[bool] = True
    chunked_prefill_online: ClassVar[bool] = True  # Algorithm 1 runs on, token by token, over the chunks
    paper: ClassVar[str] = (
        "Liu, Liu and Tang 2025, ZSMerge: Zero-Shot KV Cache Compression for Memory-Efficient Long-Context LLMs"
    )
    alpha: float = 1.0
    residual: float = 0.02
    proximity: float = 0.5
    decay: float = 0.98
    window: int = 8
    kernel: int = 5
    prefill: str = "merge"
    online: bool = True

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        name = self.name
        if not 0.0 <= self.alpha <= 1.0:
            raise SpecError(f"{name}: alpha must be in [0, 1] (Theorem 1 needs α ≤ 1); got {self.alpha}")
        if not 0.0 <= self.decay <= 1.0:
            raise SpecError(f"{name}: decay must be in [0, 1]; got {self.decay}")
        for option in ("residual", "proximity"):
            value = getattr(self, option)
            if value < 0 or math.isnan(value) or (value >= 1 and value != int(value)):
                raise SpecError(f"{name}: {option} must be a fraction in [0, 1) or a whole count ≥ 1; got {value}")
        if self.window < 1:
            raise SpecError(f"{name}: window must be ≥ 1; got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise SpecError(f"{name}: kernel must be an odd positive integer; got {self.kernel}")
        if self.prefill not in ("merge", "pool"):
            raise SpecError(f"{name}: prefill must be 'merge' or 'pool'; got {self.prefill!r}")

    def split(self, budgets: Tensor) -> BudgetSplit:
        """``B_p``, ``B_c``, ``B_r`` for per-row budgets ``(B,)``."""
        return split_budget(budgets, self.proximity, self.residual)

    def compress(self, ctx: CompressionContext) -> None:
        layers = ctx.cache.folded_layers
        scalings = ctx.memo.setdefault("zsmerge_scalings", _attention_scalings(ctx.model))
        scores = []
        for layer_idx, layer in layers:
            scores.append(self._scores(layer, scalings.get(layer_idx)))
        split = self.split(ctx.row_budgets)
        indices = [layer_idx for layer_idx, _ in layers]

        def record(i: int, keep: Tensor, lengths: Tensor, res: Residuals) -> None:
            """Merge map: kept slots; each later victim absorbed by the token that opened its slot."""
            if res.founders is None:  # pool mode: groups have no carrier token
                return
            ctx.record_kept(indices[i], keep, lengths)
            founder = F.pad(res.founders, (0, 1), value=-1)
            carrier = founder.gather(2, torch.where(res.merged_slot >= 0, res.merged_slot, founder.shape[-1] - 1))
            ctx.record_merges(indices[i], torch.where(res.merged >= 0, carrier, -1), res.merged)

        recorder = record if ctx.merge_recorder is not None else None
        _fold_layers([layer for _, layer in layers], scores, split, self.alpha, self.prefill, record=recorder)

    def online_policy(self, ctx: CompressionContext) -> ZSMergeOnline | None:
        if not self.online:
            return None
        budgets = ctx.row_budgets
        scalings = _attention_scalings(ctx.model)
        layers = {i: scalings.get(i) for i, _ in ctx.cache.folded_layers}
        return ZSMergeOnline(
            budgets, self.split(budgets), layers, self.alpha, self.decay, self.window, self.kernel, self.prefill
        )

    def _scores(self, layer: FoldedLayer, scaling: float | None) -> Tensor:
        captured = layer.captured_queries
        if captured is None:
            raise ValueError(
                f"{self.name} reads the last prefill query states, but this cache kept none; prefill with "
                "kvfold.prefill (or set cache.capture_window before the forward pass)"
            )
        if layer.physical_length != layer.logical_length:
            raise ValueError(f"{self.name} compresses a freshly prefilled cache; this layer was already compressed")
        width = min(self.window, layer.physical_length)
        if captured.shape[2] < width:
            raise ValueError(
                f"{self.name} needs the last {width} prefill queries but the prefill kept {captured.shape[2]}; "
                f"pass methods=[...] or capture_window={width} to kvfold.prefill"
            )
        keys, _, log_mass, _ = layer.padded()
        valid = torch.isfinite(log_mass)
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        scale = scaling if scaling is not None else layer.head_dim**-0.5
        return prefill_scores(captured[:, :, -width:], keys, scale, self.decay, self.kernel, beta, valid)


@register
@dataclass
class ZeroMerge(ZSMerge):
    """ZeroMerge (``papers/zeromerge.md`` §3, §4.4): the earlier version of ZSMerge, α = 0.6.

    Same parameters as :class:`ZSMerge`.
    """

    name: ClassVar[str] = "zeromerge"
    description: ClassVar[str] = "ZSMerge with the ZeroMerge paper's compensation α = 0.6; online"
    paper: ClassVar[str] = (
        "Liu, Liu and Tang 2025, ZeroMerge: Parameter-Free KV Cache Compression for Memory-Efficient Long-Context LLMs"
    )
    alpha: float = 0.6
