"""ZSMerge's steady decode step for every layer at once.

Once a layer's cache is full and its residual slots are all open, every decode step of
Algorithm 1 (Liu, Liu and Tang 2025, §3) is the same: decay the scores and add the step's
attention (eq. 5), evict the context token of least score, merge it into the residual slot of
largest ``k_r·k_t`` (eqs. 6–7), write that slot's mean with β = α·log w (eq. 8), and move the
newest entry into the emptied slot. That is some sixty small tensor operations per layer.
Every layer holds the same budget, so :class:`ZSMergeLayerBatch` runs the step once for all the
layers of a decode forward (the mechanism: :mod:`kvfold.methods.core.batched_decode`): the
per-slot state and the residual slots of every layer live in stacked tensors (``(L, B, H, C)``,
``(L, B, H, S, D)``) of which each layer's state keeps views. The result is the per-layer step's
(tests compare them).
"""

from __future__ import annotations

from typing import Any

import torch

from kvfold.methods.core.batched_decode import Buffers, LayerBatch, StepInput, gather_slots, move_newest, write_slots
from kvfold.methods.merging.zsmerge.merge import join_nearest_slot
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor

RESIDUAL = -1  # kvfold.methods.merging.zsmerge.merge.RESIDUAL: the position of residual, emptied and padding slots
_FIELDS = ("score", "position", "slot_id", "res_k", "res_v", "res_w")


class ZSMergeLayerBatch(LayerBatch):
    """The steady decode step of a :class:`~kvfold.methods.merging.zsmerge.online.ZSMergeOnline`, batched over layers.

    :meth:`step` runs when every layer has its state stacked, is one entry over the budget after
    the append, evicts in every row and has all its residual slots open; otherwise it changes
    nothing and the policy steps layer by layer, then :meth:`adopt` stacks the state again.
    """

    def __init__(self, policy: Any) -> None:
        """``policy``: the :class:`~kvfold.methods.merging.zsmerge.online.ZSMergeOnline` whose layers this
        batch steps (not imported here: that module imports this one)."""
        super().__init__(sorted(policy.layers))
        self.policy = policy
        self._closed_key: tuple | None = None
        self._closed: Tensor | None = None

    # -- state ----------------------------------------------------------------------
    def layer_state(self, layer_idx: int) -> dict[str, Tensor] | None:
        state = self.policy._state.get(layer_idx)
        return None if state is None else {name: getattr(state, name) for name in _FIELDS}

    def set_layer_state(self, layer_idx: int, views: dict[str, Tensor]) -> None:
        state = self.policy._state[layer_idx]
        for name in _FIELDS:
            setattr(state, name, views[name])

    def adopt(self) -> bool:
        """Stack every layer's state and give each layer's state views of the stacks.

        Returns:
            False where a layer has no state yet or the layers' states differ in shape.
        """
        states = [self.policy._state.get(i) for i in self.order]
        if any(state is None for state in states):
            return False
        capacity = max(state.score.shape[-1] for state in states)
        for state in states:
            state.grow(capacity)
        stack = {}
        for name in _FIELDS:
            parts = [getattr(state, name) for state in states]
            if any(part.shape != parts[0].shape or part.dtype != parts[0].dtype for part in parts):
                return False
            stack[name] = torch.stack(parts)
        self.install(stack)
        return True

    def _closed_slots(self, states: list) -> Tensor | None:
        """``(L, B, H, S)`` residual slots the rows cannot use (each layer's ``state.closed``)."""
        key = tuple(id(state.closed) for state in states)
        if key != self._closed_key:
            if all(state.closed is None for state in states):
                self._closed = None
            else:
                empty = torch.zeros_like(self._stack["res_w"][0], dtype=torch.bool)
                self._closed = torch.stack([state.closed if state.closed is not None else empty for state in states])
            self._closed_key = key
        return self._closed

    def _ready(self, items: list[StepInput]) -> bool:
        policy = self.policy
        if not self.can_step(items):
            return False
        n = items[0][1].physical_length
        logical = items[0][1].logical_length
        if n != policy.limit + 1 or n > self._stack["score"].shape[-1]:
            return False
        if any(layer.physical_length != n for _, layer, _, _, _ in items):
            return False
        b_p, b_c, b_r = policy._split_on(self._stack["score"].device)
        if not all(policy._is_steady(policy._state[i], b_r) for i in self.order):
            return False
        # every row of every layer evicts (Algorithm 1, line 10), counting the new token as
        # _arrive will see it (position = now, in the context set only if B_p = 0)
        now = logical - 1
        position = self._stack["position"].narrow(3, 0, n - 1)
        context = (position >= 0) & (position <= now - b_p.unsqueeze(-1))
        arriving = (b_p <= 0).long()  # (B, 1)
        return bool(((context.sum(-1) + arriving) > b_c).all())

    def step_layer(self, item: StepInput) -> None:
        layer_idx, layer, query, probs, _ = item
        self.policy._step_layer(layer_idx, layer, query, probs)

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, items: list[StepInput]) -> bool:
        """One steady decode step of every layer (Algorithm 1, lines 4–15, with the compaction).

        Args:
            items: ``(layer_idx, layer, query, probs, logits)`` of every layer of this forward, in
                layer order.

        Returns:
            False (nothing changed) where the layers are not all in the steady state.
        """
        if not self._ready(items):
            return False
        st = self._stack
        layers = [item[1] for item in items]
        n = layers[0].physical_length
        old, now = n - 1, layers[0].logical_length - 1
        buffers = [layer.dense_buffers() for layer in layers]
        score, position, slot_id = (st[name].narrow(3, 0, n) for name in ("score", "position", "slot_id"))
        self._decay_scores(items, score, position, slot_id, now)
        victim = self._victims(score, position, now)
        target, k_new, v_new, w_new = self._merge_victims(buffers, victim)
        # line 15: the slot holding r̂ gets its mean and β = α·log w (eq. 8); the victim's slot empties
        where = (slot_id == target).to(torch.uint8).argmax(-1, keepdim=True)
        position.scatter_(3, victim, RESIDUAL)
        write_slots(buffers, where, k_new, v_new, self.policy.alpha * torch.log(w_new))
        free = []
        for j, (_, _, log_mass) in enumerate(buffers):
            log_mass.scatter_(2, victim[j], NEG_INF)
            free.append(log_mass.argmin(-1, keepdim=True))  # β = −inf is the minimum: the first empty slot
        # the compaction: the newest slot moves into the emptied one; every layer is back at budget
        free_all = torch.stack(free)
        move_newest(buffers, layers, free_all, [n] * len(layers))
        for tensor in (score, position, slot_id):
            tensor.scatter_(3, free_all, tensor.narrow(3, old, 1).clone())
        self.policy.steps += 1
        return True

    def _decay_scores(self, items: list[StepInput], score: Tensor, position: Tensor, slot_id: Tensor, now: int) -> None:
        """Lines 4–5 in place: the new token's slot, then ``s ← λ·s + a`` (eq. 5), ``a`` the step's
        attention pooled over each GQA group (mean)."""
        count, batch, heads, n = score.shape
        old = n - 1
        score.select(3, old).fill_(0.0)
        slot_id.select(3, old).fill_(-1)
        position.select(3, old).fill_(now)
        groups = items[0][3].shape[1] // heads
        probs = torch.empty((count, batch, heads, groups, n), dtype=score.dtype, device=score.device)
        for j, item in enumerate(items):
            probs[j] = item[3].select(2, 0).reshape(batch, heads, groups, n)
        score.mul_(self.policy.decay).add_(probs.mean(dim=3))

    def _victims(self, score: Tensor, position: Tensor, now: int) -> Tensor:
        """Lines 7–11: the context set (plain tokens outside the ``B_p`` newest) and its least-scored
        token, the newest of ties: ``(L, B, H, 1)`` slots."""
        b_p, _, _ = self.policy._split_on(score.device)
        context = (position >= 0) & (position <= now - b_p.unsqueeze(-1))
        masked = torch.where(context, score, float("inf"))
        lowest = masked.amin(-1, keepdim=True)
        return torch.where(context & (masked == lowest), position, -1).argmax(-1, keepdim=True)

    def _merge_victims(self, buffers: list[Buffers], victim: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Lines 12–14: every victim joins ``r̂ = argmax_r k_r·k_t`` (eq. 6) by the incremental mean of
        eq. 7, ``w_r̂ ← w_r̂ + 1``, in the stacked residual slots.

        Returns:
            ``(r̂ (L, B, H, 1), k_r̂ and v_r̂ (L, B, H, 1, D), w_r̂ (L, B, H, 1))`` after the merge.
        """
        st = self._stack
        acc = st["res_k"].dtype
        k_t, v_t = gather_slots(buffers, victim)
        k_t, v_t = k_t.squeeze(3).to(acc), v_t.squeeze(3).to(acc)
        closed = self._closed_slots([self.policy._state[i] for i in self.order])
        return join_nearest_slot(st["res_k"], st["res_v"], st["res_w"], k_t, v_t, closed, self.policy.slot_metric)
