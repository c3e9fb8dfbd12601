"""CriticalKV: scores reweighted by the output each entry's value produces (‖W_o v‖₁), two-stage
selection.

Feng et al. 2025, *Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective*.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Wrapper, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import o_proj_weight
from kvfold.methods.core.scoring import GqaReduce, compute_dtype, gqa_groups, mask_invalid, pool_gqa
from kvfold.methods.core.selection import as_counts, topk_keep
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import layer_content
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


def critical_reweight(
    scores: Tensor,
    values: Tensor,
    o_proj_weight: Tensor,
    num_kv_heads: int,
    head_dim: int,
    epsilon: float = 1e-4,
    gqa_reduce: GqaReduce = "mean",
    chunk: int = 256,
    valid: Tensor | None = None,
) -> Tensor:
    """Output-aware importance (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference
    from an Output Perturbation Perspective", arXiv:2502.03805): ``(a + ε)·‖W_oʰ v‖₁``.

    Evicting entry ``i`` perturbs the layer output by at most ``Σ_h a_{h,i}·‖W_oʰ v_i‖₁``
    (up to a constant), where ``W_oʰ = W_o[:, h·D:(h+1)·D]`` is query head ``h``'s slice of
    ``o_proj``. With GQA a KV head's value feeds the ``G`` query heads of its group:

    * per-query-head ``scores`` ``(B, H_q, N)``: ``Σ``/mean over the group of
      ``(a_h + ε)·‖W_oʰ v‖₁`` (the bound itself);
    * per-KV-head ``scores`` ``(B, H_kv, N)``: ``(a + ε) · reduce_h ‖W_oʰ v‖₁`` (as the authors'
      release does with GQA-pooled SnapKV scores).

    Values are projected ``chunk`` tokens at a time, ``(B, H_q, chunk, hidden)`` at most.

    Args:
        scores: ``(B, H_q, N)`` or ``(B, H_kv, N)`` attention-based scores (≥ 0 on valid entries).
        values: ``(B, H_kv, N, D)``.
        o_proj_weight: ``(hidden, H_q·D)`` the ``nn.Linear`` weight of ``o_proj``.
        num_kv_heads, head_dim: ``H_kv`` and ``D`` (checked against ``values``).
        epsilon: ``ε`` added to the attention score.
        gqa_reduce: ``"mean"`` (release) or ``"sum"`` / ``"max"`` over the group.
        chunk: tokens per projection chunk.
        valid: padding mask; also, entries whose input score is ``-inf`` stay ``-inf``.

    Returns:
        ``(B, H_kv, N)``.
    """
    batch, kv_heads, length, dim = values.shape
    if (kv_heads, dim) != (num_kv_heads, head_dim):
        raise ValueError(f"values have {kv_heads} heads of dim {dim}; expected {num_kv_heads} × {head_dim}")
    if o_proj_weight.shape[1] % head_dim:
        raise ValueError(f"o_proj input size {o_proj_weight.shape[1]} is not a multiple of head_dim {head_dim}")
    num_q_heads = o_proj_weight.shape[1] // head_dim
    groups = gqa_groups(num_q_heads, num_kv_heads)
    if scores.shape[1] not in (num_q_heads, num_kv_heads):
        raise ValueError(f"scores have {scores.shape[1]} heads; expected {num_q_heads} or {num_kv_heads}")
    dtype = compute_dtype(scores, values, o_proj_weight)
    # W_o as (H_kv, G, D, hidden): the slice of query head h = k·G + g maps its D outputs to hidden.
    w_o = o_proj_weight.to(dtype).T.reshape(num_kv_heads, groups, head_dim, -1)
    v = values.to(dtype)
    norms = []
    for lo in range(0, length, chunk):  # loop over token chunks only, for memory
        projected = torch.einsum("bknd,kgdo->bkgno", v[:, :, lo : lo + chunk], w_o)
        norms.append(projected.abs().sum(dim=-1))  # ‖W_oʰ v‖₁
    out_norm = torch.cat(norms, dim=-1) if norms else v.new_zeros(batch, num_kv_heads, groups, 0)
    a = scores.to(dtype)
    dropped = torch.isneginf(a)
    if groups > 1 and scores.shape[1] == num_q_heads:
        # Σ_h-style bound per query head, then combined over the group
        per_head = (a.reshape(batch, num_kv_heads, groups, length) + epsilon) * out_norm
        result = pool_gqa(per_head.reshape(batch, num_q_heads, length), num_kv_heads, gqa_reduce)
        dropped = dropped.reshape(batch, num_kv_heads, groups, length).any(dim=2)
    else:
        group_norm = pool_gqa(out_norm.reshape(batch, num_q_heads, length), num_kv_heads, gqa_reduce)
        result = (a + epsilon) * group_norm
    result = result.masked_fill(dropped, float("-inf"))
    return mask_invalid(result, valid)


def critical_two_stage_select(
    attn_scores: Tensor,
    output_scores: Tensor,
    counts: int | Tensor,
    first_stage: float = 0.5,
    protected: Tensor | None = None,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """CriticalKV's two-stage selection (Feng et al. 2025, arXiv:2502.03805).

    Stage 1 keeps ``⌊first_stage · counts⌋`` entries by attention score (``attn_scores``, with
    the same protection rules as :func:`topk_keep`); stage 2 fills the rest of ``counts`` with
    the highest ``output_scores`` (e.g. :func:`critical_reweight`) among the entries not yet
    kept. Protected entries are kept first in both stages.

    Returns:
        ``keep_idx``, ``lengths`` as :func:`topk_keep`.
    """
    if not 0.0 <= first_stage <= 1.0:
        raise ValueError(f"first_stage must be in [0, 1]; got {first_stage}")
    batch, heads, length = attn_scores.shape
    counts_t = as_counts(counts, batch, heads, attn_scores.device)
    first = torch.floor(counts_t.double() * first_stage).long()
    stage1, stage1_len = topk_keep(attn_scores, first, protected=protected, valid=valid)
    slot = torch.arange(stage1.shape[-1], device=attn_scores.device)[None, None, :] < stage1_len[..., None]
    hits = torch.zeros(batch, heads, length, dtype=torch.long, device=attn_scores.device)
    chosen = hits.scatter_add(-1, stage1, slot.long()) > 0  # padding slots add 0
    if protected is not None:
        chosen = chosen | protected.to(torch.bool)
    return topk_keep(output_scores, counts_t, protected=chosen, valid=valid)


@register
@dataclass
class CriticalKV(Wrapper):
    """CriticalKV (Feng et al. 2025, arXiv:2502.03805, §3–4): output-aware selection.

    Scores are reweighted by the size of what the entry writes to the layer output,
    ``(a + ε)·‖W_oʰ v‖₁`` (:func:`critical_reweight`), and selection is
    two-stage: the first ``first_stage`` share of each head's budget by the inner scorer's
    attention scores, the rest by the reweighted scores. Needs non-negative attention-like
    scores from the inner scorer (not knorm, random or streamingllm).

    Parameters:
        first_stage: share of the budget chosen by attention scores (0.5 in the paper).
        epsilon: ``ε`` added to the attention score.
    """

    name: ClassVar[str] = "criticalkv"
    description: ClassVar[str] = "reweight scores by ||W_o v||_1 (output-aware), two-stage selection (0.5)"
    paper: ClassVar[str] = (
        "Feng et al. 2025, Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective"
    )
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def validate(self) -> None:
        if not 0.0 <= self.first_stage <= 1.0 or self.epsilon < 0:
            raise SpecError("criticalkv: first_stage must be in [0, 1] and epsilon ≥ 0")

    def rescore(self, layer_idx: int, layer: FoldedLayer, scores: Tensor, ctx: CompressionContext) -> Tensor:
        _, values, _, valid = layer_content(layer)
        if bool((scores[valid] < 0).any()):
            raise UserError(
                "criticalkv reweights attention scores (≥ 0); the inner method gives negative scores "
                "(use an attention-based scorer such as snapkv, h2o, tova, kvzip or expected_attention)"
            )
        weight = o_proj_weight(ctx, layer_idx)
        return critical_reweight(
            scores, values, weight, layer.num_heads, layer.head_dim, epsilon=self.epsilon, valid=valid
        )

    def select(self, layer_idx, layer, received, scores, counts, protected, valid, ctx):
        return critical_two_stage_select(received, scores, counts, self.first_stage, protected, valid)
