"""The kernel's bounds: the debug build (``KVFOLD_NATIVE_DEBUG=1``) checks every index it reads, the
release build the row lengths up front; given rows that do not fit their codes both refuse, neither reads."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import pytest
import torch

from kvfold.runtime import native
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.quantized_attention import _stored_part_native, _stored_part_torch

D, SCALING = 16, 0.25
pytestmark = pytest.mark.skipif(native.attend_codes_kernel() is None, reason=f"no native kernel: {native.status()}")


@pytest.fixture
def debug_kernel(monkeypatch):
    """The debug build, loaded as ``KVFOLD_NATIVE_DEBUG=1`` asks."""
    monkeypatch.setenv(native.DEBUG_ENV, "1")
    native.attend_codes_kernel.cache_clear()
    kernel = native.attend_codes_kernel()
    assert kernel is not None, native.status()
    yield kernel
    native.attend_codes_kernel.cache_clear()


def _rows(lengths: list[int], fmt: str = "int4", seed: int = 0) -> tuple[QuantizedRows, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    keys, values = torch.randn(rows, width, D, generator=g), torch.randn(rows, width, D, generator=g)
    beta = torch.randn(rows, width, generator=g)
    stored = QuantizedRows.from_padded(keys, values, beta, torch.tensor(lengths), QuantConfig.parse(fmt))
    return stored, torch.randn(rows, 3, D, generator=g)


def test_the_debug_build_is_its_own_library_and_says_so(debug_kernel):
    assert native.status() == "native (debug build)"
    built = sorted(p.name for p in native.cache_dir().glob("attend_codes-debug-*.so"))
    assert built, "no debug library in the kernel cache"
    release = native.load_kernel(debug=False)
    assert release is not None and ctypes.cast(release, ctypes.c_void_p).value != (
        ctypes.cast(debug_kernel, ctypes.c_void_p).value
    )


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2"])
def test_the_debug_build_computes_what_the_release_build_does(debug_kernel, fmt):
    stored, queries = _rows([40, 0, 17, 33], fmt)
    debug = _stored_part_native(debug_kernel, queries, stored, SCALING)
    release = _stored_part_native(native.load_kernel(debug=False), queries, stored, SCALING)
    reference = _stored_part_torch(queries, stored, SCALING)
    for a, b, c in zip(debug, release, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=2e-5, atol=2e-5)


# Rows whose lengths do not fit their codes, built past the Python checks (QuantizedRows.from_tensors).
def _lengths_past_the_codes(stored: QuantizedRows) -> QuantizedRows:
    return replace(stored, lengths=stored.lengths + torch.tensor([0, 9, 0]))


def _a_negative_length(stored: QuantizedRows) -> QuantizedRows:
    return replace(stored, lengths=stored.lengths * torch.tensor([1, -1, 1]))


def _key_scales_cut_short(stored: QuantizedRows) -> QuantizedRows:
    return replace(stored, key_scale=stored.key_scale[:-1], key_zero=stored.key_zero[:-1])


def _value_scales_cut_short(stored: QuantizedRows) -> QuantizedRows:
    return replace(stored, value_scale=stored.value_scale[:-2], value_zero=stored.value_zero[:-2])


def _codes_cut_short(stored: QuantizedRows) -> QuantizedRows:
    return replace(stored, key_codes=stored.key_codes[:-1])


INCONSISTENT = [_lengths_past_the_codes, _a_negative_length, _key_scales_cut_short, _value_scales_cut_short]
INCONSISTENT += [_codes_cut_short]


@pytest.mark.parametrize("mutate", INCONSISTENT, ids=lambda f: f.__name__.strip("_"))
def test_the_debug_build_refuses_an_index_past_a_buffer(debug_kernel, mutate):
    stored, queries = _rows([20, 7, 33])
    with pytest.raises(RuntimeError, match=r"code 5: an index past a buffer"):
        _stored_part_native(debug_kernel, queries, mutate(stored), SCALING)


@pytest.mark.parametrize("mutate", INCONSISTENT, ids=lambda f: f.__name__.strip("_"))
def test_the_release_build_refuses_rows_that_do_not_fit(mutate):
    stored, queries = _rows([20, 7, 33])
    kernel = native.load_kernel(debug=False)
    with pytest.raises(RuntimeError, match=r"code 4: the row lengths do not fit"):
        _stored_part_native(kernel, queries, mutate(stored), SCALING)


def _call_directly(kernel, stored: QuantizedRows, queries: torch.Tensor, entries: int, groups: int, dim: int = D):
    rows, m, _ = queries.shape
    f32 = torch.float32
    ks, kz = stored.key_scale.to(f32).contiguous(), stored.key_zero.to(f32).contiguous()
    vs, vz = stored.value_scale[:, 0].to(f32).contiguous(), stored.value_zero[:, 0].to(f32).contiguous()
    top, den, num = torch.empty(rows, m), torch.empty(rows, m), torch.empty(rows, m, D)
    return kernel(
        rows, m, dim, D, 4, stored.config.key_group, entries, groups,
        stored.lengths.data_ptr(), stored.key_codes.data_ptr(), ks.data_ptr(), kz.data_ptr(),
        stored.value_codes.data_ptr(), vs.data_ptr(), vz.data_ptr(), stored.log_mass.data_ptr(), queries.data_ptr(),
        SCALING, top.data_ptr(), den.data_ptr(), num.data_ptr(),
    )  # fmt: skip


def test_the_kernel_reads_no_further_than_the_sizes_passed(debug_kernel):
    """Called directly: the entries and key groups the caller says its buffers hold bound what the kernel
    reads, one fewer of either is refused (the rows need all of them), and a head size it does not read
    is refused before anything."""
    stored, queries = _rows([20, 7, 33])
    entries, groups = stored.key_codes.shape[0], stored.key_scale.shape[0]
    assert entries == 60 and groups == 4  # key groups of 32 entries: 1 + 1 + 2
    for kernel, code in ((debug_kernel, 5), (native.load_kernel(debug=False), 4)):
        assert _call_directly(kernel, stored, queries, entries, groups) == 0
        assert _call_directly(kernel, stored, queries, entries - 1, groups) == code
        assert _call_directly(kernel, stored, queries, entries, groups - 1) == code
        assert _call_directly(kernel, stored, queries, entries, groups, dim=D + 8) == 1
