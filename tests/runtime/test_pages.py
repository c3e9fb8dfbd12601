"""Ragged rows read in pages (kvfold.runtime.pages): the layout, and the softmax merged over a row's
pages against a float64 softmax over the row."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.host_syncs import HostSyncCounter
from kvfold.runtime.pages import (
    NEG_INF,
    SPLIT_PROGRAMS,
    gather_pages,
    page_logits,
    page_softmax,
    pages_of,
    slots_of_entries,
    split_pages,
    sum_pages,
)

LENGTHS = [0, 1, 8, 9, 21, 0, 3]
SIZE = 4


def test_every_entry_is_read_once_by_its_own_rows_pages_in_order():
    lengths = torch.tensor(LENGTHS)
    beta = torch.randn(sum(LENGTHS), generator=torch.Generator().manual_seed(0))
    pages = pages_of(lengths, SIZE, beta)
    per_row = [-(-n // SIZE) for n in LENGTHS]
    assert pages.count == sum(per_row) and pages.rows == len(LENGTHS)
    assert pages.row.tolist() == [r for r, n in enumerate(per_row) for _ in range(n)]
    valid = torch.isfinite(pages.bias)
    assert pages.slots[valid].tolist() == list(range(sum(LENGTHS)))  # each entry once, in order
    assert torch.equal(pages.bias[valid], beta)
    first = pages.slots[:, :1].expand_as(pages.slots)
    assert torch.equal(pages.slots[~valid], first[~valid])  # past a row's end: the page's first entry
    assert valid.sum(-1).tolist() == [min(SIZE, n - SIZE * k) for n in LENGTHS for k in range(-(-n // SIZE))]
    same = pages_of(lengths, SIZE, beta, count=pages.count)
    assert torch.equal(same.slots, pages.slots) and torch.equal(same.bias, pages.bias)
    plain = pages_of(lengths, SIZE)
    assert plain.bias[valid].eq(0).all() and plain.bias[~valid].eq(NEG_INF).all()


def test_the_slot_of_an_entry_reads_that_entry():
    lengths = torch.tensor(LENGTHS)
    pages = pages_of(lengths, SIZE)
    entries = torch.arange(sum(LENGTHS))
    assert torch.equal(pages.slots.view(-1)[slots_of_entries(lengths, SIZE, entries)], entries)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_rows_pages_merge_into_its_softmax(dtype):
    """Each row's maximum logit, weights' sum and weighted values from its pages equal a float64
    softmax over the row's entries (β included); an empty row and a row whose β are all −inf give
    −inf and zeros."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    total, d, m = sum(LENGTHS), 5, 3
    keys, values = torch.randn(total, d, generator=g), torch.randn(total, d, generator=g)
    beta = torch.randn(total, generator=g)
    beta[1] = NEG_INF  # row 1 (one entry) holds nothing
    queries = torch.randn(len(LENGTHS), m, d, generator=g, dtype=dtype)
    pages = pages_of(lengths, SIZE, beta)
    top, weights = page_softmax(page_logits(queries, pages, gather_pages(pages, keys, dtype), 0.7), pages)
    den = sum_pages(pages, weights.sum(-1))
    num = sum_pages(pages, torch.bmm(weights, gather_pages(pages, values, dtype)))
    first = 0
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    for r, n in enumerate(LENGTHS):
        span = slice(first, first + n)
        first += n
        logits = queries[r].double() @ keys[span].double().T * 0.7 + beta[span].double()
        if n == 0 or not torch.isfinite(logits).any():
            assert top[r].eq(NEG_INF).all() and den[r].eq(0).all() and num[r].eq(0).all()
            continue
        want = torch.softmax(logits, -1) @ values[span].double()
        torch.testing.assert_close(top[r].double(), logits.amax(-1), **tol)
        torch.testing.assert_close((num[r] / den[r][:, None]).double(), want, **tol)


def test_reading_pages_reads_nothing_back_to_the_host():
    """Built with its page count known (quantized rows: their key groups), nothing is read back; the
    merge of pages never reads back."""
    lengths = torch.tensor(LENGTHS)
    keys = torch.randn(sum(LENGTHS), 4)
    count = sum(-(-n // SIZE) for n in LENGTHS)
    with HostSyncCounter() as syncs:
        pages = pages_of(lengths, SIZE, count=count)
        top, weights = page_softmax(page_logits(torch.randn(7, 2, 4), pages, gather_pages(pages, keys), 1.0), pages)
        sum_pages(pages, weights.sum(-1))
    assert not syncs.kvfold, syncs.summary()
    with HostSyncCounter() as syncs:
        pages_of(lengths, SIZE)
    assert sum(syncs.kvfold.values()) == 1  # the page count, read once for the rows' life


@pytest.mark.parametrize("per_split", [1, 2, 3, 100])
def test_every_page_falls_in_one_split_of_its_own_row(per_split):
    """Splits (split-K decoding): each row's pages cut into consecutive runs of at most ``per_split``,
    in row order, each page in exactly one split; the splits past the used ones are empty; the count
    is the host's bound."""
    pages = pages_of(torch.tensor(LENGTHS), SIZE)
    splits = split_pages(pages, per_split)
    per_row = [-(-n // SIZE) for n in LENGTHS]
    want_per_row = [-(-p // per_split) for p in per_row]
    assert splits.count == -(-pages.count // per_split) + len(LENGTHS) >= sum(want_per_row)
    assert splits.first_split.tolist() == [0, *torch.tensor(want_per_row).cumsum(0).tolist()]
    used = sum(want_per_row)
    start, end, row = splits.start.tolist(), splits.end.tolist(), splits.row.tolist()
    covered = []
    for r in range(len(LENGTHS)):
        for j in range(splits.first_split[r], splits.first_split[r + 1]):
            assert row[j] == r and 0 < end[j] - start[j] <= per_split
            assert all(pages.row[p] == r for p in range(start[j], end[j]))
            covered.extend(range(start[j], end[j]))
    assert covered == list(range(pages.count))  # every page once, in order
    assert start[used:] == end[used:] and row[used:] == [0] * (splits.count - used)


def test_the_longest_chain_of_pages_is_a_splits_whatever_the_rows():
    """A global ranking's layer: one row holding almost every entry of its head, the others a few. One
    program a row walks the long row's pages one after another; the rows' own splits (``pages.splits``)
    walk at most ``ceil(P / SPLIT_PROGRAMS)`` pages each, in about SPLIT_PROGRAMS programs."""
    lengths = torch.tensor([32_000, 40, 7, 300, 0, 12, 90, 2_000])
    pages = pages_of(lengths, 32)
    splits = pages.splits
    longest = int((splits.end - splits.start).max())
    assert longest == -(-pages.count // SPLIT_PROGRAMS) < 1000  # the long row alone: 1,000 pages
    assert splits.count <= SPLIT_PROGRAMS + len(lengths)
    assert splits is pages.splits  # built once, kept with the rows
    with HostSyncCounter() as syncs:
        split_pages(pages, 3)
    assert not syncs.kvfold, syncs.summary()


def test_rows_without_pages_have_no_splits():
    pages = pages_of(torch.tensor([0, 0]), SIZE)
    splits = split_pages(pages, 4)
    assert splits.count == 2 and splits.first_split.tolist() == [0, 0, 0]
    assert splits.start.tolist() == splits.end.tolist() == [0, 0]
    with pytest.raises(ValueError, match="per_split"):
        split_pages(pages, 0)
