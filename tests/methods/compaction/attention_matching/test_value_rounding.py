"""Fitted values rounded with error feedback (GPTQ's update) before they are stored in codes."""

import pytest
import torch

from kvfold.methods.compaction.attention_matching.value_rounding import feedback_round, round_entries
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows

INT3 = QuantConfig(format="int3")


def _problem(P: int = 4, n: int = 24, t: int = 48, D: int = 16, seed: int = 0):
    """Attention weights of ``n`` queries over ``t`` kept entries (fewer queries than entries, as a
    fit at a small budget has per chunk of queries: entries the queries cannot tell apart) and values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.softmax(torch.randn(P, n, t, generator=g) * 2.0, -1)
    return x, torch.randn(P, t, D, generator=g)


def _output_error(x: torch.Tensor, rounded: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return (x @ (rounded - values)).norm(dim=(-2, -1))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("rotate", [0, 1])
def test_feedback_lowers_the_output_error_of_rounding(bits: int, rotate: int) -> None:
    x, values = _problem()
    storage = QuantConfig(format=f"int{bits}", rotate=rotate)
    ok = torch.ones(values.shape[:2], dtype=torch.bool)
    plain = _output_error(x, round_entries(values, storage), values)
    fed = _output_error(x, feedback_round(values, x.mT @ x, ok, storage), values)
    assert bool((fed < 0.7 * plain).all()), (fed, plain)


@pytest.mark.parametrize(
    "storage",
    [INT3, QuantConfig(format="int3", value_group=8), QuantConfig("int2", clip=1), QuantConfig("int3", rotate=1)],
)
def test_rounded_values_are_what_storage_gives_back(storage: QuantConfig) -> None:
    x, values = _problem(P=3, t=10, D=16)
    ok = torch.ones(values.shape[:2], dtype=torch.bool)
    fed = feedback_round(values, x.mT @ x, ok, storage)
    stored = QuantizedRows.from_padded(torch.randn(3, 10, 16), fed, None, torch.full((3,), 10), storage)
    back = stored.to_padded()[1]
    assert (back - fed).norm() <= 0.05 * (fed - values).norm()  # the rounding kept, within 5% of itself
    if not storage.rotate:  # rotated values come back through two float32 products: a few ulps of a scale apart
        step = float((fed.amax(-1) - fed.amin(-1)).max()) / (2**storage.bits - 1)
        assert torch.allclose(back, fed, atol=step * 1e-2)


def test_unused_slots_take_no_error_and_uncoupled_entries_are_plainly_rounded() -> None:
    x, values = _problem(P=2, t=12)
    ok = torch.ones(2, 12, dtype=torch.bool)
    ok[1, 8:] = False
    x[1, :, 8:] = 0.0
    fed = feedback_round(values, x.mT @ x, ok, INT3)
    assert torch.equal(fed[1, 8:], round_entries(values[1, 8:], INT3))
    # a diagonal Gram (each query reads one entry) couples no entries: plain rounding
    eye = torch.eye(12).expand(2, 12, 12)
    assert torch.allclose(feedback_round(values, eye, torch.ones_like(ok), INT3), round_entries(values, INT3))


def test_the_entry_read_most_is_rounded_first() -> None:
    x, values = _problem(P=1, t=6, n=4, D=8)
    x[..., 2] += 3.0  # entry 2 receives the most attention: rounded first, as plain rounding
    storage = QuantConfig(format="int2")
    fed = feedback_round(values, x.mT @ x, torch.ones(1, 6, dtype=torch.bool), storage)
    assert torch.equal(fed[0, 2], round_entries(values[0, 2], storage))
    assert not torch.equal(fed[0], round_entries(values[0], storage))
