"""Attention over quantized rows read from their codes (kvfold.runtime.quantized_attention): the
compiled kernel and the PyTorch path against a float64 reference over the dequantized entries."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from kvfold.runtime import native
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.quantized_attention import attend_stored, attend_stored_torch, native_applies

D = 32
SCALING = D**-0.5


def _case(lengths: list[int], fmt: str, beta: bool, seed: int = 0, m: int = 3, tail: int = 4):
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(max(lengths), 1)
    keys = torch.randn(rows, width, D, generator=g) * 2
    keys[:, :, 3] += 8.0  # an outlier channel: its own key range only
    values = torch.randn(rows, width, D, generator=g)
    log_mass = torch.randn(rows, width, generator=g) if beta else None
    stored = QuantizedRows.from_padded(keys, values, log_mass, torch.tensor(lengths), QuantConfig.parse(fmt))
    queries = torch.randn(rows, m, D, generator=g)
    tail_keys = torch.randn(rows, tail, D, generator=g)
    tail_values = torch.randn(rows, tail, D, generator=g)
    tail_logits = queries @ tail_keys.transpose(1, 2) * SCALING
    tail_logits[:, 0, -1] = float("-inf")  # a query that does not see the last new token
    return stored, queries, tail_logits, tail_values


def _reference(stored: QuantizedRows, queries, tail_logits, tail_values) -> torch.Tensor:
    """float64 softmax over the dequantized entries (β; −inf past each row's length) and the tail."""
    keys, values, log_mass = (t.double() for t in stored.to_padded())
    logits = torch.cat(
        [queries.double() @ keys.transpose(1, 2) * SCALING + log_mass[:, None], tail_logits.double()], -1
    )
    weights = torch.softmax(logits, -1)
    return weights @ torch.cat([values, tail_values.double()], 1)


LENGTHS = {
    "ragged": [70, 0, 33, 1, 64, 5],
    "many rows": [int(n) for n in torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(3))],
}


FORMATS = ["int8", "int4", "int2", "int4[key_group=16]", "int3", "int4[outliers=2]", "fp8", "fp8[outliers=1]",
           "int4[value_group=8]", "int2[value_group=16,outliers=1]", "int3[rotate=1]", "int4[outliers=2,rotate=1]",
           "fp8[rotate=1]", "int2[value_group=16,rotate=1]"]  # fmt: skip


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("beta", [True, False], ids=["beta", "no-beta"])
@pytest.mark.parametrize("shape", sorted(LENGTHS))
def test_both_paths_equal_a_float64_reference(fmt, beta, shape, monkeypatch):
    """The PyTorch path, and the path :func:`attend_stored` takes: the compiled kernel wherever it
    applies (counted: not the PyTorch path again), the PyTorch path where it does not (outliers).
    Without a kernel the second comparison would be the first again: skipped, and failed under CI."""
    import kvfold.runtime.quantized_attention as module

    stored, queries, tail_logits, tail_values = _case(LENGTHS[shape], fmt, beta)
    expected = _reference(stored, queries, tail_logits, tail_values)
    torch_path = attend_stored_torch(queries, tail_logits, tail_values, stored, SCALING)
    torch.testing.assert_close(torch_path.double(), expected, rtol=2e-5, atol=2e-5)
    applies = native_applies(queries, stored)
    if applies:
        _require_kernel()
    kernel_calls = []
    real = module._stored_part_native

    def counted(*args, **kwargs):
        kernel_calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "_stored_part_native", counted)
    either = attend_stored(queries, tail_logits, tail_values, stored, SCALING)
    torch.testing.assert_close(either.double(), expected, rtol=2e-5, atol=2e-5)
    assert kernel_calls == ([native.attend_codes_kernel()] if applies else [])
    if applies:
        assert native.status().startswith("native")


def _require_kernel() -> None:
    """Skip (fail under ``CI=true``) where no compiled kernel is available, saying why: the comparison
    of the kernel would otherwise be the PyTorch path compared with itself."""
    if native.attend_codes_kernel() is None:
        reason = f"no native kernel here, so only the PyTorch path could be compared: {native.status()}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def test_the_kernel_reads_integer_codes_without_outliers_and_nothing_else():
    plain = _case([5, 3], "int4", True)
    assert native_applies(plain[1], plain[0])
    assert native_applies(plain[1], _case([5, 3], "int2", True)[0])
    assert native_applies(plain[1], _case([5, 3], "int3", True)[0])
    assert not native_applies(plain[1], _case([5, 3], "fp8", True)[0])
    assert not native_applies(plain[1], _case([5, 3], "int4[outliers=1]", True)[0])
    assert not native_applies(plain[1].double(), plain[0])
    odd = _case_of([5, 3], "int4", 3, 24, 24)  # a head size the kernel is not built for: the PyTorch path
    assert not native_applies(odd[1], odd[0])


@pytest.mark.skipif(native.attend_codes_kernel() is None, reason=f"no native kernel here: {native.status()}")
def test_the_kernel_is_the_one_used_where_it_applies(monkeypatch):
    import kvfold.runtime.quantized_attention as module

    def refuse(*args, **kwargs):
        raise AssertionError("the PyTorch path ran where the kernel applies")

    monkeypatch.setattr(module, "attend_stored_torch", refuse)
    for fmt in ("int8", "int4", "int3", "int2"):
        stored, queries, tail_logits, tail_values = _case([40, 0, 17, 96], fmt, True, seed=5, m=6)
        out = attend_stored(queries, tail_logits, tail_values, stored, SCALING)
        torch.testing.assert_close(
            out.double(), _reference(stored, queries, tail_logits, tail_values), rtol=2e-5, atol=2e-5
        )
    assert native.status() == "native"


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A kernel looked up anew, built into an empty cache directory."""
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path))
    native.attend_codes_kernel.cache_clear()
    native._why_not.clear()  # noqa: SLF001 - the test resets the module's record
    yield tmp_path
    native.attend_codes_kernel.cache_clear()
    native._why_not.clear()  # noqa: SLF001


def test_disabled_or_unbuildable_kernels_leave_the_torch_path_and_say_why(fresh_kernel, monkeypatch):
    stored, queries, tail_logits, tail_values = _case([9, 4], "int4", True)
    expected = _reference(stored, queries, tail_logits, tail_values)
    monkeypatch.setenv("KVFOLD_NATIVE", "0")
    assert native.attend_codes_kernel() is None and native.status() == "torch (KVFOLD_NATIVE=0)"
    out = attend_stored(queries, tail_logits, tail_values, stored, SCALING)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    native.attend_codes_kernel.cache_clear()
    monkeypatch.delenv("KVFOLD_NATIVE")
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert native.attend_codes_kernel() is None
    assert native.status().startswith("torch (building the kernel failed")
    assert not list(fresh_kernel.rglob("*.part")) and not list(fresh_kernel.rglob("*.so"))  # nothing half-written


@pytest.mark.skipif(native.attend_codes_kernel() is None, reason=f"no native kernel here: {native.status()}")
def test_a_kernel_is_built_once_into_the_cache_directory(fresh_kernel, capsys):
    assert native.attend_codes_kernel() is not None
    built = list((fresh_kernel / "kernels").glob("attend_codes-*.so"))
    assert len(built) == 1
    assert "compiling attend_codes.c for this machine, once" in capsys.readouterr().err  # a first build says so
    stamp = built[0].stat().st_mtime_ns
    native.attend_codes_kernel.cache_clear()
    assert native.attend_codes_kernel() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert capsys.readouterr().err == ""


def test_a_kernel_is_built_again_when_the_header_it_includes_changes(tmp_path, monkeypatch):
    """The library's name hashes the source and the headers beside it (attend_blocks.h): a changed header
    is a new build, never the stale library of the old one."""
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "k.c").write_text('#include "k.h"\nint kvfold_k(void) { return K; }\n')
    (tmp_path / "k.h").write_text("#define K 1\n")
    compiler = native._compiler()  # noqa: SLF001 - the build function itself, on a two-line source
    if compiler is None:
        pytest.skip("no C compiler")
    first = native._build(compiler, source_path=tmp_path / "k.c")  # noqa: SLF001
    (tmp_path / "k.h").write_text("#define K 2\n")
    second = native._build(compiler, source_path=tmp_path / "k.c")  # noqa: SLF001
    assert first != second and first.exists() and second.exists()
    assert ctypes.CDLL(str(second)).kvfold_k() == 2


def _per_row_part(queries: torch.Tensor, stored: QuantizedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path the paged one replaced (up to 2026-11-28), row after row in a Python loop over
    the rows dequantized (as the padded path read fp8 and value groups): each row's softmax over its
    own entries."""
    rows, m, _ = queries.shape
    top, den = queries.new_full((rows, m), float("-inf")), queries.new_zeros(rows, m)
    num = queries.new_zeros(rows, m, stored.value_dim)
    keys, values, _ = stored.to_padded()  # dequantized: the codes times their scales plus zero points
    beta = torch.zeros(int(stored.lengths.sum())) if stored.log_mass is None else stored.log_mass
    for row, (first, n, _, _) in enumerate(stored.row_ranges()):
        if n:
            logits = queries[row] @ keys[row, :n].T * SCALING + beta[first : first + n]
            top[row] = logits.amax(-1)
            weights = (logits - top[row].nan_to_num(neginf=0.0)[:, None]).exp()
            den[row], num[row] = weights.sum(-1), weights @ values[row, :n]
    return top, den, num


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_paged_torch_path_equals_the_per_row_path_it_replaced(fmt):
    """Each part (maximum logit, weights' sum, weighted values) as the per-row loop gives it, on rows
    shorter and longer than a page, an empty one and one whose every β is −inf."""
    import kvfold.runtime.quantized_attention as module

    stored, queries, _, _ = _case([70, 0, 33, 1, 64, 5, 32], fmt, True, seed=2, m=4)
    stored.log_mass[70 + 33] = float("-inf")  # row 3's one entry holds nothing
    stored.__dict__.pop("pages", None)
    got = module._rotated_back(stored, module._stored_part_torch(queries, stored, SCALING))  # rotate=1: as stored
    want = _per_row_part(queries, stored)
    assert got[0][1].eq(float("-inf")).all() and got[0][3].eq(float("-inf")).all()
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_paged_torch_path_runs_a_fixed_number_of_operations_and_reads_nothing_back(monkeypatch):
    """No loop over rows or pages: the products run as often for 2 rows as for 40, and after the
    page index is built (its page count is the key groups', known without reading) no value of the
    rows is read back to the host (on a GPU, nothing waits)."""
    import kvfold.runtime.quantized_attention as module
    from kvfold.runtime.host_syncs import HostSyncCounter

    calls = []
    for name in ("bmm", "baddbmm"):
        real = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _real=real, **k: calls.append(1) or _real(*a, **k))
    for fmt, products in (("int4[outliers=1]", 3), ("int4[value_group=8]", 2)):
        for count in (2, 40):
            stored, queries, _, _ = _case([3 + 17 * (i % 5) for i in range(count)], fmt, True)
            calls.clear()
            with HostSyncCounter() as syncs:
                module._stored_part_torch(queries, stored, SCALING)
            assert len(calls) == products and not syncs.kvfold, syncs.summary()


def _case_of(lengths: list[int], fmt: str, m: int, dim: int, value_dim: int, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    keys, values = torch.randn(rows, width, dim, generator=g), torch.randn(rows, width, value_dim, generator=g)
    log_mass = torch.randn(rows, width, generator=g)
    stored = QuantizedRows.from_padded(keys, values, log_mass, torch.tensor(lengths), QuantConfig.parse(fmt))
    queries = torch.randn(rows, m, dim, generator=g)
    tail_keys, tail_values = torch.randn(rows, 2, dim, generator=g), torch.randn(rows, 2, value_dim, generator=g)
    return stored, queries, queries @ tail_keys.transpose(1, 2) * dim**-0.5, tail_values


def _reference_at(stored: QuantizedRows, queries, tail_logits, tail_values, scaling: float) -> torch.Tensor:
    keys, values, log_mass = (t.double() for t in stored.to_padded())
    stored_logits = queries.double() @ keys.transpose(1, 2) * scaling + log_mass[:, None]
    logits = torch.cat([stored_logits, tail_logits.double()], -1)
    return torch.softmax(logits, -1) @ torch.cat([values, tail_values.double()], 1)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (32, 32), (32, 48)], ids=lambda d: f"{d[0]}x{d[1]}")
def test_the_kernel_reads_any_number_of_queries_and_head_size(fmt, m, dims, monkeypatch):
    """A row's queries are its GQA group's heads × the new tokens: any number of them, in groups of three
    and one at a time after. Up to three read the codes in place, compiled for head sizes 64 and 128; more,
    and other head sizes (values of another size than the keys too), unpack a block once. Against the
    float64 reference, the kernel's path only."""
    import kvfold.runtime.quantized_attention as module

    _require_kernel()
    dim, value_dim = dims
    stored, queries, tail_logits, tail_values = _case_of([70, 0, 33, 1, 64], fmt, m, dim, value_dim)
    assert native_applies(queries, stored) and stored.value_dim == value_dim
    monkeypatch.setattr(module, "attend_stored_torch", None)  # the kernel's path only
    out = attend_stored(queries, tail_logits, tail_values, stored, dim**-0.5)
    expected = _reference_at(stored, queries, tail_logits, tail_values, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
