"""Values stored rotated (kvfold.runtime.value_rotation, QuantConfig.rotate): a fixed orthogonal
matrix, the same on every machine, and codes that keep an entry of uneven channels closer."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.quant_config import QuantConfig, QuantSpecError
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.value_rotation import rotate, rotate_back, rotation_signs, value_rotation


@pytest.mark.parametrize("dim", [1, 2, 8, 64, 128, 256])
def test_the_rotation_is_orthogonal(dim):
    t = value_rotation(dim, dtype=torch.float64)
    torch.testing.assert_close(t @ t.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(t.abs(), torch.full_like(t, dim**-0.5))  # every channel spread over all


def test_the_signs_are_pinned():
    """Files hold rotated codes: the matrix must never change between versions or machines."""
    assert rotation_signs(16) == [1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    assert value_rotation(4)[0].tolist() == [0.5, 0.5, 0.5, 0.5]


def test_rotate_back_undoes_rotate_and_other_dimensions_are_refused():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rotate_back(rotate(x)), x, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(rotate(x), x)
    with pytest.raises(ValueError, match="power of two; got 48"):
        rotate(torch.randn(2, 48))


def _stored_error(values: torch.Tensor, fmt: str) -> float:
    keys = torch.randn(values.shape, generator=torch.Generator().manual_seed(1))
    lengths = torch.full((values.shape[0],), values.shape[1])
    stored = QuantizedRows.from_padded(keys, values, None, lengths, QuantConfig.parse(fmt))
    return float((stored.to_padded()[1] - values).norm() / values.norm())


@pytest.mark.parametrize("fmt", ["int2", "int3", "int4"])
def test_rotated_values_come_back_closer_when_channels_differ(fmt):
    """Values with a few large channels (what one scale an entry codes worst): stored rotated they come
    back at least a third closer; keys are stored as they are either way."""
    g = torch.Generator().manual_seed(2)
    values = torch.randn(4, 40, 64, generator=g)
    values[..., [3, 17]] *= 12.0
    plain, rotated = _stored_error(values, fmt), _stored_error(values, f"{fmt}[rotate=1]")
    assert rotated < 0.67 * plain


def test_the_option_is_parsed_checked_and_named():
    assert QuantConfig.parse("int3[clip=1,rotate=1]") == QuantConfig(format="int3", clip=1, rotate=1)
    assert QuantConfig(format="int3", rotate=1).describe() == "int3[rotate=1]"
    with pytest.raises(QuantSpecError, match="rotate is 0"):
        QuantConfig(format="int3", rotate=2)


def test_a_value_dimension_that_is_not_a_power_of_two_is_refused_in_one_line():
    keys, values = torch.randn(2, 5, 48), torch.randn(2, 5, 48)
    with pytest.raises(QuantSpecError, match="power of two; this model's is 48: leave rotate out") as err:
        QuantizedRows.from_padded(keys, values, None, torch.tensor([5, 3]), QuantConfig(format="int3", rotate=1))
    assert "\n" not in str(err.value)
