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
