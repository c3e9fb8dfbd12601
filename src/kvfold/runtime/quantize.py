"""Quantized storage for the entries of a folded layer: packed integer codes with their scales.

The scheme is KIVI's (Liu et al. 2024, *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache*, §3): asymmetric min–max integers, **keys per channel** over groups of ``key_group``
consecutive entries of a row (outlier channels then widen only their own channel's range) and
**values per entry** over groups of ``value_group`` channels (a merged or fitted value with a wide
range coarsens no other entry). Codes of 8, 4, 3 and 2 bits are packed into bytes (eight codes in
``bits`` bytes, :mod:`kvfold.runtime.codes`), scales and zero points are float16, so the memory is
really freed and counted. The ``fp8`` format stores e4m3 numbers (as engines ship their fp8 caches)
with one float32 scale per row for keys and one for values. The format and its options are a
:class:`~kvfold.runtime.quant_config.QuantConfig`.

β (the log-mass) stays in float32, unquantized. A few entries per row with outlying keys (the
attention sinks) can be kept in full precision (``outliers``): they are left out of their group's
range and stored apart, and counted.

Rows (batch × KV head) may hold different numbers of entries: the storage is ragged (entries of
all rows one after the other), so per-head budgets keep their memory saving. Nothing here holds a
dequantized copy: :meth:`QuantizedRows.to_padded` builds one layer's keys and values when the
attention reads them, and drops them after. Rows read back from a cache file are checked first
(:mod:`kvfold.runtime.quantized_checks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor

from kvfold.runtime.codes import pack_codes, unpack_codes
from kvfold.runtime.pages import NEG_INF, PAGE_SIZE, RowPages, pages_of, slots_of_entries
from kvfold.runtime.quant_config import SIXTEEN_BIT, QuantConfig, QuantSpecError
from kvfold.runtime.quant_grid import dequantize_minmax, group_params, quantize_minmax
from kvfold.runtime.quantized_checks import check_quantized_tensors
from kvfold.runtime.value_rotation import rotate, rotate_back

FP8_MAX = 448.0
"""Largest finite e4m3 number (``torch.finfo(torch.float8_e4m3fn).max``)."""


# -------------------------------------------------------------------------- ragged rows
def _entry_mask(lengths: Tensor, width: int) -> Tensor:
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def outlier_entries(keys: Tensor, valid: Tensor, count: int) -> Tensor:
    """``(R, N)`` bool: the ``count`` valid entries of each row whose key lies farthest outside the
    row's typical range, channel by channel (the largest ``|k − median| / MAD`` over channels)."""
    if count <= 0:
        return torch.zeros_like(valid)
    x = keys.float().masked_fill(~valid[..., None], float("nan"))
    median = x.nanmedian(dim=1, keepdim=True).values
    spread = (x - median).abs().nanmedian(dim=1, keepdim=True).values.clamp_min(1e-6)
    score = ((x - median).abs() / spread).nan_to_num(0.0).amax(-1).masked_fill(~valid, NEG_INF)
    k = min(count, keys.shape[1])
    top = score.topk(k, dim=1).indices
    chosen = torch.zeros_like(valid).scatter_(1, top, True)
    return chosen & valid


@dataclass
class QuantizedRows:
    """Quantized entries of ``R`` rows of different lengths, stored one row after another.

    Attributes:
        config: the format.
        lengths: ``(R,)`` long, entries per row (E = Σ lengths).
        key_codes, value_codes: ``(E, D·bits/8)`` uint8 packed codes (fp8: ``(E, D)`` e4m3 bytes).
        key_scale, key_zero: ``(Gk, D)`` float16, one per key group of a row (Gk = Σ ceil(len/key_group));
            fp8: ``(R, 1)`` float32 scales, no zero points.
        value_scale, value_zero: ``(E, groups)`` float16 (fp8: ``(R, 1)`` float32 scales, no zeros).
        log_mass: ``(E,)`` float32 β, None when every β is 0.
        outlier_index: ``(O,)`` long, the entries (0 ≤ index < E) stored in full precision.
        outlier_keys, outlier_values: ``(O, D)`` in the model's dtype.
        dtype: the dtype :meth:`to_padded` returns (the model's).
    """

    config: QuantConfig
    lengths: Tensor
    key_codes: Tensor
    value_codes: Tensor
    key_scale: Tensor
    key_zero: Tensor | None
    value_scale: Tensor
    value_zero: Tensor | None
    log_mass: Tensor | None
    outlier_index: Tensor
    outlier_keys: Tensor
    outlier_values: Tensor
    head_dim: int
    value_dim: int
    dtype: torch.dtype

    # ------------------------------------------------------------------ building
    @classmethod
    def from_padded(
        cls, keys: Tensor, values: Tensor, log_mass: Tensor | None, lengths: Tensor, config: QuantConfig
    ) -> QuantizedRows:
        """Quantize padded rows ``keys``/``values`` ``(R, N, D)`` whose first ``lengths[r]`` entries are
        valid, with β ``(R, N)`` (None = all zero)."""
        rows, width, dim = keys.shape
        value_dim = values.shape[-1]
        for name, d in (("head", dim), ("value", value_dim)):
            if not config.is_float and d % 8:
                raise ValueError(
                    f"quantized storage packs 8 codes at a time: the {name} dimension {d} is not a multiple of 8"
                )
        if config.rotate:  # every value, outliers too, stored rotated; to_padded and attention rotate back
            if value_dim & (value_dim - 1):
                raise QuantSpecError(
                    f"rotate=1 needs a value dimension that is a power of two; this model's is {value_dim}: "
                    "leave rotate out"
                )
            values = rotate(values).to(values.dtype)
        lengths = lengths.to(device=keys.device, dtype=torch.long)
        valid = _entry_mask(lengths, width)
        outliers = outlier_entries(keys, valid, config.outliers)
        in_range = valid & ~outliers
        if config.is_float:
            key_codes, key_scale, key_zero = _fp8_rows(keys, in_range)
            value_codes, value_scale, value_zero = _fp8_rows(values, in_range)
        else:
            key_codes, key_scale, key_zero = _quantize_keys(keys, in_range, lengths, config)
            value_codes, value_scale, value_zero = _quantize_values(values, valid, config)
        flat_beta = None
        if log_mass is not None:
            beta = log_mass.float()[valid]
            flat_beta = None if bool((beta == 0).all()) else beta.contiguous()
        outlier_index = torch.nonzero(outliers[valid], as_tuple=False).flatten()
        return cls(
            config=config,
            lengths=lengths.clone(),
            key_codes=key_codes[valid].contiguous(),
            value_codes=value_codes[valid].contiguous(),
            key_scale=key_scale,
            key_zero=key_zero,
            value_scale=value_scale if config.is_float else value_scale[valid].contiguous(),
            value_zero=value_zero if config.is_float else value_zero[valid].contiguous(),
            log_mass=flat_beta,
            outlier_index=outlier_index,
            outlier_keys=keys[outliers].contiguous(),
            outlier_values=values[outliers].contiguous(),
            head_dim=dim,
            value_dim=value_dim,
            dtype=keys.dtype,
        )

    # ------------------------------------------------------------------ reading
    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def width(self) -> int:
        """Entries of the longest row (read once: the rows do not change)."""
        return int(self.lengths.max()) if self.num_rows else 0

    @cached_property
    def pages(self) -> RowPages:
        """The rows cut into pages (:mod:`kvfold.runtime.pages`), built on the first read and kept: for
        integer codes one page a key group (its scales are the page's), found without reading the
        lengths back (as many pages as key groups); fp8 in pages of :data:`PAGE_SIZE`."""
        if self.config.is_float:
            return pages_of(self.lengths, PAGE_SIZE, self.log_mass)
        return pages_of(self.lengths, self.config.key_group, self.log_mass, count=int(self.key_scale.shape[0]))

    def index_tensors(self) -> tuple[Tensor, ...]:
        """The index a decode step reads (:attr:`pages`, :attr:`outlier_slots` where entries are kept at
        full precision), built now if it was not: before a decode step is compiled, so that the compiled
        step only reads it."""
        pages = self.pages
        outliers = (self.outlier_slots,) if self.outlier_index.numel() else ()
        return (pages.row, pages.slots, pages.bias, pages.first_page, *pages.splits.tensors(), *outliers)

    @cached_property
    def outlier_slots(self) -> Tensor:
        """``(O,)`` the slot of each full-precision entry in :attr:`pages` (flat: ``page · size + position``)."""
        return slots_of_entries(self.lengths, self.pages.size, self.outlier_index)

    def row_ranges(self) -> list[tuple[int, int, int, int]]:
        """Per row ``(first entry, entries, first key group, key groups)`` in the ragged storage."""
        lengths = self.lengths.tolist()
        out, entry, group = [], 0, 0
        size = self.config.key_group
        for n in lengths:
            groups = -(-n // size)
            out.append((entry, n, group, groups))
            entry += n
            group += groups
        return out

    def to_padded(self) -> tuple[Tensor, Tensor, Tensor]:
        """Dequantized ``(keys (R, N, D), values (R, N, Dv), log_mass (R, N) float32)`` with
        N = :attr:`width` and β = −inf past each row's length (one layer's copy, built on demand)."""
        rows, width, dim = self.num_rows, self.width, self.head_dim
        valid = _entry_mask(self.lengths, width)
        cfg = self.config
        if cfg.is_float:
            keys = self._fp8_padded(self.key_codes, self.key_scale, valid, dim)
            values = self._fp8_padded(self.value_codes, self.value_scale, valid, self.value_dim)
        else:
            group = cfg.key_group
            groups = math.ceil(width / group) if width else 0
            codes = self.key_codes.new_zeros(rows, groups * group, self.key_codes.shape[-1])
            codes[:, :width][valid] = self.key_codes
            unpacked = unpack_codes(codes, cfg.bits).view(rows, groups, group, dim)
            scale = self.key_scale.new_ones(rows, groups, dim)
            zero = self.key_scale.new_zeros(rows, groups, dim)
            group_valid = _entry_mask(self.lengths, groups * group)[:, ::group] if groups else valid[:, :0]
            scale[group_valid], zero[group_valid] = self.key_scale, self.key_zero
            keys = dequantize_minmax(unpacked, scale[:, :, None], zero[:, :, None], self.dtype)
            keys = keys.reshape(rows, groups * group, dim)[:, :width]
            v_codes = self.value_codes.new_zeros(rows, width, self.value_codes.shape[-1])
            v_codes[valid] = self.value_codes
            v_groups = self.value_scale.shape[-1]
            v_scale = self.value_scale.new_ones(rows, width, v_groups)
            v_zero = self.value_scale.new_zeros(rows, width, v_groups)
            v_scale[valid], v_zero[valid] = self.value_scale, self.value_zero
            v_unpacked = unpack_codes(v_codes, cfg.bits).view(rows, width, v_groups, -1)
            values = dequantize_minmax(v_unpacked, v_scale[..., None], v_zero[..., None], self.dtype)
            values = values.reshape(rows, width, self.value_dim)
        if self.outlier_index.numel():
            where = valid.nonzero(as_tuple=False)[self.outlier_index]
            keys[where[:, 0], where[:, 1]] = self.outlier_keys.to(keys.dtype)
            values[where[:, 0], where[:, 1]] = self.outlier_values.to(values.dtype)
        if cfg.rotate:
            values = rotate_back(values).to(self.dtype)
        log_mass = torch.full((rows, width), NEG_INF, dtype=torch.float32, device=valid.device)
        log_mass[valid] = 0.0 if self.log_mass is None else self.log_mass
        return keys, values, log_mass

    def _fp8_padded(self, codes: Tensor, scale: Tensor, valid: Tensor, dim: int) -> Tensor:
        out = torch.zeros(valid.shape[0], valid.shape[1], dim, dtype=torch.float32, device=valid.device)
        out[valid] = codes.view(torch.float8_e4m3fn).float()
        return (out * scale[:, :, None]).to(self.dtype)

    # ------------------------------------------------------------------ bytes
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor held, by name (what a cache file stores)."""
        out = {
            "lengths": self.lengths,
            "key_codes": self.key_codes,
            "value_codes": self.value_codes,
            "key_scale": self.key_scale,
            "value_scale": self.value_scale,
            "outlier_index": self.outlier_index,
            "outlier_keys": self.outlier_keys,
            "outlier_values": self.outlier_values,
        }
        for name in ("key_zero", "value_zero", "log_mass"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor held."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())

    def gpu_nbytes(self) -> int:
        """Bytes as a GPU user holds them: the same, with the full-precision outlier entries at 16 bits."""
        fp = self.outlier_keys.numel() + self.outlier_values.numel()
        held = self.outlier_keys.untyped_storage().nbytes() + self.outlier_values.untyped_storage().nbytes()
        return self.nbytes() - held + fp * SIXTEEN_BIT

    # ------------------------------------------------------------------ edits
    def select_rows(self, rows: Tensor) -> QuantizedRows:
        """The rows ``rows`` (long indices, repeats allowed), in that order."""
        rows = rows.to(self.lengths.device, torch.long)
        entry_first = torch.cumsum(self.lengths, 0) - self.lengths
        entries = entry_ranges(entry_first[rows], self.lengths[rows])
        out = {"lengths": self.lengths[rows].clone()}
        for name in ("key_codes", "value_codes", "log_mass"):
            t = getattr(self, name)
            out[name] = None if t is None else t[entries].contiguous()
        if self.config.is_float:
            out.update(key_scale=self.key_scale[rows].contiguous(), value_scale=self.value_scale[rows].contiguous())
            out.update(key_zero=None, value_zero=None)
        else:
            groups = -(-self.lengths // self.config.key_group)
            group_first = torch.cumsum(groups, 0) - groups
            picked = entry_ranges(group_first[rows], groups[rows])
            out.update(key_scale=self.key_scale[picked].contiguous(), key_zero=self.key_zero[picked].contiguous())
            out.update(
                value_scale=self.value_scale[entries].contiguous(), value_zero=self.value_zero[entries].contiguous()
            )
        # outliers: the chosen rows' full-precision entries, renumbered in the new order
        is_outlier = torch.zeros(int(self.lengths.sum()), dtype=torch.bool, device=self.lengths.device)
        is_outlier[self.outlier_index] = True
        slot_of = self.lengths.new_zeros(is_outlier.shape[0])
        slot_of[self.outlier_index] = torch.arange(self.outlier_index.numel(), device=self.lengths.device)
        new_index = torch.nonzero(is_outlier[entries], as_tuple=False).flatten()
        take = slot_of[entries[new_index]]
        out["outlier_index"] = new_index
        out["outlier_keys"] = self.outlier_keys[take].contiguous()
        out["outlier_values"] = self.outlier_values[take].contiguous()
        return replace(self, **out)

    def clone(self) -> QuantizedRows:
        return self.map(lambda t: t.clone())

    def map(self, fn) -> QuantizedRows:
        """The same storage with ``fn`` applied to every tensor (``.to(device)``, ``.clone()``)."""
        return replace(self, **{name: fn(t) for name, t in self.tensors().items()})

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, Tensor],
        config: QuantConfig,
        head_dim: int,
        value_dim: int,
        dtype: torch.dtype,
        *,
        checked: bool = False,
    ) -> QuantizedRows:
        """Rebuild from :meth:`tensors` (a cache file's content), every tensor checked first
        (:func:`check_quantized_tensors`), unless ``checked``: the caller has run that check on these
        very tensors with these arguments (a cache file's loader, which checks every layer before it
        builds any).

        Raises:
            QuantizedTensorsError: a tensor missing, unexpected, or of the wrong shape, dtype or values.
        """
        if not checked:
            check_quantized_tensors(tensors, config, head_dim, value_dim, dtype)
        return cls(
            config=config,
            lengths=tensors["lengths"].long(),
            key_codes=tensors["key_codes"],
            value_codes=tensors["value_codes"],
            key_scale=tensors["key_scale"],
            key_zero=tensors.get("key_zero"),
            value_scale=tensors["value_scale"],
            value_zero=tensors.get("value_zero"),
            log_mass=tensors.get("log_mass"),
            outlier_index=tensors["outlier_index"].long(),
            outlier_keys=tensors["outlier_keys"],
            outlier_values=tensors["outlier_values"],
            head_dim=head_dim,
            value_dim=value_dim,
            dtype=dtype,
        )


def entry_ranges(first: Tensor, counts: Tensor) -> Tensor:
    """Concatenated ``arange(first[i], first[i] + counts[i])``."""
    total = int(counts.sum())
    if total == 0:
        return first.new_zeros(0)
    start = torch.repeat_interleave(first, counts)
    offset = torch.arange(total, device=first.device) - torch.repeat_interleave(
        torch.cumsum(counts, 0) - counts, counts
    )
    return start + offset


def _quantize_keys(
    keys: Tensor, in_range: Tensor, lengths: Tensor, config: QuantConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel codes over groups of ``key_group`` entries: packed codes ``(R, N, ·)`` and the
    used groups' float16 scales and zero points ``(Gk, D)``, row after row."""
    rows, width, dim = keys.shape
    group = config.key_group
    groups = math.ceil(width / group) if width else 0
    pad = groups * group - width
    x = keys.float()
    mask = in_range
    if pad:
        x = torch.cat([x, x.new_zeros(rows, pad, dim)], 1)
        mask = torch.cat([mask, mask.new_zeros(rows, pad)], 1)
    xg = x.view(rows, groups, group, dim)
    mg = mask.view(rows, groups, group, 1)
    low = xg.masked_fill(~mg, float("inf")).amin(2)
    high = xg.masked_fill(~mg, NEG_INF).amax(2)
    empty = ~mg.any(2).expand_as(low)
    low, high = low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)
    scale, zero = group_params(xg, low, high, config.bits, 2, bool(config.clip), mg.to(xg.dtype))
    codes = quantize_minmax(xg, scale[:, :, None], zero[:, :, None], config.bits).view(rows, groups * group, dim)
    packed = pack_codes(codes[:, :width], config.bits)
    used = _entry_mask(lengths, groups * group)[:, ::group] if groups else mask[:, :0]
    return packed, scale[used].contiguous(), zero[used].contiguous()


def _quantize_values(values: Tensor, valid: Tensor, config: QuantConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Per-entry codes over groups of ``value_group`` channels: packed codes ``(R, N, ·)`` and
    float16 scales and zero points ``(R, N, groups)``."""
    rows, width, dim = values.shape
    size = config.value_group or dim
    if dim % size:
        raise ValueError(f"value_group {size} does not divide the value dimension {dim}")
    x = values.float().view(rows, width, dim // size, size)
    scale, zero = group_params(x, x.amin(-1), x.amax(-1), config.bits, -1, bool(config.clip))
    codes = quantize_minmax(x, scale[..., None], zero[..., None], config.bits).view(rows, width, dim)
    return pack_codes(codes, config.bits), scale, zero


def _fp8_rows(x: Tensor, in_range: Tensor) -> tuple[Tensor, Tensor, None]:
    """e4m3 bytes ``(R, N, D)`` and one float32 scale per row ``(R, 1)`` (the row's absolute maximum
    over ``in_range`` entries mapped to e4m3's largest number)."""
    amax = x.float().abs().amax(-1).masked_fill(~in_range, 0.0).amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (x.float() / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8), scale, None


def roundtrip_keys(keys: Tensor, lengths: Tensor, config: QuantConfig) -> Tensor:
    """The keys ``(R, N, D)`` (first ``lengths[r]`` valid) as quantized storage gives them back:
    what attention will read after :meth:`QuantizedRows.from_padded` stores them (the values are
    not touched). Attention Matching fits β and the values to these keys."""
    rows = QuantizedRows.from_padded(keys, keys, None, lengths, replace(config, rotate=0))  # keys only
    out = rows.to_padded()[0]
    return torch.cat([out, keys[:, out.shape[1] :]], 1) if out.shape[1] < keys.shape[1] else out
