"""KeepKV's online half: the selector's decode-time policy, made to ZIP-merge its victims in place
(and chunked prefill through the same path). See :mod:`kvfold.methods.merging.keepkv`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvfold.methods.core.online import OnlineEviction, StepView
from kvfold.methods.merging.keepkv.merge import best_match, merged_weight, zip_merge, zip_merge_pair
from kvfold.methods.merging.keepkv.scores import (
    STAT_LOG_SCORE,
    STAT_WEIGHT,
    ema_step,
    ema_step_one_,
    log_scores_of,
    step_log_scores,
    window_log_scores,
)
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.rows import NEG_INF

Tensor = torch.Tensor
_TALLY_BATCH = 256
"""Decode steps (of all layers) whose merge counts :class:`KeepKVOnline` adds up at once."""


class MergeOptions(Protocol):
    """The options of the ``keepkv`` folder that its online half reads (the registered
    :class:`~kvfold.methods.merging.keepkv.method.KeepKV`, which imports this module)."""

    alpha: float
    eps: float
    max_scale: float
    eq7_scaling: bool
    threshold: float
    window: int


class KeepKVOnline:
    """The decode-time half of KeepKV, attached as ``policy.folder`` to an online eviction policy.

    :meth:`observe` updates every entry's EMA score with the step's attention (Algorithm 1, line 6)
    and returns the slot-aligned state the policy moves with its slots; :meth:`fold` ZIP-merges the
    victims into their most similar remaining entries before the policy removes them (lines 4–5,
    8–10). Counters: ``merged``, ``evicted`` (below threshold), ``votes_dropped``, ``fallbacks``.
    """

    def __init__(self, folder: MergeOptions, scalings: dict[int, float]) -> None:
        self.folder = folder
        self.scalings = scalings
        self._log_sum: dict[int, Tensor] = {}
        self._weight: dict[int, Tensor] = {}
        self._key_norm: dict[int, Tensor] = {}  # slot-aligned ‖k‖ (B, H, capacity), for best_match
        self._counts: dict[str, float] = {"merged": 0, "evicted": 0, "votes_dropped": 0.0, "fallbacks": 0}
        self._pending: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # decode steps not counted yet

    @property
    def merged(self) -> int:
        """Victims merged into a carrier."""
        return int(self._counted("merged"))

    @property
    def evicted(self) -> int:
        """Victims dropped (no carrier above the threshold)."""
        return int(self._counted("evicted"))

    @property
    def votes_dropped(self) -> float:
        """Votes ``p`` of the dropped victims."""
        return float(self._counted("votes_dropped"))

    @property
    def fallbacks(self) -> int:
        """Merged keys that fell back to the convex merge."""
        return int(self._counted("fallbacks"))

    def report(self) -> dict[str, float]:
        return {"merged": self.merged, "evicted": self.evicted, "votes_dropped": self.votes_dropped,
                "fallbacks": self.fallbacks}  # fmt: skip

    def _counted(self, key: str) -> float:
        self._flush()
        return self._counts[key]

    def _tally(self, goes: Tensor, leaving: Tensor, exact: Tensor, victim_beta: Tensor) -> None:
        """Keep a decode step's outcome ``(B, H, 1)`` per row; :meth:`_flush` counts it later, with
        many steps at once (no host synchronisation per step)."""
        self._pending.append((goes, leaving, exact, victim_beta))
        if len(self._pending) >= _TALLY_BATCH:
            self._flush()

    def _flush(self) -> None:
        """Add the pending decode steps to the counters (runs of steps with equal shapes at once)."""
        pending, self._pending = self._pending, []
        start = 0
        while start < len(pending):
            end = start + 1
            while end < len(pending) and pending[end][0].shape == pending[start][0].shape:
                end += 1
            goes, leaving, exact, beta = (torch.stack(group) for group in zip(*pending[start:end], strict=True))
            merged, leaving_count, exact_count = torch.stack([goes, leaving, goes & exact]).flatten(1).sum(1).tolist()
            self._counts["merged"] += merged
            self._counts["evicted"] += leaving_count - merged
            self._counts["fallbacks"] += merged - exact_count
            if leaving_count > merged:  # each step's dropped votes, added step after step
                dropped = torch.where(leaving & ~goes, beta.exp(), 0.0).flatten(1).sum(1)
                for votes in dropped.tolist():
                    self._counts["votes_dropped"] += votes
            start = end

    def _state(self, layer_idx: int, layer: FoldedLayer, old: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """The slot-aligned EMA ``(log S, Σω)`` and key norms of a layer, created or grown to ``n``
        slots; a created or grown state has its norms computed for every slot."""
        log_sum = self._log_sum.get(layer_idx)
        weight = self._weight.get(layer_idx)
        key_norm = self._key_norm.get(layer_idx)
        if log_sum is None:
            dtype = torch.float64 if layer.dtype == torch.float64 else torch.float32
            capacity = n + 16
            log_sum = torch.full((layer.batch_size, layer.num_heads, capacity), NEG_INF, dtype=dtype,
                                 device=layer.device)  # fmt: skip
            weight = torch.zeros_like(log_sum)
            if old:
                log_score, w = self._initial(layer_idx, layer, old)
                weight[:, :, :old] = w.to(dtype)
                log_sum[:, :, :old] = torch.where(w > 0, log_score + w.clamp_min(1e-300).log(), NEG_INF).to(dtype)
        elif log_sum.shape[2] < n:
            grow = n + 16 - log_sum.shape[2]
            log_sum = torch.cat([log_sum, log_sum.new_full((*log_sum.shape[:2], grow), NEG_INF)], dim=2)
            weight = torch.cat([weight, weight.new_zeros(*weight.shape[:2], grow)], dim=2)
            key_norm = None
        if key_norm is None:
            key_norm = torch.zeros_like(weight)
            keys = layer.dense_buffers()[0]
            key_norm[:, :, :n] = torch.linalg.vector_norm(keys.to(key_norm.dtype), dim=-1)
        self._log_sum[layer_idx], self._weight[layer_idx], self._key_norm[layer_idx] = log_sum, weight, key_norm
        return log_sum, weight, key_norm

    def _initial(self, layer_idx: int, layer: FoldedLayer, count: int) -> tuple[Tensor, Tensor]:
        """Scores of the entries present before the first step: from the one-shot fold, else from the
        captured prefill queries, else none (the first step's query then starts the EMA)."""
        log_score = layer.entry_stats.get(STAT_LOG_SCORE)
        weight = layer.entry_stats.get(STAT_WEIGHT)
        if log_score is not None and weight is not None and log_score.shape[-1] == count:
            return log_score, weight
        if layer.captured_queries is not None and layer.physical_length == layer.logical_length:
            keys, _, log_mass = layer.dense_buffers()
            width = min(self.folder.window, layer.captured_queries.shape[2], count)
            return window_log_scores(
                layer.captured_queries[:, :, -width:], keys[:, :, :count], self.scalings[layer_idx],
                self.folder.alpha, torch.isfinite(log_mass[:, :, :count]),
            )  # fmt: skip
        empty = torch.zeros(layer.batch_size, layer.num_heads, count, device=layer.device)
        return empty.fill_(NEG_INF), torch.zeros_like(empty)

    def observe(
        self,
        layer_idx: int,
        layer: FoldedLayer,
        query: Tensor,
        probs: Tensor | None,
        view: StepView | None = None,
        logits: Tensor | None = None,
    ) -> list[Tensor]:
        """Update the EMA with this forward's queries; return the slot-aligned state tensors.

        ``view``: the layer's buffers for this step, when the policy has taken them already.
        ``logits``: the attention's scores before β (``(B, H_kv, G·q, N)``), when it computed them.
        """
        if view is None:
            keys, values, log_mass = layer.dense_buffers()
            view = StepView(keys, values, log_mass, torch.isfinite(log_mass))
        n = view.keys.shape[2]
        q_len = query.shape[2]
        old = n - q_len
        fresh = self._key_norm.get(layer_idx) is None or self._key_norm[layer_idx].shape[2] < n
        log_sum, weight, key_norm = self._state(layer_idx, layer, old, n)
        if not fresh:  # the norms of the entries this forward appended
            key_norm.narrow(2, old, q_len).copy_(
                torch.linalg.vector_norm(view.keys.narrow(2, old, q_len).to(key_norm.dtype), dim=-1)
            )
        log_sum_n, weight_n = log_sum.narrow(2, 0, n), weight.narrow(2, 0, n)
        log_sum_n.narrow(2, old, q_len).fill_(NEG_INF)
        weight_n.narrow(2, old, q_len).fill_(0.0)
        log_s = step_log_scores(query, view.keys, view.log_mass, self.scalings[layer_idx], probs, view.valid, logits)
        if q_len == 1:  # a decode step: the same update, in place
            ema_step_one_(log_sum_n, weight_n, log_s, self.folder.alpha)
        else:
            new_sum, new_weight = ema_step(log_sum_n, weight_n, log_s, old, self.folder.alpha)
            log_sum_n.copy_(new_sum)
            weight_n.copy_(new_weight)
        return [log_sum, weight, key_norm]

    def export_state(self, layer_idx: int, layer: FoldedLayer) -> None:
        """Write the EMA state of a layer's slots where :meth:`_initial` of a fresh policy reads it."""
        log_sum = self._log_sum.get(layer_idx)
        if log_sum is None:
            return
        n = layer.physical_length
        weight = self._weight[layer_idx][:, :, :n]
        layer.entry_stats[STAT_LOG_SCORE] = log_scores_of(log_sum[:, :, :n], weight).float()
        layer.entry_stats[STAT_WEIGHT] = weight.float()

    def fold(self, layer_idx: int, layer: FoldedLayer, victims: Tensor, view: StepView | None = None) -> None:
        """ZIP-merge the ``victims`` ``(B, H, E)`` (slots about to be removed) into carriers, in place.

        ``view``: the layer's buffers for this step, when the policy has taken them already.
        """
        if view is None:
            keys, values, log_mass = layer.dense_buffers()
            valid = torch.isfinite(log_mass)
        else:
            keys, values, log_mass, valid = view
        n = keys.shape[2]
        log_sum = self._log_sum[layer_idx].narrow(2, 0, n)
        weight = self._weight[layer_idx].narrow(2, 0, n)
        key_norm = self._key_norm[layer_idx].narrow(2, 0, n)
        if victims.shape[2] == 1:
            self._fold_one(keys, values, log_mass, log_sum, weight, key_norm, victims, valid)
            return
        # several victims (a multi-token forward): closed form over the whole row (eq. 25)
        leaving = torch.zeros_like(valid).scatter_(2, victims, True) & valid
        if not bool(leaving.any()):
            return
        victim_keys = torch.gather(keys, 2, victims[..., None].expand(-1, -1, -1, keys.shape[-1]))
        sim, targets = best_match(victim_keys, keys, valid & ~leaving)
        goes = torch.gather(leaving, 2, victims) & (sim > self.folder.threshold)
        goes = goes & (torch.gather(weight, 2, victims) > 0)  # observed at least once: ŝ is defined
        beta = torch.where(valid, log_mass, torch.zeros_like(log_mass))
        slots = torch.arange(n, device=keys.device).expand_as(valid).contiguous()
        target_map = slots.scatter(2, victims, torch.where(goes, targets, victims))
        merge = torch.zeros_like(valid).scatter_(2, victims, goes)
        log_score = log_scores_of(log_sum, weight)
        merged = zip_merge(
            keys, values, beta, log_score, target_map, merge, self.folder.eps, self.folder.max_scale,
            self.folder.eq7_scaling,
        )  # fmt: skip
        new_weight = merged_weight(weight, target_map, merge, merged.receivers)
        at = merged.receivers
        for buffer, new in (
            (keys, merged.keys),
            (values, merged.values),
            (log_mass, merged.log_votes),
            (log_sum, merged.log_scores + new_weight.clamp_min(1e-300).log()),
            (weight, new_weight),
        ):
            buffer.copy_(torch.where(at if buffer.dim() == 3 else at[..., None], new.to(buffer.dtype), buffer))
        key_norm.copy_(torch.linalg.vector_norm(keys.to(key_norm.dtype), dim=-1))
        dropped = leaving & ~merge
        self._flush()  # the counts stay in step order
        self._counts["merged"] += int(goes.sum())
        self._counts["evicted"] += int(dropped.sum())
        self._counts["votes_dropped"] += float(beta.exp()[dropped].sum())
        self._counts["fallbacks"] += int(merged.fallback.sum())

    def _fold_one(
        self,
        keys: Tensor,
        values: Tensor,
        log_mass: Tensor,
        log_sum: Tensor,
        weight: Tensor,
        key_norm: Tensor,
        victim: Tensor,
        valid: Tensor,
    ) -> None:
        """A decode step's victim ``(B, H, 1)`` per row: ZIP-merge it into its most similar
        remaining entry (eq. 7, on the (victim, carrier) pair only, O(D) per row).

        :meth:`observe` has run on this forward, so every slot's EMA weight is ``≥ 1 − α > 0``:
        ``ŝ`` is defined everywhere (``log ŝ = log S − log Σω``). The merged entry goes to the
        carrier's slot; a row that does not merge writes it into the victim's own slot instead,
        which the policy overwrites or drops next (so no masked write).
        """
        dim = keys.shape[-1]
        leaving = valid.gather(2, victim)  # the victim is an entry, not an empty slot
        victim_key = keys.gather(2, victim.unsqueeze(-1).expand(-1, -1, 1, dim))
        allowed = valid.scatter(2, victim, False)
        sim, target = best_match(victim_key, keys, allowed, candidate_norms=key_norm)  # Algorithm 1, lines 4–5
        goes = leaving & (sim > self.folder.threshold)
        pair = torch.cat([victim, target], dim=2)  # (B, H, 2)
        pair_k = keys.gather(2, pair.unsqueeze(-1).expand(-1, -1, -1, dim))
        pair_v = values.gather(2, pair.unsqueeze(-1).expand(-1, -1, -1, values.shape[-1]))
        pair_beta = log_mass.gather(2, pair)  # finite wherever the row merges
        pair_weight = weight.gather(2, pair)
        pair_score = log_sum.gather(2, pair) - pair_weight.log()  # log ŝ (log_scores_of, every weight > 0)
        key, value, log_p, log_s, exact = zip_merge_pair(
            pair_k, pair_v, pair_beta, pair_score, self.folder.eps, self.folder.max_scale, self.folder.eq7_scaling
        )
        new_weight = pair_weight.amax(-1, keepdim=True)  # the EMA weight of the group: its largest
        slot = torch.where(goes, target, victim)
        stored = key if key.dtype == keys.dtype else key.to(keys.dtype)
        keys.scatter_(2, slot.unsqueeze(-1).expand(-1, -1, 1, dim), stored)
        key_norm.scatter_(2, slot, torch.linalg.vector_norm(stored.to(key_norm.dtype), dim=-1))
        values.scatter_(
            2,
            slot.unsqueeze(-1).expand(-1, -1, 1, values.shape[-1]),
            value if value.dtype == values.dtype else value.to(values.dtype),
        )
        log_mass.scatter_(2, slot, log_p if log_p.dtype == log_mass.dtype else log_p.to(log_mass.dtype))
        log_sum.scatter_(2, slot, (log_s + new_weight.log()).to(log_sum.dtype))
        weight.scatter_(2, slot, new_weight)
        self._tally(goes, leaving, exact, pair_beta.narrow(2, 0, 1))


class LayerPolicies:
    """One online policy per layer (layers with different limits and recent windows).

    With ``batched`` (a :class:`~kvfold.methods.merging.keepkv.decode.LayerBatchedDecode`, which KeepKV
    sets on H2O's per-layer policies), a decode forward's layers are held until its last layer
    and stepped at once; whenever that cannot be done (a longer forward, a layer not yet at its
    limit) each layer's policy steps as it would have, in layer order
    (:class:`~kvfold.methods.core.batched_decode.LayerBatch`).
    """

    def __init__(self, policies: dict[int, OnlineEviction]) -> None:
        self.policies = policies
        self.needs_attention = any(p.needs_attention for p in policies.values())
        self.folder = None
        self.batched = None

    @property
    def steps(self) -> int:
        return self.policies[min(self.policies)].steps if self.policies else 0

    def after_forward(
        self, layer_idx: int, layer: FoldedLayer, query: Tensor, probs: Tensor | None, logits: Tensor | None = None
    ) -> None:
        policy = self.policies.get(layer_idx)
        if policy is None:
            return
        if self.batched is not None:
            self.batched.new_forward(layer_idx)  # a held forward that stopped early steps first
        if self.batched is None or query.shape[2] != 1:
            policy.after_forward(layer_idx, layer, query, probs, logits)
            return
        self.batched.hold((layer_idx, layer, query, probs, logits))

    def export_state(self, cache: FoldedCache) -> None:
        """Every layer's policy writes its state into the cache (see :meth:`OnlineEviction.export_state`)."""
        if self.batched is not None:
            self.batched.run_held()
        for policy in self.policies.values():
            policy.export_state(cache)
