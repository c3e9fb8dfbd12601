"""Nonuniform head budgets for Attention Matching (Zweiger et al. 2026, §3.4, Appendix E, Algorithm 4).

Heads differ in how much they suffer from compaction, and the ranking is stable across inputs
(§3.4), so a per-head share of the total budget is computed **once per model** and reused:

1. :func:`head_sensitivity` — every KV head of every layer is compacted at a base ratio ``r0``;
   then one head at a time gets another ratio ``ρ`` while the others stay at ``r0``, and the loss
   change ``J_h(ρ)`` is measured: the mean KL(full ‖ compacted) of the next-token distributions on
   a teacher-forced continuation (the paper's log-perplexity of original-cache generations differs
   from this KL by a constant, App. F.2). Compacting all heads at each ratio once and swapping
   single heads in makes this ``|ratios|`` compactions plus cheap continuation passes.
2. :func:`greedy_swap` — Algorithm 4: from uniform shares, repeatedly move ``η`` of share from the
   head whose loss rises least to the head whose loss falls most, while that helps.
3. :class:`~kvfold.methods.core.head_schedule.HeadSchedule` — the shares saved as JSON with the
   model's name and a hash of its architecture, loaded with ``am_highest[schedule=path.json]`` or
   ``kvzip[schedule=path.json]``. Per-head budgets become real per-head lengths in the cache (paged
   storage), not a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvfold.methods.core.base import build_method
from kvfold.methods.core.compression_context import CompressionContext
from kvfold.methods.core.head_schedule import HeadSchedule, config_hash
from kvfold.methods.core.model import model_name
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError

Tensor = torch.Tensor

__all__ = [
    "DEFAULT_RATIOS",
    "HeadSchedule",
    "build_head_schedule",
    "config_hash",
    "greedy_swap",
    "head_sensitivity",
]

DEFAULT_RATIOS = (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4)
"""Per-head compaction ratios at which the sensitivity curves are measured."""

# ---------------------------------------------------------------------------- Algorithm 4


def _interp(curve: Tensor, ratios: Tensor, rho: Tensor) -> Tensor:
    """Piecewise-linear ``J_h(ρ)`` per head; flat outside the measured ratios. curve ``(H, R)``."""
    rho = rho.clamp(float(ratios[0]), float(ratios[-1]))
    hi = torch.searchsorted(ratios, rho.contiguous(), right=False).clamp(1, len(ratios) - 1)
    lo = hi - 1
    r_lo, r_hi = ratios[lo], ratios[hi]
    frac = ((rho - r_lo) / (r_hi - r_lo)).clamp(0, 1)
    j_lo = curve.gather(1, lo[:, None])[:, 0]
    j_hi = curve.gather(1, hi[:, None])[:, 0]
    return j_lo + frac * (j_hi - j_lo)


def greedy_swap(
    curves: Tensor, ratios: Sequence[float], r0: float = 0.05, eta: float | None = None, max_iters: int | None = None
) -> Tensor:
    """Algorithm 4 (Appendix E): nonuniform shares by greedy swaps on sensitivity curves.

    ``ρ_h = p_h·H·r0``; with ``η' = η·H·r0``, the gain of growing head h is
    ``g⁺_h = J_h(ρ_h) − J_h(ρ_h + η')`` (−∞ past ratio 1) and the cost of shrinking head a is
    ``g⁻_a = J_a(ρ_a − η') − J_a(ρ_a)`` (+∞ below η'); while ``max g⁺ > min g⁻`` (different heads)
    move η of share from the cheapest to the best. Each swap lowers the predicted total loss
    ``Σ_h J_h(ρ_h)``, so the loop ends.

    Args:
        curves: ``(H, R)`` loss changes of every head (layers × KV heads flattened) at ``ratios``.
        ratios: increasing ratios of the curves' columns.
        r0: the reference overall ratio (0.05 in the paper).
        eta: share step (default ``1/(4H)``).
        max_iters: safety cap on swaps (default ``100·H``).

    Returns:
        ``(H,)`` float64 shares summing to 1.
    """
    curve = curves.to(torch.float64).reshape(-1, curves.shape[-1])
    heads = curve.shape[0]
    grid = torch.tensor(list(ratios), dtype=torch.float64)
    eta = 1.0 / (4 * heads) if eta is None else eta
    step = eta * heads * r0  # η' in ratio space
    shares = torch.full((heads,), 1.0 / heads, dtype=torch.float64)
    for _ in range(max_iters or 100 * heads):
        rho = shares * heads * r0
        now = _interp(curve, grid, rho)
        gain = torch.where(rho + step <= 1 + 1e-12, now - _interp(curve, grid, rho + step), -torch.inf)
        cost = torch.where(rho >= step - 1e-12, _interp(curve, grid, rho - step) - now, torch.inf)
        best = int(gain.argmax())
        cheapest = int(cost.masked_fill(torch.arange(heads) == best, torch.inf).argmin())
        if not bool(gain[best] > cost[cheapest] + 1e-15):
            break
        shares[cheapest] -= eta
        shares[best] += eta
    return shares.clamp_min(0) / shares.clamp_min(0).sum()


# ---------------------------------------------------------------------------- sensitivity curves


@torch.inference_mode()
def _continuation_logprobs(model, cache, last_logits: Tensor, cont: list[int]) -> Tensor:
    """Log-probabilities ``(m, V)`` predicting each continuation token (teacher forced)."""
    start = cache.get_seq_length()
    ids = torch.tensor([cont], device=model.device)
    pos = torch.arange(start, start + len(cont), device=model.device)[None]
    logits = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True).logits[0]
    predicting = torch.cat([last_logits.to(logits.dtype), logits[:-1]], dim=0)
    return torch.log_softmax(predicting.double(), dim=-1)


def _kl(ref: Tensor, other: Tensor) -> float:
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def _with_head(base, donor, layer_idx: int, head: int):
    """A copy of ``base`` whose KV head ``head`` of layer ``layer_idx`` comes from ``donor``."""
    cache = base.copy()
    layer = cache.layers[layer_idx]
    kb, vb, lb, nb = layer.padded()
    kd, vd, ld, nd = donor.layers[layer_idx].padded()
    width = max(kb.shape[2], kd.shape[2])

    def pad(t: Tensor, fill: float = 0.0) -> Tensor:
        extra = width - t.shape[2]
        if extra == 0:
            return t.clone()
        shape = list(t.shape)
        shape[2] = extra
        return torch.cat([t, t.new_full(shape, fill)], dim=2)

    k, v, lm = pad(kb), pad(vb), pad(lb, float("-inf"))
    k[:, head] = pad(kd)[:, head]
    v[:, head] = pad(vd)[:, head]
    lm[:, head] = pad(ld, float("-inf"))[:, head]
    lengths = nb.clone()
    lengths[:, head] = nd[:, head]
    # valid entries first in every row (replace reads the first ``lengths`` slots)
    order = torch.sort((~torch.isfinite(lm)).to(torch.uint8), dim=-1, stable=True).indices
    k = k.gather(2, order[..., None].expand(-1, -1, -1, k.shape[-1]))
    v = v.gather(2, order[..., None].expand(-1, -1, -1, v.shape[-1]))
    lm = lm.gather(2, order)
    layer.replace(k, v, lm, lengths=lengths)
    return cache


@torch.inference_mode()
def head_sensitivity(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    method: str = "am_highest_fast",
    ratios: Sequence[float] = DEFAULT_RATIOS,
    base_ratio: float = 0.05,
    continuation_tokens: int = 32,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Tensor:
    """Sensitivity curves ``J_{l,h}(ρ)`` ``(L_folded, H_kv, R)``: loss change when only head
    ``(l, h)`` is compacted at ratio ``ρ`` and every other head at ``base_ratio`` (§3.4, Fig. 2).

    The loss is the mean KL(full ‖ compacted) of the next-token distributions over the last
    ``continuation_tokens`` tokens of each text (teacher forced after the compacted rest),
    averaged over ``texts``. The compactions of one text at every ratio share its repeat pass
    (:meth:`CompressionContext.shared_result`). ``progress`` is told each text and layer measured.
    """
    total = None
    for number, text in enumerate(texts, 1):
        ids = tokenizer(text, add_special_tokens=True).input_ids
        if len(ids) <= continuation_tokens + 8:
            raise UserError(
                f"calibration text too short: {len(ids)} tokens for a {continuation_tokens}-token continuation"
            )
        context, cont = ids[:-continuation_tokens], ids[-continuation_tokens:]
        input_ids = torch.tensor([context], device=model.device)
        cache = FoldedCache(model.config)
        cache.capture_window = len(context)
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.capture_window = 0
        last = out.logits[:, -1]
        reference = _continuation_logprobs(model, cache.copy(), last, cont)
        shared: dict = {}  # one repeat pass for every ratio
        compacted = {
            r: _compressed_copy(model, tokenizer, cache, input_ids, method, r, seed, shared)
            for r in sorted({*ratios, base_ratio})
        }
        base = compacted[base_ratio]
        base_loss = _kl(reference, _continuation_logprobs(model, base.copy(), last, cont))
        layers = [i for i, _ in base.folded_layers]
        heads = base.folded_layers[0][1].num_heads
        curves = torch.zeros(len(layers), heads, len(ratios), dtype=torch.float64)
        for j, layer_idx in enumerate(layers):
            if progress is not None:
                progress(f"text {number}/{len(texts)}: layer {j + 1}/{len(layers)}")
            for h in range(heads):
                for r_i, r in enumerate(ratios):
                    mixed = _with_head(base, compacted[r], layer_idx, h)
                    loss = _kl(reference, _continuation_logprobs(model, mixed, last, cont))
                    curves[j, h, r_i] = loss - base_loss
        total = curves if total is None else total + curves
    return total / len(texts)


def _compressed_copy(
    model, tokenizer, cache: FoldedCache, input_ids: Tensor, method: str, ratio: float, seed: int, shared: dict
):
    """A copy of the prefilled ``cache`` compressed with ``method`` at ``ratio`` (``shared``: results of
    the prefilled context reused across ratios, e.g. the repeat pass)."""
    ctx = CompressionContext(
        model=model,
        cache=cache.copy(),
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        budget=Budget.parse(ratio),
        seed=seed,
        tokenizer=tokenizer,
        shared=shared,
    )
    build_method(method).apply(ctx)
    return ctx.cache


def build_head_schedule(
    model,
    tokenizer,
    texts: Sequence[str],
    path: str | Path | None = None,
    *,
    method: str = "am_highest_fast",
    ratios: Sequence[float] = DEFAULT_RATIOS,
    r0: float = 0.05,
    eta: float | None = None,
    continuation_tokens: int = 32,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> HeadSchedule:
    """Sensitivity curves on calibration ``texts``, Algorithm 4, and (with ``path``) a saved schedule."""
    curves = head_sensitivity(
        model,
        tokenizer,
        texts,
        method=method,
        ratios=ratios,
        base_ratio=r0,
        continuation_tokens=continuation_tokens,
        seed=seed,
        progress=progress,
    )
    num_layers, heads, _ = curves.shape
    step = 1.0 / (4 * num_layers * heads) if eta is None else eta
    shares = greedy_swap(curves.reshape(num_layers * heads, -1), ratios, r0=r0, eta=step).view(num_layers, heads)
    layers = [i for i, _ in FoldedCache(model.config).folded_layers]
    schedule = HeadSchedule(
        model=model_name(model),
        config_hash=config_hash(model.config),
        layers=layers,
        shares=shares.tolist(),
        r0=r0,
        eta=step,
        ratios=[float(r) for r in ratios],
        curves=curves.tolist(),
    )
    if path is not None:
        schedule.save(path)
    return schedule
