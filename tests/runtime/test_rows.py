"""FloatRows: rows of different lengths at full precision, one after another (the stored rows of a
FoldedLayer that is not quantized), and their part of the attention."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.runtime import rows as rows_module
from kvfold.runtime.quantized_attention import merge_with_tail, stored_part
from kvfold.runtime.rows import NEG_INF, FloatRows, float_part, grow_capacity, ragged_saves_memory
from tests.conftest import CharTokenizer, make_tiny_model

D = 4
STEPS = 35
"""Decode steps that take every row of the end-to-end test well past its stored length."""


def _padded_rows(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    rows = len(lengths)
    keys, values = torch.randn(rows, width, D), torch.randn(rows, width, D)
    log_mass = torch.randn(rows, width)
    return keys, values, log_mass, torch.tensor(lengths)


def test_padded_rows_round_trip_and_hold_their_entries_only():
    lengths = [0, 1, 16, 17, 48]
    keys, values, log_mass, lens = _padded_rows(lengths, 48)
    log_mass[3, 2] = NEG_INF  # an empty slot inside a row stays the row's
    rows = FloatRows.from_padded(keys, values, log_mass, lens)
    assert rows.num_rows == len(lengths) and rows.width == 48
    assert torch.equal(rows.lengths, lens) and rows.keys.shape == (sum(lengths), D)
    k, v, lm = rows.to_padded()
    for r, n in enumerate(lengths):
        assert torch.equal(k[r, :n], keys[r, :n]) and torch.equal(v[r, :n], values[r, :n])
        assert torch.equal(lm[r, :n], log_mass[r, :n])
        assert (lm[r, n:] == NEG_INF).all() and (k[r, n:] == 0).all()
    held = sum(t.untyped_storage().nbytes() for t in (rows.lengths, rows.keys, rows.values, rows.log_mass))
    assert rows.nbytes() == held == sum(lengths) * (2 * D * 4 + 4) + len(lengths) * 8
    assert rows.gpu_nbytes() == sum(lengths) * (2 * D * 2 + 4) + len(lengths) * 8
    plain = FloatRows.from_padded(keys, values, torch.zeros_like(log_mass), lens)
    assert plain.log_mass is None  # every β 0: none held, as the dense layout does


def test_selected_rows_are_the_rows_picked():
    lengths = [3, 0, 7, 2]
    keys, values, log_mass, lens = _padded_rows(lengths, 7)
    rows = FloatRows.from_padded(keys, values, log_mass, lens)
    picked = torch.tensor([2, 2, 0, 1])
    got = rows.select_rows(picked)
    want = FloatRows.from_padded(keys[picked], values[picked], log_mass[picked], lens[picked])
    for name, tensor in want.tensors().items():
        assert torch.equal(got.tensors()[name], tensor), name


def _reference_part(queries, keys, values, log_mass, lengths, scaling, tail_logits, tail_values):
    """Each row's softmax over its stored entries and its tail, in float64, one row at a time."""
    out = []
    for r, n in enumerate(lengths):
        logits = torch.cat([queries[r].double() @ keys[r, :n].double().T * scaling + log_mass[r, :n].double(),
                            tail_logits[r].double()], -1)  # fmt: skip
        out.append(torch.softmax(logits, -1) @ torch.cat([values[r, :n], tail_values[r]]).double())
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_stored_part_of_full_precision_rows_merged_with_a_tail_equals_float64(dtype):
    """:func:`float_part` (all rows at once) merged with a tail by log-sum-exp: every row's softmax
    over its own entries, β included, and its tail; an empty row and a row of −inf β included."""
    lengths = [0, 5, 1, 12, 3]
    keys, values, log_mass, lens = _padded_rows(lengths, 12)
    log_mass[3, 4] = NEG_INF
    log_mass[4, :3] = NEG_INF  # a row whose entries all hold nothing
    g = torch.Generator().manual_seed(1)
    queries = torch.randn(5, 6, D, generator=g, dtype=dtype)
    tail_logits = torch.randn(5, 6, 2, generator=g, dtype=dtype)
    tail_values = torch.randn(5, 2, D, generator=g, dtype=dtype)
    rows = FloatRows.from_padded(keys, values, log_mass, lens)
    part = stored_part(queries, rows, 0.5)
    assert part[0][0].eq(NEG_INF).all() and part[0][4].eq(NEG_INF).all()
    out = merge_with_tail(*part, tail_logits, tail_values)
    want = _reference_part(queries, keys, values, log_mass, lengths, 0.5, tail_logits, tail_values)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-12}
    torch.testing.assert_close(out.double(), want, **tol)
    no_rows = FloatRows.from_padded(keys[:0], values[:0], log_mass[:0], lens[:0])
    assert float_part(queries[:0], no_rows, 0.5)[0].numel() == 0
    top, den, num = float_part(queries, FloatRows.from_padded(keys, values, log_mass, torch.zeros_like(lens)), 0.5)
    assert top.eq(NEG_INF).all() and den.eq(0).all() and num.eq(0).all()  # rows without entries: nothing


def test_float_part_reads_every_row_in_a_fixed_number_of_operations(monkeypatch):
    """No loop over rows: the batched products run once whatever the number of rows."""
    calls = []
    for name in ("bmm", "baddbmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(rows_module.torch, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    for count in (2, 40):
        calls.clear()
        keys, values, log_mass, lens = _padded_rows([3 + i % 5 for i in range(count)], 8)
        float_part(torch.randn(count, 2, D), FloatRows.from_padded(keys, values, log_mass, lens), 0.5)
        assert len(calls) == 2


def test_capacity_grows_geometrically():
    assert grow_capacity(0, 5) == 16
    assert grow_capacity(800, 801) == 900
    assert grow_capacity(10, 100) == 100


def test_rows_go_ragged_only_when_padding_wastes_memory():
    assert not ragged_saves_memory(torch.tensor([64, 64, 60]), 64)
    assert ragged_saves_memory(torch.tensor([2, 128, 2]), 128)
    assert not ragged_saves_memory(torch.tensor([0, 0]), 0)


def _stored_entries(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's entries row after row, in slot order (slots with β = −inf skipped)."""
    keys, values, log_mass, _ = layer.padded()
    held = torch.isfinite(log_mass)
    return keys[held], values[held], log_mass[held]


def _assert_same_entries(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> None:
    """Equal up to float32 rounding: keys decoded after the first layer saw the two attention paths."""
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _masked_reference(cache: kvfold.FoldedCache) -> kvfold.FoldedCache:
    """The same cache unpacked into the dense layout, each row's tail masked with β = −inf."""
    reference = cache.copy()
    for _, layer in reference.folded_layers:
        keys, values, log_mass, _ = layer.padded()
        layer.replace(keys, values, log_mass)
        assert layer.stored is None
    return reference


def _step(model, cache, ids: list[int]) -> torch.Tensor:
    logical = cache.get_seq_length()
    pos = torch.arange(logical, logical + len(ids))[None]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=pos, use_cache=True)
    return out.logits[0, -1]


def test_a_ragged_cache_decoded_into_its_tail_reads_saves_and_takes_another_turn(tmp_path):
    """End to end on a tiny model: per-head lengths (stored rows), decode many tokens into the dense
    tail, then read ``layer.keys``, save and load, edit the batch and prefill a next turn — each
    compared with the same cache unpacked into the masked dense layout before decoding."""
    model = kvfold.enable(make_tiny_model("llama", num_key_value_heads=3, num_attention_heads=6))
    tokenizer = CharTokenizer()
    text = "the quick brown fox jumps over the lazy dog; " * 3
    context = kvfold.prefill(model, tokenizer, text, use_chat_template=False)
    cache = context.compress("global:knorm[online=false]", 0.2).cache
    assert all(isinstance(layer.stored, FloatRows) for _, layer in cache.folded_layers)
    reference = _masked_reference(cache)
    logits = context.last_logits[0]
    for _ in range(STEPS):
        token = int(logits.argmax())
        logits = _step(model, cache, [token])
        torch.testing.assert_close(logits, _step(model, reference, [token]), rtol=1e-5, atol=1e-5)
    for _, layer in cache.folded_layers:  # the stored rows as they were, the tokens in the tail
        assert isinstance(layer.stored, FloatRows) and layer.physical_length == layer.stored.width + STEPS
    paged_layers = dict(cache.folded_layers)
    for i, ref_layer in reference.folded_layers:
        layer = paged_layers[i]
        got = _stored_entries(layer)
        _assert_same_entries(got, _stored_entries(ref_layer))
        slot = layer.valid_mask()
        assert torch.equal(layer.keys[slot], got[0]) and torch.equal(layer.values[slot], got[1])

    kvfold.save_cache(cache, tmp_path / "paged.kvc", model)
    loaded = kvfold.load_cache(tmp_path / "paged.kvc", model)
    edited = cache.copy()
    edited.batch_repeat_interleave(2)
    edited.batch_select_indices(torch.tensor([1]))
    for i, layer in paged_layers.items():
        want = _stored_entries(layer)
        for other in (loaded, edited):
            for a, b in zip(_stored_entries(other.layers[i]), want, strict=True):
                assert torch.equal(a, b)

    turn = tokenizer("and then what happened?").input_ids
    want = _step(model, reference, turn)
    for other in (cache, loaded, edited):
        torch.testing.assert_close(_step(model, other, turn), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_format", [None, "int4"])
def test_the_index_a_decode_reads_is_built_before_a_step_is_compiled(kv_format):
    """``index_tensors()`` (what ``fix_tails`` calls before a step is compiled) builds the pages and the Triton
    kernels' splits and gives their tensors, so that a compiled step reads them instead of building them."""
    from kvfold.runtime.quant_config import QuantConfig
    from kvfold.runtime.quantize import QuantizedRows

    keys, values, beta, lengths = _padded_rows([5, 40, 0, 77], 80)
    keys, values = keys.repeat(1, 1, 4), values.repeat(1, 1, 4)  # a head dimension that packs (16)
    if kv_format is None:
        stored = FloatRows.from_padded(keys, values, beta, lengths)
    else:
        stored = QuantizedRows.from_padded(keys, values, beta, lengths, QuantConfig.parse(kv_format))
    assert "pages" not in stored.__dict__
    held = stored.index_tensors()
    pages = stored.__dict__["pages"]
    assert "splits" in pages.__dict__ and "first_page" in pages.__dict__
    ids = {id(t) for t in held}
    assert all(id(t) in ids for t in (pages.row, pages.slots, pages.bias, pages.first_page, *pages.splits.tensors()))
