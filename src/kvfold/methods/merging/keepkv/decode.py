"""KeepKV's decode step for every layer at once.

KeepKV's step on one layer (Tian et al. 2025, Algorithm 1: H2O's accumulated score, the EMA score
of eq. 8, the victim, its most similar entry, the ZIP-merge of eq. 7, moving the newest entry into
the freed slot) is about a hundred small tensor operations. :class:`LayerBatchedDecode` runs it
once for every layer of a decode forward (the mechanism: :mod:`kvfold.methods.core.batched_decode`;
:class:`~kvfold.methods.merging.keepkv.online.LayerPolicies` holds the layers' steps): the per-slot
state of every layer (H2O scores, token positions, ``log S``, ``Σω``, key norms) lives in stacked
``(L, B, H, C)`` tensors, of which each layer's policy keeps a view. Layers shorter than the
longest are padded with slots that are never valid. The result is the per-layer step's (tests
compare them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvfold.methods.core.batched_decode import Buffers, LayerBatch, StepInput, gather_slots, move_newest, write_slots
from kvfold.methods.core.online import PROTECTED
from kvfold.methods.merging.keepkv.merge import zip_merge_pair
from kvfold.methods.merging.keepkv.scores import ema_fold_group_
from kvfold.runtime.rows import NEG_INF

if TYPE_CHECKING:  # pragma: no cover
    from kvfold.methods.eviction.h2o import H2OOnline
    from kvfold.methods.merging.keepkv.online import KeepKVOnline

Tensor = torch.Tensor

_STATES = ("score", "position", "log_sum", "weight", "key_norm")
_FILL = {"score": 0.0, "position": 0, "log_sum": NEG_INF, "weight": 0.0, "key_norm": 0.0}
_NEVER = 1 << 62
"""A token position no entry reaches (layers without a protected recent window)."""


class LayerBatchedDecode(LayerBatch):
    """The decode step of per-layer H2O policies that share one :class:`KeepKVOnline`, batched
    over layers.

    :meth:`step` runs when every layer is in the steady state (one entry over its limit after the
    append) and its state is stacked; otherwise the per-layer policies step and :meth:`adopt`
    stacks their state for the next step.

    Args:
        policies: one :class:`~kvfold.methods.eviction.h2o.H2OOnline` per layer (limits of that layer only).
        folder: the :class:`~kvfold.methods.merging.keepkv.online.KeepKVOnline` they share.
    """

    def __init__(self, policies: dict[int, H2OOnline], folder: KeepKVOnline) -> None:
        super().__init__(sorted(policies))
        self.policies = policies
        self.folder = folder
        self.limits = [policies[i].limits[i] for i in self.order]

    # -- state ----------------------------------------------------------------------
    def layer_state(self, layer_idx: int) -> dict[str, Tensor | None]:
        policy, folder = self.policies[layer_idx], self.folder
        return {
            "score": policy._state.get(layer_idx),
            "position": policy._positions.get(layer_idx) if policy.recent else None,
            "log_sum": folder._log_sum.get(layer_idx),
            "weight": folder._weight.get(layer_idx),
            "key_norm": folder._key_norm.get(layer_idx),
        }

    def set_layer_state(self, layer_idx: int, views: dict[str, Tensor]) -> None:
        policy = self.policies[layer_idx]
        policy._state[layer_idx] = views["score"]
        if policy.recent:
            policy._positions[layer_idx] = views["position"]
        self.folder._log_sum[layer_idx] = views["log_sum"]
        self.folder._weight[layer_idx] = views["weight"]
        self.folder._key_norm[layer_idx] = views["key_norm"]

    def adopt(self) -> bool:
        """Move every layer's state into stacked tensors and give each policy views of them.

        Returns:
            False where some layer has no state yet (its policy has not stepped).
        """
        views = [self.layer_state(i) for i in self.order]
        for j, layer_idx in enumerate(self.order):
            if any(views[j][name] is None for name in ("score", "log_sum", "weight", "key_norm")):
                return False
            if self.policies[layer_idx].recent and views[j]["position"] is None:
                return False
        capacity = max(self.limits) + 1
        stack: dict[str, Tensor] = {}
        for name in _STATES:
            like = next((v[name] for v in views if v[name] is not None), None)
            if like is None:  # no layer keeps a recent window: positions are never read
                like = views[0]["score"].to(torch.long)
            batch, heads = like.shape[:2]
            tensor = torch.full((len(self.order), batch, heads, capacity), _FILL[name], dtype=like.dtype,
                                device=like.device)  # fmt: skip
            for j, view in enumerate(views):
                if view[name] is not None:
                    count = min(capacity, view[name].shape[-1])
                    tensor[j, :, :, :count] = view[name][..., :count]
            stack[name] = tensor
        self.install(stack)
        return True

    def _ready(self, items: list[StepInput]) -> bool:
        if not self.can_step(items):
            return False
        capacity = self._stack["score"].shape[-1]
        for (_, layer, _, _, logits), limit in zip(items, self.limits, strict=True):
            n = layer.physical_length
            if logits is None or n != limit + 1 or n > capacity:
                return False
        return True

    def step_layer(self, item: StepInput) -> None:
        self.policies[item[0]].after_forward(*item)

    # -- the step ---------------------------------------------------------------------
    @torch.no_grad()
    def step(self, items: list[StepInput]) -> bool:
        """One decode step of every layer (Algorithm 1, lines 4–10, with eq. 8's EMA).

        Args:
            items: the attention's inputs of every layer of this forward, in layer order.

        Returns:
            False (nothing done) where the layers are not all in the steady state with stacked
            state; the caller then runs the per-layer policies.
        """
        if not self._ready(items):
            return False
        st = self._stack
        layers = [item[1] for item in items]
        count, capacity = len(items), st["score"].shape[-1]
        batch, heads = st["score"].shape[1:3]
        device = st["score"].device
        sizes = [layer.physical_length for layer in layers]
        buffers = [layer.dense_buffers() for layer in layers]
        newest = torch.tensor(sizes, device=device).sub_(1).view(count, 1, 1, 1).expand(count, batch, heads, 1)
        in_range = torch.arange(capacity, device=device) < newest[:, :1, :1]  # (L, 1, 1, C)
        beta, logits, probs, new_norm = self._stack_inputs(items, buffers, sizes)
        valid = beta > NEG_INF
        logical = layers[0].logical_length
        self._observe(newest, probs, logits, valid, new_norm, logical)
        victim = self._victims(beta, valid, in_range, logical)
        target, goes, leaving = self._carriers(buffers, sizes, victim, valid)
        self._merge_pairs(buffers, beta, victim, target, goes, leaving)
        # the newest entry moves into the victim's slot; every layer is back at its limit
        for tensor in st.values():
            tensor.scatter_(3, victim, tensor.gather(3, newest))
        move_newest(buffers, layers, victim, sizes)
        for layer_idx in self.order:
            if layer_idx == 0:
                self.policies[layer_idx].steps += 1
        return True

    def _stack_inputs(
        self, items: list[StepInput], buffers: list[Buffers], sizes: list[int]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The step's inputs, stacked, padded slots empty (β = −inf, probabilities 0): β
        ``(L, B, H, C)``, the attention's logits and probabilities ``(L, B, H, G, C)``, and the
        newest key's norm ``(L, B, H, 1)``."""
        st = self._stack
        count, capacity = len(items), st["score"].shape[-1]
        batch, heads = st["score"].shape[1:3]
        device = st["score"].device
        groups = items[0][3].shape[1] // heads
        beta = torch.full((count, batch, heads, capacity), NEG_INF, dtype=buffers[0][2].dtype, device=device)
        logits = torch.full((count, batch, heads, groups, capacity), NEG_INF, dtype=items[0][4].dtype, device=device)
        probs = torch.zeros((count, batch, heads, groups, capacity), dtype=items[0][3].dtype, device=device)
        new_norm = torch.empty((count, batch, heads, 1), dtype=st["key_norm"].dtype, device=device)
        for j, ((_, _, _, p, z), (keys, _, log_mass), n) in enumerate(zip(items, buffers, sizes, strict=True)):
            beta[j, :, :, :n] = log_mass
            logits[j, ..., :n] = z.reshape(batch, heads, groups, n)
            probs[j, ..., :n] = p.reshape(batch, heads, groups, n)
            torch.linalg.vector_norm(keys.narrow(2, n - 1, 1).to(new_norm.dtype), dim=-1, out=new_norm[j])
        return beta, logits, probs, new_norm

    def _observe(
        self, newest: Tensor, probs: Tensor, logits: Tensor, valid: Tensor, new_norm: Tensor, logical: int
    ) -> None:
        """The newest entry's state, then the step's attention into the scores of every layer:
        H2O's accumulated attention and KeepKV's EMA of eq. 8 (Algorithm 1, line 6)."""
        st = self._stack
        # H2O: every entry adds the step's attention, summed over the group; the new entry starts at it
        st["score"].scatter_(3, newest, 0.0).add_(probs.sum(dim=3))
        st["position"].scatter_(3, newest, logical - 1)
        # KeepKV's EMA (eq. 8) of ln s = q·k·scaling over the group (ema_step_one_, every layer at once)
        st["log_sum"].scatter_(3, newest, NEG_INF)
        st["weight"].scatter_(3, newest, 0.0)
        st["key_norm"].scatter_(3, newest, new_norm)
        log_s = torch.where(valid[:, :, :, None], logits, NEG_INF)
        ema_fold_group_(st["log_sum"], st["weight"], log_s, self.folder.folder.alpha)

    def _victims(self, beta: Tensor, valid: Tensor, in_range: Tensor, logical: int) -> Tensor:
        """Each row's victim ``(L, B, H, 1)``: the least score, the protected recent window and sinks
        never, empty slots first (H2O's online eviction)."""
        st = self._stack
        recent = [self.policies[i].recent for i in self.order]
        horizon = torch.tensor([logical - r if r else _NEVER for r in recent], device=beta.device)
        scores = st["score"].masked_fill(st["position"] >= horizon.view(len(recent), 1, 1, 1), PROTECTED)
        scores = torch.where(valid, scores, beta).masked_fill_(~in_range, PROTECTED)
        return scores.argmin(dim=-1, keepdim=True)  # (L, B, H, 1)

    def _carriers(
        self, buffers: list[Buffers], sizes: list[int], victim: Tensor, valid: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Each victim's most cosine-similar remaining entry (Algorithm 1, lines 4–5, as
        :func:`~kvfold.methods.merging.keepkv.merge.best_match`), the keys read layer by layer.

        Returns:
            ``(target, goes, leaving)`` ``(L, B, H, 1)``: the carrier's slot, whether the victim
            merges (similarity above the threshold) and whether the victim is an entry at all.
        """
        st = self._stack
        raw = torch.zeros(st["key_norm"].shape, dtype=st["key_norm"].dtype, device=victim.device)
        for j, ((keys, _, _), n) in enumerate(zip(buffers, sizes, strict=True)):
            victim_key = keys.gather(2, victim[j].unsqueeze(-1).expand(-1, -1, 1, keys.shape[-1]))
            raw[j, :, :, :n] = torch.matmul(victim_key, keys.transpose(-1, -2)).squeeze(2)
        tiny = torch.finfo(raw.dtype).tiny
        sim = raw / st["key_norm"].clamp_min(tiny)
        allowed = valid.scatter(3, victim, False)
        best = torch.where(allowed, sim, NEG_INF).max(dim=-1, keepdim=True)
        similarity = best.values / st["key_norm"].gather(3, victim).clamp_min(tiny)
        leaving = valid.gather(3, victim)
        goes = leaving & (similarity > self.folder.folder.threshold)
        return best.indices, goes, leaving

    def _merge_pairs(
        self, buffers: list[Buffers], beta: Tensor, victim: Tensor, target: Tensor, goes: Tensor, leaving: Tensor
    ) -> None:
        """ZIP-merge every (victim, carrier) pair (eq. 7, all layers in one call) and write the
        merged entry into the carrier's slot (a row that does not merge writes into its victim)."""
        st, folder = self._stack, self.folder.folder
        count, batch, heads = victim.shape[:3]
        pair = torch.cat([victim, target], dim=3)  # (L, B, H, 2)
        pair_k, pair_v = gather_slots(buffers, pair)
        dim, dim_v = pair_k.shape[-1], pair_v.shape[-1]
        pair_beta = beta.gather(3, pair)
        pair_weight = st["weight"].gather(3, pair)
        pair_score = st["log_sum"].gather(3, pair) - pair_weight.log()
        key, value, log_p, log_s, exact = zip_merge_pair(
            pair_k.flatten(0, 1), pair_v.flatten(0, 1), pair_beta.flatten(0, 1), pair_score.flatten(0, 1),
            folder.eps, folder.max_scale, folder.eq7_scaling,
        )  # fmt: skip
        key = key.view(count, batch, heads, 1, dim).to(pair_k.dtype)
        value = value.view(count, batch, heads, 1, dim_v).to(pair_v.dtype)
        log_p, log_s = log_p.view(count, batch, heads, 1), log_s.view(count, batch, heads, 1)
        new_weight = pair_weight.amax(dim=-1, keepdim=True)
        slot = torch.where(goes, target, victim)
        write_slots(buffers, slot, key, value, log_p)
        st["key_norm"].scatter_(3, slot, torch.linalg.vector_norm(key.to(st["key_norm"].dtype), dim=-1))
        st["log_sum"].scatter_(3, slot, (log_s + new_weight.log()).to(st["log_sum"].dtype))
        st["weight"].scatter_(3, slot, new_weight)
        self.folder._tally(goes, leaving, exact.view(count, batch, heads, 1), pair_beta.narrow(3, 0, 1))
