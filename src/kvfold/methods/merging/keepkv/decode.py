"""KeepKV's decode step for every layer at once (issue 10, points 2 and 4).

A decode forward hands each layer's attention to its online policy. KeepKV's step on one layer
(Tian et al. 2025, Algorithm 1: H2O's accumulated score, the EMA score of eq. 8, the victim, its
most similar entry, the ZIP-merge of eq. 7, moving the newest entry into the freed slot) is about
a hundred small tensor operations, and on a CPU their dispatch costs more than their arithmetic.
A layer's policy touches only that layer, and nothing reads the layer again before the next
forward, so :class:`~kvfold.methods.merging.keepkv.online.LayerPolicies` holds the step of each layer until the
forward's last layer and :class:`LayerBatchedDecode` runs it once for all of them: the per-slot
state of every layer (H2O scores, token positions, ``log S``, ``Σω``, key norms) lives in stacked
``(L, B, H, C)`` tensors, of which each layer's policy keeps a view, and only what reads or
writes a layer's keys and values runs layer by layer. Layers shorter than the longest are padded
with slots that are never valid. The result is the per-layer step's (tests compare them).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvfold.methods.core.online import PROTECTED
from kvfold.runtime.cache import NEG_INF, FoldedLayer

if TYPE_CHECKING:  # pragma: no cover
    from kvfold.methods.eviction.h2o import H2OOnline
    from kvfold.methods.merging.keepkv.online import KeepKVOnline

Tensor = torch.Tensor

StepInput = tuple[int, FoldedLayer, Tensor, "Tensor | None", "Tensor | None"]
"""What the attention hands a policy: ``(layer_idx, layer, query, probs, logits)``."""

_STATES = ("score", "position", "log_sum", "weight", "key_norm")
_FILL = {"score": 0.0, "position": 0, "log_sum": NEG_INF, "weight": 0.0, "key_norm": 0.0}
_NEVER = 1 << 62
"""A token position no entry reaches (layers without a protected recent window)."""


class LayerBatchedDecode:
    """The decode step of per-layer H2O policies that share one :class:`KeepKVOnline`, batched
    over layers.

    :meth:`step` runs when every layer is in the steady state (one entry over its limit after the
    append) and its state is stacked; otherwise the caller runs the per-layer policies and calls
    :meth:`adopt`, which stacks their state for the next step.

    Args:
        policies: one :class:`~kvfold.methods.eviction.h2o.H2OOnline` per layer (limits of that layer only).
        folder: the :class:`~kvfold.methods.merging.keepkv.online.KeepKVOnline` they share.
    """

    def __init__(self, policies: dict[int, H2OOnline], folder: KeepKVOnline) -> None:
        self.policies = policies
        self.folder = folder
        self.order = sorted(policies)
        self.limits = [policies[i].limits[i] for i in self.order]
        self._stack: dict[str, Tensor] | None = None

    # -- state ----------------------------------------------------------------------
    def _views(self, layer_idx: int) -> dict[str, Tensor | None]:
        policy, folder = self.policies[layer_idx], self.folder
        return {
            "score": policy._state.get(layer_idx),
            "position": policy._positions.get(layer_idx) if policy.recent else None,
            "log_sum": folder._log_sum.get(layer_idx),
            "weight": folder._weight.get(layer_idx),
            "key_norm": folder._key_norm.get(layer_idx),
        }

    def _is_stacked(self) -> bool:
        if self._stack is None:
            return False
        for j, layer_idx in enumerate(self.order):
            for name, tensor in self._views(layer_idx).items():
                if tensor is not None and tensor.data_ptr() != self._stack[name][j].data_ptr():
                    return False  # a layer's state grew (a longer forward): stack it again
        return True

    def adopt(self) -> bool:
        """Move every layer's state into stacked tensors and give each policy views of them.

        Returns:
            False where some layer has no state yet (its policy has not stepped).
        """
        views = [self._views(i) for i in self.order]
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
        for j, layer_idx in enumerate(self.order):
            policy = self.policies[layer_idx]
            policy._state[layer_idx] = stack["score"][j]
            if policy.recent:
                policy._positions[layer_idx] = stack["position"][j]
            self.folder._log_sum[layer_idx] = stack["log_sum"][j]
            self.folder._weight[layer_idx] = stack["weight"][j]
            self.folder._key_norm[layer_idx] = stack["key_norm"][j]
        self._stack = stack
        return True

    def _ready(self, items: list[StepInput]) -> bool:
        if not self._is_stacked() or [item[0] for item in items] != self.order:
            return False
        capacity = self._stack["score"].shape[-1]
        logical = items[0][1].logical_length
        for (_, layer, query, probs, logits), limit in zip(items, self.limits, strict=True):
            if probs is None or logits is None or layer.paged is not None or query.shape[2] != 1:
                return False
            n = layer.physical_length
            if n != limit + 1 or n > capacity or layer.logical_length != logical:
                return False
        return True

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
        folder = self.folder.folder
        layers = [item[1] for item in items]
        count, capacity = len(items), st["score"].shape[-1]
        batch, heads = st["score"].shape[1:3]
        device = st["score"].device
        sizes = [layer.physical_length for layer in layers]
        buffers = [layer.dense_buffers() for layer in layers]
        num_q = items[0][3].shape[1]
        groups = num_q // heads
        newest = torch.tensor(sizes, device=device).sub_(1).view(count, 1, 1, 1).expand(count, batch, heads, 1)
        in_range = torch.arange(capacity, device=device) < newest[:, :1, :1]  # (L, 1, 1, C)

        # the step's inputs, stacked; padded slots are empty (β = −inf, probabilities 0)
        beta = torch.full((count, batch, heads, capacity), NEG_INF, dtype=buffers[0][2].dtype, device=device)
        logits = torch.full((count, batch, heads, groups, capacity), NEG_INF, dtype=items[0][4].dtype, device=device)
        probs = torch.zeros((count, batch, heads, groups, capacity), dtype=items[0][3].dtype, device=device)
        new_norm = torch.empty((count, batch, heads, 1), dtype=st["key_norm"].dtype, device=device)
        for j, ((_, _, _, p, z), (keys, _, log_mass), n) in enumerate(zip(items, buffers, sizes, strict=True)):
            beta[j, :, :, :n] = log_mass
            logits[j, ..., :n] = z.reshape(batch, heads, groups, n)
            probs[j, ..., :n] = p.reshape(batch, heads, groups, n)
            torch.linalg.vector_norm(keys.narrow(2, n - 1, 1).to(new_norm.dtype), dim=-1, out=new_norm[j])
        valid = beta > NEG_INF

        # H2O: every entry adds the step's attention, summed over the group; the new entry starts at it
        st["score"].scatter_(3, newest, 0.0).add_(probs.sum(dim=3))
        logical = layers[0].logical_length
        st["position"].scatter_(3, newest, logical - 1)
        # KeepKV's EMA (eq. 8) of ln s = q·k·scaling over the group (ema_step_one_, every layer at once)
        st["log_sum"].scatter_(3, newest, NEG_INF)
        st["weight"].scatter_(3, newest, 0.0)
        st["key_norm"].scatter_(3, newest, new_norm)
        self._ema(torch.where(valid[:, :, :, None], logits, NEG_INF), folder.alpha)

        # the victim: least score, the protected recent window and sinks never, empty slots first
        recent = [self.policies[i].recent for i in self.order]
        horizon = torch.tensor([logical - r if r else _NEVER for r in recent], device=device).view(count, 1, 1, 1)
        scores = st["score"].masked_fill(st["position"] >= horizon, PROTECTED)
        scores = torch.where(valid, scores, beta).masked_fill_(~in_range, PROTECTED)
        victim = scores.argmin(dim=-1, keepdim=True)  # (L, B, H, 1)

        # its most cosine-similar remaining entry (best_match), the keys read layer by layer
        raw = torch.zeros((count, batch, heads, capacity), dtype=st["key_norm"].dtype, device=device)
        for j, ((keys, _, _), n) in enumerate(zip(buffers, sizes, strict=True)):
            victim_key = keys.gather(2, victim[j].unsqueeze(-1).expand(-1, -1, 1, keys.shape[-1]))
            raw[j, :, :, :n] = torch.matmul(victim_key, keys.transpose(-1, -2)).squeeze(2)
        tiny = torch.finfo(raw.dtype).tiny
        sim = raw / st["key_norm"].clamp_min(tiny)
        allowed = valid.scatter(3, victim, False)
        best = torch.where(allowed, sim, NEG_INF).max(dim=-1, keepdim=True)
        similarity = best.values / st["key_norm"].gather(3, victim).clamp_min(tiny)
        target = best.indices
        leaving = valid.gather(3, victim)
        goes = leaving & (similarity > folder.threshold)

        # ZIP-merge of the (victim, carrier) pairs (eq. 7), all layers in one call
        from kvfold.methods.merging.keepkv.merge import zip_merge_pair

        pair = torch.cat([victim, target], dim=3)  # (L, B, H, 2)
        dim, dim_v = buffers[0][0].shape[-1], buffers[0][1].shape[-1]
        pair_k = torch.empty((count, batch, heads, 2, dim), dtype=buffers[0][0].dtype, device=device)
        pair_v = torch.empty((count, batch, heads, 2, dim_v), dtype=buffers[0][1].dtype, device=device)
        for j, (keys, values, _) in enumerate(buffers):
            torch.gather(keys, 2, pair[j].unsqueeze(-1).expand(-1, -1, -1, dim), out=pair_k[j])
            torch.gather(values, 2, pair[j].unsqueeze(-1).expand(-1, -1, -1, dim_v), out=pair_v[j])
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
        slot = torch.where(goes, target, victim)  # a row that does not merge writes into its victim
        for j, (keys, values, log_mass) in enumerate(buffers):
            keys.scatter_(2, slot[j].unsqueeze(-1).expand(-1, -1, 1, dim), key[j])
            values.scatter_(2, slot[j].unsqueeze(-1).expand(-1, -1, 1, dim_v), value[j])
            log_mass.scatter_(2, slot[j], log_p[j].to(log_mass.dtype))
        st["key_norm"].scatter_(3, slot, torch.linalg.vector_norm(key.to(st["key_norm"].dtype), dim=-1))
        st["log_sum"].scatter_(3, slot, (log_s + new_weight.log()).to(st["log_sum"].dtype))
        st["weight"].scatter_(3, slot, new_weight)
        self.folder._tally(goes, leaving, exact.view(count, batch, heads, 1), pair_beta.narrow(3, 0, 1))

        # the newest entry moves into the victim's slot; every layer is back at its limit
        for tensor in st.values():
            tensor.scatter_(3, victim, tensor.gather(3, newest))
        for j, ((keys, values, log_mass), layer, n) in enumerate(zip(buffers, layers, sizes, strict=True)):
            index = victim[j].unsqueeze(-1)
            keys.scatter_(2, index.expand(-1, -1, 1, dim), keys.narrow(2, n - 1, 1).clone())
            values.scatter_(2, index.expand(-1, -1, 1, dim_v), values.narrow(2, n - 1, 1).clone())
            log_mass.scatter_(2, victim[j], log_mass.narrow(2, n - 1, 1).clone())
            layer.truncate(n - 1)
        for layer_idx in self.order:
            if layer_idx == 0:
                self.policies[layer_idx].steps += 1
        return True

    def _ema(self, log_s: Tensor, alpha: float) -> None:
        """:func:`~kvfold.methods.merging.keepkv.scores.ema_step_one_` on the stacked state;
        ``log_s`` ``(L, B, H, G, C)``."""
        from kvfold.methods.merging.keepkv.scores import _one_query_weight

        log_sum, weight = self._stack["log_sum"], self._stack["weight"]
        log_w, w = _one_query_weight(alpha, log_sum.dtype)
        x = log_s if log_s.dtype == log_sum.dtype else log_s.to(log_sum.dtype)
        groups = x.shape[3]
        added = x[:, :, :, 0]
        for head in range(1, groups):
            added = torch.logaddexp(added, x[:, :, :, head])
        added = added + (log_w - math.log(groups))
        log_sum.copy_(torch.logaddexp(log_sum + math.log(alpha), added))
        weight.mul_(alpha).add_(w)
