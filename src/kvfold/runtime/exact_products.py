"""Matrix products of 16-bit operands summed in float32: the products a float32 upcast gives, at a 16-bit rate.

A product of two bfloat16 (or two float16) numbers is exact in float32, so multiplying 16-bit operands with
float32 sums gives what converting them to float32 first gives, up to the order of the sums. On a GPU the
first runs on tensor cores and the second does not: an H200 multiplies float32 at about 67 TFLOP/s, and
bfloat16 with float32 sums at about 990. Attention Matching's fits on a GPU (Zweiger et al. 2026, App. A.2)
form their logits ``s·Q Kᵀ`` from the repeat pass's 16-bit queries and the cache's 16-bit keys, once over
every entry for the targets and once over the kept keys for the features: about a third of the fits'
products at Llama-3.1-8B's shape (counted at 1K–4K tokens; the rest multiply float32 features).

:func:`float32_bmm` takes CUDA's ``torch.bmm(…, out_dtype=torch.float32)``; on other devices (the CPU only
under :data:`FORCED`, which tests and benchmarks set) it converts the operands to float32 first, the same
products. :func:`applies` says where callers keep their operands in 16 bits: CUDA, two or more operands of
one 16-bit dtype, and the device's product checked once against the float32 upcast on a small problem
(:data:`STATUS`; ``kvfold bench`` records :func:`products_path`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvfold.runtime.device_checks import checked_once, error_line, status_key

OPERAND_DTYPES = (torch.float16, torch.bfloat16)
"""Operands multiplied as they are, with float32 sums."""

FORCED: bool | None = None
"""None: :func:`applies` says what the device offers; True or False: whatever it offers (tests on the CPU, and
a GPU benchmark timing both paths in one process)."""

STATUS: dict[str, str] = {}
"""Per device and dtype (``"cuda:0 torch.bfloat16"``), what :func:`check` found: ``"exact"``, or why not."""


def float32_bmm(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` ``(P, n, m)`` in float32 from 16-bit ``a`` ``(P, n, k)`` and ``b`` ``(P, k, m)`` of one dtype:
    float32 sums of exact products (CUDA's ``out_dtype``), else the operands converted to float32 first."""
    if a.device.type == "cuda":
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def applies(*operands: Tensor) -> bool:
    """Whether the caller may keep ``operands`` in 16 bits and multiply them by :func:`float32_bmm`: all of one
    16-bit dtype, and CUDA with its product found right (checked once a device and dtype, :data:`STATUS`),
    unless :data:`FORCED` says otherwise."""
    dtype = operands[0].dtype
    if dtype not in OPERAND_DTYPES or any(t.dtype != dtype for t in operands):
        return False
    if FORCED is not None:
        return FORCED
    device = operands[0].device
    if device.type != "cuda":
        return False
    return checked_once(STATUS, device, dtype, lambda: check(device, dtype)) == "exact"


def check(device: torch.device, dtype: torch.dtype) -> str:
    """``"exact"`` when :func:`float32_bmm` of 16-bit operands on ``device`` gives the float32 upcast's products
    on a small problem (3 × 70 × 128 by 128 × 300) within 1e-5 of their scale, else why not."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 70, 128, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(3, 300, 128, generator=gen).to(device=device, dtype=dtype).mT
    try:
        got = float32_bmm(a, b)
    except Exception as err:  # noqa: BLE001 - a library's or a driver's error, whatever its class
        return f"float32 products (the 16-bit product failed: {type(err).__name__}: {error_line(err)})"
    want = torch.bmm(a.float(), b.float())
    if got.dtype != torch.float32 or got.shape != want.shape:
        return f"float32 products (the 16-bit product gave {got.dtype} {tuple(got.shape)})"
    off = float((got - want).abs().max() / want.abs().max())
    if not off <= 1e-5:  # the sums' order moves these by about 1e-7 of their scale; 16-bit sums by 1e-3
        return f"float32 products (the 16-bit product is off by {off:.3g} of its scale)"
    return "exact"


def products_path(device: torch.device, dtype: torch.dtype) -> str:
    """How products of ``dtype`` operands are taken on ``device``: ``"16-bit operands, float32 sums"``, or
    ``"float32 products (why)"``."""
    if dtype not in OPERAND_DTYPES:
        return f"float32 products ({dtype} operands)"
    if FORCED is not None:
        return "16-bit operands, float32 sums" if FORCED else "float32 products (forced)"
    if device.type != "cuda":
        return f"float32 products (on {device.type})"
    status = STATUS.get(status_key(device, dtype), "float32 products (not checked on this device yet)")
    return "16-bit operands, float32 sums" if status == "exact" else status
