"""The stored part of attention in two Triton kernels a layer: ragged rows, β, and integer codes read in place.

What :func:`kvfold.runtime.quantized_attention.stored_part` computes for a layer's stored rows (each row's
maximum logit, and relative to it its weights' sum and weighted values; merged with the dense tail by
log-sum-exp afterwards), fused. The rows' pages (:mod:`kvfold.runtime.pages`: one key group a page for
integer codes, 32 entries for rows at full precision) are cut into splits of a few consecutive pages of
one row (:class:`~kvfold.runtime.pages.PageSplits`, about :data:`~kvfold.runtime.pages.SPLIT_PROGRAMS` a
layer). One program a split and block of its row's queries walks the split's pages, reads each page's
codes where they lie, unpacks them (8 bits; 4 and 2 bits by planes; 3 bits, eight codes in three bytes:
:func:`kvfold.runtime.codes.pack_codes`), applies the page's key scales and zero points and each entry's
value scale and zero point, adds β, and keeps one running softmax over the pages (online softmax,
Milakov & Gimelshein 2018; the order of FlashAttention, Dao et al. 2022 §3.1). A second kernel merges
each row's splits by their maximum logits (split-K decoding, FlashDecoding: Dao et al. 2023). Nothing
is dequantized into memory and nothing is read back to the host.

Why splits: a decode step has ``B × H`` rows a layer (8 at batch 1 of Llama-3.1-8B's layout) and a global
ranking such as KVzip's keeps almost every entry of some heads, so one program a row would leave all
but a few of a GPU's multiprocessors idle while one of them walks the longest row's pages one after
another. Cut into splits, the longest chain of pages a program walks is a split's, and a layer's pages
are spread over a few hundred programs.

The PyTorch path over pages launches a few dozen kernels a layer and writes each page's dequantized keys
and values to memory; on a GPU a decode step is bound by those launches (docs/benchmarks.md, "On a GPU").
These kernels are two launches a layer, and under a compiled decode (:mod:`kvfold.pipeline.compiled_decode`)
part of its graph.

:func:`triton_applies` says where a decode takes it: CUDA tensors, and rows it reads (:func:`reads_rows`):
integer codes of 8, 4, 3 or 2 bits with one value scale
an entry and no full-precision outlier entries, or rows at full precision; key groups and head
dimensions of at least 16 (``tl.dot``'s smallest block), key groups of a power of two. Other rows (fp8,
value groups, outliers, key groups of 48 entries) are read by the PyTorch path, and ``kvfold bench``
records which path a decode took. On the CPU the tests run the kernel under Triton's interpreter
(``TRITON_INTERPRET=1`` set before Triton is imported).
"""

from __future__ import annotations

import importlib.util
import os

from torch import Tensor

from kvfold.runtime.pages import empty_part, split_pages
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import FloatRows

INTERPRET_ENV = "TRITON_INTERPRET"
"""``TRITON_INTERPRET=1``: Triton runs its kernels with NumPy on the host (CPU tensors), for tests."""

MIN_BLOCK = 16
"""``tl.dot``'s smallest dimension: pages, head dimensions and query blocks are at least this."""

QUERY_BLOCK = MIN_BLOCK
"""Queries a program takes: a decode step's GQA group (4 of Llama-3.1-8B's heads) fits one block, and a
longer question's queries are cut into blocks of 16. Blocks of 32 or 64 queries read a split's pages
fewer times, but under Triton 3.6 (the GPU machine's) they spill registers at a head dimension of 128
in every variant (``tools/triton_targets.py``)."""

PAGE_PART = 32
"""Entries the kernel reads at once: a page (a key group) of 64 entries is read in two parts. Whole pages
of 64 spill registers under Triton 3.6 (``tools/triton_targets.py``)."""

LAUNCH = {"num_warps": 8, "num_stages": 1}
"""How both kernels are launched. Compiled for an H200 (``tools/triton_targets.py``, no GPU needed), the
page loop under Triton's default launch (4 warps, software pipelining over 3 stages) holds 255 registers
a thread and spills 180–1,930 bytes a thread to memory at a head dimension of 128, under Triton 3.6 and
3.9; one stage and 8 warps hold 71–206 and spill nothing, in every variant. A split walks a few pages,
so loads are overlapped by the programs in flight, not by stages within one."""


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
    4, 3 or 2 bits with one value scale an entry and no full-precision outliers, key groups of a power of
    two and head dimensions of at least :data:`MIN_BLOCK`."""
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
        and cfg.key_group & (cfg.key_group - 1) == 0  # a page is whole parts of a power of two (tl.arange)
        and not stored.outlier_index.numel()
    )


def stored_part_triton(
    queries: Tensor, stored: QuantizedRows | FloatRows, scaling: float, per_split: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """The stored part of the rows (:func:`~kvfold.runtime.quantized_attention.stored_part`) by the kernels:
    every split of the rows' pages at once, then each row's splits merged (module docstring).

    Args:
        queries: ``(R, M, D)`` float32, row ``r``'s ``M`` queries (its GQA group's heads × new tokens).
        stored: the rows (:func:`triton_applies` must hold).
        scaling: the logit scale.
        per_split: pages a split holds at most; None: the rows' own splits
            (:attr:`~kvfold.runtime.pages.RowPages.splits`, built once and kept).

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
    from kvfold.runtime.triton_kernels import merge_splits_kernel, stored_part_kernel  # imports Triton, here only

    rows, m, d = queries.shape
    dv = stored.value_dim
    queries = queries.contiguous()
    splits = pages.splits if per_split is None else split_pages(pages, per_split)
    split_top = queries.new_empty(splits.count, m)
    split_den = queries.new_empty(splits.count, m)
    split_num = queries.new_empty(splits.count, m, dv)
    block_m = QUERY_BLOCK
    block_dv = block_size(dv)
    query_blocks = -(-m // block_m)
    if isinstance(stored, FloatRows):
        keys, values = stored.keys, stored.values
        key_scale = key_zero = value_scale = value_zero = keys  # unread when FLOAT
        bits, key_bytes, value_bytes = 16, d, dv
    else:
        keys, values = stored.key_codes, stored.value_codes
        key_scale, key_zero = stored.key_scale, stored.key_zero
        value_scale, value_zero = stored.value_scale[:, 0].contiguous(), stored.value_zero[:, 0].contiguous()
        bits, key_bytes, value_bytes = stored.config.bits, keys.shape[-1], values.shape[-1]
    stored_part_kernel[(splits.count, query_blocks)](
        queries, splits.row, splits.start, splits.end, pages.slots, pages.bias,
        keys, values, key_scale, key_zero, value_scale, value_zero,
        split_top, split_den, split_num,
        m, d, dv, key_bytes, value_bytes, float(scaling),
        BITS=bits, SIZE=pages.size, PART=min(pages.size, PAGE_PART), BLOCK_M=block_m,
        BLOCK_D=block_size(d), BLOCK_DV=block_dv, **LAUNCH,
    )  # fmt: skip
    top = queries.new_empty(rows, m)
    den = queries.new_empty(rows, m)
    num = queries.new_empty(rows, m, dv)
    merge_splits_kernel[(rows, query_blocks)](
        split_top, split_den, split_num, splits.first_split, top, den, num, m, dv,
        BLOCK_M=block_m, BLOCK_DV=block_dv, **LAUNCH,
    )  # fmt: skip
    return top, den, num


def block_size(n: int) -> int:
    """A kernel's block over ``n`` channels: the next power of two, at least :data:`MIN_BLOCK` (``tl.arange``
    takes powers of two; ``tl.dot`` blocks of at least 16)."""
    return max(MIN_BLOCK, 1 << max(0, (int(n) - 1).bit_length()))
