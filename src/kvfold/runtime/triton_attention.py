"""The stored part of attention in one Triton kernel a layer: ragged rows, β, and integer codes read in place.

What :func:`kvfold.runtime.quantized_attention.stored_part` computes for a layer's stored rows (each row's
maximum logit, and relative to it its weights' sum and weighted values; merged with the dense tail by
log-sum-exp afterwards), fused: one program a row (batch × KV head) and block of its queries walks the
row's pages (:mod:`kvfold.runtime.pages`: one key group a page for integer codes, 32 entries for rows at
full precision), reads each page's codes where they lie, unpacks them (8 bits; 4 and 2 bits by planes;
3 bits, eight codes in three bytes: :func:`kvfold.runtime.codes.pack_codes`), applies the page's key
scales and zero points and each entry's value scale and zero point, adds β, and keeps one running
softmax over the pages (online softmax, Milakov & Gimelshein 2018; the order of FlashAttention, Dao et
al. 2022 §3.1). Nothing is dequantized into memory and nothing is read back to the host.

The PyTorch path over pages launches a few dozen kernels a layer and writes each page's dequantized keys
and values to memory; on a GPU a decode step is bound by those launches (docs/gpu.md). This kernel is
one launch a layer, and under a compiled decode (:mod:`kvfold.pipeline.compiled_decode`) part of its
graph.

:func:`triton_applies` says where a decode takes it: CUDA tensors, and rows it reads (:func:`reads_rows`):
integer codes of 8, 4, 3 or 2 bits with one value scale
an entry and no full-precision outlier entries, or rows at full precision; key groups and head
dimensions of at least 16 (``tl.dot``'s smallest block). Other rows (fp8, value groups, outliers) are
read by the PyTorch path, and ``kvfold bench`` records which path a decode took. On the CPU the tests
run the kernel under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

from kvfold.runtime.pages import empty_part
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import FloatRows

INTERPRET_ENV = "TRITON_INTERPRET"
"""``TRITON_INTERPRET=1``: Triton runs its kernels with NumPy on the host (CPU tensors), for tests."""

MIN_BLOCK = 16
"""``tl.dot``'s smallest dimension: pages, head dimensions and query blocks are at least this."""


def available() -> bool:
    """Whether Triton is installed (it comes with CUDA builds of torch; ``pip install triton`` elsewhere)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs its kernels on the host (``TRITON_INTERPRET=1``)."""
    return os.environ.get(INTERPRET_ENV, "0") not in ("", "0")


def triton_applies(queries: Tensor, stored: QuantizedRows | FloatRows) -> bool:
    """Whether the kernel reads these rows in a decode step: CUDA queries, Triton installed, and rows it
    reads (:func:`reads_rows`)."""
    return queries.device.type == "cuda" and available() and reads_rows(stored)


def reads_rows(stored: QuantizedRows | FloatRows) -> bool:
    """Whether the kernel reads ``stored`` (module docstring): rows at full precision, or integer codes of 8,
    4, 3 or 2 bits with one value scale an entry and no full-precision outliers, key groups and head
    dimensions of at least :data:`MIN_BLOCK`."""
    if stored.head_dim < MIN_BLOCK or stored.value_dim < MIN_BLOCK:
        return False
    if isinstance(stored, FloatRows):
        return True
    cfg = stored.config
    return (
        not cfg.is_float
        and not cfg.value_group
        and cfg.bits in (8, 4, 3, 2)
        and cfg.key_group >= MIN_BLOCK
        and not stored.outlier_index.numel()
    )


def stored_part_triton(
    queries: Tensor, stored: QuantizedRows | FloatRows, scaling: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The stored part of the rows (:func:`~kvfold.runtime.quantized_attention.stored_part`) by the kernel.

    Args:
        queries: ``(R, M, D)`` float32, row ``r``'s ``M`` queries (its GQA group's heads × new tokens).
        stored: the rows (:func:`triton_applies` must hold).
        scaling: the logit scale.

    Returns:
        ``(top (R, M), den (R, M), num (R, M, Dv))`` float32: each row's maximum logit (−inf for a row
        without entries), its weights' sum and weighted values relative to it.
    """
    if not reads_rows(stored):
        raise ValueError("stored_part_triton(): the kernel does not read these rows (see reads_rows)")
    if queries.device.type != "cuda" and not interpreted():
        raise ValueError(f"stored_part_triton() runs on CUDA, or with {INTERPRET_ENV}=1 set before Triton is imported")
    pages = stored.pages
    if not pages.count:
        return empty_part(queries, stored.value_dim)
    from kvfold.runtime.triton_kernels import stored_part_kernel  # imports Triton, here only

    rows, m, d = queries.shape
    dv = stored.value_dim
    queries = queries.contiguous()
    top = queries.new_empty(rows, m)
    den = queries.new_empty(rows, m)
    num = queries.new_empty(rows, m, dv)
    first_page = pages.first_page
    block_m = max(MIN_BLOCK, min(64, _next_power_of_two(m)))
    grid = (rows, -(-m // block_m))
    if isinstance(stored, FloatRows):
        keys, values = stored.keys, stored.values
        key_scale = key_zero = value_scale = value_zero = keys  # unread when FLOAT
        bits, key_bytes, value_bytes = 16, d, dv
    else:
        keys, values = stored.key_codes, stored.value_codes
        key_scale, key_zero = stored.key_scale, stored.key_zero
        value_scale, value_zero = stored.value_scale[:, 0].contiguous(), stored.value_zero[:, 0].contiguous()
        bits, key_bytes, value_bytes = stored.config.bits, keys.shape[-1], values.shape[-1]
    stored_part_kernel[grid](
        queries, first_page, pages.slots, pages.bias,
        keys, values, key_scale, key_zero, value_scale, value_zero,
        top, den, num,
        m, d, dv, key_bytes, value_bytes, float(scaling),
        BITS=bits, SIZE=pages.size, BLOCK_M=block_m,
        BLOCK_D=max(MIN_BLOCK, _next_power_of_two(d)), BLOCK_DV=max(MIN_BLOCK, _next_power_of_two(dv)),
    )  # fmt: skip
    return top, den, num


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
