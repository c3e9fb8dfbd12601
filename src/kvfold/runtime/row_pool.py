"""Quantized rows packed into fixed-size byte chunks: a cache held in an engine's blocks at its own bytes.

A serving engine hands a request whole blocks of memory, every layer the same number of them
(vLLM: one block table for all layers of a request). A kvfold cache has rows (layer × KV head) of
different lengths, so laying each row, or each layer, into its own blocks pays for the longest row
or the busiest layer. Here the cache's rows are cut into *segments* and packed, in order, into
chunks of ``chunk_bytes`` (one block of one layer): every chunk of the request is filled whatever
layer it belongs to, so a request holds ``ceil(chunks / layers)`` blocks, about the file's bytes.

Each chunk is a small :class:`~kvfold.runtime.quantize.QuantizedRows` of its own (the library's
storage, KIVI's axes, Liu et al. 2024 §3), its rows being the segments it holds:

* a 16-byte header: :data:`CHUNK_MAGIC`, the number of segments, flags (bit 0: β stored);
* then, each array aligned to :data:`ALIGN` bytes: the segments' lengths (int64), key codes, value
  codes, key scales and zero points (float16, one row a key group), value scales and zero points
  (float16, one an entry) and β (float32, when any layer has it).

A segment is a run of one row's entries. Key scales belong to groups of ``key_group`` entries
counted from the row's start, so a segment either starts on a group boundary or lies inside one
group: its groups then are its own. Attention over a row is the log-sum-exp merge of its segments'
parts (each part's maximum logit, weights' sum and weighted values, as the kernel returns them),
then of the row's full-precision tail (:func:`attend_layer`). The codes are read where they lie:
nothing is dequantized and nothing is copied but the scales the kernel takes as float32.

The plan (which segment lies where) is a function of the rows' lengths and the chunk size
(:func:`plan_pool`), so whoever holds the file recomputes it; the lengths are in the chunks too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvfold.runtime.quantize import QuantConfig, QuantizedRows
from kvfold.runtime.quantized_attention import merge_with_tail, stored_part

CHUNK_MAGIC = 0x4346564B
"""``b"KVFC"`` read as a little-endian 32-bit word: the first bytes of every chunk."""
HEADER_BYTES = 16
ALIGN = 16
"""Every array of a chunk starts on a multiple of this many bytes (so a view of it is aligned)."""
FLAG_BETA = 1


class PoolError(ValueError):
    """Rows that cannot be packed (a format the chunks do not hold, or a chunk too small)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Segment:
    """A run of one row's entries inside one chunk.

    Attributes:
        layer: the layer the row belongs to.
        row: the row within its layer (batch × KV head).
        first: the row's first entry the segment holds.
        entries: how many.
        chunk: the chunk that holds it.
    """

    layer: int
    row: int
    first: int
    entries: int
    chunk: int


@dataclass(frozen=True)
class ChunkLayout:
    """Where a chunk's arrays lie: ``offsets[name] = (first byte, bytes)``, for ``entries`` entries in
    ``groups`` key groups over ``segments`` segments."""

    segments: tuple[Segment, ...]
    entries: int
    groups: int
    offsets: dict[str, tuple[int, int]]

    @property
    def used_bytes(self) -> int:
        return max((start + size for start, size in self.offsets.values()), default=HEADER_BYTES)


@dataclass(frozen=True)
class PoolPlan:
    """How a cache's quantized rows are packed into chunks (:func:`plan_pool`).

    Attributes:
        config: the rows' format.
        head_dim, value_dim: the rows' key and value widths.
        chunk_bytes: bytes a chunk holds.
        rows_per_layer: rows (batch × KV head) of each layer.
        beta: whether the chunks store β.
        chunks: each chunk's layout, in order.
    """

    config: QuantConfig
    head_dim: int
    value_dim: int
    chunk_bytes: int
    rows_per_layer: tuple[int, ...]
    beta: bool
    chunks: tuple[ChunkLayout, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def nbytes(self) -> int:
        """Bytes the chunks hold, their unused ends included."""
        return self.num_chunks * self.chunk_bytes

    def layer_parts(self, layer: int) -> list[tuple[int, int, int]]:
        """``(chunk, first segment, segments)`` of each chunk that holds segments of ``layer``, in order."""
        out = []
        for index, chunk in enumerate(self.chunks):
            positions = [i for i, s in enumerate(chunk.segments) if s.layer == layer]
            if positions:
                out.append((index, positions[0], len(positions)))
        return out


def _chunk_offsets(config: QuantConfig, head_dim: int, value_dim: int, segments: int, entries: int, groups: int,
                   beta: bool) -> dict[str, tuple[int, int]]:  # fmt: skip
    """Each array's (first byte, bytes) in a chunk holding these counts (module docstring's order)."""
    sizes = [
        ("lengths", segments * 8),
        ("key_codes", entries * (head_dim * config.bits // 8)),
        ("value_codes", entries * (value_dim * config.bits // 8)),
        ("key_scale", groups * head_dim * 2),
        ("key_zero", groups * head_dim * 2),
        ("value_scale", entries * 2),
        ("value_zero", entries * 2),
    ]
    if beta:
        sizes.append(("log_mass", entries * 4))
    offsets, at = {}, HEADER_BYTES
    for name, size in sizes:
        offsets[name] = (at, size)
        at = _aligned(at + size)
    return offsets


def _chunk_bytes_used(config, head_dim, value_dim, segments, entries, groups, beta) -> int:
    offsets = _chunk_offsets(config, head_dim, value_dim, segments, entries, groups, beta)
    return max(start + size for start, size in offsets.values())


def check_poolable(config: QuantConfig) -> None:
    """Refuse a format whose rows the chunks do not hold.

    Raises:
        PoolError: fp8, value groups within an entry, or full-precision outlier entries.
    """
    if config.is_float or config.value_group:
        raise PoolError(f"format {config.describe()}: the pool holds integer codes with one value scale an entry")
    if config.outliers:
        raise PoolError(f"format {config.describe()}: the pool holds no full-precision outlier entries")


def plan_pool(
    lengths: Sequence[Tensor], config: QuantConfig, head_dim: int, value_dim: int, chunk_bytes: int, *, beta: bool
) -> PoolPlan:
    """Cut every row into segments and pack them, layer after layer, row after row, into chunks.

    Args:
        lengths: per layer, ``(R,)`` entries of each row.
        config: the rows' format (:func:`check_poolable`).
        head_dim, value_dim: key and value widths.
        chunk_bytes: bytes of one chunk (one block of one layer in the engine).
        beta: whether the chunks store β (any layer has it).

    Raises:
        PoolError: a format the pool does not hold, or a chunk that cannot hold one entry.
    """
    check_poolable(config)
    group = config.key_group
    if _chunk_bytes_used(config, head_dim, value_dim, 1, 1, 1, beta) > chunk_bytes:
        raise PoolError(f"a chunk of {chunk_bytes} bytes cannot hold one entry of format {config.describe()}")
    chunks: list[ChunkLayout] = []
    current: list[Segment] = []
    entries = groups = 0

    def close() -> None:
        nonlocal current, entries, groups
        if current:
            offsets = _chunk_offsets(config, head_dim, value_dim, len(current), entries, groups, beta)
            chunks.append(ChunkLayout(tuple(current), entries, groups, offsets))
        current, entries, groups = [], 0, 0

    def fits(n: int) -> bool:
        used = _chunk_bytes_used(config, head_dim, value_dim, len(current) + 1, entries + n,
                                 groups + math.ceil(n / group), beta)  # fmt: skip
        return used <= chunk_bytes

    for layer, layer_lengths in enumerate(lengths):
        for row, length in enumerate(int(n) for n in layer_lengths.tolist()):
            first = 0
            while first < length:
                phase = first % group
                limit = length - first if phase == 0 else min(length - first, group - phase)
                if not fits(1):
                    close()
                    continue
                low, high = 1, limit  # the most entries that fit: fits() is monotone in n
                while low < high:
                    mid = (low + high + 1) // 2
                    low, high = (mid, high) if fits(mid) else (low, mid - 1)
                current.append(Segment(layer, row, first, low, len(chunks)))
                entries += low
                groups += math.ceil(low / group)
                first += low
    close()
    rows = tuple(int(t.numel()) for t in lengths)
    return PoolPlan(config, head_dim, value_dim, chunk_bytes, rows, beta, tuple(chunks))


def pack_pool(layers: Sequence[QuantizedRows], chunk_bytes: int) -> tuple[PoolPlan, Tensor]:
    """Pack every layer's quantized rows into chunks.

    Returns:
        The plan and the chunks' bytes, ``(num_chunks, chunk_bytes)`` uint8 (unused ends zero).

    Raises:
        PoolError: layers of different formats or widths, or :func:`plan_pool`'s errors.
    """
    if not layers:
        raise PoolError("no layers to pack")
    first = layers[0]
    for stored in layers:
        if (stored.config, stored.head_dim, stored.value_dim) != (first.config, first.head_dim, first.value_dim):
            raise PoolError("every layer of a pool has one format and one head size")
    beta = any(stored.log_mass is not None for stored in layers)
    plan = plan_pool([s.lengths for s in layers], first.config, first.head_dim, first.value_dim, chunk_bytes,
                     beta=beta)  # fmt: skip
    out = torch.zeros(plan.num_chunks, chunk_bytes, dtype=torch.uint8)
    ranges = [s.row_ranges() for s in layers]
    for index, chunk in enumerate(plan.chunks):
        _write_chunk(out[index], chunk, layers, ranges, plan)
    return plan, out


def _write_chunk(target: Tensor, chunk: ChunkLayout, layers, ranges, plan: PoolPlan) -> None:
    header = torch.tensor([CHUNK_MAGIC, len(chunk.segments), FLAG_BETA if plan.beta else 0, 0], dtype=torch.int64)
    target[:HEADER_BYTES] = header.to(torch.int32).view(torch.uint8)
    group = plan.config.key_group
    parts: dict[str, list[Tensor]] = {name: [] for name in chunk.offsets}
    for seg in chunk.segments:
        stored = layers[seg.layer]
        entry0, _, group0, _ = ranges[seg.layer][seg.row]
        entries = slice(entry0 + seg.first, entry0 + seg.first + seg.entries)
        first_group = group0 + seg.first // group
        groups = slice(first_group, first_group + math.ceil(seg.entries / group))
        parts["lengths"].append(torch.tensor([seg.entries], dtype=torch.int64))
        parts["key_codes"].append(stored.key_codes[entries])
        parts["value_codes"].append(stored.value_codes[entries])
        parts["key_scale"].append(stored.key_scale[groups].to(torch.float16))
        parts["key_zero"].append(stored.key_zero[groups].to(torch.float16))
        parts["value_scale"].append(stored.value_scale[entries, 0].to(torch.float16))
        parts["value_zero"].append(stored.value_zero[entries, 0].to(torch.float16))
        if plan.beta:
            beta = stored.log_mass
            parts["log_mass"].append(
                torch.zeros(seg.entries, dtype=torch.float32) if beta is None else beta[entries].float()
            )
    for name, (start, size) in chunk.offsets.items():
        if size:
            data = torch.cat([p.reshape(-1).contiguous() for p in parts[name]]).view(torch.uint8)
            target[start : start + size] = data


def chunk_rows(chunk: Tensor, layout: ChunkLayout, plan: PoolPlan, first: int = 0, count: int | None = None
               ) -> QuantizedRows:  # fmt: skip
    """Segments ``first … first + count − 1`` of a chunk as :class:`QuantizedRows`, views of its bytes.

    Args:
        chunk: the chunk's ``chunk_bytes`` uint8 bytes (from :func:`pack_pool`, or an engine's block).
        layout: its layout in the plan.
        plan: the pool's plan.

    Raises:
        PoolError: the chunk's header does not match its layout (another chunk, or damaged bytes).
    """
    count = len(layout.segments) - first if count is None else count
    header = chunk[:HEADER_BYTES].view(torch.int32).tolist()
    if header[0] != _as_int32(CHUNK_MAGIC) or header[1] != len(layout.segments):
        raise PoolError("a chunk's header does not match the pool's plan (not this cache's chunk)")
    group = plan.config.key_group
    sizes = [s.entries for s in layout.segments]
    entry0, entries = sum(sizes[:first]), sum(sizes[first : first + count])
    group0 = sum(math.ceil(n / group) for n in sizes[:first])
    groups = sum(math.ceil(n / group) for n in sizes[first : first + count])
    kb, vb = plan.head_dim * plan.config.bits // 8, plan.value_dim * plan.config.bits // 8

    def array(name: str, dtype: torch.dtype, start: int, n: int, width: int = 1) -> Tensor:
        offset = layout.offsets[name][0]
        item = torch.empty(0, dtype=dtype).element_size() * width
        return chunk[offset + start * item : offset + (start + n) * item].view(dtype).view(n, width)

    lengths = array("lengths", torch.int64, first, count)[:, 0]
    return QuantizedRows(
        config=plan.config,
        lengths=lengths,
        key_codes=array("key_codes", torch.uint8, entry0, entries, kb),
        value_codes=array("value_codes", torch.uint8, entry0, entries, vb),
        key_scale=array("key_scale", torch.float16, group0, groups, plan.head_dim),
        key_zero=array("key_zero", torch.float16, group0, groups, plan.head_dim),
        value_scale=array("value_scale", torch.float16, entry0, entries),
        value_zero=array("value_zero", torch.float16, entry0, entries),
        log_mass=array("log_mass", torch.float32, entry0, entries)[:, 0] if plan.beta else None,
        outlier_index=torch.zeros(0, dtype=torch.long),
        outlier_keys=torch.zeros(0, plan.head_dim),
        outlier_values=torch.zeros(0, plan.value_dim),
        head_dim=plan.head_dim,
        value_dim=plan.value_dim,
        dtype=torch.float32,
    )


def _as_int32(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def attend_layer(
    queries: Tensor,
    tail_logits: Tensor,
    tail_values: Tensor,
    chunks: Sequence[Tensor],
    plan: PoolPlan,
    layer: int,
    scaling: float,
) -> Tensor:
    """Attention of one layer's folded queries over its rows held in the pool, and their tails.

    Args:
        queries: ``(R, M, D)`` float32, row ``r``'s queries (its GQA group's heads × new tokens).
        tail_logits: ``(R, M, n)`` their scaled logits over each row's full-precision tail.
        tail_values: ``(R, n, Dv)`` the tail's values.
        chunks: every chunk's bytes, by index (``chunks[i]`` holds ``plan.chunks[i]``).
        plan: the pool's plan.
        layer: the layer.
        scaling: the logit scale.

    Returns:
        ``(R, M, Dv)``: the softmax over each row's stored entries (all its segments) and its tail.
    """
    rows, m, _ = queries.shape
    top = queries.new_full((rows, m), float("-inf"))
    den = queries.new_zeros(rows, m)
    num = queries.new_zeros(rows, m, plan.value_dim)
    for index, first, count in plan.layer_parts(layer):
        layout = plan.chunks[index]
        stored = chunk_rows(chunks[index], layout, plan, first, count)
        owners = torch.tensor([s.row for s in layout.segments[first : first + count]], dtype=torch.long)
        part_top, part_den, part_num = stored_part(queries.index_select(0, owners), stored, scaling)
        _merge_parts(top, den, num, owners, part_top, part_den, part_num)
    return merge_with_tail(top, den, num, tail_logits, tail_values)


def _merge_parts(top: Tensor, den: Tensor, num: Tensor, owners: Tensor, part_top: Tensor, part_den: Tensor,
                 part_num: Tensor) -> None:  # fmt: skip
    """Fold segments' parts into their rows' running parts (log-sum-exp), in place. A row may own
    several of the segments, so they are folded one at a time in order."""
    for i, row in enumerate(owners.tolist()):
        new_top = torch.maximum(top[row], part_top[i])
        finite = torch.isfinite(new_top)
        keep = torch.where(finite, (top[row] - new_top).exp(), torch.zeros_like(new_top))
        add = torch.where(finite, (part_top[i] - new_top).exp(), torch.zeros_like(new_top))
        den[row] = den[row] * keep + part_den[i] * add
        num[row] = num[row] * keep[:, None] + part_num[i] * add[:, None]
        top[row] = new_top
