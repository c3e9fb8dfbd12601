"""Integer codes of 8, 4, 3 and 2 bits packed into bytes (eight codes in ``bits`` bytes), and read back.

4 and 2 bits are packed by planes, so that each plane unpacks as one contiguous block; 3 bits
little-endian, eight codes in three bytes. The quantized storage (:mod:`kvfold.runtime.quantize`)
packs its codes with :func:`pack_codes`; the attention over codes
(:mod:`kvfold.runtime.quantized_attention`, :mod:`kvfold.runtime.triton_attention` and the C
kernels) reads them in this layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT_BITS = (8, 4, 3, 2)
"""Widths of the integer formats."""


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes ``(..., n)`` (each < 2**bits, n a multiple of 8) into ``(..., n·bits/8)`` bytes.

    4 and 2 bits are packed by planes: byte ``j`` holds codes ``j``, ``j + n/p``, … (``p = 8/bits``
    codes a byte), code ``k·n/p + j`` at bit ``k·bits``, so each plane unpacks as one contiguous
    block (:func:`code_planes`). 3 bits: eight codes in three bytes, code ``i`` at bit ``3i``.
    """
    if bits not in INT_BITS:
        raise ValueError(f"bits must be one of {INT_BITS}")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    *lead, n = codes.shape
    if n % 8:
        raise ValueError(f"pack_codes needs a multiple of 8 codes per row; got {n}")
    if 8 % bits == 0:
        per = 8 // bits
        planes = codes.reshape(*lead, per, n // per)
        out = planes[..., 0, :].clone()
        for i in range(1, per):
            out |= planes[..., i, :] << (i * bits)
        return out
    grouped = codes.reshape(*lead, n // 8, 8).to(torch.int32)
    word = grouped[..., 0].clone()
    for i in range(1, 8):
        word |= grouped[..., i] << (i * bits)
    shifts = torch.arange(0, 8 * bits, 8, device=codes.device, dtype=torch.int32)
    return ((word[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(*lead, n // 8 * bits)


def unpack_codes(packed: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``(..., n·bits/8)`` bytes to ``(..., n)`` uint8 codes."""
    if bits == 8:
        return packed
    *lead, m = packed.shape
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        return torch.cat(code_planes(packed, bits), -1)
    grouped = packed.reshape(*lead, m // bits, bits).to(torch.int32)
    word = grouped[..., 0].clone()
    for j in range(1, bits):
        word |= grouped[..., j] << (8 * j)
    shifts = torch.arange(0, 8 * bits, bits, device=packed.device, dtype=torch.int32)
    return ((word[..., None] >> shifts) & mask).to(torch.uint8).reshape(*lead, m // bits * 8)


def code_planes(packed: Tensor, bits: int) -> list[Tensor]:
    """The code planes of bytes packed by :func:`pack_codes` (4 or 2 bits): ``8/bits`` uint8 tensors
    ``(..., m)``, plane ``k`` holding codes ``k·m … (k+1)·m − 1`` of each row (8 and 3 bits: one
    plane, every code)."""
    if bits == 8:
        return [packed]
    if 8 % bits:
        return [unpack_codes(packed, bits)]
    mask = (1 << bits) - 1
    return [(packed >> (k * bits)) & mask if k else packed & mask for k in range(8 // bits)]
