"""CaM: cache merging into the retained neighbours (``cam``, ``snapkv+cam``, ``h2o[online=false]+cam``).

Zhang et al. 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference" (ICML 2024, PMLR
235:58840-58850). Evicting token ``e`` perturbs the attention output by its share ``A_e`` of the
attention; CaM compensates by **merging its value into the values of the retained tokens that
follow it** (keys untouched), and merges only with a probability set by how prominent ``A_e`` is
relative to the retained tokens' attention (the paper's "sampling strategy governed by the
prominence of attention scores within discarded locations")::

    p_e = clamp(A_e / max_{r ∈ retained} A_r, 0, 1)        merge probability (reference=max)
    M_e ~ Bernoulli(p_e)                                  (seeded: ctx.seed, per layer)
    v_r ← v_r + M_e · v_e / |S_e|   for r ∈ S_e           S_e: the m retained entries after e

``A`` is the attention the last ``window`` prefill queries give each entry (mean over the window
and the query heads of a GQA group). The reference is the largest attention among the retained
entries, as in the authors' release (where it is taken over the sinks and the recent window,
i.e. over what is retained); ``reference=mean`` divides by their mean attention instead (a
milder reading of "prominence", which merges far more often: with attention sinks the maximum
is large and the default merges rarely). ``S_e`` are the ``merge`` = m retained entries following
``e`` in position order (fewer when fewer exist; the m last ones when none follows). Keys and β
stay as the eviction left them: CaM defines no log-mass (a merged value is a *sum*, not an
average standing for several tokens, so β = log count would double-count it).

The authors' release applies this rule in a StreamingLLM setting (sinks + recent window; the
reference maximum is over sinks and recent tokens, i.e. over what is retained), one token at a
time, spreading ``v_e/m`` over the next m tokens (m = 16 in the streaming example). Here it runs
one-shot after any selector; bare ``cam`` is ``streamingllm[online=false]+cam``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.folding import FoldSite, MergingFolder, row_uniforms, window_scores
from kvfold.methods.core.spec import SpecError

Tensor = torch.Tensor

__all__ = ["CaM", "cam_merge", "merge_sets"]


def merge_sets(kept: Tensor, lengths: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """First retained index and size of every position's merge set ``S_e``.

    Args:
        kept: ``(B, H, N)`` bool, the retained slots.
        lengths: ``(B, H)`` retained entries per row (``= kept.sum(-1)``).
        size: ``m``.

    Returns:
        ``(start, count)`` ``(B, H, N)`` long: ``S_e`` is retained entries ``start … start + count − 1``
        (indices into the retained entries in position order).
    """
    before = kept.long().cumsum(-1) - kept.long()  # retained entries strictly before position e
    c = lengths[..., None]
    start = torch.where(before >= c, (c - size).clamp(min=0), before)  # none after e: the last m
    count = torch.minimum(torch.full_like(start, size), c - start).clamp(min=0)
    return start, count


def cam_merge(
    values_kept: Tensor,
    values: Tensor,
    merged: Tensor,
    start: Tensor,
    count: Tensor,
    size: int,
) -> Tensor:
    """CaM's value update ``v_r ← v_r + Σ_{e: r ∈ S_e} M_e v_e / |S_e|``.

    Args:
        values_kept: ``(B, H, K, D)`` values of the retained entries (position order).
        values: ``(B, H, N, D)`` values of all entries.
        merged: ``(B, H, N)`` bool ``M_e`` (False for retained and padding entries).
        start, count: from :func:`merge_sets`.
        size: ``m`` (the loop runs over the m offsets of a merge set, not over tokens).

    Returns:
        ``(B, H, K, D)`` the new retained values (same dtype as ``values_kept``).
    """
    k = values_kept.shape[2]
    out = torch.cat([values_kept, values_kept.new_zeros(*values_kept.shape[:2], 1, values_kept.shape[-1])], dim=2)
    share = merged.to(values.dtype) / count.clamp(min=1).to(values.dtype)  # M_e / |S_e|
    for offset in range(size):
        hit = merged & (offset < count)
        target = torch.where(hit, start + offset, torch.full_like(start, k))  # slot k: a dump row
        src = values * (share * hit)[..., None]
        out.scatter_add_(2, target[..., None].expand_as(values), src.to(out.dtype))
    return out[:, :, :k]


@register
@dataclass
class CaM(MergingFolder):
    """CaM (Zhang et al., ICML 2024): evicted values merged, with probability from their relative
    attention, into the ``merge`` retained entries that follow them; keys untouched (see the
    module docstring for the equations). Seeded and reproducible (``ctx.seed``, per layer; a
    context draws the same alone or in a batch).

    Use after any selector (``snapkv+cam``, ``h2o[online=false]+cam``); ``cam`` alone is
    ``streamingllm[online=false]+cam`` (the paper's sinks + recent setting).

    Parameters:
        merge: size ``m`` of the merge set (16, the authors' streaming release).
        window: prefill queries whose attention gives ``A`` (the last 32).
        reference: ``max`` (the release) or ``mean`` attention of the retained entries, the
            denominator of the merge probability.
    """

    name: ClassVar[str] = "cam"
    description: ClassVar[str] = (
        "merge evicted values into the next retained entries with probability from relative attention"
    )
    paper: ClassVar[str] = "Zhang et al. 2024, CaM: Cache Merging for Memory-efficient LLMs Inference (ICML)"
    merge: int = 16
    window: int = 32
    reference: str = "max"
    selector_spec: ClassVar[str] = "streamingllm[online=false]"

    def validate(self) -> None:
        if self.merge < 1 or self.window < 1:
            raise SpecError(f"cam: merge and window must be ≥ 1; got merge={self.merge}, window={self.window}")
        if self.reference not in ("max", "mean"):
            raise SpecError(f"cam: reference must be max or mean; got {self.reference!r}")

    def fold_layer(self, site: FoldSite, ctx: CompressionContext) -> None:
        layer_idx, layer, keep, lengths = site.layer_idx, site.layer, site.keep, site.lengths
        keys0, values0, beta0 = site.kept_entries()
        values, valid = site.values, site.valid
        attention, _ = window_scores(ctx, layer_idx, layer, self.window, self.name)  # A, (B, H, N)
        dtype = attention.dtype
        kept = site.kept
        evicted = valid & ~kept
        # p_e = clamp(A_e / max_{retained} A_r, 0, 1)   (or the mean over the retained entries)
        retained_attention = attention.masked_fill(~kept, 0.0)
        if self.reference == "max":
            reference = retained_attention.amax(-1, keepdim=True)
        else:
            reference = retained_attention.sum(-1, keepdim=True) / lengths[..., None].clamp(min=1).to(dtype)
        prob = (attention / reference.clamp_min(torch.finfo(dtype).tiny)).clamp(0.0, 1.0)
        merged = evicted & (row_uniforms(ctx, layer_idx, valid, dtype) < prob)  # M_e ~ Bernoulli(p_e)
        start, count = merge_sets(kept, lengths, self.merge)
        merged = merged & (count > 0)
        new_values = cam_merge(values0.to(dtype), values.to(dtype), merged, start, count, self.merge)
        layer.replace(keys0, new_values.to(values0.dtype), beta0, lengths=lengths)
        report = ctx.report.setdefault("cam", {})
        report[layer_idx] = {"evicted": int(evicted.sum()), "merged": int(merged.sum())}
        if ctx.merge_recorder is not None:
            self._record(layer_idx, keep, merged, start, count, ctx)

    def _record(
        self, layer_idx: int, keep: Tensor, merged: Tensor, start: Tensor, count: Tensor, ctx: CompressionContext
    ) -> None:
        """Every (carrier, absorbed) pair with share ``1/|S_e|``."""
        offsets = torch.arange(self.merge, device=keep.device)
        index = (start[..., None] + offsets).clamp(max=keep.shape[-1] - 1)  # (B, H, N, m)
        hit = merged[..., None] & (offsets < count[..., None])
        carrier = torch.gather(keep, 2, index.flatten(2)).view_as(index)
        position = torch.arange(merged.shape[-1], device=keep.device)[None, None, :, None].expand_as(index)
        absorbed = torch.where(hit, position, torch.full_like(position, -1))
        share = hit.double() / count[..., None].clamp(min=1).double()
        ctx.record_merges(layer_idx, carrier.flatten(2), absorbed.flatten(2), share.flatten(2))
