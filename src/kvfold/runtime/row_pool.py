"""Quantized rows packed into fixed-size byte chunks: a cache held in an engine's blocks at its own bytes.

A serving engine hands a request whole blocks of memory, every layer the same number of them
(vLLM: one block table for all layers of a request). A kvfold cache has rows (layer × KV head) of
different lengths, so laying each row, or each layer, into its own blocks pays for the longest row
or the busiest layer. Here the cache's rows are cut into *segments* and packed, in order, into
chunks of ``chunk_bytes`` (one block of one layer): every chunk of the request is filled whatever
layer it belongs to, so a request holds ``ceil(chunks / layers)`` blocks, about the file's bytes.

Each chunk is a small :class:`~kvfold.runtime.quantize.QuantizedRows` of its own (the library's
storage, KIVI's axes, Liu et al. 2024 §3), its rows being the segments it holds:

* a 16-byte header: :data:`CHUNK_MAGIC`, the number of segments, flags (bit 0: β stored; bit 1:
  rows at full precision; bit 2: values stored rotated);
* then, each array aligned to :data:`ALIGN` bytes: the segments' lengths (int64), key codes, value
  codes, key scales and zero points (float16, one row a key group), value scales and zero points
  (float16, one an entry) and β (float32, when any layer has it).

A segment is a run of one row's entries. Key scales belong to groups of ``key_group`` entries
counted from the row's start, so a segment either starts on a group boundary or lies inside one
group: its groups then are its own. Attention over a row is the log-sum-exp merge of its segments'
parts (each part's maximum logit, weights' sum and weighted values, as the kernel returns them),
then of the row's full-precision tail (:func:`attend_layer`). The codes are read where they lie:
nothing is dequantized and nothing is copied but the scales the kernel takes as float32.

Rows kept at full precision (a file stored unquantized) pack the same way as :class:`FloatRows`:
their chunks hold the segments' lengths, keys and values in the rows' own dtype, and β (flag bit 1).

The plan (which segment lies where) is a function of the rows' lengths and the chunk size
(:func:`plan_pool`), so whoever holds the file recomputes it; the lengths are in the chunks too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.quantized_attention import merge_with_tail, stored_part
from kvfold.runtime.rows import FloatRows

CHUNK_MAGIC = 0x4346564B
"""``b"KVFC"`` read as a little-endian 32-bit word: the first bytes of every chunk."""
HEADER_BYTES = 16
ALIGN = 16
"""Every array of a chunk starts on a multiple of this many bytes (so a view of it is aligned)."""
FLAG_BETA = 1
FLAG_FLOAT = 2
FLAG_ROTATED = 4
"""Values stored rotated (``QuantConfig.rotate``): the kernel rotates the file part's weighted values back."""


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
    """How a cache's rows are packed into chunks (:func:`plan_pool`).

    Attributes:
        config: the quantized rows' format; None for rows at full precision (:class:`FloatRows`).
        dtype: the full-precision rows' dtype (unused for quantized rows).
        head_dim, value_dim: the rows' key and value widths.
        chunk_bytes: bytes a chunk holds.
        rows_per_layer: rows (batch × KV head) of each layer.
        beta: whether the chunks store β.
        chunks: each chunk's layout, in order.
    """

    config: QuantConfig | None
    dtype: torch.dtype
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

    @property
    def flags(self) -> int:
        """The flags every chunk's header holds (:data:`FLAG_BETA`, :data:`FLAG_FLOAT`, :data:`FLAG_ROTATED`)."""
        rotated = self.config is not None and bool(self.config.rotate)
        flags = (FLAG_BETA if self.beta else 0) | (FLAG_FLOAT if self.config is None else 0)
        return flags | (FLAG_ROTATED if rotated else 0)

    def layer_parts(self, layer: int) -> list[tuple[int, int, int]]:
        """``(chunk, first segment, segments)`` of each chunk that holds segments of ``layer``, in order
        (found once for every layer: the backend asks for each layer at every step)."""
        return self._parts_by_layer.get(layer, [])

    @cached_property
    def _parts_by_layer(self) -> dict[int, list[tuple[int, int, int]]]:
        out: dict[int, list[tuple[int, int, int]]] = {}
        for index, chunk in enumerate(self.chunks):
            for position, segment in enumerate(chunk.segments):
                parts = out.setdefault(segment.layer, [])
                if parts and parts[-1][0] == index:
                    parts[-1] = (index, parts[-1][1], parts[-1][2] + 1)
                else:
                    parts.append((index, position, 1))
        return out


@dataclass(frozen=True)
class _Format:
    """What one entry, key group and segment of a chunk cost: the arrays' names and sizes."""

    config: QuantConfig | None
    dtype: torch.dtype
    head_dim: int
    value_dim: int
    beta: bool

    @property
    def group(self) -> int | None:
        """Entries a key group (None: full-precision rows have no groups)."""
        return None if self.config is None else self.config.key_group

    def groups(self, entries: int) -> int:
        return 0 if self.group is None else math.ceil(entries / self.group)

    @cached_property
    def arrays(self) -> tuple[tuple[str, int, int, int], ...]:
        """Each array of a chunk, in the module docstring's order: its name and its bytes per segment,
        per entry and per key group."""
        arrays = [("lengths", 8, 0, 0)]
        if self.config is None:
            element = torch.empty(0, dtype=self.dtype).element_size()
            arrays += [("keys", 0, self.head_dim * element, 0), ("values", 0, self.value_dim * element, 0)]
        else:
            bits = self.config.bits
            arrays += [
                ("key_codes", 0, self.head_dim * bits // 8, 0),
                ("value_codes", 0, self.value_dim * bits // 8, 0),
                ("key_scale", 0, 0, self.head_dim * 2),
                ("key_zero", 0, 0, self.head_dim * 2),
                ("value_scale", 0, 2, 0),
                ("value_zero", 0, 2, 0),
            ]
        if self.beta:
            arrays.append(("log_mass", 0, 4, 0))
        return tuple(arrays)

    def offsets(self, segments: int, entries: int, groups: int) -> dict[str, tuple[int, int]]:
        """Each array's (first byte, bytes) in a chunk holding these counts."""
        offsets, at = {}, HEADER_BYTES
        for name, per_segment, per_entry, per_group in self.arrays:
            size = per_segment * segments + per_entry * entries + per_group * groups
            offsets[name] = (at, size)
            at = _aligned(at + size)
        return offsets

    def used(self, segments: int, entries: int, groups: int) -> int:
        """Bytes a chunk holding these counts uses up to its last array's end (each array starts at or
        after the previous one's end, so the last one ends furthest): :meth:`offsets` without a dict,
        as the planner asks it for every cut."""
        end = HEADER_BYTES
        for _, per_segment, per_entry, per_group in self.arrays:
            start = -(-end // ALIGN) * ALIGN
            end = start + per_segment * segments + per_entry * entries + per_group * groups
        return end


def check_poolable(config: QuantConfig | None) -> None:
    """Refuse a format whose rows the chunks do not hold.

    Raises:
        PoolError: fp8, value groups within an entry, or full-precision outlier entries.
    """
    if config is None:
        return
    if config.is_float or config.value_group:
        raise PoolError(f"format {config.describe()}: the pool holds integer codes with one value scale an entry")
    if config.outliers:
        raise PoolError(f"format {config.describe()}: the pool holds no full-precision outlier entries")


def plan_pool(
    lengths: Sequence[Tensor],
    config: QuantConfig | None,
    head_dim: int,
    value_dim: int,
    chunk_bytes: int,
    *,
    beta: bool,
    dtype: torch.dtype = torch.float32,
) -> PoolPlan:
    """Cut every row into segments and pack them, layer after layer, row after row, into chunks.

    Args:
        lengths: per layer, ``(R,)`` entries of each row.
        config: the rows' format (:func:`check_poolable`); None for rows at full precision.
        head_dim, value_dim: key and value widths.
        chunk_bytes: bytes of one chunk (one block of one layer in the engine).
        beta: whether the chunks store β (any layer has it).
        dtype: the full-precision rows' dtype.

    Raises:
        PoolError: a format the pool does not hold, or a chunk that cannot hold one entry.
    """
    check_poolable(config)
    form = _Format(config, dtype, head_dim, value_dim, beta)
    if form.used(1, 1, form.groups(1)) > chunk_bytes:
        raise PoolError(f"a chunk of {chunk_bytes} bytes cannot hold one entry of these rows")
    chunks: list[ChunkLayout] = []
    current: list[Segment] = []
    entries = groups = 0
    group, used = form.group, form.used

    def close() -> None:
        nonlocal current, entries, groups
        if current:
            chunks.append(ChunkLayout(tuple(current), entries, groups, form.offsets(len(current), entries, groups)))
        current, entries, groups = [], 0, 0

    def fits(n: int) -> bool:
        return used(len(current) + 1, entries + n, groups + (0 if group is None else -(-n // group))) <= chunk_bytes

    per_entry = sum(a[2] for a in form.arrays) + sum(a[3] for a in form.arrays) / (group or 1)
    slack = int((ALIGN * len(form.arrays) + sum(a[3] for a in form.arrays)) // per_entry) + 1

    def most(limit: int) -> int:
        """The most of a run's next ``limit`` entries the chunk takes (one at least does): the whole run
        most often; else searched near what the room left holds at an entry's mean bytes (the search
        only narrows by what fits() answers, which is monotone in the entries)."""
        if fits(limit):
            return limit
        low, high = 1, limit - 1
        guess = int((chunk_bytes - used(len(current) + 1, entries, groups)) // per_entry)
        if low < guess - slack and fits(guess - slack):
            low = guess - slack
        if guess + slack < high and not fits(guess + slack):
            high = guess + slack - 1
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if fits(mid) else (low, mid - 1)
        return low

    for layer, layer_lengths in enumerate(lengths):
        for row, length in enumerate(int(n) for n in layer_lengths.tolist()):
            first = 0
            while first < length:
                phase = 0 if group is None else first % group
                limit = length - first if phase == 0 else min(length - first, group - phase)
                if not fits(1):
                    close()
                    continue
                low = most(limit)
                current.append(Segment(layer, row, first, low, len(chunks)))
                entries += low
                groups += form.groups(low)
                first += low
    close()
    rows = tuple(int(t.numel()) for t in lengths)
    return PoolPlan(config, dtype, head_dim, value_dim, chunk_bytes, rows, beta, tuple(chunks))


Rows = QuantizedRows | FloatRows


def pack_pool(layers: Sequence[Rows], chunk_bytes: int) -> tuple[PoolPlan, Tensor]:
    """Pack every layer's rows (all quantized in one format, or all at full precision) into chunks.

    Returns:
        The plan and the chunks' bytes, ``(num_chunks, chunk_bytes)`` uint8 (unused ends zero).

    Raises:
        PoolError: layers of different formats or widths, or :func:`plan_pool`'s errors.
    """
    if not layers:
        raise PoolError("no layers to pack")

    def kind(rows: Rows) -> tuple:
        config = rows.config if isinstance(rows, QuantizedRows) else None
        dtype = rows.dtype if config is None else None
        return config, dtype, rows.head_dim, rows.value_dim

    if len({kind(rows) for rows in layers}) != 1:
        raise PoolError("every layer of a pool has one format and one head size")
    config, dtype, head_dim, value_dim = kind(layers[0])
    beta = any(rows.log_mass is not None for rows in layers)
    plan = plan_pool([rows.lengths for rows in layers], config, head_dim, value_dim, chunk_bytes, beta=beta,
                     dtype=dtype or torch.float32)  # fmt: skip
    out = torch.zeros(plan.num_chunks, chunk_bytes, dtype=torch.uint8)
    _write_chunks(out, plan, layers)
    return plan, out


def _form(plan: PoolPlan) -> _Format:
    return _Format(plan.config, plan.dtype, plan.head_dim, plan.value_dim, plan.beta)


def _array_bytes(layers: Sequence[Rows], plan: PoolPlan) -> dict[str, Tensor]:
    """Every layer's arrays one after another as the chunks hold them (scales and zero points in
    float16, β in float32 and zero for a layer without it), each ``(entries or key groups, bytes)``
    uint8. Rows lie one after another and are packed in that order, so a chunk's part of an array is
    one run of it."""

    def joined(parts: list[Tensor]) -> Tensor:
        data = torch.cat([part.reshape(part.shape[0], math.prod(part.shape[1:])) for part in parts])
        return data.contiguous().view(torch.uint8)  # (n, width × bytes of an element)

    out: dict[str, Tensor] = {}
    if plan.config is None:
        out["keys"] = joined([rows.keys for rows in layers])
        out["values"] = joined([rows.values for rows in layers])
    else:
        out["key_codes"] = joined([rows.key_codes for rows in layers])
        out["value_codes"] = joined([rows.value_codes for rows in layers])
        out["key_scale"] = joined([rows.key_scale.to(torch.float16) for rows in layers])
        out["key_zero"] = joined([rows.key_zero.to(torch.float16) for rows in layers])
        out["value_scale"] = joined([rows.value_scale[:, :1].to(torch.float16) for rows in layers])
        out["value_zero"] = joined([rows.value_zero[:, :1].to(torch.float16) for rows in layers])
    if plan.beta:
        out["log_mass"] = joined([
            torch.zeros(int(rows.lengths.sum()), dtype=torch.float32) if rows.log_mass is None
            else rows.log_mass.float() for rows in layers
        ])  # fmt: skip
    return out


def _write_chunks(out: Tensor, plan: PoolPlan, layers: Sequence[Rows]) -> None:
    """Write every chunk's header and arrays into ``out`` (``(chunks, chunk_bytes)`` uint8): a copy an
    array a chunk, of the run of :func:`_array_bytes` its segments hold."""
    if not plan.chunks:
        return
    form = _form(plan)
    arrays = _array_bytes(layers, plan)
    per_group = {name for name, _, _, group_bytes in form.arrays if group_bytes}
    first_entry, first_group, layer_entry, layer_group = [], [], 0, 0
    for rows in layers:  # each row's first entry and key group among all layers'
        ranges = rows.row_ranges()
        first_entry.append([layer_entry + r[0] for r in ranges])
        first_group.append([layer_group + r[2] for r in ranges])
        layer_entry += sum(r[1] for r in ranges)
        layer_group += sum(r[3] for r in ranges)
    headers = [[_as_int32(CHUNK_MAGIC), len(chunk.segments), plan.flags, 0] for chunk in plan.chunks]
    out[:, :HEADER_BYTES] = torch.tensor(headers, dtype=torch.int32).view(torch.uint8)
    target = out.numpy()  # views: NumPy copies a small slice in a fraction of torch's time
    sources = {name: data.numpy() for name, data in arrays.items()}
    for index, chunk in enumerate(plan.chunks):
        seg = chunk.segments[0]
        entry = first_entry[seg.layer][seg.row] + seg.first
        group = first_group[seg.layer][seg.row] + (seg.first // form.group if form.group else 0)
        for name, (start, size) in chunk.offsets.items():
            if name == "lengths":
                data = np.array([s.entries for s in chunk.segments], dtype=np.int64).view(np.uint8)
            elif name in per_group:
                data = sources[name][group : group + chunk.groups]
            else:
                data = sources[name][entry : entry + chunk.entries]
            target[index, start : start + size] = data.reshape(-1)


def chunk_rows(chunk: Tensor, layout: ChunkLayout, plan: PoolPlan, first: int = 0, count: int | None = None) -> Rows:
    """Segments ``first … first + count − 1`` of a chunk as rows (:class:`QuantizedRows` or
    :class:`FloatRows`), views of its bytes.

    Args:
        chunk: the chunk's ``chunk_bytes`` uint8 bytes (from :func:`pack_pool`, or an engine's block).
        layout: its layout in the plan.
        plan: the pool's plan.

    Raises:
        PoolError: the chunk's header does not match its layout (another chunk, or damaged bytes).
    """
    form = _form(plan)
    count = len(layout.segments) - first if count is None else count
    header = chunk[:HEADER_BYTES].view(torch.int32).tolist()
    if header[:3] != [_as_int32(CHUNK_MAGIC), len(layout.segments), plan.flags]:
        raise PoolError("a chunk's header does not match the pool's plan (not this cache's chunk)")
    sizes = [s.entries for s in layout.segments]
    entry0, entries = sum(sizes[:first]), sum(sizes[first : first + count])
    group0 = sum(form.groups(n) for n in sizes[:first])
    groups = sum(form.groups(n) for n in sizes[first : first + count])

    def array(name: str, dtype: torch.dtype, start: int, n: int, width: int = 1) -> Tensor:
        offset = layout.offsets[name][0]
        item = torch.empty(0, dtype=dtype).element_size() * width
        return chunk[offset + start * item : offset + (start + n) * item].view(dtype).view(n, width)

    lengths = array("lengths", torch.int64, first, count)[:, 0]
    log_mass = array("log_mass", torch.float32, entry0, entries)[:, 0] if plan.beta else None
    if plan.config is None:
        return FloatRows(
            lengths=lengths,
            keys=array("keys", plan.dtype, entry0, entries, plan.head_dim),
            values=array("values", plan.dtype, entry0, entries, plan.value_dim),
            log_mass=log_mass,
        )
    kb, vb = plan.head_dim * plan.config.bits // 8, plan.value_dim * plan.config.bits // 8
    return QuantizedRows(
        config=plan.config,
        lengths=lengths,
        key_codes=array("key_codes", torch.uint8, entry0, entries, kb),
        value_codes=array("value_codes", torch.uint8, entry0, entries, vb),
        key_scale=array("key_scale", torch.float16, group0, groups, plan.head_dim),
        key_zero=array("key_zero", torch.float16, group0, groups, plan.head_dim),
        value_scale=array("value_scale", torch.float16, entry0, entries),
        value_zero=array("value_zero", torch.float16, entry0, entries),
        log_mass=log_mass,
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
        _merge_parts(top, den, num, owners, *stored_part(queries.index_select(0, owners), stored, scaling))
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
