"""Decode-time eviction under a fixed budget, shared by every online method.

After each forward of a layer the policy scores the new entries, and while the layer holds
more than its limit it removes the lowest-scored unprotected entry of every row. A single
decode step removes one entry per row by moving the newest entry into the victim's slot, so
the work is proportional to the budget and the cache is never copied (issue 10, point 2).
Entry order inside a row carries no meaning: positions are already encoded in the keys.
"""

from __future__ import annotations

import torch

from kvfold.cache import FoldedLayer

PROTECTED = float("inf")


class OnlineEviction:
    """Base policy: subclasses define how slots are scored.

    Args:
        limits: the number of entries per row each layer may hold, by layer index.
        needs_attention: whether the attention must hand over its probabilities each step.
    """

    needs_attention: bool = False

    def __init__(self, limits: dict[int, int], needs_attention: bool = False) -> None:
        self.limits = limits
        self.needs_attention = needs_attention
        self._state: dict[int, torch.Tensor] = {}  # (B, H, capacity) scores aligned with slots
        self.steps = 0

    # -- to override ------------------------------------------------------------------
    def initial_scores(self, layer_idx: int, layer: FoldedLayer, count: int) -> torch.Tensor:
        """Scores ``(B, H, count)`` of the entries present before the policy's first step."""
        raise NotImplementedError

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
        self, layer_idx: int, layer: FoldedLayer, query: torch.Tensor, probs: torch.Tensor | None
    ) -> None:
        if layer_idx not in self.limits:
            return
        q_len = query.shape[2]
        n = layer.physical_length
        state = self._state_for(layer_idx, layer, n - q_len)
        state[:, :, n - q_len : n] = self.new_scores(layer_idx, layer, state[:, :, : n - q_len], q_len, probs)
        limit = self.limits[layer_idx]
        excess = n - limit
        if excess == 1:
            self._evict_one(layer, state, n)
        elif excess > 1:
            self._evict_many(layer, state, n, limit)
        if layer_idx == 0:
            self.steps += 1

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

    def _evict_one(self, layer: FoldedLayer, state: torch.Tensor, n: int) -> None:
        keys, values, log_mass = layer.dense_buffers()
        scores = torch.where(torch.isfinite(log_mass), state[:, :, :n], torch.full_like(log_mass, -PROTECTED))
        victim = scores.argmin(dim=-1, keepdim=True)  # (B, H, 1); ties: the oldest slot
        last = n - 1
        for tensor in (keys, values):
            idx = victim[..., None].expand(-1, -1, 1, tensor.shape[-1])
            tensor.scatter_(2, idx, tensor[:, :, last : last + 1].clone())
        log_mass.scatter_(2, victim, log_mass[:, :, last : last + 1].clone())
        state.scatter_(2, victim, state[:, :, last : last + 1].clone())
        layer.truncate(last)

    def _evict_many(self, layer: FoldedLayer, state: torch.Tensor, n: int, limit: int) -> None:
        keys, values, log_mass = layer.dense_buffers()
        scores = torch.where(torch.isfinite(log_mass), state[:, :, :n], torch.full_like(log_mass, -PROTECTED))
        order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :limit]
        keep = torch.sort(order, dim=-1).values
        for tensor in (keys, values):
            kept = torch.gather(tensor, 2, keep[..., None].expand(-1, -1, -1, tensor.shape[-1]))
            tensor[:, :, :limit] = kept
        log_mass[:, :, :limit] = torch.gather(log_mass, 2, keep)
        state[:, :, :limit] = torch.gather(state[:, :, :n], 2, keep)
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
