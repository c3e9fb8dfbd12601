"""Ragged rows at full precision: the stored part of a folded layer when it is not quantized.

A :class:`~kvfold.runtime.folded_layer.FoldedLayer` holds at most two parts: a ragged *stored* part, the
compressed entries of rows (batch × KV head) of different lengths, followed by a dense *tail* of
equal length for every row (what is appended after: the question, generated tokens). The stored
part is quantized (:class:`~kvfold.runtime.quantize.QuantizedRows`) or at full precision
(:class:`FloatRows`, here); both keep every row's entries one after another, so the memory held
follows Σ row lengths, not rows × the longest row. An empty slot has log-mass β = −inf
(:data:`NEG_INF`).

:func:`float_part` attends full-precision rows the way
:func:`~kvfold.runtime.quantized_attention.stored_part` attends quantized ones: each row's maximum
logit, and relative to it its weights' sum and weighted values, which merge with the tail (or with
other pieces of the row) by their log-sum-exp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch
from torch import Tensor

from kvfold.runtime.pages import (
    NEG_INF,
    PAGE_SIZE,
    RowPages,
    empty_part,
    gather_pages,
    page_logits,
    page_softmax,
    pages_of,
    sum_pages,
)
from kvfold.runtime.quant_config import SIXTEEN_BIT
from kvfold.runtime.quantize import entry_ranges

ROW_ROUNDING = 16
"""Entries a row is rounded up to when :func:`ragged_saves_memory` weighs ragged rows against padding."""


def grow_capacity(capacity: int, needed: int) -> int:
    """Geometric growth: amortised O(1) copies per appended token."""
    return max(needed, capacity + max(16, capacity // 8))


def ragged_saves_memory(lengths: Tensor, padded_length: int) -> bool:
    """Store rows ragged when padding them would waste more than an eighth of the padded layout, each
    row counted rounded up to :data:`ROW_ROUNDING` entries (a margin: small savings stay padded)."""
    rows = lengths.numel()
    dense = rows * int(lengths.max())
    ragged = int(((lengths + ROW_ROUNDING - 1) // ROW_ROUNDING).clamp(min=1).sum()) * ROW_ROUNDING
    return ragged < dense * 7 / 8 and padded_length > 0


def compact_rows(
    keys: Tensor, values: Tensor, log_mass: Tensor, valid: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Padded rows ``(B, H, N, ·)`` with their valid entries (``valid``: finite β) moved to each row's
    first ``lengths`` slots, in order; β = −inf after them."""
    n = valid.shape[-1]
    order = torch.where(valid, torch.arange(n, device=valid.device), n).sort(-1).values
    order = order.clamp_max(n - 1)
    take = order[..., None]
    keys = keys.gather(2, take.expand(-1, -1, -1, keys.shape[-1]))
    values = values.gather(2, take.expand(-1, -1, -1, values.shape[-1]))
    in_row = torch.arange(n, device=valid.device) < lengths[..., None]
    log_mass = log_mass.gather(2, order).masked_fill(~in_row, NEG_INF)
    return keys, values, log_mass


@dataclass
class FloatRows:
    """Entries of ``R`` rows kept at full precision, stored one row after another (as
    :class:`~kvfold.runtime.quantize.QuantizedRows` stores codes).

    Attributes:
        lengths: ``(R,)`` long, entries per row (E = Σ lengths).
        keys, values: ``(E, D)`` and ``(E, Dv)`` in the rows' dtype.
        log_mass: ``(E,)`` float32 β, None when every β is 0.
    """

    lengths: Tensor
    keys: Tensor
    values: Tensor
    log_mass: Tensor | None

    @classmethod
    def from_padded(cls, keys: Tensor, values: Tensor, log_mass: Tensor, lengths: Tensor | None = None) -> FloatRows:
        """Rows from padded ``(R, N, D)`` keys and values: each row's first ``lengths[r]`` entries (an
        entry of β = −inf among them is kept), or without ``lengths`` the entries where β ``(R, N)`` is
        finite."""
        if lengths is None:
            valid = torch.isfinite(log_mass)
        else:
            valid = torch.arange(keys.shape[1], device=keys.device) < lengths.to(keys.device)[:, None]
        beta = log_mass[valid].float()
        return cls(
            lengths=valid.sum(-1).long(),
            keys=keys[valid].contiguous(),
            values=values[valid].contiguous(),
            log_mass=None if bool((beta == 0).all()) else beta.contiguous(),
        )

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[-1])

    @property
    def value_dim(self) -> int:
        return int(self.values.shape[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def width(self) -> int:
        """Entries of the longest row (read once: the rows do not change)."""
        return int(self.lengths.max()) if self.num_rows else 0

    def row_ranges(self) -> list[tuple[int, int, int, int]]:
        """Per row ``(first entry, entries, 0, 0)`` (no key groups)."""
        out, entry = [], 0
        for n in self.lengths.tolist():
            out.append((entry, n, 0, 0))
            entry += n
        return out

    def padded_index(self) -> tuple[Tensor, Tensor]:
        """``(index, valid)``, both ``(R, W)`` with W = :attr:`width`: the entry each padded slot reads
        (a valid one, repeated, past the row's end) and whether the slot is the row's."""
        position = torch.arange(self.width, device=self.lengths.device)
        index = (self.starts[:, None] + position).clamp_max(max(int(self.keys.shape[0]) - 1, 0))
        return index, position < self.lengths[:, None]

    @cached_property
    def pages(self) -> RowPages:
        """The rows cut into pages of :data:`~kvfold.runtime.pages.PAGE_SIZE` entries with their β
        (:mod:`kvfold.runtime.pages`), built on the first read and kept: what a decode step reads."""
        return pages_of(self.lengths, PAGE_SIZE, self.log_mass)

    def index_tensors(self) -> tuple[Tensor, ...]:
        """The index a decode step reads (:attr:`pages`), built now if it was not: before a decode step
        is compiled, so that the compiled step only reads it."""
        pages = self.pages
        return (pages.row, pages.slots, pages.bias, pages.first_page, *pages.splits.tensors())

    @cached_property
    def starts(self) -> Tensor:
        """``(R,)`` each row's first entry (made once: the rows do not change)."""
        return self.lengths.cumsum(0) - self.lengths

    def to_padded(self) -> tuple[Tensor, Tensor, Tensor]:
        """``(keys (R, W, D), values (R, W, Dv), log_mass (R, W) float32)`` with β = −inf past each row's
        length (a copy, built on demand)."""
        index, valid = self.padded_index()
        keys = self.keys[index].masked_fill_(~valid[..., None], 0)
        values = self.values[index].masked_fill_(~valid[..., None], 0)
        beta = torch.zeros(valid.shape, device=valid.device) if self.log_mass is None else self.log_mass[index].float()
        return keys, values, beta.masked_fill_(~valid, NEG_INF)

    def tensors(self) -> dict[str, Tensor]:
        """Every tensor held, by name."""
        held = {"lengths": self.lengths, "keys": self.keys, "values": self.values}
        return held if self.log_mass is None else {**held, "log_mass": self.log_mass}

    def nbytes(self) -> int:
        """Bytes of every tensor held."""
        return sum(t.untyped_storage().nbytes() for t in self.tensors().values())

    def gpu_nbytes(self) -> int:
        """Bytes as a GPU user holds them: the same, with keys and values at 16 bits."""
        entries = self.keys.shape[0]
        held = sum(t.untyped_storage().nbytes() for name, t in self.tensors().items() if name not in ("keys", "values"))
        return held + entries * (self.head_dim + self.value_dim) * SIXTEEN_BIT

    def select_rows(self, rows: Tensor) -> FloatRows:
        """The rows ``rows`` (long indices, repeats allowed), in that order."""
        rows = rows.to(self.lengths.device, torch.long)
        entries = entry_ranges(self.starts[rows], self.lengths[rows])
        beta = None if self.log_mass is None else self.log_mass[entries].contiguous()
        return FloatRows(self.lengths[rows].clone(), self.keys[entries].contiguous(),
                         self.values[entries].contiguous(), beta)  # fmt: skip

    def map(self, fn) -> FloatRows:
        """The same rows with ``fn`` applied to every tensor (``.to(device)``, ``.clone()``)."""
        return replace(self, **{name: fn(t) for name, t in self.tensors().items()})

    def clone(self) -> FloatRows:
        return self.map(lambda t: t.clone())


def float_part(queries: Tensor, rows: FloatRows, scaling: float) -> tuple[Tensor, Tensor, Tensor]:
    """What :func:`~kvfold.runtime.quantized_attention.stored_part` gives for rows at full precision:
    each row's maximum logit ``(R, M)`` (−inf for an empty row), and relative to it its weights' sum
    ``(R, M)`` and weighted values ``(R, M, Dv)``, computed in the queries' dtype.

    Every row is read at once, in pages (:attr:`FloatRows.pages`: the work follows Σ lengths, not
    rows × the longest row): each page's keys and values gathered, its logits computed against its
    row's queries, the pages of a row merged by their maximum logit. A few batched operations a layer
    whatever the number of rows, and no value read back to the host."""
    pages = rows.pages
    if not pages.count:
        return empty_part(queries, rows.value_dim)
    acc = queries.dtype
    top, weights = page_softmax(page_logits(queries, pages, gather_pages(pages, rows.keys, acc), scaling), pages)
    num = torch.bmm(weights, gather_pages(pages, rows.values, acc))
    return top, sum_pages(pages, weights.sum(-1)), sum_pages(pages, num)
