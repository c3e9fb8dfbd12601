"""ZSMerge's online policy: Algorithm 1 replayed for every new token in the layer's dense buffers
(decode steps and chunked prefill). See :mod:`kvfold.methods.merging.zsmerge`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfold.methods.core.scoring import compute_dtype, pool_gqa
from kvfold.methods.merging.zsmerge.decode import ZSMergeLayerBatch
from kvfold.methods.merging.zsmerge.merge import (
    COUNT,
    POSITION,
    RESIDUAL,
    SCORE,
    BudgetSplit,
    decayed_scores,
    fold_layers,
    join_nearest_slot,
    merge_into_slots,
    prefill_scores,
)
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor
STEP_BLOCK = 64
"""Steps of a multi-token forward whose scores (eq. 5) are computed at once (bounds their memory)."""


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
        slot_metric: ``"dot"`` (eq. 6) or ``"l2"``: how a victim picks its residual slot.
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
        slot_metric: str = "dot",
    ) -> None:
        self.budgets = budgets.long()
        self.slot_metric = slot_metric
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
        self._batch = ZSMergeLayerBatch(self)  # holds a decode forward's layers until its last one

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
        self._batch.new_forward(layer_idx)  # a held forward that stopped early steps first
        if query.shape[2] == 1 and probs is not None and layer_idx in self._state:
            self._batch.hold((layer_idx, layer, query, probs, logits))
            return
        self._step_layer(layer_idx, layer, query, probs)

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
        self._batch.run_held()
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
        return layer.stored is None and all(
            key in stats and tuple(stats[key].shape) == shape for key in (SCORE, COUNT, POSITION)
        )

    def _init_state(self, layer: FoldedLayer, count: int) -> _LayerState:
        keys, values, log_mass = layer.dense_buffers()
        acc = compute_dtype(keys)  # the layer's dtype: float32, or float64 for a float64 cache
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
        fold_layers([layer], [scores], self.split, self.alpha, self.mode, [offset], slot_metric=self.slot_metric)
        if layer.stored is None:
            self._state[layer_idx] = self._init_state(layer, layer.physical_length)

    def adopt(self, cache: FoldedCache) -> None:
        """Take over a freshly prefilled cache: bring every layer this policy has not seen to budget
        as :meth:`after_forward` does for a prefill run under the policy (scores from the window of
        the captured prefill queries, Algorithm 1 over the prompt), all layers in one stream.
        A chunked prefill calls it after its first chunk (:mod:`kvfold.pipeline.chunked`).

        Raises:
            ValueError: a layer holds merged entries already, or the prefill kept no queries.
        """
        layers = [(i, layer) for i, layer in cache.folded_layers if i in self.layers and i not in self._state]
        scores = []
        for layer_idx, layer in layers:
            if layer.captured_queries is None:
                raise UserError(
                    "zsmerge scores a prefill with its last queries, but this cache kept none "
                    "(set cache.capture_window before the forward pass)"
                )
            scores.append(self._window_scores(layer_idx, layer, layer.captured_queries))
        offsets = [layer.logical_length - layer.physical_length for _, layer in layers]
        fold_layers(
            [layer for _, layer in layers], scores, self.split, self.alpha, self.mode, offsets,
            slot_metric=self.slot_metric,
        )  # fmt: skip
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
            target = merge_into_slots(
                state.res_k,
                state.res_v,
                state.res_w,
                state.fill,
                k_t,
                v_t,
                evict & (b_r > 0),
                b_r,
                torch.arange(slots, device=dev),
                self.slot_metric,
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
        target, k_new, v_new, w_new = join_nearest_slot(
            state.res_k, state.res_v, state.res_w, k_t, v_t, state.closed, self.slot_metric
        )  # (B, H, 1), (B, H, 1, D), (B, H, 1, D), (B, H, 1)
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

        1. **Victims** (lines 4–11, :meth:`_eviction_schedule` and :meth:`_victims_many`). The scores
           of every step come in blocks of :data:`STEP_BLOCK` steps,
           ``s_{i0+k} = λ^{k+1} s_{i0−1} + Σ_{j≤k} λ^{k−j} a_{i0+j}``, one matrix product per block;
           when the context set exceeds ``B_c`` is known in closed form (one token joins it per
           step, one leaves per eviction); each step is then a single masked minimum over the
           slots, sorted newest first so that ties evict the newest.
        2. **Merges** (lines 12–15, :meth:`_merge_many`): the victims join the residual slots in
           eviction order, one step at a time on the small slot tensors (slot sums and counts:
           eq. 7's incremental mean is their ratio; eq. 6 compares ``k_t`` with the means).
        3. **Cache edits**, once (:meth:`_edit_cache_many`): victims leave the plain tokens (a new
           residual slot, or an emptied slot), merged slots get their means and β = α·log w (eq. 8).
        """
        keys, values, log_mass = layer.dense_buffers()
        b_p, b_c, b_r = (t[..., None] for t in self._split_on(keys.device))  # (B, 1, 1)
        position = state.position[:, :, : keys.shape[2]]
        joins, evict = self._eviction_schedule(position, b_p, b_c, start, q_len)
        victims = self._victims_many(state, probs, position, joins, evict, layer.num_heads)
        opens, fill_before = self._merge_many(keys, values, state, victims, evict, b_r)
        self._edit_cache_many(keys, values, log_mass, state, position, victims, evict, opens, fill_before)

    @staticmethod
    def _eviction_schedule(position: Tensor, b_p: Tensor, b_c: Tensor, start: int, q_len: int) -> tuple[Tensor, Tensor]:
        """When each plain token joins the context set (lines 7–9) and which steps evict (line 10),
        in closed form: one eviction per step while the set holds more than ``B_c``, so after step
        ``i`` ``X_i = min((|C_i| − B_c)⁺, i + 1)`` tokens have left it.

        Args:
            position: ``(B, H, N)`` the slots' token positions (``RESIDUAL`` for non-plain slots).
            b_p, b_c: ``(B, 1, 1)`` ``B_p`` and ``B_c``.
            start, q_len: the forward's first token position and its token count.

        Returns:
            ``(joins (B, H, N), evict (B, H, q))``: the step at which each slot's token joins the
            context set (−1: already in it; ``q_len``: never), and whether each step evicts.
        """
        dev = position.device
        plain = position >= 0
        joins = torch.where(plain, position + b_p - start, q_len).clamp(-1, q_len)
        joined = torch.zeros(*joins.shape[:2], q_len + 2, dtype=torch.long, device=dev)
        joined = joined.scatter_add_(-1, joins + 1, torch.ones_like(joins)).cumsum(-1)[..., 1 : q_len + 1]
        steps = torch.arange(1, q_len + 1, device=dev)
        evicted_by = torch.minimum((joined - b_c).clamp_min(0), steps)
        evict = torch.diff(evicted_by, dim=-1, prepend=torch.zeros_like(evicted_by[..., :1])) > 0  # (B, H, q)
        return joins, evict

    def _victims_many(
        self, state: _LayerState, probs: Tensor | None, position: Tensor, joins: Tensor, evict: Tensor, heads: int
    ) -> Tensor:
        """Pass 1 of :meth:`_arrive_many` (line 11): each step's victim, the least-scored member of the
        context set with the scores of eq. 5 after that step's query; ``state.score`` ends updated.

        Returns:
            ``(B, H, q)`` the victims' slots (``N``: the step evicts nothing).
        """
        n, q_len = position.shape[-1], evict.shape[-1]
        dev, acc = position.device, state.score.dtype
        # the slots sorted newest first (argmin's first minimum = the newest)
        order = torch.argsort(torch.where(position >= 0, position, RESIDUAL - 1), dim=-1, descending=True)
        joins = joins.gather(-1, order)
        s = state.score[:, :, :n].gather(-1, order)
        gone = torch.zeros(*joins.shape[:2], n + 1, dtype=torch.bool, device=dev)  # column n: "no victim"
        chosen = []  # per block, (B, H, k) columns of the sorted slots
        for i0 in range(0, q_len, STEP_BLOCK):
            k = min(q_len, i0 + STEP_BLOCK) - i0
            block = self._block_scores(s, probs, order, i0, k, heads, acc)
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
        return F.pad(order, (0, 1), value=n).gather(-1, torch.cat(chosen, dim=-1))  # slots, (B, H, q); n: none

    def _block_scores(
        self, s: Tensor, probs: Tensor | None, order: Tensor, i0: int, k: int, heads: int, acc: torch.dtype
    ) -> Tensor:
        """Eq. 5 after each of the ``k`` steps ``i0 …`` from the scores ``s`` ``(B, H, N)`` before
        them (slots in ``order``): ``s_k = λ^{k+1} s + Σ_{j≤k} λ^{k−j} a_j``, ``(B, H, k, N)``;
        without attention the scores stay as they are."""
        if probs is None:
            return s[:, :, None].expand(-1, -1, k, -1)
        dev = s.device
        a = pool_gqa(probs[:, :, i0 : i0 + k].to(acc), heads, "mean")
        a = a.gather(-1, order[:, :, None, :].expand(-1, -1, k, -1))
        lag = torch.arange(k, device=dev, dtype=acc)
        lag = lag[:, None] - lag[None, :]
        decay = torch.where(lag >= 0, torch.pow(self.decay, lag.clamp_min(0)), 0.0)
        block = torch.pow(self.decay, torch.arange(1, k + 1, device=dev, dtype=acc))[:, None] * s[:, :, None]
        return block + decay @ a

    def _merge_many(
        self, keys: Tensor, values: Tensor, state: _LayerState, victims: Tensor, evict: Tensor, b_r: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Pass 2 of :meth:`_arrive_many`: the victims join the residual slots in eviction order
        (lines 12–15: eq. 6, eq. 7), on slot sums and counts (each step one scatter-add per tensor).

        Returns:
            ``(opens, fill_before)`` ``(B, H, q)``: whether a step's victim opens a new slot (line 13)
            and the slots open before each step.
        """
        n, dev, acc = keys.shape[2], keys.device, state.score.dtype
        slots = state.res_k.shape[-2]
        merging = evict & (b_r > 0)
        fill_before = state.fill[..., None] + merging.long().cumsum(-1) - merging.long()
        opens = merging & (fill_before < b_r)  # line 13: the victim itself becomes a new slot
        if not slots:
            return opens, fill_before
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
            if self.slot_metric == "l2":  # 2 k_r·k_t − ‖k_r‖²
                dots = 2.0 * dots - key_sum.square().sum(-1) / weight.clamp_min(1).square()
            nearest = dots.masked_fill(closed[:, :, i], float("-inf")).argmax(-1)  # ties: the first slot
            target = torch.where(opens[:, :, i], new_slot[:, :, i], nearest)[..., None]  # line 13 or line 15
            key_sum.scatter_add_(2, target[..., None].expand(-1, -1, 1, key_sum.shape[-1]), k_t[:, :, i, None])
            value_sum.scatter_add_(2, target[..., None].expand(-1, -1, 1, value_sum.shape[-1]), v_t[:, :, i, None])
            weight.scatter_add_(2, target, added[:, :, i, None])  # eq. 7: w_r̂ ← w_r̂ + 1
        state.res_k = key_sum / weight.clamp_min(1)[..., None]  # eq. 7: the means
        state.res_v = value_sum / weight.clamp_min(1)[..., None]
        state.res_w = weight
        state.fill += opens.sum(-1)
        return opens, fill_before

    def _edit_cache_many(
        self,
        keys: Tensor,
        values: Tensor,
        log_mass: Tensor,
        state: _LayerState,
        position: Tensor,
        victims: Tensor,
        evict: Tensor,
        opens: Tensor,
        fill_before: Tensor,
    ) -> None:
        """Pass 3 of :meth:`_arrive_many`, the cache: victims leave the plain tokens, new slots are
        numbered, emptied slots go (a spare column ``N`` takes the writes of the steps without a
        victim); then every residual slot holds its mean with β = α·log w (line 15, eq. 8)."""
        n = keys.shape[2]
        padded = F.pad(state.slot_id[:, :, :n], (0, 1), value=-1)
        padded.scatter_(-1, torch.where(opens, victims, n), fill_before)
        state.slot_id[:, :, :n] = padded[..., :n]
        padded = F.pad(position, (0, 1)).scatter_(-1, victims, RESIDUAL)
        state.position[:, :, :n] = padded[..., :n]
        padded = F.pad(log_mass, (0, 1)).scatter_(-1, torch.where(evict & ~opens, victims, n), NEG_INF)
        log_mass.copy_(padded[..., :n])
        if state.res_k.shape[-2]:
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
