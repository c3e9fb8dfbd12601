"""KV formats (kvfold.runtime.quant_config): parsing a format and its options, writing it back, and
refusing what does not exist."""

from __future__ import annotations

import pytest

from kvfold.runtime.quant_config import QuantConfig, QuantSpecError


def test_config_parsing_and_errors():
    assert QuantConfig.parse("4") == QuantConfig(format="int4")
    assert QuantConfig.parse(2) == QuantConfig(format="int2")
    assert QuantConfig.parse("int4[key_group=64,outliers=2]") == QuantConfig("int4", key_group=64, outliers=2)
    assert QuantConfig.parse("int4[key_group=64]").describe() == "int4[key_group=64]"
    assert QuantConfig.parse("16") is None and QuantConfig.parse(None) is None
    for bad in ("int5", "fp4", "int4[group=3]", "int4[key_group=x]", "int4[key_group=0]"):
        with pytest.raises(QuantSpecError):
            QuantConfig.parse(bad)


def test_clip_is_a_format_option_that_reads_back():
    assert QuantConfig.parse("int3[clip=1]") == QuantConfig("int3", clip=1)
    assert QuantConfig.parse("int3[clip=1]").describe() == "int3[clip=1]"
    for bad in ("int3[clip=2]", "fp8[clip=1]"):
        with pytest.raises(QuantSpecError):
            QuantConfig.parse(bad)
