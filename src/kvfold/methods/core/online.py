"""Decode-time eviction under a fixed budget, shared by every online method.

After each forward of a layer the policy scores the new entries, and while the layer holds
more than its limit it removes the lowest-scored unprotected entry of every row. A single
decode step removes one entry per row by moving the newest entry into the victim's slot, so
the work is proportional to the budget and the cache is never copied.
Entry order inside a row carries no meaning: positions are already encoded in the keys.
With ``recent > 0`` the policy also tracks each slot's token position and never evicts the
``recent`` newest tokens (H2O's local window, TOVA's current token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.rows import NEG_INF

PROTECTED = float("inf")
POSITION_STAT = "online.position"
"""``layer.entry_stats`` key of the slots' token positions as a policy tracks them, written by
:meth:`OnlineEviction.export_state` (slots are no longer in position order once a single step has
moved the newest entry into a victim's slot)."""


class StepView(NamedTuple):
    """A layer's dense buffers during one policy step (views of :meth:`FoldedLayer.dense_buffers`,
    taken once per step and handed to the folder)."""

    keys: torch.Tensor  # (B, H, N, D)
    values: torch.Tensor  # (B, H, N, D_v)
    log_mass: torch.Tensor  # (B, H, N) β, −inf on empty slots
    valid: torch.Tensor  # (B, H, N) bool, the occupied slots (finite β)


class OnlineEviction:
    """Base policy: subclasses define how slots are scored.

    Args:
        limits: the number of entries per row each layer may hold, by layer index.
        needs_attention: whether the attention must hand over its probabilities each step.
        recent: the newest tokens that are never evicted (0 = none). The positions of the entries
            present before the policy's first step come from an earlier policy's
            :meth:`export_state` when the cache has them; otherwise they are assumed to be in
            ascending position order (as one-shot compression leaves them) and to end at the
            newest token seen.

    Attributes:
        folder: an optional online folder (KeepKV) that merges victims instead of dropping them:
            ``folder.observe(layer_idx, layer, query, probs, view, logits)`` returns slot-aligned state
            tensors ``(B, H, capacity)`` that move with the slots, ``folder.fold(layer_idx, layer,
            victims, view)`` runs on the victims' slots ``(B, H, E)`` just before they are removed
            (it may write anything into them), and ``folder.export_state(layer_idx, layer)`` writes
            its state into ``layer.entry_stats``. ``view`` is the step's :class:`StepView`.
    """

    needs_attention: bool = False
    folder = None

    def __init__(self, limits: dict[int, int], needs_attention: bool = False, recent: int = 0) -> None:
        if recent < 0:
            raise ValueError(f"recent must be ≥ 0; got {recent}")
        self.limits = limits
        self.needs_attention = needs_attention
        self.recent = recent
        self._state: dict[int, torch.Tensor] = {}  # (B, H, capacity) scores aligned with slots
        self._positions: dict[int, torch.Tensor] = {}  # (B, H, capacity) token positions (recent > 0)
        self.steps = 0

    # -- to override ------------------------------------------------------------------
    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> torch.Tensor:
        """Scores ``(B, H, count)`` of the entries present before the policy's first step."""
        raise NotImplementedError

    def export_scores(self, layer_idx: int, layer: FoldedLayer, scores: torch.Tensor) -> None:
        """Write the slots' scores ``(B, H, N)`` where :meth:`initial_scores` of a fresh policy reads
        them (nothing by default: scores derived from the cache itself need no copy)."""

    def new_scores(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        state: torch.Tensor,
        q_len: int,
        probs: torch.Tensor | None,
    ) -> torch.Tensor:
        """Scores ``(B, H, q_len)`` of the newly appended entries; may update ``state`` in place."""
        raise NotImplementedError

    # -- the shared mechanism ---------------------------------------------------------
    def after_forward(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: torch.Tensor,
        probs: torch.Tensor | None,
        logits: torch.Tensor | None = None,
    ) -> None:
        if layer_idx not in self.limits:
            return
        q_len = query.shape[2]
        n = layer.physical_length
        old = n - q_len
        state = self._state_for(layer_idx, layer, old)
        new = self.new_scores(layer_idx, layer, state.narrow(2, 0, old), q_len, probs)  # may update the old in place
        state.narrow(2, old, q_len).copy_(new)
        slots = [state]
        if self.recent:
            slots.append(self._positions_for(layer_idx, layer, state.shape[2], old))
        limit = self.limits[layer_idx]
        excess = n - limit
        if self.folder is not None or excess > 0:
            keys, values, log_mass = layer.dense_buffers()  # once per step, shared with the folder
            view = StepView(keys, values, log_mass, log_mass > NEG_INF)  # β is finite or −inf: one comparison
            if self.folder is not None:
                slots.extend(self.folder.observe(layer_idx, layer, query, probs, view, logits))
            if excess == 1:
                self._evict_one(layer, slots, n, layer_idx, view)
            elif excess > 1:
                self._evict_many(layer, slots, n, limit, layer_idx, view)
        if layer_idx == 0:
            self.steps += 1

    def export_state(self, cache: FoldedCache) -> None:
        """Write this policy's per-slot state into ``layer.entry_stats`` (scores, token positions and
        the folder's state), so that a fresh policy of the same method continues from it, as it
        continues from a one-shot compression (e.g. after a chunked prefill, for every answer).

        Args:
            cache: the :class:`~kvfold.runtime.cache.FoldedCache` this policy ran on.
        """
        for layer_idx, layer in cache.folded_layers:
            state = self._state.get(layer_idx)
            if state is None:
                continue  # never stepped on this layer: its statistics are still those it started from
            n = layer.physical_length
            self.export_scores(layer_idx, layer, state[:, :, :n].clone())
            if self.recent:
                layer.entry_stats[POSITION_STAT] = self._positions[layer_idx][:, :, :n].clone()
            if self.folder is not None:
                self.folder.export_state(layer_idx, layer)

    def _state_for(self, layer_idx: int, layer: FoldedLayer, old: int) -> torch.Tensor:
        state = self._state.get(layer_idx)
        n = layer.physical_length
        if state is None:
            capacity = max(n, self.limits.get(layer_idx, n) + 1)
            state = torch.zeros(layer.batch_size, layer.num_heads, capacity, device=layer.device)
            if old:
                state[:, :, :old] = self.initial_scores(layer_idx, layer, old)
            self._state[layer_idx] = state
        elif state.shape[2] < n:
            grown = state.new_zeros(state.shape[0], state.shape[1], n)
            grown[:, :, : state.shape[2]] = state
            self._state[layer_idx] = state = grown
        return state

    def _positions_for(self, layer_idx: int, layer: FoldedLayer, capacity: int, old: int) -> torch.Tensor:
        """Token positions of the slots (same capacity as the state); new entries get theirs."""
        positions = self._positions.get(layer_idx)
        n = layer.physical_length
        newest = layer.logical_length  # one past the newest token
        if positions is None:
            positions = torch.zeros(layer.batch_size, layer.num_heads, capacity, dtype=torch.long, device=layer.device)
            exported = layer.entry_stats.get(POSITION_STAT)
            if old and exported is not None and exported.shape == (layer.batch_size, layer.num_heads, old):
                positions[:, :, :old] = exported  # from an earlier policy's export_state
            elif old:
                # earlier entries: ascending order, the last valid one is the token before the new ones
                _, _, log_mass = layer.dense_buffers()
                valid = torch.isfinite(log_mass[:, :, :old]).long()
                from_end = valid.flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid entry
                positions[:, :, :old] = newest - (n - old) - from_end
            self._positions[layer_idx] = positions
        elif positions.shape[2] < capacity:
            grown = positions.new_zeros(positions.shape[0], positions.shape[1], capacity)
            grown[:, :, : positions.shape[2]] = positions
            self._positions[layer_idx] = positions = grown
        if n - old == 1:  # a decode step: one new token
            positions[:, :, old].fill_(newest - 1)
        else:
            positions[:, :, old:n] = torch.arange(newest - (n - old), newest, device=positions.device)
        return positions

    def _victim_scores(self, layer: FoldedLayer, slots: list[torch.Tensor], n: int, view: StepView) -> torch.Tensor:
        """Scores that choose victims: empty slots first (their β, −inf), the ``recent`` newest tokens never."""
        scores = slots[0].narrow(2, 0, n)
        if self.recent:
            scores = scores.masked_fill(slots[1].narrow(2, 0, n) >= layer.logical_length - self.recent, PROTECTED)
        return torch.where(view.valid, scores, view.log_mass)  # β = −inf = −PROTECTED on the empty slots

    def _evict_one(self, layer: FoldedLayer, slots: list[torch.Tensor], n: int, layer_idx: int, view: StepView) -> None:
        victim = self._victim_scores(layer, slots, n, view).argmin(dim=-1, keepdim=True)  # (B, H, 1); ties: oldest
        if self.folder is not None:
            self.folder.fold(layer_idx, layer, victim, view)
        keys, values, log_mass, _ = view
        last = n - 1
        index = victim.unsqueeze(-1).expand(-1, -1, 1, keys.shape[-1])
        keys.scatter_(2, index, keys.narrow(2, last, 1).clone())
        if values.shape[-1] != keys.shape[-1]:
            index = victim.unsqueeze(-1).expand(-1, -1, 1, values.shape[-1])
        values.scatter_(2, index, values.narrow(2, last, 1).clone())
        for tensor in (log_mass, *slots):
            tensor.scatter_(2, victim, tensor.narrow(2, last, 1).clone())
        layer.truncate(last)

    def _evict_many(
        self, layer: FoldedLayer, slots: list[torch.Tensor], n: int, limit: int, layer_idx: int, view: StepView
    ) -> None:
        scores = self._victim_scores(layer, slots, n, view)
        ranked = torch.sort(scores, dim=-1, descending=True, stable=True).indices
        if self.folder is not None:
            self.folder.fold(layer_idx, layer, ranked[..., limit:], view)
        order = ranked[..., :limit]
        keep = torch.sort(order, dim=-1).values
        keys, values, log_mass, _ = view
        for tensor in (keys, values):
            kept = torch.gather(tensor, 2, keep[..., None].expand(-1, -1, -1, tensor.shape[-1]))
            tensor[:, :, :limit] = kept
        for tensor in (log_mass, *slots):
            tensor[:, :, :limit] = torch.gather(tensor[:, :, :n], 2, keep)
        layer.truncate(limit)


class RecencyEviction(OnlineEviction):
    """StreamingLLM online: keep ``sinks`` first entries and the most recent ones."""

    def __init__(self, limits: dict[int, int], sinks: int) -> None:
        super().__init__(limits)
        self.sinks = sinks

    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> torch.Tensor:
        # After a one-shot StreamingLLM (or no) compression, slots are in position order.
        _, _, log_mass = layer.dense_buffers()
        valid = torch.isfinite(log_mass[:, :, :count])
        rank = torch.cumsum(valid.long(), dim=-1) - 1  # order among valid entries
        scores = torch.arange(count, device=log_mass.device, dtype=torch.float32).expand_as(rank).clone()
        return scores.masked_fill(valid & (rank < self.sinks), PROTECTED)

    def new_scores(self, layer_idx, layer, state, q_len, probs) -> torch.Tensor:
        start = layer.logical_length - q_len
        pos = torch.arange(start, start + q_len, device=state.device, dtype=torch.float32)
        return pos.expand(state.shape[0], state.shape[1], q_len)
