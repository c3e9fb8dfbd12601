"""ZSMerge's steady decode step for every layer at once (issue 10, points 2 and 4).

Once a layer's cache is full and its residual slots are all open, every decode step of
Algorithm 1 (Liu, Liu and Tang 2025, §3) is the same: decay the scores and add the step's
attention (eq. 5), evict the context token of least score, merge it into the residual slot of
largest ``k_r·k_t`` (eqs. 6–7), write that slot's mean with β = α·log w (eq. 8), and move the
newest entry into the emptied slot. That is some sixty small tensor operations per layer, which
on a CPU cost more than their arithmetic. A layer's step touches only that layer and every
layer holds the same budget, so :class:`~kvfold.methods.merging.zsmerge.online.ZSMergeOnline` holds a decode
forward's layers until its last one and :class:`ZSMergeLayerBatch` runs the step once for all
of them: the per-slot state and the residual slots of every layer live in stacked tensors
(``(L, B, H, C)``, ``(L, B, H, S, D)``) of which each layer's state keeps views, and only the
reads and writes of a layer's keys and values run layer by layer. The result is the per-layer
step's (tests compare them).
"""

from __future__ import annotations

from typing import Any

import torch

from kvfold.methods.merging.zsmerge.merge import slot_affinity
from kvfold.runtime.cache import NEG_INF

Tensor = torch.Tensor

RESIDUAL = -1  # kvfold.methods.merging.zsmerge.merge.RESIDUAL: the position of residual, emptied and padding slots
_FIELDS = ("score", "position", "slot_id", "res_k", "res_v", "res_w")


class ZSMergeLayerBatch:
    """The steady decode step of a :class:`~kvfold.methods.merging.zsmerge.online.ZSMergeOnline`, batched over layers.

    :meth:`step` runs when every layer has its state stacked, is one entry over the budget after
    the append, evicts in every row and has all its residual slots open; otherwise it changes
    nothing and the policy steps layer by layer, then calls :meth:`adopt`.
    """

    def __init__(self, policy: Any) -> None:
        """``policy``: the :class:`~kvfold.methods.merging.zsmerge.online.ZSMergeOnline` whose layers this
        batch steps (not imported here: that module imports this one)."""
        self.policy = policy
        self.order = sorted(policy.layers)
        self._stack: dict[str, Tensor] | None = None
        self._closed_key: tuple | None = None
        self._closed: Tensor | None = None

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
        for j, state in enumerate(states):
            for name in _FIELDS:
                setattr(state, name, stack[name][j])
        self._stack = stack
        return True

    def _is_stacked(self) -> bool:
        if self._stack is None:
            return False
        for j, layer_idx in enumerate(self.order):
            state = self.policy._state.get(layer_idx)
            if state is None:
                return False
            for name in _FIELDS:
                if getattr(state, name).data_ptr() != self._stack[name][j].data_ptr():
                    return False  # grown or replaced (a longer forward): stack again
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

    def _ready(self, items: list[tuple]) -> bool:
        policy = self.policy
        if not self._is_stacked() or [item[0] for item in items] != self.order:
            return False
        n = items[0][1].physical_length
        logical = items[0][1].logical_length
        if n != policy.limit + 1 or n > self._stack["score"].shape[-1]:
            return False
        for _, layer, query, probs, _ in items:
            if query.shape[2] != 1 or probs is None or layer.paged is not None:
                return False
            if layer.physical_length != n or layer.logical_length != logical:
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

    @torch.no_grad()
    def step(self, items: list[tuple]) -> bool:
        """One steady decode step of every layer (Algorithm 1, lines 4–15, with the compaction).

        Args:
            items: ``(layer_idx, layer, query, probs, logits)`` of every layer of this forward, in
                layer order.

        Returns:
            False (nothing changed) where the layers are not all in the steady state.
        """
        if not self._ready(items):
            return False
        policy, st = self.policy, self._stack
        layers = [item[1] for item in items]
        states = [policy._state[i] for i in self.order]
        count = len(items)
        batch, heads = st["score"].shape[1:3]
        n = layers[0].physical_length
        old, now = n - 1, layers[0].logical_length - 1
        buffers = [layer.dense_buffers() for layer in layers]
        dim, dim_v = buffers[0][0].shape[-1], buffers[0][1].shape[-1]
        acc = st["res_k"].dtype
        device = st["score"].device
        b_p, _, _ = policy._split_on(device)

        # lines 4–5: the new token's slot, then s ← λ·s + a (eq. 5), a GQA-pooled (mean)
        score, position, slot_id = (st[name].narrow(3, 0, n) for name in ("score", "position", "slot_id"))
        score.select(3, old).fill_(0.0)
        slot_id.select(3, old).fill_(-1)
        position.select(3, old).fill_(now)
        groups = items[0][3].shape[1] // heads
        probs = torch.empty((count, batch, heads, groups, n), dtype=score.dtype, device=device)
        for j, item in enumerate(items):
            probs[j] = item[3].select(2, 0).reshape(batch, heads, groups, n)
        score.mul_(policy.decay).add_(probs.mean(dim=3))

        # lines 7–11: the context set and its least-scored token (the oldest of ties)
        context = (position >= 0) & (position <= now - b_p.unsqueeze(-1))
        masked = torch.where(context, score, float("inf"))
        lowest = masked.amin(-1, keepdim=True)
        victim = torch.where(context & (masked == lowest), position, -1).argmax(-1, keepdim=True)  # (L, B, H, 1)

        # lines 12–14: merge the victim into r̂ = argmax_r k_r·k_t (eq. 6) by the mean of eq. 7
        k_t = torch.empty((count, batch, heads, 1, dim), dtype=buffers[0][0].dtype, device=device)
        v_t = torch.empty((count, batch, heads, 1, dim_v), dtype=buffers[0][1].dtype, device=device)
        for j, (keys, values, _) in enumerate(buffers):
            torch.gather(keys, 2, victim[j].unsqueeze(-1).expand(-1, -1, 1, dim), out=k_t[j])
            torch.gather(values, 2, victim[j].unsqueeze(-1).expand(-1, -1, 1, dim_v), out=v_t[j])
        k_t, v_t = k_t.squeeze(3).to(acc), v_t.squeeze(3).to(acc)
        res_k, res_v, res_w = st["res_k"], st["res_v"], st["res_w"]
        dots = torch.matmul(res_k, k_t.unsqueeze(-1)).squeeze(-1)  # (L, B, H, S)
        dots = slot_affinity(dots, res_k, policy.slot_metric)
        closed = self._closed_slots(states)
        if closed is not None:
            dots = dots.masked_fill(closed, float("-inf"))
        target = dots.argmax(-1, keepdim=True)
        w = res_w.gather(-1, target)
        k_old = res_k.gather(-2, target.unsqueeze(-1).expand(-1, -1, -1, 1, dim)).squeeze(3)
        v_old = res_v.gather(-2, target.unsqueeze(-1).expand(-1, -1, -1, 1, dim_v)).squeeze(3)
        w_new = w + 1.0
        k_new = ((w * k_old + k_t) / w_new).unsqueeze(3)
        v_new = ((w * v_old + v_t) / w_new).unsqueeze(3)
        res_k.scatter_(-2, target.unsqueeze(-1).expand(-1, -1, -1, 1, dim), k_new)
        res_v.scatter_(-2, target.unsqueeze(-1).expand(-1, -1, -1, 1, dim_v), v_new)
        res_w.scatter_(-1, target, w_new)

        # line 15: the slot holding r̂ gets its mean and β = α·log w (eq. 8); the victim's slot empties
        where = (slot_id == target).to(torch.uint8).argmax(-1, keepdim=True)
        beta_new = policy.alpha * torch.log(w_new)
        position.scatter_(3, victim, RESIDUAL)
        free = []
        for j, (keys, values, log_mass) in enumerate(buffers):
            keys.scatter_(2, where[j].unsqueeze(-1).expand(-1, -1, 1, dim), k_new[j].to(keys.dtype))
            values.scatter_(2, where[j].unsqueeze(-1).expand(-1, -1, 1, dim_v), v_new[j].to(values.dtype))
            log_mass.scatter_(2, where[j], beta_new[j].to(log_mass.dtype))
            log_mass.scatter_(2, victim[j], NEG_INF)
            free.append(log_mass.argmin(-1, keepdim=True))  # β = −inf is the minimum: the first empty slot

        # the compaction: the newest slot moves into the emptied one; every layer is back at budget
        for j, ((keys, values, log_mass), layer) in enumerate(zip(buffers, layers, strict=True)):
            index = free[j].unsqueeze(-1)
            keys.scatter_(2, index.expand(-1, -1, 1, dim), keys.narrow(2, old, 1).clone())
            values.scatter_(2, index.expand(-1, -1, 1, dim_v), values.narrow(2, old, 1).clone())
            log_mass.scatter_(2, free[j], log_mass.narrow(2, old, 1).clone())
            layer.truncate(old)
        free_all = torch.stack(free)
        for tensor in (score, position, slot_id):
            tensor.scatter_(3, free_all, tensor.narrow(3, old, 1).clone())
        policy.steps += 1
        return True
