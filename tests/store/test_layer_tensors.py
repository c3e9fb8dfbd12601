"""A layer as the tensors a cache file holds, and back (:mod:`kvfold.store.layer_tensors`)."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quant_config import QuantConfig
from kvfold.store.layer_tensors import layer_from_tensors, layer_tensors

B, H, N, D = 2, 3, 24, 8


def _layer(seed: int = 0) -> FoldedLayer:
    torch.manual_seed(seed)
    layer = FoldedLayer()
    keys, values = torch.randn(B, H, N, D), torch.randn(B, H, N, D)
    layer.update(keys, values)
    return layer


def _ragged(layer: FoldedLayer) -> FoldedLayer:
    keys, values, _, _ = layer.padded()
    beta = torch.randn(B, H, N)
    layer.replace(keys, values, beta, lengths=torch.tensor([[3, 24, 7], [12, 1, 5]]))
    return layer


def _rebuilt(layer: FoldedLayer, quant: QuantConfig | None = None) -> tuple[str, dict, FoldedLayer]:
    layer.logical_length = 40
    layout, tensors = layer_tensors(layer, queries=True)
    rebuilt = layer_from_tensors(layout, tensors, logical_length=40, batch_size=B, num_heads=H, quant=quant)
    return layout, tensors, rebuilt


def _same_contents(a: FoldedLayer, b: FoldedLayer) -> None:
    for x, y in zip(a.padded(), b.padded(), strict=True):
        assert torch.equal(x, y)
    assert a.logical_length == b.logical_length


def test_a_dense_layer_is_its_tail_and_comes_back_the_same():
    layer = _layer()
    layer.update(torch.randn(B, H, 2, D), torch.randn(B, H, 2, D))  # capacity beyond the entries
    layer.entry_stats = {"acc": torch.arange(B * H * (N + 2.0)).view(B, H, N + 2)}
    layer.captured_queries = torch.randn(B, 6, 4, D)
    layout, tensors, rebuilt = _rebuilt(layer)
    assert layout == "dense" and "log_mass" not in tensors  # every β 0: none stored
    assert tensors["keys"].shape == (B, H, N + 2, D)  # the entries, not the capacity
    _same_contents(layer, rebuilt)
    assert torch.equal(rebuilt.entry_stats["acc"], layer.entry_stats["acc"])
    assert torch.equal(rebuilt.captured_queries, layer.captured_queries)


def test_ragged_rows_are_stored_entry_after_entry_and_come_back_the_same():
    layer = _ragged(_layer(1))
    layer.update(torch.randn(B, H, 1, D), torch.randn(B, H, 1, D))  # a tail after the stored rows
    width = layer.stored.width
    stat = torch.randn(B, H, width + 1)
    layer.entry_stats = {"s": stat}
    layout, tensors, rebuilt = _rebuilt(layer)
    lengths = torch.tensor([[3, 24, 7], [12, 1, 5]]) + 1
    assert layout == "paged" and torch.equal(tensors["row_lengths"], lengths)
    assert tensors["keys"].shape == (int(lengths.sum()), D)  # no padding in the file
    # one row's entries in slot order: its stored entries, then its tail
    keys, _, _, _ = layer.padded()
    assert torch.equal(tensors["keys"][:3], keys[0, 0, :3]) and torch.equal(tensors["keys"][3], keys[0, 0, width])
    assert torch.equal(rebuilt.row_lengths(), lengths)
    _, _, beta, _ = layer.padded()
    _, _, beta_back, _ = rebuilt.padded()
    valid = torch.isfinite(beta)
    assert torch.equal(beta[valid], beta_back[torch.isfinite(beta_back)])
    assert torch.equal(rebuilt.entry_stats["s"][rebuilt.valid_mask()], stat[layer.valid_mask()])


def test_quantized_rows_keep_their_codes_and_need_their_format():
    layer = _ragged(_layer(2))
    config = QuantConfig.parse("int4")
    layer.quantize(config)
    layout, tensors, rebuilt = _rebuilt(layer, quant=config)
    assert layout == "quantized" and any(name.startswith("q.") for name in tensors)
    for name, t in layer.stored.tensors().items():
        assert torch.equal(rebuilt.stored.tensors()[name], t)
    _same_contents(layer, rebuilt)
    with pytest.raises(ValueError, match="names no KV format"):
        layer_from_tensors(layout, tensors, logical_length=40, batch_size=B, num_heads=H)


def test_inconsistent_tensors_and_unknown_layouts_are_refused():
    _, tensors, _ = _rebuilt(_layer(3))
    with pytest.raises(ValueError, match="disagree"):
        layer_from_tensors("dense", tensors, logical_length=40, batch_size=B, num_heads=H + 1)
    _, paged, _ = _rebuilt(_ragged(_layer(4)))
    paged["row_lengths"] = paged["row_lengths"] + 1
    with pytest.raises(ValueError, match="do not add up"):
        layer_from_tensors("paged", paged, logical_length=40, batch_size=B, num_heads=H)
    with pytest.raises(ValueError, match="unknown layer layout"):
        layer_from_tensors("sparse", tensors, logical_length=40, batch_size=B, num_heads=H)
