"""Attention over the quantized entries of a folded layer, read from their codes.

The entries are stored ragged (:class:`~kvfold.runtime.quantize.QuantizedRows`: every row's entries
one after another, KIVI's axes, Liu et al. 2024 §3): keys per channel over groups of entries,
values per entry. Two paths compute the same thing (both are tested against a float64 reference):

* **the compiled kernel** (:mod:`kvfold.runtime.native`, on the CPU, 8-, 4-, 3- and 2-bit codes
  without outlier entries, head sizes multiples of 16): a block of entries at a time on the serving
  kernel's blocks (``kernels/attend_blocks.h``), a key group's scales folded into the queries
  (``q · k = codes · (q ⊙ s) + q · z``), a value's scale into its probability;
* **PyTorch** (:func:`attend_stored_torch`, everywhere else): the rows are read in pages, one a key
  group (:mod:`kvfold.runtime.pages`, built once for the rows and kept with them): each page's codes
  are gathered and its keys dequantized with the page's scales, its logits computed against its row's
  queries, and the pages of a row merged by their maximum logit; the values are never dequantized: an
  output is ``(p ⊙ s_v) · codes_v + p · z_v``. A fixed number of batched operations a layer, and no
  value read back to the host (on a GPU nothing waits for the device).

Rows that store their values rotated (``QuantConfig.rotate``, :mod:`kvfold.runtime.value_rotation`)
are read the same way; their part's weighted values are rotated back before the tail is merged.

Nothing but the page index outlives the call: codes are converted to numbers one layer at a time, freed after.
"""

from __future__ import annotations

import torch

from kvfold.runtime.codes import code_planes
from kvfold.runtime.native import ERRORS, attend_codes_kernel
from kvfold.runtime.pages import empty_part, gather_pages, page_logits, page_softmax, sum_pages
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import FloatRows, float_part
from kvfold.runtime.triton_attention import stored_part_triton, triton_applies
from kvfold.runtime.value_rotation import rotate_back

Tensor = torch.Tensor


def reads_codes(stored: QuantizedRows | FloatRows) -> bool:
    """Whether :func:`stored_part` reads this storage as it lies, a page at a time: every storage does
    (rows at full precision, integer codes, fp8, value groups within an entry); before 2026-11-28 fp8
    and value groups were dequantized into padded rows at every step."""
    return isinstance(stored, (FloatRows, QuantizedRows))


def attend_stored(
    queries: Tensor, tail_logits: Tensor, tail_values: Tensor, stored: QuantizedRows, scaling: float
) -> Tensor:
    """Attention of the folded queries over each row's stored entries and its full-precision tail:
    by the compiled kernel (:mod:`kvfold.runtime.native`) where it applies, else
    :func:`attend_stored_torch` (the same computation in PyTorch operations)."""
    kernel = attend_codes_kernel() if native_applies(queries, stored) else None
    if kernel is None:
        return attend_stored_torch(queries, tail_logits, tail_values, stored, scaling)
    part = _rotated_back(stored, _stored_part_native(kernel, queries, stored, scaling))
    return _with_tail(*part, tail_logits, tail_values)


def stored_part(queries: Tensor, stored: QuantizedRows | FloatRows, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """The stored part of :func:`attend_stored` alone, by the kernel where it applies: each row's
    maximum logit ``(R, M)`` (−inf for an empty row), its weights' sum ``(R, M)`` and weighted values
    ``(R, M, Dv)`` relative to it. Parts of one row's pieces merge by log-sum-exp, and
    :func:`merge_with_tail` adds the row's tail. On a GPU the Triton kernel reads the rows it applies
    to (:mod:`kvfold.runtime.triton_attention`); otherwise rows at full precision are read by
    :func:`~kvfold.runtime.rows.float_part`, and codes by the CPU's C kernel or PyTorch."""
    if triton_applies(queries, stored):
        part = stored_part_triton(queries, stored, scaling)
    elif isinstance(stored, FloatRows):
        return float_part(queries, stored, scaling)
    else:
        kernel = attend_codes_kernel() if native_applies(queries, stored) else None
        if kernel is None:
            part = _stored_part_torch(queries, stored, scaling)
        else:
            part = _stored_part_native(kernel, queries, stored, scaling)
    return part if isinstance(stored, FloatRows) else _rotated_back(stored, part)


def _rotated_back(stored: QuantizedRows, part: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """A stored part whose weighted values are back in the values' own coordinates: rotated back
    (:func:`~kvfold.runtime.value_rotation.rotate_back`, one ``Dv × Dv`` product) where the rows store
    rotated values (``QuantConfig.rotate``); attention is linear in the values."""
    if not stored.config.rotate:
        return part
    top, den, num = part
    return top, den, rotate_back(num).to(num.dtype)


def merge_with_tail(top: Tensor, den: Tensor, num: Tensor, tail_logits: Tensor, tail_values: Tensor) -> Tensor:
    """The softmax over a stored part (:func:`stored_part`) and each row's full-precision tail."""
    return _with_tail(top, den, num, tail_logits, tail_values)


def _with_tail(top: Tensor, den: Tensor, num: Tensor, tail_logits: Tensor, tail_values: Tensor) -> Tensor:
    """The softmax over each row's stored part and its tail: the stored part as its maximum logit
    ``top`` ``(R, M)`` (−inf for an empty row), its weights' sum ``den`` and weighted values ``num``
    ``(R, M, Dv)`` relative to it; each part rescaled to the larger maximum, then normalized."""
    new_top = torch.maximum(tail_logits.amax(-1), top)
    weights_of_tail = (tail_logits - new_top[..., None]).exp_()
    stored_shift = (top - new_top).exp_()
    out = torch.baddbmm(num * stored_shift[..., None], weights_of_tail, tail_values)
    return out.div_(torch.addcmul(weights_of_tail.sum(-1), den, stored_shift)[..., None])


def native_applies(queries: Tensor, stored: QuantizedRows) -> bool:
    """Whether the compiled kernel can read these rows: float32 queries on the CPU, codes of 8, 4, 3
    or 2 bits with one value scale an entry, no full-precision outlier entries, head sizes that are
    multiples of 16 (every model family kvfold supports has them), outside a step that
    ``torch.compile`` traces (it compiles the PyTorch path; a ctypes call would break its graph)."""
    return (
        queries.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and queries.dtype == torch.float32
        and not stored.config.is_float
        and not stored.config.value_group
        and stored.config.bits in (8, 4, 3, 2)
        and not stored.outlier_index.numel()
        and stored.head_dim <= 1024
        and stored.value_dim <= 1024
        and stored.head_dim % 16 == 0
        and stored.value_dim % 16 == 0
        and queries.shape[1] <= 256
    )


def _stored_part_native(
    kernel, queries: Tensor, stored: QuantizedRows, scaling: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The stored part by the compiled kernel: each row's maximum logit ``(R, M)``, its sum of
    probabilities relative to it ``(R, M)`` and their values' sum ``(R, M, Dv)``."""
    rows, m, dim = queries.shape
    queries = queries.contiguous()
    lengths = stored.lengths.to(torch.int64).contiguous()
    f32 = torch.float32
    key_scale, key_zero = stored.key_scale.to(f32).contiguous(), stored.key_zero.to(f32).contiguous()
    value_scale = stored.value_scale[:, 0].to(f32).contiguous()
    value_zero = stored.value_zero[:, 0].to(f32).contiguous()
    beta = None if stored.log_mass is None else stored.log_mass.to(f32).contiguous()
    key_codes, value_codes = stored.key_codes.contiguous(), stored.value_codes.contiguous()
    top, den = queries.new_empty(rows, m), queries.new_empty(rows, m)
    num = queries.new_empty(rows, m, stored.value_dim)
    bits = stored.config.bits
    widths = max(1, dim * bits // 8), max(1, stored.value_dim * bits // 8)
    per_entry = [key_codes.numel() // widths[0], value_codes.numel() // widths[1]]
    per_entry += [value_scale.numel(), value_zero.numel()] + ([] if beta is None else [beta.numel()])
    groups = min(key_scale.numel(), key_zero.numel()) // max(1, dim)  # what the buffers hold: read no further
    code = kernel(
        rows, m, dim, stored.value_dim, bits, stored.config.key_group, min(per_entry), groups,
        lengths.data_ptr(), key_codes.data_ptr(), key_scale.data_ptr(), key_zero.data_ptr(),
        value_codes.data_ptr(), value_scale.data_ptr(), value_zero.data_ptr(),
        0 if beta is None else beta.data_ptr(), queries.data_ptr(), scaling,
        top.data_ptr(), den.data_ptr(), num.data_ptr(),
    )  # fmt: skip
    if code:
        why = ERRORS.get(code, "unknown")
        raise RuntimeError(f"the quantized-attention kernel refused its arguments (code {code}: {why})")
    return top, den, num


def attend_stored_torch(
    queries: Tensor, tail_logits: Tensor, tail_values: Tensor, stored: QuantizedRows, scaling: float
) -> Tensor:
    """Attention of the folded queries over each row's stored entries and its full-precision tail.

    Args:
        queries: ``(R, M, D)``: row ``r``'s ``M`` queries (its GQA group's heads × new tokens), in
            the accumulation dtype (float32 or wider).
        tail_logits: ``(R, M, n)``: their scaled logits over the row's tail (β added, the new tokens'
            future masked with −inf; every query sees at least its own token).
        tail_values: ``(R, n, Dv)``: the tail's values, in the queries' dtype.
        stored: the quantized rows (``R`` of them): :func:`reads_codes` must hold.
        scaling: the logit scale.

    Returns:
        ``(R, M, Dv)``: ``softmax([q·k·scaling + β, tail_logits]) · [values, tail_values]``.
    """
    return _with_tail(*_rotated_back(stored, _stored_part_torch(queries, stored, scaling)), tail_logits, tail_values)


def _stored_part_torch(queries: Tensor, stored: QuantizedRows, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """What the kernel computes, in batched PyTorch operations over the rows' pages
    (:attr:`QuantizedRows.pages`: one a key group for integer codes): each row's maximum stored logit
    ``(R, M)``, and relative to it the sum of its weights ``(R, M)`` and of its weighted values
    ``(R, M, Dv)``, for every format.

    A fixed number of operations a layer whatever the rows' lengths, and no value read back to the host
    (on a GPU nothing waits): each page's codes are gathered and its keys dequantized with the page's
    scales (:func:`_page_keys`); integer values with one scale an entry are never dequantized
    (:func:`_page_values_part`)."""
    pages = stored.pages
    if not pages.count:
        return empty_part(queries, stored.value_dim)
    top, weights = page_softmax(page_logits(queries, pages, _page_keys(stored, queries.dtype), scaling), pages)
    return top, sum_pages(pages, weights.sum(-1)), sum_pages(pages, _page_values_part(stored, weights))


def _page_keys(stored: QuantizedRows, acc: torch.dtype) -> Tensor:
    """Every page's keys ``(P, S, D)`` in ``acc``: codes times the page's scales plus its zero points
    (fp8: times the row's scale), full-precision entries as they are."""
    pages, cfg = stored.pages, stored.config
    if cfg.is_float:
        keys = gather_pages(pages, stored.key_codes).view(torch.float8_e4m3fn).to(acc)
        keys.mul_(stored.key_scale.to(acc).index_select(0, pages.row)[:, :, None])
    else:
        keys = _codes(gather_pages(pages, stored.key_codes), cfg.bits, acc)
        keys.mul_(stored.key_scale.to(acc)[:, None, :]).add_(stored.key_zero.to(acc)[:, None, :])
    if stored.outlier_index.numel():
        keys.view(-1, keys.shape[-1]).index_copy_(0, stored.outlier_slots, stored.outlier_keys.to(acc))
    return keys


def _page_values_part(stored: QuantizedRows, weights: Tensor) -> Tensor:
    """Each page's weighted values ``(P, M, Dv)``, the weights ``(P, M, S)``. Integer codes with one
    scale an entry are not dequantized: ``(p ⊙ s) · codes + p · z`` (a full-precision entry's own
    values with scale 1 and zero 0); fp8 and value groups within an entry are dequantized a page at a
    time."""
    pages, cfg, acc = stored.pages, stored.config, weights.dtype
    slots = stored.outlier_slots if stored.outlier_index.numel() else None
    if cfg.is_float:
        values = gather_pages(pages, stored.value_codes).view(torch.float8_e4m3fn).to(acc)
        values.mul_(stored.value_scale.to(acc).index_select(0, pages.row)[:, :, None])
    else:
        values = _codes(gather_pages(pages, stored.value_codes), cfg.bits, acc)  # (P, S, Dv)
    if cfg.is_float or cfg.value_group:
        if cfg.value_group:
            grouped = values.view(pages.count, pages.size, stored.value_scale.shape[-1], -1)
            grouped.mul_(gather_pages(pages, stored.value_scale, acc)[..., None])
            grouped.add_(gather_pages(pages, stored.value_zero, acc)[..., None])
        if slots is not None:
            values.view(-1, values.shape[-1]).index_copy_(0, slots, stored.outlier_values.to(acc))
        return torch.bmm(weights, values)
    value_scale = gather_pages(pages, stored.value_scale[:, 0], acc)  # (P, S)
    value_zero = gather_pages(pages, stored.value_zero[:, 0], acc)
    if slots is not None:  # full-precision entries: their own values · 1 + 0
        values.view(-1, values.shape[-1]).index_copy_(0, slots, stored.outlier_values.to(acc))
        value_scale.view(-1).index_fill_(0, slots, 1.0)
        value_zero.view(-1).index_fill_(0, slots, 0.0)
    # Σ p·s·c + Σ p·z: the zero points' sum broadcast over the channels
    return torch.baddbmm(torch.bmm(weights, value_zero[:, :, None]), weights * value_scale[:, None, :], values)


def _codes(packed: Tensor, bits: int, dtype: torch.dtype) -> Tensor:
    """Packed codes ``(..., ·)`` as numbers ``(..., D)`` in ``dtype``, plane by plane."""
    planes = code_planes(packed, bits)
    if len(planes) == 1:
        return planes[0].to(dtype)
    width = planes[0].shape[-1]
    out = torch.empty(*packed.shape[:-1], width * len(planes), dtype=dtype, device=packed.device)
    for k, plane in enumerate(planes):
        out[..., k * width : (k + 1) * width] = plane
    return out
