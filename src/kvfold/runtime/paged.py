"""The paged layout of a folded layer: rows of different lengths in fixed-size blocks.

Used by :class:`kvfold.runtime.cache.FoldedLayer` when rows (batch × KV head) hold different
numbers of entries, as with per-head budgets (AdaKV, Attention Matching head schedules). Entries
live in blocks of :data:`BLOCK_SIZE` owned by rows, so the memory held is Σ row lengths rounded up
to a block, not rows × the longest row. An empty slot has log-mass β = −inf (:data:`NEG_INF`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")
BLOCK_SIZE = 16
"""Entries per block of the paged layout."""


def grow_capacity(capacity: int, needed: int) -> int:
    """Geometric growth: amortised O(1) copies per appended token."""
    return max(needed, capacity + max(16, capacity // 8))


@dataclass
class PagedRows:
    """Paged storage for rows of different lengths (one row = one batch element × KV head).

    Attributes:
        keys: ``(num_blocks_capacity, BLOCK_SIZE, D)``.
        values: same shape as ``keys``.
        log_mass: ``(num_blocks_capacity, BLOCK_SIZE)`` float32; −inf in empty slots.
        block_row: ``(num_blocks_capacity,)`` long, the row that owns each block. A row's blocks are
            in buffer order but not contiguous: :meth:`append_one` opens new blocks after all others.
        num_blocks: number of blocks in use (a prefix of the buffers).
        row_lengths: ``(R,)`` long, entries per row.
        row_last_block: ``(R,)`` long, the block that receives the row's next entry.
    """

    keys: torch.Tensor
    values: torch.Tensor
    log_mass: torch.Tensor
    block_row: torch.Tensor
    num_blocks: int
    row_lengths: torch.Tensor
    row_last_block: torch.Tensor

    @classmethod
    def from_padded(
        cls, keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor, lengths: torch.Tensor
    ) -> PagedRows:
        """Pack padded rows ``(R, N, D)`` whose first ``lengths[r]`` entries are valid."""
        rows, _, dim = keys.shape
        lengths = lengths.to(torch.long).cpu().clone()  # owned: decoding increments it in place
        blocks_per_row = torch.clamp((lengths + BLOCK_SIZE - 1) // BLOCK_SIZE, min=1)
        num_blocks = int(blocks_per_row.sum())
        block_row = torch.repeat_interleave(torch.arange(rows), blocks_per_row)
        first_block = torch.cumsum(blocks_per_row, 0) - blocks_per_row
        block_in_row = torch.arange(num_blocks) - first_block[block_row]
        # Gather each block's entries from its row; slots past the row length stay empty.
        positions = block_in_row[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)[None, :]
        filled = positions < lengths[block_row][:, None]
        src = torch.where(filled, positions, torch.zeros_like(positions))
        device = keys.device
        row_idx = block_row.to(device)[:, None].expand(-1, BLOCK_SIZE)
        src = src.to(device)
        filled_d = filled.to(device)
        k = keys[row_idx, src] * filled_d[..., None]
        v = values[row_idx, src] * filled_d[..., None]
        lm = torch.where(filled_d, log_mass[row_idx, src].float(), torch.full_like(src, NEG_INF, dtype=torch.float32))
        return cls(
            keys=k.contiguous(),
            values=v.contiguous(),
            log_mass=lm.contiguous(),
            block_row=block_row.to(device),
            num_blocks=num_blocks,
            row_lengths=lengths.to(device),
            row_last_block=(first_block + blocks_per_row - 1).to(device),
        )

    @property
    def num_rows(self) -> int:
        return int(self.row_lengths.shape[0])

    def to_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Unpack to padded ``(R, N_max, D)`` tensors (β = −inf past each row's length)."""
        nb = self.num_blocks
        rows = self.num_rows
        dim = self.keys.shape[-1]
        max_len = int(self.row_lengths.max()) if rows else 0
        width = max(1, math.ceil(max_len / BLOCK_SIZE)) * BLOCK_SIZE
        block_row = self.block_row[:nb]
        block_in_row = self._block_in_row()
        k = self.keys.new_zeros(rows, width // BLOCK_SIZE, BLOCK_SIZE, dim)
        v = self.values.new_zeros(rows, width // BLOCK_SIZE, BLOCK_SIZE, dim)
        lm = self.log_mass.new_full((rows, width // BLOCK_SIZE, BLOCK_SIZE), NEG_INF)
        k[block_row, block_in_row] = self.keys[:nb]
        v[block_row, block_in_row] = self.values[:nb]
        lm[block_row, block_in_row] = self.log_mass[:nb]
        k = k.reshape(rows, width, dim)[:, :max_len]
        v = v.reshape(rows, width, dim)[:, :max_len]
        lm = lm.reshape(rows, width)[:, :max_len]
        return k, v, lm, self.row_lengths.clone()

    def _block_in_row(self) -> torch.Tensor:
        """``(num_blocks,)`` each block's index within its row's page list.

        A row's blocks are not contiguous in the buffers: a block opened by :meth:`append_one`
        lands after every block in use. They are in order, though (a row's later block has a
        larger id), so a block's index is its rank among its row's blocks in buffer order.
        """
        nb = self.num_blocks
        block_row = self.block_row[:nb]
        counts = torch.bincount(block_row, minlength=self.num_rows)
        first = torch.cumsum(counts, 0) - counts
        order = torch.argsort(block_row, stable=True)  # blocks row after row, each row's in order
        block_in_row = torch.empty_like(block_row)
        block_in_row[order] = torch.arange(nb, device=block_row.device) - first[block_row[order]]
        return block_in_row

    def append_one(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append one entry to every row in place (decode step). ``keys``: ``(R, D)``."""
        slot = self.row_lengths % BLOCK_SIZE
        needs_block = (slot == 0) & (self.row_lengths > 0)
        new_rows = torch.nonzero(needs_block).flatten()
        if new_rows.numel():
            count = int(new_rows.numel())
            self._ensure_blocks(self.num_blocks + count)
            ids = torch.arange(self.num_blocks, self.num_blocks + count, device=self.block_row.device)
            self.block_row[ids] = new_rows
            self.log_mass[ids] = NEG_INF
            self.row_last_block[new_rows] = ids
            self.num_blocks += count
        target = self.row_last_block
        self.keys[target, slot] = keys.to(self.keys.dtype)
        self.values[target, slot] = values.to(self.values.dtype)
        self.log_mass[target, slot] = 0.0
        self.row_lengths += 1

    def _ensure_blocks(self, needed: int) -> None:
        capacity = self.keys.shape[0]
        if needed <= capacity:
            return
        new_cap = grow_capacity(capacity, needed)
        extra = new_cap - capacity
        self.keys = torch.cat([self.keys, self.keys.new_zeros(extra, *self.keys.shape[1:])])
        self.values = torch.cat([self.values, self.values.new_zeros(extra, *self.values.shape[1:])])
        self.log_mass = torch.cat([self.log_mass, self.log_mass.new_full((extra, BLOCK_SIZE), NEG_INF)])
        self.block_row = torch.cat([self.block_row, self.block_row.new_full((extra,), -1)])

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from (
            self.keys,
            self.values,
            self.log_mass,
            self.block_row,
            self.row_lengths,
            self.row_last_block,
        )


def paging_saves_memory(lengths: torch.Tensor, padded_length: int) -> bool:
    """Page rows when padding would waste more than an eighth of the dense layout."""
    rows = lengths.numel()
    dense = rows * int(lengths.max())
    paged = int(((lengths + BLOCK_SIZE - 1) // BLOCK_SIZE).clamp(min=1).sum()) * BLOCK_SIZE
    return paged < dense * 7 / 8 and padded_length > 0
