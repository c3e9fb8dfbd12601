"""Checks of quantized rows' tensors read from an untrusted cache file, before anything reads them.

A cache file's checksum proves that it was not damaged by accident, not that it is safe to read
(docs/faults.md, "Untrusted cache files"): the quantized attention reads codes, scales and row
lengths by index, so :func:`check_quantized_tensors` refuses tensors that contradict their format
(:class:`~kvfold.runtime.quant_config.QuantConfig`) or each other, shapes before values, with a
:class:`QuantizedTensorsError` naming the tensor at fault.
:meth:`kvfold.runtime.quantize.QuantizedRows.from_tensors` runs it, and :mod:`kvfold.store.validate`
runs it and :func:`check_tensor` on every tensor of a file.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kvfold.runtime.errors import UserError
from kvfold.runtime.quant_config import QuantConfig


class QuantizedTensorsError(UserError):
    """Tensors of quantized rows that contradict their format or each other (a damaged or crafted
    cache file). ``tensor`` names the one at fault (``key_scale``), ``problem`` says what is wrong."""

    def __init__(self, tensor: str, problem: str) -> None:
        super().__init__(f"{tensor}: {problem}")
        self.tensor = tensor
        self.problem = problem


def _shape_text(shape: tuple[int, ...] | torch.Size) -> str:
    return "(" + ", ".join(str(int(n)) for n in shape) + ")"


def check_tensor(
    name: str, tensor: Tensor, shape: tuple[int, ...], dtype: torch.dtype, error: type[Exception] | None = None
) -> None:
    """Refuse ``tensor`` unless it has exactly ``dtype`` and ``shape`` (read from its metadata only).

    Raises:
        QuantizedTensorsError: (or ``error(name, problem)``) naming the tensor and what was expected.
    """
    make = error or QuantizedTensorsError
    if tensor.dtype != dtype:
        raise make(
            name, f"dtype {str(tensor.dtype).replace('torch.', '')}, expected {str(dtype).replace('torch.', '')}"
        )
    if tuple(tensor.shape) != tuple(shape):
        raise make(name, f"shape {_shape_text(tensor.shape)}, expected {_shape_text(shape)}")


def _check_finite(name: str, tensor: Tensor, positive: bool = False) -> None:
    if tensor.numel() and not bool(torch.isfinite(tensor).all()):
        raise QuantizedTensorsError(name, "holds NaN or infinite numbers")
    if positive and tensor.numel() and not bool((tensor > 0).all()):
        raise QuantizedTensorsError(name, "holds scales that are not positive")


def _row_lengths(tensors: dict[str, Tensor], rows: int | None) -> list[int]:
    """The checked row lengths (int64, ``(rows,)``, each in ``[0, stored codes]``) as Python ints."""
    lengths = tensors["lengths"]
    if lengths.dtype != torch.int64 or lengths.dim() != 1 or (rows is not None and lengths.shape[0] != rows):
        expected = "(rows,)" if rows is None else f"({rows},)"
        raise QuantizedTensorsError(
            "lengths", f"dtype {str(lengths.dtype).replace('torch.', '')} shape {_shape_text(lengths.shape)}, "
            f"expected int64 {expected}"
        )  # fmt: skip
    if tensors["key_codes"].dim() != 2:
        raise QuantizedTensorsError("key_codes", f"{tensors['key_codes'].dim()} dimensions, expected 2")
    stored = tensors["key_codes"].shape[0]
    if lengths.numel() and (bool((lengths < 0).any()) or bool((lengths > stored).any())):
        raise QuantizedTensorsError("lengths", f"a row length is negative or past the {stored} stored entries")
    return [int(n) for n in lengths.tolist()]


def check_quantized_tensors(
    tensors: dict[str, Tensor],
    config: QuantConfig,
    head_dim: int,
    value_dim: int,
    dtype: torch.dtype,
    rows: int | None = None,
) -> None:
    """Refuse quantized rows whose tensors (:meth:`~kvfold.runtime.quantize.QuantizedRows.tensors`)
    do not fit ``config``, the dimensions, ``dtype`` (of the full-precision outliers) and each other,
    before anything reads them: names, dtypes, shapes (codes ``ceil(D·bits/8)`` bytes an entry as
    :func:`~kvfold.runtime.codes.pack_codes` packs them; one key scale and zero point a group of
    ``key_group`` entries of a row; value scales a value group), row lengths (``rows`` of them when
    given, non-negative, adding up to the stored entries), finite positive scales, finite zero points
    and β, outlier indices in range, increasing and at most ``outliers`` a row. Shapes are checked
    before values, so a lie about a size is refused before any read.

    Raises:
        QuantizedTensorsError: naming the first tensor at fault.
    """
    zeros = () if config.is_float else ("key_zero", "value_zero")
    needed = {"lengths", "key_codes", "value_codes", "key_scale", "value_scale", "outlier_index", "outlier_keys"}
    needed |= {"outlier_values", *zeros}
    for name in sorted(needed - set(tensors)):
        raise QuantizedTensorsError(name, "missing")
    for name in sorted(set(tensors) - needed - {"log_mass"}):
        raise QuantizedTensorsError(name, f"not a tensor of {config.format} rows")
    if not config.is_float:
        for what, d in (("head", head_dim), ("value", value_dim)):
            if d % 8:
                raise QuantizedTensorsError("key_codes", f"the {what} dimension {d} is not a multiple of 8")
        if value_dim % (config.value_group or value_dim):
            raise QuantizedTensorsError("value_scale", f"value_group {config.value_group} does not divide {value_dim}")
    lengths = _row_lengths(tensors, rows)
    entries, count = sum(lengths), len(lengths)
    u8 = torch.uint8
    stored = tensors["key_codes"].shape[0]
    if entries != stored:
        raise QuantizedTensorsError(
            "key_codes", f"{stored} entries, but the row lengths (q.lengths) add up to {entries}"
        )
    check_tensor("key_codes", tensors["key_codes"], (entries, -(-head_dim * config.bits // 8)), u8)
    check_tensor("value_codes", tensors["value_codes"], (entries, -(-value_dim * config.bits // 8)), u8)
    if config.is_float:
        scales = {"key_scale": (count, 1), "value_scale": (count, 1)}
        scale_dtype = torch.float32
    else:
        groups = sum(-(-n // config.key_group) for n in lengths)
        per_entry = value_dim // (config.value_group or value_dim)
        scales = {"key_scale": (groups, head_dim), "key_zero": (groups, head_dim)}
        scales |= {"value_scale": (entries, per_entry), "value_zero": (entries, per_entry)}
        scale_dtype = torch.float16
    for name, shape in scales.items():
        check_tensor(name, tensors[name], shape, scale_dtype)
    if "log_mass" in tensors:
        check_tensor("log_mass", tensors["log_mass"], (entries,), torch.float32)
    _check_outliers(tensors, config, entries, count, head_dim, value_dim, dtype)
    for name in scales:
        _check_finite(name, tensors[name], positive=name.endswith("scale"))
    if "log_mass" in tensors:
        _check_finite("log_mass", tensors["log_mass"])


def _check_outliers(
    tensors: dict[str, Tensor], config: QuantConfig, entries: int, rows: int, head_dim: int, value_dim: int,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """The full-precision entries: indices in ``[0, entries)``, increasing, at most ``outliers`` a row;
    their keys and values of ``dtype``, finite."""
    index = tensors["outlier_index"]
    if index.dtype != torch.int64 or index.dim() != 1 or index.shape[0] > config.outliers * rows:
        raise QuantizedTensorsError(
            "outlier_index", f"dtype {str(index.dtype).replace('torch.', '')} shape {_shape_text(index.shape)}, "
            f"expected int64 (at most {config.outliers * rows},)"
        )  # fmt: skip
    count = int(index.shape[0])
    check_tensor("outlier_keys", tensors["outlier_keys"], (count, head_dim), dtype)
    check_tensor("outlier_values", tensors["outlier_values"], (count, value_dim), dtype)
    if count:
        if bool((index < 0).any()) or bool((index >= entries).any()):
            raise QuantizedTensorsError("outlier_index", f"an index is outside the {entries} stored entries")
        if count > 1 and not bool((index[1:] > index[:-1]).all()):
            raise QuantizedTensorsError("outlier_index", "indices are not increasing (repeated or out of order)")
        for name in ("outlier_keys", "outlier_values"):
            _check_finite(name, tensors[name])
