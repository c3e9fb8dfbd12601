"""Integer grids of quantized storage: float16 scales and zero points of asymmetric min–max grids,
searched (clipped) ranges, rounding to codes and back.

KIVI's scheme (Liu et al. 2024, *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*, §3)
rounds each group to the asymmetric grid its minimum and maximum span; the clipping search of
weight quantizers (e.g. AWQ, Lin et al. 2024, §3.2) shrinks the range where that gives the group
back closer. :mod:`kvfold.runtime.quantize` stores the codes these grids give.
"""

from __future__ import annotations

import torch
from torch import Tensor

NEG_INF = float("-inf")


def _round_down_half(x: Tensor) -> Tensor:
    """float16 at or below ``x`` (float32), finite."""
    h = x.clamp(-65504.0, 65504.0).half()
    below = h.float() > x
    return torch.where(below, torch.nextafter(h, torch.full_like(h, NEG_INF)), h)


def _round_up_half(x: Tensor) -> Tensor:
    """float16 at or above ``x`` (float32, ≥ 0)."""
    h = x.clamp(max=65504.0).half()
    above = h.float() < x
    return torch.where(above, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def minmax_params(low: Tensor, high: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """float16 ``(scale, zero)`` of an asymmetric ``bits``-bit grid that covers ``[low, high]``:
    ``zero ≤ low`` and ``zero + (2**bits − 1)·scale ≥ high`` in float32 arithmetic, so every value in
    the range lands within ``scale / 2`` of its grid point (a constant range gets scale 1)."""
    levels = (1 << bits) - 1
    zero = _round_down_half(low.float())
    span = (high.float() - zero.float()).clamp(min=0) / levels
    scale = _round_up_half(span * (1 + 2**-10))
    for _ in range(2):  # float32 rounding of zero + levels·scale may fall a hair short of high
        short = zero.float() + levels * scale.float() < high.float()
        scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, zero


def quantize_minmax(x: Tensor, scale: Tensor, zero: Tensor, bits: int) -> Tensor:
    """uint8 codes ``round((x − zero) / scale)`` clamped to the grid (scale, zero broadcast)."""
    levels = (1 << bits) - 1
    codes = torch.round((x.float() - zero.float()) / scale.float())
    return codes.clamp_(0, levels).to(torch.uint8)


def dequantize_minmax(codes: Tensor, scale: Tensor, zero: Tensor, dtype: torch.dtype) -> Tensor:
    """``codes · scale + zero`` in ``dtype`` (computed in float32 or wider)."""
    acc = torch.promote_types(dtype, torch.float32)
    return torch.addcmul(zero.to(acc), codes.to(acc), scale.to(acc)).to(dtype)


CLIP_FACTORS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
"""Fractions of a group's min–max range tried by the clipping search (``QuantConfig.clip``)."""


CLIP_BATCH_ELEMENTS = 1 << 24
"""Up to this many elements of ``x`` times the candidates, :func:`group_params` tries every clipping
factor in one batch of operations (a few operations in all, where one candidate at a time issues
each of them once a factor); larger groups of groups try them one after another (memory follows ``x``)."""


def group_params(
    x: Tensor, low: Tensor, high: Tensor, bits: int, dim: int, clip: bool, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """float16 ``(scale, zero)`` of the groups of ``x`` that lie along ``dim`` (their ranges ``[low,
    high]``: ``x``'s shape with ``dim`` reduced): min–max (:func:`minmax_params`), or with ``clip`` the
    range shrunk toward its middle by the factor of :data:`CLIP_FACTORS` whose codes give ``x`` back
    with the least squared error (summed where ``mask``, when given, is 1: the valid elements; of
    equal errors the first factor)."""
    scale, zero = minmax_params(low, high, bits)
    if not clip:
        return scale, zero
    low, high = low.float(), high.float()
    mid = (low + high) / 2
    if x.numel() * len(CLIP_FACTORS) <= CLIP_BATCH_ELEMENTS:
        return _searched_at_once(x, low, mid, high, (scale, zero), bits, dim, mask)
    best = None
    for factor in CLIP_FACTORS:
        if factor != 1.0:
            s, z = minmax_params(mid - (mid - low) * factor, mid + (high - mid) * factor, bits)
        else:
            s, z = scale, zero
        error = _clip_error(x, s.unsqueeze(dim), z.unsqueeze(dim), bits, dim, mask)
        if best is None:
            best, scale, zero = error, s, z
            continue
        better = error < best
        best = torch.where(better, error, best)
        scale, zero = torch.where(better, s, scale), torch.where(better, z, zero)
    return scale, zero


def _clip_error(x: Tensor, scale: Tensor, zero: Tensor, bits: int, dim: int, mask: Tensor | None) -> Tensor:
    """Squared error of ``x`` given back by the grid ``(scale, zero)``, summed along ``dim``."""
    error = (dequantize_minmax(quantize_minmax(x, scale, zero, bits), scale, zero, torch.float32) - x.float()).square()
    return (error if mask is None else error * mask).sum(dim)


def _searched_at_once(
    x: Tensor,
    low: Tensor,
    mid: Tensor,
    high: Tensor,
    minmax: tuple[Tensor, Tensor],
    bits: int,
    dim: int,
    mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`group_params`'s search with every factor of :data:`CLIP_FACTORS` along a new leading
    dimension: the same grids as one factor at a time (``minmax``: the factor 1's, from the range
    itself)."""
    factors = torch.tensor(CLIP_FACTORS, dtype=torch.float32, device=low.device).reshape(-1, *([1] * low.dim()))
    scales, zeros = minmax_params(mid - (mid - low) * factors, mid + (high - mid) * factors, bits)
    whole = CLIP_FACTORS.index(1.0)
    scales[whole], zeros[whole] = minmax
    axis = dim % x.dim() + 1  # dim in the candidates' shape
    error = _clip_error(x.unsqueeze(0), scales.unsqueeze(axis), zeros.unsqueeze(axis), bits, axis, mask)
    pick = error.argmin(0, keepdim=True)  # the first of equal errors, as the loop keeps it
    return scales.gather(0, pick).squeeze(0), zeros.gather(0, pick).squeeze(0)
