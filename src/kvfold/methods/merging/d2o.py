"""D2O: dynamic discriminative operations (``d2o``, and ``X+d2o_merge`` after any selector).

Wan et al. 2025, "D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of
Large Language Models" (ICLR 2025, arXiv:2406.13035). Two levels:

* **layer level** (§3.2) — attention is dense in some layers and sparse in others; dense layers
  lose more when evicted, so they get more of the cache. The density of layer ``l`` is measured
  by the variance of its prefill attention rows (here: the last ``window`` prefill queries),
  ``σ²_l = mean_{heads, queries} Var_j(a_ij)`` (a uniform row has variance 0, a one-hot row the
  largest), and the layer budgets are ``∝ 1/σ²_l`` with the average held at the requested budget
  (largest-remainder rounding, each layer in ``[⌈min_ratio · b⌉, N]``; ``min_ratio`` is our
  safeguard, 0 = none). The authors' release never compresses layers 0, 1 and the last one
  (``full_edge_layers=true``).
* **token level** (§3.3) — inside a layer, H2O-style eviction (sinks, heavy hitters by
  accumulated attention, and recent tokens), then a *compensation*: each evicted token ``e`` is
  compared with the retained keys; its best cosine similarity ``u_e = max_c cos(k_e, k_c)`` is
  checked against a threshold ``τ`` kept as an exponential moving average of those
  similarities. Evicted tokens are visited in position order (as a stream of evictions)::

      τ_{-1} = mean_e u_e,     τ_j = α u_j + (1 − α) τ_{j−1}
      merge e_j into c_j = argmax_c cos(k_{e_j}, k_c)   iff   u_j ≥ τ_{j−1}

  A carrier ``c`` with absorbed set ``E_c`` becomes the similarity-weighted average (the carrier's
  own similarity is 1, hence its weight ``e¹``)::

      w_e = exp(u_e) / Z,   w_c = exp(1) / Z,   Z = exp(1) + Σ_{e∈E_c} exp(u_e)
      k_c ← w_c k_c + Σ_e w_e k_e,     v_c ← w_c v_c + Σ_e w_e v_e

  The authors' release normalizes by the count instead (``weighting=count``: plain mean).

β: D2O defines none (a merged entry is an average). ``log_mass=true`` adds to the carrier's β the
log of its total weight relative to its own, ``log(Z / e) = log(1 + Σ_e exp(u_e − 1))``
(``log(1 + n)`` with count weighting), so the averaged entry attends like the tokens it stands
for (kvfold's β, architecture guide).

Reconstruction note: the variance rule, the EMA stream over evicted tokens and the weighting are
written from the paper as we read it and from the authors' release; docs/methods.md lists where
it departs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvfold.methods.core.base import ComposedMethod, Standalone, register
from kvfold.methods.core.budgets import apportion
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import FoldSite, MergingFolder, compute_dtype, window_scores
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.h2o import H2O, H2OPrefillObserver

Tensor = torch.Tensor

__all__ = [
    "D2O",
    "D2OMerge",
    "attention_variance",
    "d2o_merge",
    "ema_thresholds",
    "nearest_retained",
    "variance_layer_budgets",
]

WEIGHTINGS = ("similarity", "count")
EMA_TAIL = 1e-12
"""The EMA kernel is cut where ``(1 − α)^k`` falls below this (the result does not change)."""


# ---------------------------------------------------------------------------- layer level


def attention_variance(probs: Tensor, valid: Tensor) -> Tensor:
    """``σ²`` per batch row: ``Var_j(a_ij)`` over each row's valid keys, averaged over heads and queries.

    Args:
        probs: ``(B, H_q, W, N)`` attention rows (0 on padding).
        valid: ``(B, H_kv, N)`` bool.

    Returns:
        ``(B,)`` in the dtype of ``probs``.
    """
    groups = probs.shape[1] // valid.shape[1]
    count = valid.sum(-1).repeat_interleave(groups, dim=1).clamp(min=1).to(probs.dtype)[..., None]  # (B, H_q, 1)
    mean = probs.sum(-1) / count
    variance = probs.square().sum(-1) / count - mean.square()  # E[a²] − E[a]²
    return variance.clamp(min=0).mean(dim=(1, 2))


def variance_layer_budgets(
    variances: list[float], average: int, context_tokens: int, min_ratio: float = 0.25
) -> list[int]:
    """D2O §3.2: layer budgets ``∝ 1/σ²_l`` with mean ``average``, each in ``[⌈min_ratio·average⌉, N]``.

    Args:
        variances: ``σ²_l`` per compressed layer.
        average: the requested entries per layer (per KV head).
        context_tokens: ``N`` (no layer keeps more).
        min_ratio: least budget of a layer as a fraction of ``average`` (0 = at least one entry).

    Returns:
        Integer budgets summing to ``L · min(average, N)``.
    """
    layers = len(variances)
    if average >= context_tokens:
        return [context_tokens] * layers
    tiny = min((v for v in variances if v > 0), default=1.0) * 1e-3
    weights = [1.0 / max(v, tiny) for v in variances]
    minimum = min(average, max(1, math.ceil(min_ratio * average)))
    return apportion(weights, average * layers, minimum=minimum, maximum=context_tokens)


# ---------------------------------------------------------------------------- token level


def nearest_retained(keys: Tensor, kept_keys: Tensor, slot: Tensor, chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """``u_e = max_c cos(k_e, k_c)`` and its argmax ``c`` over the retained keys, for every entry.

    Args:
        keys: ``(B, H, N, D)``; kept_keys: ``(B, H, K, D)``; slot: ``(B, H, K)`` bool (valid kept slots).
        chunk: entries compared at a time (memory ``(B, H, chunk, K)``).

    Returns:
        ``(u (B, H, N), carrier (B, H, N) long)`` — carrier indexes the retained entries.
    """
    unit = F.normalize(keys, dim=-1)
    kept_unit = F.normalize(kept_keys, dim=-1).mT
    best, where = [], []
    for lo in range(0, keys.shape[2], chunk):  # chunks of entries, for memory
        sim = (unit[:, :, lo : lo + chunk] @ kept_unit).masked_fill(~slot[:, :, None, :], -math.inf)
        value, index = sim.max(-1)
        best.append(value)
        where.append(index)
    return torch.cat(best, -1), torch.cat(where, -1)


def ema_thresholds(similarity: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """The threshold each evicted token meets: ``τ_{j−1}`` of the EMA ``τ_j = α u_j + (1 − α) τ_{j−1}``.

    ``τ_{-1}`` is the mean of the row's ``u``. Closed form (vectorized, a causal convolution)::

        τ_j = (1 − α)^{j+1} τ_{-1} + α Σ_{i≤j} (1 − α)^{j−i} u_i

    Args:
        similarity: ``(..., E)`` ``u`` of the evicted tokens in position order.
        valid: ``(..., E)`` bool, a prefix of each row (rows hold different numbers of tokens).
        alpha: ``α`` in ``[0, 1]`` (0: the threshold stays at the mean; 1: the previous token's ``u``).

    Returns:
        ``(..., E)`` ``τ_{j−1}`` (meaningless past a row's valid prefix).
    """
    shape = similarity.shape
    length = shape[-1]
    u = similarity.reshape(-1, length)
    mask = valid.reshape(-1, length)
    x = torch.where(mask, u, torch.zeros_like(u))
    start = x.sum(-1) / mask.sum(-1).clamp(min=1).to(u.dtype)  # τ_{-1}
    decay = 1.0 - alpha
    steps = torch.arange(length, device=u.device, dtype=u.dtype)
    if decay == 0.0:
        smoothed = x
    elif decay == 1.0:
        smoothed = torch.zeros_like(x)
    else:
        width = min(length, math.ceil(math.log(EMA_TAIL) / math.log(decay)) + 1)
        kernel = (decay ** torch.arange(width, device=u.device, dtype=u.dtype)).flip(-1)
        smoothed = F.conv1d(F.pad(x[:, None, :], (width - 1, 0)), kernel[None, None, :])[:, 0, :]
    tau = (decay ** (steps + 1))[None, :] * start[:, None] + alpha * smoothed
    previous = torch.cat([start[:, None], tau[:, :-1]], dim=-1)
    return previous.reshape(shape)


def d2o_merge(
    kept_keys: Tensor,
    kept_values: Tensor,
    keys: Tensor,
    values: Tensor,
    merged: Tensor,
    carrier: Tensor,
    similarity: Tensor,
    weighting: str = "similarity",
) -> tuple[Tensor, Tensor, Tensor]:
    """Fold the merged evicted entries into their carriers (D2O §3.3 weighted average).

    Args:
        kept_keys, kept_values: ``(B, H, K, D)`` retained entries.
        keys, values: ``(B, H, N, D)`` all entries.
        merged: ``(B, H, N)`` bool, the evicted entries that merge.
        carrier: ``(B, H, N)`` long, index of each entry's carrier among the retained entries.
        similarity: ``(B, H, N)`` ``u_e``.
        weighting: ``"similarity"`` (``exp(u)``, carrier ``exp(1)``) or ``"count"`` (all 1).

    Returns:
        ``(keys (B, H, K, D), values (B, H, K, D), mass (B, H, K))``: the merged retained entries and
        each carrier's total weight relative to its own (1 for a carrier that absorbed nothing).
    """
    if weighting == "similarity":
        own = math.e  # exp(cos(k_c, k_c)) = exp(1)
        weight = torch.exp(similarity)
    else:
        own = 1.0
        weight = torch.ones_like(similarity)
    weight = torch.where(merged, weight, torch.zeros_like(weight))
    index = carrier.clamp(min=0)
    total = torch.full(kept_keys.shape[:3], own, dtype=weight.dtype, device=weight.device)
    total = total.scatter_add(2, index, weight)  # Z = w_c + Σ_e w_e (unnormalized)
    out = []
    for kept, every in ((kept_keys, keys), (kept_values, values)):
        num = kept * own
        num = num.scatter_add(2, index[..., None].expand_as(every), every * weight[..., None])
        out.append(num / total[..., None])
    return out[0], out[1], total / own


@register
@dataclass
class D2OMerge(MergingFolder):
    """D2O's compensation after any selector (``snapkv+d2o_merge``, ``h2o[online=false]+d2o_merge``):
    each evicted token merges into its most cosine-similar retained key when that similarity
    reaches an EMA threshold (D2O §3.3; see the module docstring).

    Parameters:
        ema: ``α`` of the threshold's moving average over the evicted tokens (0.5).
        weighting: ``similarity`` (the paper: ``exp(cos)`` weights, carrier ``exp(1)``) or ``count``
            (the authors' release: plain mean).
        log_mass: also set β = log of each carrier's total weight relative to its own (off: D2O
            defines no β).
    """

    name: ClassVar[str] = "d2o_merge"
    description: ClassVar[str] = "merge evicted tokens into the most cosine-similar retained key above an EMA threshold"
    paper: ClassVar[str] = (
        "Wan et al. 2025, D2O: Dynamic Discriminative Operations for Efficient Long-Context Inference of LLMs (ICLR)"
    )
    ema: float = 0.5
    weighting: str = "similarity"
    log_mass: bool = False

    def validate(self) -> None:
        if not 0.0 <= self.ema <= 1.0:
            raise SpecError(f"{self.name}: ema must be in [0, 1]; got {self.ema}")
        if self.weighting not in WEIGHTINGS:
            raise SpecError(f"{self.name}: weighting must be one of {', '.join(WEIGHTINGS)}; got {self.weighting!r}")

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        layer_idx, layer, keep, lengths = site.layer_idx, site.layer, site.keep, site.lengths
        keys_kept, values_kept, beta_kept = site.kept_entries()
        keys, values = site.keys, site.values
        dtype = compute_dtype(keys)
        slot = torch.arange(keep.shape[-1], device=keep.device)[None, None, :] < lengths[..., None]
        evicted = site.evicted
        similarity, carrier = nearest_retained(keys.to(dtype), keys_kept.to(dtype), slot)
        similarity = torch.where(evicted, similarity, torch.zeros_like(similarity))
        # the evicted tokens as a stream in position order: evicted first (stable), then the rest
        order = torch.sort((~evicted).to(torch.uint8), dim=-1, stable=True).indices
        width = int(evicted.sum(-1).max()) if evicted.numel() else 0
        order = order[..., :width]
        in_stream = torch.gather(evicted, -1, order)
        stream = torch.gather(similarity, -1, order)
        threshold = ema_thresholds(stream, in_stream, self.ema)
        take = in_stream & (stream >= threshold)  # u_j ≥ τ_{j−1}
        merged = torch.zeros_like(evicted, dtype=torch.long).scatter(-1, order, take.long()) > 0
        new_keys, new_values, mass = d2o_merge(
            keys_kept.to(dtype),
            values_kept.to(dtype),
            keys.to(dtype),
            values.to(dtype),
            merged,
            carrier,
            similarity,
            self.weighting,
        )
        beta = beta_kept + torch.log(mass).to(beta_kept.dtype) if self.log_mass else beta_kept
        layer.replace(new_keys.to(keys_kept.dtype), new_values.to(values_kept.dtype), beta, lengths=lengths)
        report = ctx.report.setdefault("d2o", {})
        report[layer_idx] = {"evicted": int(evicted.sum()), "merged": int(merged.sum())}
        if ctx.merge_recorder is not None:
            site.record_merges(ctx, torch.gather(keep, 2, carrier.clamp(min=0)), merged)


# ---------------------------------------------------------------------------- the whole method


@dataclass
class _D2OSelector(H2O):
    """H2O eviction (sinks, heavy hitters, recent) with D2O's variance-based layer budgets."""

    name: ClassVar[str] = "d2o"
    window: int = 32
    min_ratio: float = 0.25
    full_edge_layers: bool = False

    def layer_budgets(self, ctx: CompressionContext) -> list[Tensor]:
        cached = ctx.memo.get("d2o_layer_budgets")
        if cached is not None:
            return cached
        folded = ctx.cache.folded_layers
        budgets = [ctx.row_budgets.clone() for _ in range(ctx.num_layers)]
        edge = {folded[0][0], folded[min(1, len(folded) - 1)][0], folded[-1][0]} if self.full_edge_layers else set()
        variances = []
        for layer_idx, layer in folded:
            _, probs = window_scores(ctx, layer_idx, layer, self.window, "d2o")
            variances.append(attention_variance(probs, layer.valid_mask()))
        table = torch.stack(variances).cpu().double()  # (L_folded, B)
        tuned = [j for j, (i, _) in enumerate(folded) if i not in edge]
        for b, (average, length) in enumerate(zip(ctx.row_budgets.tolist(), ctx.context_lengths.tolist(), strict=True)):
            if tuned:
                row = variance_layer_budgets([float(table[j, b]) for j in tuned], average, length, self.min_ratio)
                for j, count in zip(tuned, row, strict=True):
                    budgets[folded[j][0]][b] = count
            for layer_idx in edge:
                budgets[layer_idx][b] = length
        ctx.memo["d2o_layer_budgets"] = budgets
        ctx.report.setdefault("d2o", {})["layer_budgets"] = [budgets[i].tolist() for i, _ in folded]
        ctx.report["d2o"]["attention_variance"] = table.T.tolist()
        return budgets


@register
@dataclass
class D2O(Standalone):
    """D2O (Wan et al., ICLR 2025): layer budgets from the variance of prefill attention, H2O-style
    eviction keeping sinks, heavy hitters and recent tokens, and EMA-threshold merging of evicted
    tokens into their most cosine-similar retained key (see the module docstring).

    Parameters:
        recent_ratio: share of each layer's budget kept for the most recent tokens (0.5, H2O's split).
        sinks: first tokens always kept (4).
        window: prefill queries whose attention rows measure each layer's variance (32).
        min_ratio: least budget of a layer as a fraction of the average (0.25; ours, 0 = none).
        full_edge_layers: never compress layers 0, 1 and the last one (the authors' release;
            the cache then holds more than the budget).
        ema, weighting, log_mass: as :class:`D2OMerge`.
    """

    name: ClassVar[str] = "d2o"
    description: ClassVar[str] = (
        "variance-based layer budgets, sinks + heavy hitters + recent, EMA-threshold merging of evicted tokens"
    )
    paper: ClassVar[str] = D2OMerge.paper
    recent_ratio: float = 0.5
    sinks: int = 4
    window: int = 32
    min_ratio: float = 0.25
    full_edge_layers: bool = False
    ema: float = 0.5
    weighting: str = "similarity"
    log_mass: bool = False

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        self._parts()  # the parts check their own options
        if self.window < 1 or not 0.0 <= self.min_ratio <= 1.0:
            raise SpecError(f"d2o: window must be ≥ 1 and min_ratio in [0, 1]; got {self.window}, {self.min_ratio}")

    def prefill_observers(self) -> list:
        return [H2OPrefillObserver()]

    def _parts(self) -> ComposedMethod:
        selector = _D2OSelector(
            recent_ratio=self.recent_ratio,
            sinks=self.sinks,
            online=False,
            window=self.window,
            min_ratio=self.min_ratio,
            full_edge_layers=self.full_edge_layers,
        )
        folder = D2OMerge(ema=self.ema, weighting=self.weighting, log_mass=self.log_mass)
        selector.validate()
        folder.validate()
        return ComposedMethod(spec=self.name, wrappers=(), selector=selector, folder=folder)

    def compress(self, ctx: CompressionContext) -> None:
        self._parts().compress(ctx)
