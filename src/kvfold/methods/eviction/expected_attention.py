"""Expected Attention: the attention future queries are expected to give, times the value norm.

Devoto et al. 2025, *Expected Attention: KV Cache Compression by Estimating Attention from Future
Queries Distribution*. Future queries are modelled as a Gaussian of the recent (un-rotated)
queries, rotated to the next positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvfold.methods.core.base import Selector, register
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.model import layer_scaling, rope_tables, unrotate
from kvfold.methods.core.scoring import GqaReduce, compute_dtype, gqa_groups, mask_invalid, pool_gqa
from kvfold.methods.core.spec import SpecError
from kvfold.methods.eviction.common import captured_window, first_valid, layer_content
from kvfold.runtime.folded_layer import FoldedLayer

Tensor = torch.Tensor


# ---------------------------------------------------------------------------- scores


def _safe_softmax(logits: Tensor) -> Tensor:
    """Max-shifted softmax over the last axis; rows with no finite logit give all zeros."""
    peak = logits.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(logits - peak)  # exp(-inf) = 0 for masked entries
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / total.clamp_min(torch.finfo(weights.dtype).tiny), weights * 0)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, attention_scaling: float = 1.0) -> tuple[Tensor, Tensor]:
    """The rotary ``cos``, ``sin`` tables of transformers' default RoPE (``rotate_half`` layout).

    ``freqs = positions ⊗ inv_freq``, ``emb = [freqs, freqs]``; ``cos = cos(emb)·attention_scaling``.

    Args:
        inv_freq: ``(D/2,)`` the rotary module's ``inv_freq``.
        positions: ``(T,)`` absolute positions.
        attention_scaling: the rotary module's ``attention_scaling`` (1 for plain RoPE).

    Returns:
        ``cos``, ``sin``: ``(T, D)`` float32 (float64 if ``inv_freq`` is float64).
    """
    dtype = compute_dtype(inv_freq)
    freqs = positions.to(dtype)[:, None] * inv_freq.to(dtype)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def mean_rope_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """``R̄ = mean_t R_t``, the average RoPE rotation over the positions of ``cos``/``sin``.

    For transformers' layout ``R_t x = cos_t ⊙ x + sin_t ⊙ rotate_half(x)``, i.e.
    ``R_t = diag(cos_t) + diag(sin_t)·P`` with ``P x = [−x₂; x₁]``.

    Args:
        cos, sin: ``(T, D)`` or ``(B, T, D)`` (as returned by a rotary module).

    Returns:
        ``(D, D)`` or ``(B, D, D)``: apply to a column vector, ``q_rot = R̄ q``.
    """
    dtype = compute_dtype(cos, sin)
    cos_mean, sin_mean = cos.to(dtype).mean(dim=-2), sin.to(dtype).mean(dim=-2)  # (..., D)
    dim = cos.shape[-1]
    half = dim // 2
    perm = torch.zeros(dim, dim, dtype=dtype, device=cos.device)
    perm[:half, half:] = -torch.eye(half, dtype=dtype, device=cos.device)
    perm[half:, :half] = torch.eye(half, dtype=dtype, device=cos.device)
    return torch.diag_embed(cos_mean) + sin_mean[..., :, None] * perm


def expected_attention_scores(
    queries_pre_rope: Tensor,
    keys: Tensor,
    values: Tensor,
    cos: Tensor,
    sin: Tensor,
    scaling: float,
    use_covariance: bool = True,
    use_value_norm: bool = True,
    epsilon: float = 0.0,
    gqa_reduce: GqaReduce = "mean",
    log_mass: Tensor | None = None,
    valid: Tensor | None = None,
) -> Tensor:
    """Expected Attention scores (Devoto et al. 2025, "Expected Attention: KV Cache Compression
    by Estimating Attention from Future Queries Distribution", released in NVIDIA kvpress).

    Future queries are modelled as Gaussian ``q ~ N(μ, Σ)`` with ``μ, Σ`` the mean and (biased)
    covariance of the recent **pre-RoPE** queries of each query head. A future query at position
    ``t`` is ``R_t q``; averaging over the ``T`` future positions whose ``cos``/``sin`` are given
    uses the mean rotation ``R̄`` (:func:`mean_rope_rotation`): ``μ̄ = R̄ μ``, ``Σ̄ = R̄ Σ R̄ᵀ``.
    For a logit ``z = s·q̄·k`` with ``q̄ ~ N(μ̄, Σ̄)``, ``E[exp z] = exp(s·μ̄·k + s²·kᵀΣ̄k / 2)``
    (``s = scaling``, ``= μ̄·k/√d + kᵀΣ̄k/(2d)`` for ``s = 1/√d``). These expected scores are
    normalised over the keys (softmax, with ``β`` and padding), averaged over the GQA group,
    and weighted by the value norm: ``score = (ā + ε)·‖v‖₂``.

    Approximation: ``μ̄`` is exactly the mean of ``R_t μ`` over ``t``, but ``R̄ Σ R̄ᵀ`` replaces
    ``mean_t R_t Σ R_tᵀ`` and the mixture over positions is treated as one Gaussian (the spread
    of ``R_t μ`` across ``t`` is ignored), as in the authors' release.

    Args:
        queries_pre_rope: ``(B, H_q, M, D)`` recent pre-RoPE query states (drop sink tokens first;
            ``M = 1`` gives ``Σ = 0``).
        keys: ``(B, H_kv, N, D)`` post-RoPE keys; values: ``(B, H_kv, N, D)``.
        cos, sin: ``(T, D)`` or ``(B, T, D)`` rotary tables of the next ``T`` positions (e.g.
            ``rope_cos_sin(inv_freq, arange(L, L + n_future))``, ``L`` the logical length).
        scaling: logit scale (``1/√D``).
        use_covariance: include the ``s²·kᵀΣ̄k/2`` term.
        use_value_norm: multiply by ``‖v‖₂``.
        epsilon: ``ε`` added before the value-norm weighting.
        gqa_reduce: combination of the ``G`` query heads (``"mean"``).
        log_mass, valid: see :mod:`kvfold.methods.core.scoring`.

    Returns:
        ``(B, H_kv, N)``, ``-inf`` on padding.
    """
    batch, num_q_heads, num_samples, dim = queries_pre_rope.shape
    num_kv_heads, length = keys.shape[1], keys.shape[2]
    groups = gqa_groups(num_q_heads, num_kv_heads)
    dtype = compute_dtype(queries_pre_rope, keys, values, cos, sin, log_mass)
    q = queries_pre_rope.to(dtype)
    mu = q.mean(dim=2)  # (B, H_q, D)
    rot = mean_rope_rotation(cos, sin).to(dtype)  # (D, D) or (B, D, D)
    rot = rot[:, None] if rot.dim() == 3 else rot  # broadcast over heads
    mu_bar = (rot @ mu[..., None])[..., 0]  # μ̄ = R̄ μ
    k = keys.to(dtype)
    k_grouped = k[:, :, None]  # (B, H_kv, 1, N, D)
    logits = torch.einsum("bkgd,bknd->bkgn", mu_bar.reshape(batch, num_kv_heads, groups, dim), k) * scaling
    if use_covariance and num_samples > 1:
        centered = q - mu[:, :, None]
        sigma = centered.transpose(-1, -2) @ centered / num_samples  # Σ (B, H_q, D, D)
        sigma_bar = rot @ sigma @ rot.transpose(-1, -2)  # Σ̄ = R̄ Σ R̄ᵀ
        sigma_bar = sigma_bar.reshape(batch, num_kv_heads, groups, dim, dim)
        quad = ((k_grouped @ sigma_bar) * k_grouped).sum(dim=-1)  # kᵀ Σ̄ k, (B, H_kv, G, N)
        logits = logits + 0.5 * scaling**2 * quad
    if log_mass is not None:
        logits = logits + log_mass.to(dtype)[:, :, None, :]
    if valid is not None:
        logits = logits.masked_fill(~valid.to(torch.bool)[:, :, None, :], float("-inf"))
    probs = _safe_softmax(logits).reshape(batch, num_q_heads, length)
    scores = pool_gqa(probs, num_kv_heads, gqa_reduce)
    if use_value_norm:
        scores = (scores + epsilon) * torch.linalg.vector_norm(values.to(dtype), dim=-1)
    elif epsilon:
        scores = scores + epsilon
    return mask_invalid(scores, valid)


# ---------------------------------------------------------------------------- Expected Attention


@register
@dataclass
class ExpectedAttention(Selector):
    """Expected Attention (Devoto et al. 2025, "Expected Attention: KV Cache Compression by
    Estimating Attention from Future Queries Distribution", §3).

    Future queries are modelled as a Gaussian fitted to recent **pre-RoPE** queries, rotated by
    the mean RoPE rotation of the next ``n_future`` positions; each entry's score is its expected
    attention times ``‖v‖`` (:func:`expected_attention_scores`). Pre-RoPE
    queries come from the captured post-RoPE ones by the inverse rotation (RoPE is orthogonal),
    with the model's own rotary tables. The first ``sinks`` tokens are left out of the query
    statistics and of the softmax, and always kept.

    Difference from the release: it fits the statistics on all prompt queries; here they come
    from the last ``window`` queries captured at prefill (64 by default).

    Parameters:
        n_future: future positions averaged over (512).
        sinks: initial tokens excluded and kept (4).
        window: recent queries for the Gaussian (≤ what the prefill captured).
        use_covariance: include the ``kᵀΣk/2d`` term.
        use_value_norm: weight by ``‖v‖₂``.
        epsilon: added before the value-norm weighting.
    """

    name: ClassVar[str] = "expected_attention"
    description: ClassVar[str] = "expected attention of future queries (Gaussian of recent queries) x value norm"
    paper: ClassVar[str] = (
        "Devoto et al. 2025, Expected Attention: KV Cache Compression by Estimating Attention "
        "from Future Queries Distribution"
    )
    n_future: int = 512
    sinks: int = 4
    window: int = 64
    use_covariance: bool = True
    use_value_norm: bool = True
    epsilon: float = 0.0

    @property
    def query_window(self) -> int:  # type: ignore[override]
        return self.window

    def validate(self) -> None:
        for option in ("n_future", "window"):
            if getattr(self, option) < 1:
                raise SpecError(f"expected_attention: {option} must be ≥ 1; got {getattr(self, option)}")
        if self.sinks < 0 or self.epsilon < 0:
            raise SpecError("expected_attention: sinks and epsilon must be ≥ 0")

    def score(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor:
        keys, values, beta, valid = layer_content(layer)
        captured = captured_window(layer, self.window, self.name, strict=False)
        sinks = first_valid(valid, self.sinks)
        key_valid = valid & ~sinks
        lengths = valid[:, 0].sum(-1).tolist()  # tokens per row (left padding excluded)
        rows = []
        for b in range(keys.shape[0]):  # per batch row: rows differ in length, so in positions
            row = slice(b, b + 1)
            rows.append(
                self._row_scores(
                    ctx, layer_idx, int(lengths[b]), captured[row], keys[row], values[row], beta[row], key_valid[row]
                )
            )
        scores = torch.cat(rows)
        # sinks are protected; give them the row's top score so that scores stay finite
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        return torch.where(sinks, top.expand_as(scores), scores)

    def _row_scores(
        self,
        ctx: CompressionContext,
        layer_idx: int,
        length: int,
        captured: Tensor,
        keys: Tensor,
        values: Tensor,
        beta: Tensor,
        key_valid: Tensor,
    ) -> Tensor:
        """Scores of one batch row of ``length`` tokens, ``(1, H_kv, N)``."""
        width = captured.shape[2]
        positions = torch.arange(length - width, length, device=keys.device)  # of the captured queries
        use = positions >= min(self.sinks, length - 1)  # real tokens past the sinks (at least one)
        cos, sin = rope_tables(ctx.model, layer_idx, positions[use])
        queries = unrotate(captured[:, :, use], cos, sin)  # pre-RoPE (1, H_q, M, D)
        future = torch.arange(length, length + self.n_future, device=keys.device)
        cos_f, sin_f = rope_tables(ctx.model, layer_idx, future)
        return expected_attention_scores(
            queries,
            keys,
            values,
            cos_f,
            sin_f,
            layer_scaling(ctx, layer_idx, ctx.cache.layers[layer_idx], require_module=True),
            use_covariance=self.use_covariance,
            use_value_norm=self.use_value_norm,
            epsilon=self.epsilon,
            log_mass=beta,
            valid=key_valid,
        )

    def protected(self, layer_idx: int, layer: FoldedLayer, ctx: CompressionContext) -> Tensor | None:
        return first_valid(layer.valid_mask(), self.sinks) if self.sinks else None
