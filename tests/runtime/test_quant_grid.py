"""Integer grids (kvfold.runtime.quant_grid): float16 min–max grids that cover their range, rounding
to codes and back, and the clipping search."""

from __future__ import annotations

import torch

from kvfold.runtime.codes import INT_BITS
from kvfold.runtime.quant_grid import CLIP_FACTORS, dequantize_minmax, group_params, minmax_params, quantize_minmax


def test_minmax_grid_covers_the_range_in_float16():
    low = torch.tensor([-3.3333, 40.1234, 0.5, 7.0])
    high = torch.tensor([2.7182, 77.7, 0.5, 7.0001])
    for bits in INT_BITS:
        scale, zero = minmax_params(low, high, bits)
        assert scale.dtype == zero.dtype == torch.float16
        assert (zero.float() <= low).all()
        assert (zero.float() + ((1 << bits) - 1) * scale.float() >= high).all()


def test_quantize_then_dequantize_helpers_agree():
    x = torch.linspace(-2, 5, 33)
    scale, zero = minmax_params(x.min(), x.max(), 4)
    back = dequantize_minmax(quantize_minmax(x, scale, zero, 4), scale, zero, torch.float32)
    assert (back - x).abs().max() <= scale.float() / 2 + 1e-6


def _squared_error(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (dequantize_minmax(quantize_minmax(x, scale, zero, 3), scale, zero, torch.float32) - x).square().sum()


def test_the_search_keeps_min_max_where_nothing_is_gained_and_clips_a_lone_tail():
    flat = torch.linspace(-1, 1, 8)[None]  # evenly spread: min–max is the best grid of 8 levels
    tail = torch.cat([torch.randn(1, 63, generator=torch.Generator().manual_seed(0)), torch.tensor([[9.0]])], -1)
    for x in (flat, tail):
        low, high = x.amin(-1), x.amax(-1)
        plain = minmax_params(low, high, 3)
        searched = group_params(x, low, high, 3, -1, clip=True)
        assert group_params(x, low, high, 3, -1, clip=False) == plain
        errors = [
            (
                dequantize_minmax(quantize_minmax(x, s[:, None], z[:, None], 3), s[:, None], z[:, None], torch.float32)
                - x
            )
            .square()
            .sum()
            for s, z in (plain, searched)
        ]
        if x is flat:
            assert torch.equal(searched[0], plain[0]) and torch.equal(searched[1], plain[1])
        else:
            assert errors[1] < errors[0] and searched[0] < plain[0]
    assert CLIP_FACTORS[0] == 1.0


def test_the_search_in_one_batch_picks_the_grids_of_one_factor_at_a_time(monkeypatch):
    """Every factor at once (small groups) and one after another (large ones) give the same grids,
    along either dimension and with a mask; ties go to the first factor both ways."""
    from kvfold.runtime import quant_grid

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, 16, generator=gen) * torch.rand(4, 1, 16, generator=gen).mul(4)
    x[0, 5, :] = 7.0  # a lone tail in some groups
    x[1] = torch.linspace(-1, 1, 8).repeat(4)[:, None]  # evenly spread: ties at min–max
    mask = (torch.rand(4, 32, 16, generator=gen) > 0.2).float()
    cases = [(dim, m) for dim in (1, -1) for m in (None, mask)]
    for bits in (2, 3, 4):
        for dim, m in cases:
            low, high = x.amin(dim), x.amax(dim)
            batched = group_params(x, low, high, bits, dim, True, m)
            with monkeypatch.context() as patch:
                patch.setattr(quant_grid, "CLIP_BATCH_ELEMENTS", 0)
                looped = group_params(x, low, high, bits, dim, True, m)
            assert torch.equal(batched[0], looped[0]) and torch.equal(batched[1], looped[1])
            plain = minmax_params(low, high, bits)
            assert not torch.equal(batched[0], plain[0])  # the search moved some grid
    # a range whose middle, in float32, does not give its ends back: factor 1 is still min–max itself
    low, high = torch.tensor([-0.0004962566308677197]), torch.tensor([1290.5985107421875])
    mid = (low + high) / 2
    moved, exact = minmax_params(mid - (mid - low), mid + (high - mid), 3), minmax_params(low, high, 3)
    assert not (torch.equal(moved[0], exact[0]) and torch.equal(moved[1], exact[1]))
    spread = torch.linspace(float(low), float(high), 8)[None]  # evenly spread: min–max is the best grid
    assert group_params(spread, low, high, 3, -1, True) == minmax_params(low, high, 3)
