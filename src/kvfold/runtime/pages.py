"""Ragged rows read in pages: how a decode step attends stored rows without padding every row to the longest.

Stored rows (:class:`~kvfold.runtime.rows.FloatRows`, :class:`~kvfold.runtime.quantize.QuantizedRows`)
keep each row's entries one after another, rows of very different lengths (a global ranking such as
KVzip's, Kim et al. 2025 §3, may keep almost every entry of one head and a few of another). Padding
every row to the longest (what the decode did before) reads and multiplies ``rows × longest`` slots,
about the full cache's at a tenth of its entries. Cut into pages of ``size`` consecutive entries of one
row instead (a paged KV cache's blocks, Kwon et al. 2023 §4.2), the work follows Σ lengths plus at most
``size − 1`` slots a row, and every page has the same shape, so a layer is a few batched operations
whatever the number of rows, and no value is read back to the host.

:class:`RowPages` is built once for a storage (the rows never change) and kept with it; a step then
gathers each page's entries, computes its logits, and :func:`page_softmax` / :func:`sum_pages` merge the
pages of a row by their maximum logit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

NEG_INF = float("-inf")
"""β of a slot that holds nothing (padding, an empty row's tail): it adds −inf to the slot's logit."""
PAGE_SIZE = 32
"""Entries a page of full-precision rows holds (quantized rows use their key group: one scale a page)."""
SPLIT_PROGRAMS = 256
"""About how many pieces (:class:`PageSplits`) a kernel that walks a layer's pages cuts them into: about two
programs for each of an H200's 132 streaming multiprocessors, whatever the rows' lengths."""


@dataclass(frozen=True)
class RowPages:
    """Rows cut into pages of ``size`` consecutive entries, each page within one row (a row of ``n``
    entries has ``ceil(n / size)`` pages, the last one partly filled).

    Attributes:
        size: slots a page.
        row: ``(P,)`` long, the row each page belongs to (non-decreasing: pages in row order).
        slots: ``(P, size)`` long, the stored entry each slot reads; a slot past its row's end reads the
            page's first entry (finite numbers, weighted 0 by ``bias``).
        bias: ``(P, size)`` float32, each slot's β (0 for rows without one), −inf past its row's end.
        rows: the number of rows.
    """

    size: int
    row: Tensor
    slots: Tensor
    bias: Tensor
    rows: int

    @property
    def count(self) -> int:
        """Pages (P)."""
        return int(self.row.shape[0])

    @cached_property
    def first_page(self) -> Tensor:
        """``(rows + 1,)`` int32: each row's first page, then the page count (pages are in row order), for
        a kernel that walks a row's pages (:mod:`kvfold.runtime.triton_attention`); made on first use."""
        per_row = torch.zeros(self.rows, dtype=torch.long, device=self.row.device)
        per_row.index_add_(0, self.row, torch.ones_like(self.row))
        return torch.cat([per_row.new_zeros(1), per_row.cumsum(0)]).to(torch.int32)

    @cached_property
    def splits(self) -> PageSplits:
        """The pages cut into :class:`PageSplits` of at most ``ceil(count / SPLIT_PROGRAMS)`` pages, for a
        kernel (:mod:`kvfold.runtime.triton_attention`); made on first use."""
        return split_pages(self, max(1, -(-self.count // SPLIT_PROGRAMS)))

    def nbytes(self) -> int:
        """Bytes of the index held (built on the first read, kept with the rows)."""
        return sum(t.untyped_storage().nbytes() for t in (self.row, self.slots, self.bias))


@dataclass(frozen=True)
class PageSplits:
    """A row's pages cut into splits of at most ``per_split`` consecutive pages, so that a kernel walks
    every split at once and merges a row's splits afterwards (split-K decoding: FlashDecoding, Dao et al.
    2023). One program a row walks the longest row's pages one after another, and with a global ranking
    (KVzip's) one row of a layer may hold almost every entry of its head while there are only ``B × H``
    rows: a few programs do all the work. Cut into splits the work is spread over about
    :data:`SPLIT_PROGRAMS` programs whatever the rows' lengths.

    ``count`` is a bound known on the host without reading the device, ``ceil(P / per_split) + rows``;
    the splits past the last row's are empty (``start == end``, row 0).

    Attributes:
        per_split: pages a split holds at most.
        row: ``(count,)`` int32, each split's row.
        start, end: ``(count,)`` int32, each split's first page and one past its last.
        first_split: ``(rows + 1,)`` int32, each row's first split, then the splits used (a row's splits
            are consecutive).
        count: splits, the unused ones included.
    """

    per_split: int
    row: Tensor
    start: Tensor
    end: Tensor
    first_split: Tensor
    count: int

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors a kernel reads."""
        return (self.row, self.start, self.end, self.first_split)


def split_pages(pages: RowPages, per_split: int) -> PageSplits:
    """:class:`PageSplits` of ``pages`` of at most ``per_split`` pages each, built on the device without
    reading it back (the bound ``ceil(P / per_split) + rows`` is the number of splits made)."""
    if per_split < 1:
        raise ValueError(f"split_pages(): per_split must be at least 1, got {per_split}")
    first_page = pages.first_page.long()
    per_row = first_page[1:] - first_page[:-1]
    splits_per_row = (per_row + per_split - 1) // per_split
    ends = splits_per_row.cumsum(0)
    count = -(-pages.count // per_split) + pages.rows
    index = torch.arange(count, device=first_page.device)
    row = torch.bucketize(index, ends, right=True)  # rows past the last: unused splits
    used = row < pages.rows
    row = row.clamp_max(max(pages.rows - 1, 0))  # (no rows: no pages, no splits, nothing indexed)
    start = first_page[row] + (index - (ends - splits_per_row)[row]) * per_split
    end = torch.minimum(start + per_split, first_page[row + 1])
    start, end = torch.where(used, start, 0), torch.where(used, end, 0)
    first_split = torch.cat([ends.new_zeros(1), ends])
    return PageSplits(
        per_split=per_split,
        row=torch.where(used, row, 0).to(torch.int32),
        start=start.to(torch.int32),
        end=end.to(torch.int32),
        first_split=first_split.to(torch.int32),
        count=count,
    )


def pages_of(lengths: Tensor, size: int, log_mass: Tensor | None = None, count: int | None = None) -> RowPages:
    """:class:`RowPages` of rows of ``lengths`` ``(R,)`` entries stored one after another, with β
    ``log_mass`` ``(E,)`` (None: all 0).

    ``count`` is the number of pages, Σ ``ceil(lengths / size)``, when the caller knows it (quantized rows:
    their key groups); otherwise it is read from ``lengths`` once, here (on a GPU the one host read of
    these rows' life)."""
    device = lengths.device
    lengths = lengths.long()
    per_row = (lengths + size - 1) // size
    if count is None:
        count = int(per_row.sum())
    rows = int(lengths.shape[0])
    row = torch.repeat_interleave(torch.arange(rows, device=device), per_row, output_size=count)
    first_page = per_row.cumsum(0) - per_row
    starts = lengths.cumsum(0) - lengths
    within = torch.arange(count, device=device) - first_page.index_select(0, row)
    first = starts.index_select(0, row) + within * size  # (P,) each page's first entry
    slots = first[:, None] + torch.arange(size, device=device)
    valid = slots < (starts + lengths).index_select(0, row)[:, None]
    slots = torch.where(valid, slots, first[:, None])
    beta = torch.zeros((), device=device) if log_mass is None else log_mass.float()[slots]
    bias = torch.where(valid, beta, NEG_INF)
    return RowPages(size=size, row=row, slots=slots, bias=bias.contiguous(), rows=rows)


def slots_of_entries(lengths: Tensor, size: int, entries: Tensor) -> Tensor:
    """The flat slot (``page · size + position``) of each stored entry in ``entries`` ``(O,)`` long, in
    :func:`pages_of`'s layout of rows of ``lengths``."""
    lengths = lengths.long()
    ends = lengths.cumsum(0)
    starts = ends - lengths
    per_row = (lengths + size - 1) // size
    first_page = per_row.cumsum(0) - per_row
    row = torch.bucketize(entries, ends, right=True)
    position = entries - starts.index_select(0, row)
    return (first_page.index_select(0, row) + position // size) * size + position % size


def gather_pages(pages: RowPages, flat: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``flat`` ``(E, ·)`` (one row per stored entry) gathered into pages ``(P, size, ·)``, in ``dtype``."""
    out = flat.index_select(0, pages.slots.view(-1))
    out = out.view(pages.count, pages.size, *flat.shape[1:])
    return out if dtype is None else out.to(dtype)


def page_logits(queries: Tensor, pages: RowPages, keys: Tensor, scaling: float) -> Tensor:
    """``q · k · scaling + β`` ``(P, M, size)`` of each page's keys ``(P, size, D)`` against its row's
    queries (``queries`` ``(R, M, D)``), −inf past a row's end."""
    own = queries.index_select(0, pages.row)  # (P, M, D)
    bias = pages.bias.to(queries.dtype)[:, None, :]
    return torch.baddbmm(bias, own, keys.transpose(1, 2), alpha=scaling)


def page_softmax(logits: Tensor, pages: RowPages) -> tuple[Tensor, Tensor]:
    """Each row's maximum logit ``(R, M)`` (−inf for an empty row) and the pages' weights ``(P, M, size)``
    relative to it (``logits`` is overwritten)."""
    m = logits.shape[1]
    top = logits.new_full((pages.rows, m), NEG_INF)
    if pages.count:
        index = pages.row[:, None].expand(-1, m)
        top.scatter_reduce_(0, index, logits.amax(-1), reduce="amax")
    shift = top.nan_to_num(neginf=0.0).index_select(0, pages.row)  # a row whose every β is −inf: weights 0
    return top, logits.sub_(shift[..., None]).exp_()


def empty_part(queries: Tensor, value_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """The stored part of rows that hold no entry, for queries ``(R, M, D)``: maximum logit −inf ``(R, M)``,
    weights' sum 0 ``(R, M)``, weighted values 0 ``(R, M, value_dim)``."""
    rows, m, _ = queries.shape
    return queries.new_full((rows, m), NEG_INF), queries.new_zeros(rows, m), queries.new_zeros(rows, m, value_dim)


def sum_pages(pages: RowPages, per_page: Tensor) -> Tensor:
    """``per_page`` ``(P, ...)`` summed over each row's pages: ``(R, ...)``."""
    out = per_page.new_zeros(pages.rows, *per_page.shape[1:])
    return out.index_add_(0, pages.row, per_page)
