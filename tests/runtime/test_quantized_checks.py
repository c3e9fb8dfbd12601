"""Checks of quantized rows' tensors (kvfold.runtime.quantized_checks): rows the library stores pass,
and a missing, unexpected, misshapen or out-of-range tensor is refused with its name, shapes before
values. Whole damaged and crafted cache files are tested in tests/store."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.quantized_checks import QuantizedTensorsError, check_quantized_tensors, check_tensor

D = 16


def _tensors(spec: str = "int4[outliers=1]") -> tuple[dict[str, torch.Tensor], QuantConfig]:
    torch.manual_seed(0)
    config = QuantConfig.parse(spec)
    lengths = torch.tensor([40, 3, 0, 33])
    keys, values = torch.randn(4, 40, D), torch.randn(4, 40, D)
    rows = QuantizedRows.from_padded(keys, values, torch.randn(4, 40), lengths, config)
    return {name: t.clone() for name, t in rows.tensors().items()}, config


def _refusal(tensors: dict[str, torch.Tensor], config: QuantConfig, rows: int | None = None) -> QuantizedTensorsError:
    with pytest.raises(QuantizedTensorsError) as caught:
        check_quantized_tensors(tensors, config, D, D, torch.float32, rows=rows)
    return caught.value


@pytest.mark.parametrize("spec", ["int4[outliers=1]", "int3[key_group=8,value_group=8]", "int2", "fp8"])
def test_the_libraries_own_rows_pass_and_rebuild(spec):
    tensors, config = _tensors(spec)
    check_quantized_tensors(tensors, config, D, D, torch.float32, rows=4)
    rows = QuantizedRows.from_tensors(tensors, config, D, D, torch.float32)
    assert rows.lengths.tolist() == [40, 3, 0, 33]


def test_a_missing_or_unexpected_tensor_is_named():
    tensors, config = _tensors()
    del tensors["key_zero"]
    error = _refusal(tensors, config)
    assert (error.tensor, error.problem) == ("key_zero", "missing")
    tensors, config = _tensors()
    tensors["extra"] = torch.zeros(1)
    assert _refusal(tensors, config).tensor == "extra"


def test_check_tensor_names_dtype_and_shape_and_raises_the_given_error():
    t = torch.zeros(3, 4, dtype=torch.float16)
    check_tensor("x", t, (3, 4), torch.float16)
    with pytest.raises(QuantizedTensorsError, match=r"^x: dtype float16, expected float32$"):
        check_tensor("x", t, (3, 4), torch.float32)
    with pytest.raises(QuantizedTensorsError, match=r"^x: shape \(3, 4\), expected \(3, 5\)$"):
        check_tensor("x", t, (3, 5), torch.float16)

    class Own(ValueError):
        def __init__(self, name: str, problem: str) -> None:
            super().__init__(f"own {name}: {problem}")

    with pytest.raises(Own, match="own x: shape"):
        check_tensor("x", t, (4, 4), torch.float16, error=Own)


def test_row_lengths_must_fit_the_stored_entries_and_the_row_count():
    tensors, config = _tensors()
    tensors["lengths"][1] += 1
    assert _refusal(tensors, config).tensor == "key_codes"  # the lengths add up to one entry more
    tensors, config = _tensors()
    tensors["lengths"][0] = -1
    assert _refusal(tensors, config).tensor == "lengths"
    tensors, config = _tensors()
    assert "expected int64 (5,)" in str(_refusal(tensors, config, rows=5))


def test_shapes_are_checked_before_values():
    tensors, config = _tensors()
    tensors["key_scale"] = torch.full((tensors["key_scale"].shape[0] + 1, D), float("nan"), dtype=torch.float16)
    assert "shape" in _refusal(tensors, config).problem


@pytest.mark.parametrize(
    "name,edit,problem",
    [
        ("key_scale", lambda t: t.index_fill_(0, torch.tensor([0]), 0.0), "not positive"),
        ("value_zero", lambda t: t.index_fill_(0, torch.tensor([0]), float("inf")), "NaN or infinite"),
        ("log_mass", lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")), "NaN or infinite"),
        ("outlier_index", lambda t: t.flip(0), "not increasing"),
        ("outlier_index", lambda t: t + 10**6, "outside"),
        ("outlier_keys", lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")), "NaN or infinite"),
    ],
)
def test_values_out_of_range_are_refused(name, edit, problem):
    tensors, config = _tensors()
    tensors[name] = edit(tensors[name])
    error = _refusal(tensors, config)
    assert error.tensor == name and problem in error.problem


def test_more_outliers_than_the_format_keeps_are_refused():
    tensors, config = _tensors("int4[outliers=1]")
    assert _refusal(tensors, QuantConfig("int4")).tensor == "outlier_index"
    check_quantized_tensors(tensors, QuantConfig("int4", outliers=2), D, D, torch.float32)
