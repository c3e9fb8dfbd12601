"""PagedRows: rows of different lengths in fixed-size blocks (the paged layout of a FoldedLayer)."""

from __future__ import annotations

import pytest
import torch

import kvfold
from kvfold.runtime.paged import BLOCK_SIZE, NEG_INF, PagedRows, grow_capacity, paging_saves_memory
from tests.conftest import CharTokenizer, make_tiny_model

D = 4


def _padded_rows(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    rows = len(lengths)
    keys, values = torch.randn(rows, width, D), torch.randn(rows, width, D)
    log_mass = torch.randn(rows, width)
    return keys, values, log_mass, torch.tensor(lengths)


def test_padded_rows_round_trip_and_hold_one_block_per_started_block():
    lengths = [0, 1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE]
    keys, values, log_mass, lens = _padded_rows(lengths, 3 * BLOCK_SIZE)
    pages = PagedRows.from_padded(keys, values, log_mass, lens)
    assert pages.num_rows == len(lengths)
    assert pages.num_blocks == 1 + 1 + 1 + 2 + 3  # an empty row still owns one block
    k, v, lm, back = pages.to_padded()
    assert torch.equal(back, lens)
    for r, n in enumerate(lengths):
        assert torch.equal(k[r, :n], keys[r, :n]) and torch.equal(v[r, :n], values[r, :n])
        assert torch.equal(lm[r, :n], log_mass[r, :n])
        assert (lm[r, n:] == NEG_INF).all()


def test_append_one_fills_blocks_and_opens_new_ones():
    lengths = [BLOCK_SIZE - 2, BLOCK_SIZE, 2]
    keys, values, log_mass, lens = _padded_rows(lengths, BLOCK_SIZE)
    pages = PagedRows.from_padded(keys, values, log_mass, lens)
    new_k, new_v = torch.randn(3, D), torch.randn(3, D)
    pages.append_one(new_k, new_v)
    assert pages.num_blocks == 1 + 2 + 1  # row 1 was full: it opened a block, the others had room
    assert pages.block_row[: pages.num_blocks].tolist() == [0, 1, 2, 1]
    assert pages.row_last_block.tolist() == [0, 3, 2]
    assert torch.equal(pages.keys[3, 0], new_k[1]) and torch.equal(pages.values[3, 0], new_v[1])
    assert pages.log_mass[3, 0] == 0 and (pages.log_mass[3, 1:] == NEG_INF).all()
    assert pages.row_lengths.tolist() == [n + 1 for n in lengths]
    held = sum(t.untyped_storage().nbytes() for t in pages.tensors())
    assert held >= pages.num_blocks * BLOCK_SIZE * D * 4 * 2


def test_append_one_within_blocks_reads_back_padded():
    lengths = [BLOCK_SIZE - 2, 5, 2]
    keys, values, log_mass, lens = _padded_rows(lengths, BLOCK_SIZE)
    pages = PagedRows.from_padded(keys, values, log_mass, lens)
    new_k, new_v = torch.randn(3, D), torch.randn(3, D)
    pages.append_one(new_k, new_v)
    pages.append_one(new_k, new_v)
    k, v, lm, back = pages.to_padded()
    assert back.tolist() == [n + 2 for n in lengths]
    for r, n in enumerate(lengths):
        assert torch.equal(k[r, :n], keys[r, :n]) and torch.equal(lm[r, :n], log_mass[r, :n])
        assert torch.equal(k[r, n : n + 2], new_k[r].expand(2, D))
        assert torch.equal(v[r, n : n + 2], new_v[r].expand(2, D))
        assert (lm[r, n : n + 2] == 0).all()


@pytest.mark.parametrize(
    "lengths",
    [
        [BLOCK_SIZE, 3, BLOCK_SIZE],  # the old contiguous numbering raised IndexError
        [3 * BLOCK_SIZE - 1, BLOCK_SIZE, 2],  # ... and here silently read the wrong blocks
    ],
)
def test_to_padded_after_append_one_opened_a_block(lengths):
    """A block opened by a decode step lands after every block in use, not next to its row's
    blocks: ``to_padded`` follows each row's blocks in order instead of assuming contiguity."""
    keys, values, log_mass, lens = _padded_rows(lengths, max(lengths))
    pages = PagedRows.from_padded(keys, values, log_mass, lens)
    new_k, new_v = torch.randn(len(lengths), D), torch.randn(len(lengths), D)
    pages.append_one(new_k, new_v)
    assert pages.block_row[: pages.num_blocks].tolist() != sorted(pages.block_row[: pages.num_blocks].tolist())
    k, v, lm, back = pages.to_padded()
    assert back.tolist() == [n + 1 for n in lengths]
    for r, n in enumerate(lengths):
        assert torch.equal(k[r, :n], keys[r, :n]) and torch.equal(v[r, :n], values[r, :n])
        assert torch.equal(lm[r, :n], log_mass[r, :n])
        assert torch.equal(k[r, n], new_k[r]) and torch.equal(v[r, n], new_v[r]) and lm[r, n] == 0
        assert (lm[r, n + 1 :] == NEG_INF).all()


def test_to_padded_follows_rows_across_many_decode_steps():
    """Against a list-of-entries model of every row, after each of many decode steps."""
    lengths = [0, 1, 5, BLOCK_SIZE - 1, BLOCK_SIZE, 2 * BLOCK_SIZE + 3]
    keys, values, log_mass, lens = _padded_rows(lengths, max(lengths))
    pages = PagedRows.from_padded(keys, values, log_mass, lens)
    expected = [[(keys[r, i], values[r, i], float(log_mass[r, i])) for i in range(n)] for r, n in enumerate(lengths)]
    for step in range(3 * BLOCK_SIZE + 2):
        new_k, new_v = torch.randn(len(lengths), D), torch.randn(len(lengths), D)
        pages.append_one(new_k, new_v)
        for r, row in enumerate(expected):
            row.append((new_k[r], new_v[r], 0.0))
        k, v, lm, back = pages.to_padded()
        assert back.tolist() == [len(row) for row in expected]
        for r, row in enumerate(expected):
            assert torch.equal(k[r, : len(row)], torch.stack([e[0] for e in row])), f"step {step} row {r}"
            assert torch.equal(v[r, : len(row)], torch.stack([e[1] for e in row])), f"step {step} row {r}"
            assert lm[r, : len(row)].tolist() == [e[2] for e in row], f"step {step} row {r}"
            assert (lm[r, len(row) :] == NEG_INF).all()


def test_capacity_grows_geometrically():
    assert grow_capacity(0, 5) == 16
    assert grow_capacity(800, 801) == 900
    assert grow_capacity(10, 100) == 100


def test_paging_only_when_padding_wastes_memory():
    assert not paging_saves_memory(torch.tensor([64, 64, 60]), 64)
    assert paging_saves_memory(torch.tensor([2, 128, 2]), 128)
    assert not paging_saves_memory(torch.tensor([0, 0]), 0)


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
        assert layer.paged is None
    return reference


def _step(model, cache, ids: list[int]) -> torch.Tensor:
    logical = cache.get_seq_length()
    pos = torch.arange(logical, logical + len(ids))[None]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=pos, use_cache=True)
    return out.logits[0, -1]


def test_a_paged_cache_decoded_past_a_block_boundary_reads_saves_and_takes_another_turn(tmp_path):
    """End to end on a tiny model: per-head lengths (paged), decode until every row opened a block,
    then read ``layer.keys``, save and load, edit the batch and prefill a next turn — each compared
    with the same cache unpacked into the masked dense layout before decoding."""
    model = kvfold.enable(make_tiny_model("llama", num_key_value_heads=3, num_attention_heads=6))
    tokenizer = CharTokenizer()
    text = "the quick brown fox jumps over the lazy dog; " * 3
    context = kvfold.prefill(model, tokenizer, text, use_chat_template=False)
    cache = context.compress("global:knorm[online=false]", 0.2).cache
    assert all(layer.paged is not None for _, layer in cache.folded_layers)
    reference = _masked_reference(cache)
    logits = context.last_logits[0]
    for _ in range(BLOCK_SIZE + 2):  # every row crosses a block boundary
        token = int(logits.argmax())
        logits = _step(model, cache, [token])
        torch.testing.assert_close(logits, _step(model, reference, [token]), rtol=1e-5, atol=1e-5)
    for _, layer in cache.folded_layers:
        assert layer.paged is not None
        assert layer.paged.block_row[: layer.paged.num_blocks].diff().lt(0).any()  # rows' blocks interleave
    paged_layers = dict(cache.folded_layers)
    for i, ref_layer in reference.folded_layers:
        layer = paged_layers[i]
        got = _stored_entries(layer)
        _assert_same_entries(got, _stored_entries(ref_layer))
        slot = torch.arange(layer.physical_length)[None, None, :] < layer.row_lengths()[..., None]
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
