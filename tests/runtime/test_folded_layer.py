"""FoldedLayer on its own: checks of what it stores, growth, the logical length and its tail's accessors."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.folded_layer import FoldedLayer

HKV, D = 3, 8


def _filled(k: torch.Tensor) -> FoldedLayer:
    layer = FoldedLayer()
    layer.update(k, k.clone())
    return layer


def test_replace_rejects_nan_and_inf():
    k = torch.randn(1, HKV, 8, D)
    layer = _filled(k)
    bad = k.clone()
    bad[0, 1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer.replace(bad, k)
    beta = torch.zeros(1, HKV, 8)
    beta[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer.replace(k, k, beta)


def test_crop_is_refused_with_a_clear_error():
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        _filled(torch.randn(1, HKV, 4, D)).crop(-1)


def test_folded_layer_dense_growth_is_amortised():
    layer = _filled(torch.randn(1, HKV, 100, D))
    capacities = set()
    for _ in range(50):
        layer.update(torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D))
        capacities.add(layer.nbytes())
    assert len(capacities) <= 5  # a handful of reallocations for 50 steps, not one per step


def test_logical_length_survives_compression():
    k = torch.randn(1, HKV, 20, D)
    layer = _filled(k)
    layer.replace(k[:, :, :5], k[:, :, :5].clone())
    assert layer.get_seq_length() == 20
    assert layer.physical_length == 5
    assert layer.get_mask_sizes(1) == (6, 15)


def test_the_tail_is_read_as_views_of_its_slots_in_use():
    """:meth:`FoldedLayer.tail`: the filled slots only (not the spare capacity), no copy, β None while
    every β is 0 and the stored β once one is set."""
    k, v = torch.randn(1, HKV, 10, D), torch.randn(1, HKV, 10, D)
    layer = FoldedLayer()
    layer.update(k, v)
    layer.update(k[:, :, :1], v[:, :, :1])  # grows the capacity beyond the 11 slots in use
    keys, values, beta = layer.tail()
    assert layer.tail_length == 11 and keys.shape == (1, HKV, 11, D) and beta is None
    assert torch.equal(keys[:, :, :10], k) and torch.equal(values[:, :, 10], v[:, :, 0])
    assert keys.untyped_storage().data_ptr() == layer.tail()[0].untyped_storage().data_ptr()  # a view
    layer.set_log_mass(torch.full((1, HKV, 11), 0.5))
    assert torch.equal(layer.tail()[2], torch.full((1, HKV, 11), 0.5))


def test_an_adopted_tail_is_held_as_it_is():
    """:meth:`FoldedLayer.adopt_tail`: the tensors become the tail, uncopied, with their length."""
    layer = _filled(torch.randn(1, HKV, 4, D))
    keys, values, beta = torch.randn(1, HKV, 7, D), torch.randn(1, HKV, 7, D), torch.randn(1, HKV, 7)
    layer.adopt_tail(keys, values, beta)
    assert layer.tail_length == 7 and layer.physical_length == 7
    held = layer.tail()
    assert held[0].data_ptr() == keys.data_ptr() and torch.equal(held[2], beta)
    assert torch.equal(layer.row_lengths(), torch.full((1, HKV), 7))


def test_a_tail_made_under_inference_mode_is_made_writable_once():
    """Outside ``torch.inference_mode`` a tail made inside it is copied (its content kept) so that a
    later pass may write to it in place; a writable tail, or a call inside the mode, is left as it is."""
    with torch.inference_mode():
        layer = _filled(torch.randn(1, HKV, 6, D))
        layer.make_tail_writable()
        assert layer.tail()[0].is_inference()  # inside the mode: nothing to do
    before = layer.tail()[0].clone()
    layer.make_tail_writable()
    keys = layer.tail()[0]
    assert not keys.is_inference() and torch.equal(keys, before)
    pointer = keys.data_ptr()
    layer.make_tail_writable()
    assert layer.tail()[0].data_ptr() == pointer  # already writable: no copy
    layer.dense_buffers()[0][0, 0, 0, 0] = 1.0  # an in-place write works outside the mode
