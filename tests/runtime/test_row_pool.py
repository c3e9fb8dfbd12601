"""Quantized rows packed into fixed-size chunks (kvfold.runtime.row_pool): the chunks hold the rows'
own bytes, every layer's segments share them, and attention over a layer's segments equals the
attention over its rows."""

from __future__ import annotations

import math

import pytest
import torch

from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.quantized_attention import attend_stored
from kvfold.runtime.row_pool import (
    FLAG_BETA,
    FLAG_ROTATED,
    FloatRows,
    PoolError,
    attend_layer,
    chunk_rows,
    pack_pool,
    plan_pool,
)

D = 64
SCALING = D**-0.5
CHUNK = 32 * 3 * 2 * D * 4 // 4  # a quarter of a vLLM block of SmolLM2 in float32: many splits


def _layers(fmt: str, lengths: list[list[int]], seed: int = 0, beta: bool = True) -> list[QuantizedRows]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for row_lengths in lengths:
        width = max(max(row_lengths), 1)
        rows = len(row_lengths)
        keys = torch.randn(rows, width, D, generator=g) * 2
        keys[:, :, 5] += 6.0
        values = torch.randn(rows, width, D, generator=g)
        log_mass = torch.randn(rows, width, generator=g) if beta else None
        out.append(QuantizedRows.from_padded(keys, values, log_mass, torch.tensor(row_lengths), QuantConfig.parse(fmt)))
    return out


RAGGED = [[300, 0, 41], [7, 500, 33], [0, 0, 0], [96, 97, 95]]


@pytest.mark.parametrize("fmt", ["int4", "int3", "int8", "int2", "int4[key_group=16]"])
@pytest.mark.parametrize("beta", [True, False], ids=["beta", "no-beta"])
def test_attention_over_a_layers_segments_equals_the_attention_over_its_rows(fmt, beta):
    layers = _layers(fmt, RAGGED, beta=beta)
    plan, chunks = pack_pool(layers, CHUNK)
    assert plan.num_chunks > len(layers)  # rows were cut across chunks
    g = torch.Generator().manual_seed(1)
    for index, stored in enumerate(layers):
        queries = torch.randn(3, 5, D, generator=g)
        tail_keys, tail_values = torch.randn(3, 4, D, generator=g), torch.randn(3, 4, D, generator=g)
        tail_logits = queries @ tail_keys.transpose(1, 2) * SCALING
        tail_logits[:, 0, -1] = float("-inf")
        expected = attend_stored(queries, tail_logits, tail_values, stored, SCALING)
        got = attend_layer(queries, tail_logits, tail_values, list(chunks), plan, index, SCALING)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_every_entry_is_in_exactly_one_segment_and_its_codes_are_the_rows_own():
    layers = _layers("int4", RAGGED)
    plan, chunks = pack_pool(layers, CHUNK)
    covered = {(layer, row): [] for layer, lengths in enumerate(RAGGED) for row in range(len(lengths))}
    for index, layout in enumerate(plan.chunks):
        assert layout.used_bytes <= plan.chunk_bytes
        rows = chunk_rows(chunks[index], layout, plan)
        first_entry = 0
        for position, seg in enumerate(layout.segments):
            assert int(rows.lengths[position]) == seg.entries
            stored = layers[seg.layer]
            start = stored.row_ranges()[seg.row][0] + seg.first
            own = stored.key_codes[start : start + seg.entries]
            assert torch.equal(rows.key_codes[first_entry : first_entry + seg.entries], own)
            assert seg.first % stored.config.key_group == 0 or (
                seg.first // stored.config.key_group == (seg.first + seg.entries - 1) // stored.config.key_group
            )  # a segment starts on a key group or lies inside one
            covered[(seg.layer, seg.row)].append((seg.first, seg.entries))
            first_entry += seg.entries
    for (layer, row), runs in covered.items():
        runs.sort()
        assert sum(n for _, n in runs) == RAGGED[layer][row]
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:], strict=False))


def test_the_pool_holds_about_the_rows_bytes():
    """With a real block size (SmolLM2 in float32: 32 tokens × 3 heads × 128 channels × 4 bytes), the
    chunks hold within 3% of the rows' bytes: cuts cost a header, alignment and a key group's scales."""
    g = torch.Generator().manual_seed(2)
    lengths = [[int(n) for n in torch.randint(0, 900, (3,), generator=g)] for _ in range(30)]
    layers = _layers("int4", lengths)
    plan, _ = pack_pool(layers, 32 * 3 * 128 * 4)
    rows_bytes = sum(s.nbytes() for s in layers)
    assert plan.nbytes <= 1.03 * rows_bytes + plan.chunk_bytes
    per_layer = max(math.ceil(s.nbytes() / plan.chunk_bytes) for s in layers) * len(layers)
    assert plan.num_chunks < per_layer  # one pool beats a layer's own blocks


def test_a_chunk_of_another_plan_is_refused():
    layers = _layers("int4", RAGGED)
    plan, chunks = pack_pool(layers, CHUNK)
    with pytest.raises(PoolError, match="header"):
        chunk_rows(torch.zeros_like(chunks[0]), plan.chunks[0], plan)
    with pytest.raises(PoolError, match="header"):
        chunk_rows(chunks[1], plan.chunks[0], plan)


def test_formats_the_pool_does_not_hold_are_refused():
    for fmt in ("fp8", "int4[outliers=1]", "int4[value_group=16]"):
        with pytest.raises(PoolError):
            plan_pool([torch.tensor([3])], QuantConfig.parse(fmt), D, D, CHUNK, beta=True)
    rotated = plan_pool([torch.tensor([3])], QuantConfig.parse("int3[rotate=1]"), D, D, CHUNK, beta=True)
    assert rotated.flags == FLAG_BETA | FLAG_ROTATED  # every chunk's header says how its values lie
    with pytest.raises(PoolError, match="cannot hold one entry"):
        plan_pool([torch.tensor([3])], QuantConfig.parse("int4"), D, D, 64, beta=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_full_precision_pack_at_their_own_bytes_and_attend_as_a_float64_softmax(dtype):
    g = torch.Generator().manual_seed(4)
    layers = []
    for lengths in RAGGED:
        width = max(max(lengths), 1)
        log_mass = torch.randn(3, width, generator=g)
        log_mass[torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]] = float("-inf")
        keys = torch.randn(3, width, D, generator=g).to(dtype)
        layers.append(FloatRows.from_padded(keys, torch.randn(3, width, D, generator=g).to(dtype), log_mass))
    plan, chunks = pack_pool(layers, CHUNK)
    rows_bytes = sum(rows.nbytes() for rows in layers)
    assert plan.num_chunks > len(layers) and plan.nbytes <= 1.06 * rows_bytes + plan.chunk_bytes
    for index, rows in enumerate(layers):
        queries = torch.randn(3, 2, D, generator=g)
        tail_keys, tail_values = torch.randn(3, 4, D, generator=g), torch.randn(3, 4, D, generator=g)
        tail_logits = queries @ tail_keys.transpose(1, 2) * SCALING
        got = attend_layer(queries, tail_logits, tail_values, list(chunks), plan, index, SCALING)
        for row, (first, n, _, _) in enumerate(rows.row_ranges()):
            keys = rows.keys[first : first + n].double()
            beta = torch.zeros(n, dtype=torch.float64) if rows.log_mass is None else rows.log_mass[first : first + n]
            logits = torch.cat(
                [queries[row].double() @ keys.T * SCALING + beta.double(), tail_logits[row].double()], -1
            )
            values = torch.cat([rows.values[first : first + n].double(), tail_values[row].double()])
            torch.testing.assert_close(got[row].double(), torch.softmax(logits, -1) @ values, rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------------- the plan and the bytes, by definition
def _array_costs(fmt: str | None, dtype: torch.dtype, beta: bool) -> list[tuple[str, int, int, int]]:
    """A chunk's arrays as the module docstring lays them out: name, bytes a segment, an entry, a key group."""
    arrays = [("lengths", 8, 0, 0)]
    if fmt is None:
        element = torch.empty(0, dtype=dtype).element_size()
        arrays += [("keys", 0, D * element, 0), ("values", 0, D * element, 0)]
    else:
        bits = QuantConfig.parse(fmt).bits
        arrays += [("key_codes", 0, D * bits // 8, 0), ("value_codes", 0, D * bits // 8, 0),
                   ("key_scale", 0, 0, 2 * D), ("key_zero", 0, 0, 2 * D), ("value_scale", 0, 2, 0),
                   ("value_zero", 0, 2, 0)]  # fmt: skip
    return arrays + ([("log_mass", 0, 4, 0)] if beta else [])


def _bytes_used(arrays, segments: int, entries: int, groups: int) -> int:
    at = end = 16
    for _, per_segment, per_entry, per_group in arrays:
        at = -(-end // 16) * 16
        end = at + per_segment * segments + per_entry * entries + per_group * groups
    return end


def _greedy_plan(lengths: list[list[int]], arrays, group: int | None, chunk_bytes: int) -> list[list[tuple]]:
    """Segments chunk by chunk, one entry at a time: a run (a row's rest, or the rest of the key group it
    starts inside) goes into the chunk while one more entry fits."""
    chunks, current, entries, groups = [], [], 0, 0

    def count(n: int) -> int:
        return 0 if group is None else -(-n // group)

    for layer, row_lengths in enumerate(lengths):
        for row, length in enumerate(row_lengths):
            first = 0
            while first < length:
                phase = 0 if group is None else first % group
                limit = length - first if phase == 0 else min(length - first, group - phase)
                n = 0
                while n < limit and _bytes_used(arrays, len(current) + 1, entries + n + 1,
                                                groups + count(n + 1)) <= chunk_bytes:  # fmt: skip
                    n += 1
                if n == 0:
                    chunks.append(current)
                    current, entries, groups = [], 0, 0
                    continue
                current.append((layer, row, first, n))
                entries, groups, first = entries + n, groups + count(n), first + n
    return chunks + ([current] if current else [])


def _chunk_bytes_by_segment(layers, plan, index: int) -> torch.Tensor:
    """Chunk ``index`` written segment by segment from the rows' own tensors, as the docstring lays it out."""
    chunk = plan.chunks[index]
    out = torch.zeros(plan.chunk_bytes, dtype=torch.uint8)
    out[:16] = torch.tensor([0x4346564B, len(chunk.segments), plan.flags, 0], dtype=torch.int32).view(torch.uint8)
    parts = {name: [] for name in chunk.offsets}
    for seg in chunk.segments:
        rows = layers[seg.layer]
        first, _, group0, _ = rows.row_ranges()[seg.row]
        entries = slice(first + seg.first, first + seg.first + seg.entries)
        parts["lengths"].append(torch.tensor([seg.entries]))
        if isinstance(rows, FloatRows):
            parts["keys"].append(rows.keys[entries])
            parts["values"].append(rows.values[entries])
        else:
            size = rows.config.key_group
            groups = slice(group0 + seg.first // size, group0 + seg.first // size + -(-seg.entries // size))
            parts["key_codes"].append(rows.key_codes[entries])
            parts["value_codes"].append(rows.value_codes[entries])
            parts["key_scale"].append(rows.key_scale[groups].half())
            parts["key_zero"].append(rows.key_zero[groups].half())
            parts["value_scale"].append(rows.value_scale[entries, 0].half())
            parts["value_zero"].append(rows.value_zero[entries, 0].half())
        if plan.beta:
            beta = rows.log_mass
            parts["log_mass"].append(torch.zeros(seg.entries) if beta is None else beta[entries].float())
    for name, (start, size) in chunk.offsets.items():
        if size:
            out[start : start + size] = torch.cat([p.reshape(-1) for p in parts[name]]).view(torch.uint8)
    return out


def _mixed_layers(fmt: str | None, dtype: torch.dtype, lengths: list[list[int]], seed: int) -> list:
    """Layers of ``lengths``, every other one without β, quantized in ``fmt`` or at full precision."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for index, row_lengths in enumerate(lengths):
        width = max(max(row_lengths), 1)
        shape = (len(row_lengths), width)
        keys, values = torch.randn(*shape, D, generator=g), torch.randn(*shape, D, generator=g)
        log_mass = torch.randn(*shape, generator=g) if index % 2 == 0 else None
        if fmt is None:  # β of zeros: stored as none
            beta = torch.zeros(shape) if log_mass is None else log_mass
            rows = FloatRows.from_padded(keys.to(dtype), values.to(dtype), beta, torch.tensor(row_lengths))
        else:
            rows = QuantizedRows.from_padded(keys, values, log_mass, torch.tensor(row_lengths), QuantConfig.parse(fmt))
        out.append(rows)
    return out


@pytest.mark.parametrize(
    ("fmt", "dtype"),
    [("int4", None), ("int3", None), ("int2", None), ("int8", None), ("int4[key_group=16]", None),
     ("int3[rotate=1]", None), (None, torch.float32), (None, torch.bfloat16)],
)  # fmt: skip
@pytest.mark.parametrize("chunk_bytes", [1024, 3072, 12288])
def test_the_plan_is_the_greedy_packing_and_every_chunk_holds_its_segments_bytes(fmt, dtype, chunk_bytes):
    """The planner's search and the writer's runs give what packing one entry at a time and writing one
    segment at a time give: the same segments in the same chunks, byte for byte."""
    g = torch.Generator().manual_seed(chunk_bytes)
    lengths = [[int(n) for n in torch.randint(0, 300, (3,), generator=g)] for _ in range(5)]
    lengths[1][0], lengths[3] = 0, [0, 0, 0]
    layers = _mixed_layers(fmt, dtype or torch.float32, lengths, seed=chunk_bytes)
    plan, chunks = pack_pool(layers, chunk_bytes)
    group = None if fmt is None else QuantConfig.parse(fmt).key_group
    expected = _greedy_plan(lengths, _array_costs(fmt, dtype or torch.float32, beta=True), group, chunk_bytes)
    assert [[(s.layer, s.row, s.first, s.entries) for s in c.segments] for c in plan.chunks] == expected
    for index in range(plan.num_chunks):
        assert torch.equal(chunks[index], _chunk_bytes_by_segment(layers, plan, index)), index


def test_no_rows_pack_into_no_chunks():
    plan, chunks = pack_pool(_mixed_layers("int4", torch.float32, [[0, 0, 0], [0, 0, 0]], seed=0), CHUNK)
    assert plan.num_chunks == 0 and chunks.shape == (0, CHUNK)
