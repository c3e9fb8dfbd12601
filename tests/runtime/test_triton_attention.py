"""The Triton kernel over stored rows (kvfold.runtime.triton_attention), run by Triton's interpreter on
the CPU: the same stored part as the PyTorch path and as float64, for every format it reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfold.runtime import quantized_attention, triton_attention
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import FloatRows

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="Triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the kernel runs: the GPU, or the CPU under Triton's interpreter."""

FORMATS = ["int8", "int4", "int3", "int2", "int4[key_group=16]", "int3[key_group=64]", None]
"""Integer codes of every width and key groups of 16–64 entries, and rows at full precision (None)."""


pytestmark = [
    pytestmark,
    pytest.mark.skipif(
        not torch.cuda.is_available() and not triton_attention.interpreted(),
        reason="no GPU, and Triton's interpreter was not chosen before Triton was imported (tests/conftest.py)",
    ),
]


def _interpreter_takes_loaded_loop_bounds() -> bool:
    """Whether Triton's interpreter runs a loop whose bounds a kernel loaded, as the kernel walks a row's
    pages. Triton 3.6's interpreter under NumPy 2.4 does not ("only 0-dimensional arrays can be
    converted to Python scalars"); compiled kernels are not affected."""
    if torch.cuda.is_available() or not triton_attention.available() or not triton_attention.interpreted():
        return True
    import triton
    import triton.language as tl

    @triton.jit
    def loop_over_loaded_bounds(bounds_ptr, out_ptr):
        row = tl.program_id(0)
        total = tl.zeros((1,), tl.int32)
        for _ in range(tl.load(bounds_ptr + row), tl.load(bounds_ptr + row + 1)):
            total += 1
        tl.store(out_ptr + row + tl.arange(0, 1), total)

    out = torch.zeros(1, dtype=torch.int32)
    try:
        loop_over_loaded_bounds[(1,)](torch.tensor([2, 5], dtype=torch.int32), out)
    except Exception:  # noqa: BLE001 - the interpreter's own error, whatever its class
        return False
    return int(out[0]) == 3


INTERPRETER_RUNS = _interpreter_takes_loaded_loop_bounds()

pytestmark = [
    *pytestmark,
    pytest.mark.skipif(
        not INTERPRETER_RUNS,
        reason=f"Triton's interpreter here cannot loop over loaded bounds with NumPy {np.__version__} "
        "(Triton 3.6 needs NumPy < 2.4; constraints-oldest.txt pins 2.3.5); compiled kernels are not affected",
    ),
]


def _rows(kv_format: str | None, lengths: list[int], dim: int = 32, value_dim: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(lengths)
    keys = torch.randn(rows, width, dim, generator=generator) * 2
    values = torch.randn(rows, width, value_dim, generator=generator)
    beta = torch.randn(rows, width, generator=generator)
    beta[0, 1] = float("-inf")  # an entry that holds nothing
    if rows > 1 and lengths[1] <= 16:
        beta[1] = float("-inf")  # a row whose entries all hold nothing (its only page −inf)
    length = torch.tensor(lengths)
    if kv_format is None:
        flat = torch.arange(width)[None, :] < length[:, None]
        return FloatRows(length, keys[flat], values[flat], beta[flat])
    return QuantizedRows.from_padded(keys, values, beta, length, QuantConfig.parse(kv_format))


def _kernel(queries, stored, scaling, per_split=None):
    """The kernel's part on :data:`DEVICE`, brought back to the CPU."""
    on_device = stored.map(lambda t: t.to(DEVICE))
    part = triton_attention.stored_part_triton(queries.to(DEVICE), on_device, scaling, per_split=per_split)
    return tuple(t.cpu() for t in part)


def _reference(queries, stored, scaling):
    """The PyTorch path (pages, no kernel), and float64 over the dequantized rows."""
    if isinstance(stored, FloatRows):
        from kvfold.runtime.rows import float_part

        torch_part = float_part(queries, stored, scaling)
    else:
        torch_part = quantized_attention._stored_part_torch(queries, stored, scaling)  # noqa: SLF001 - the reference
    keys, values, beta = stored.to_padded()
    logits = torch.einsum("rmd,rnd->rmn", queries.double(), keys.double()) * scaling + beta.double()[:, None, :]
    top = logits.amax(-1)
    weights = (logits - top.nan_to_num(neginf=0.0)[..., None]).exp()
    exact = (top, weights.sum(-1), weights @ values.double())
    return torch_part, exact


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("m", [1, 4, 70])
def test_the_kernel_reads_what_the_pytorch_path_reads(kv_format, m):
    """Rows of very different lengths (one of 0, one shorter than a page whose every β is −inf, one cut
    inside a page), ``m`` queries a row (one token of a GQA group; a question longer than a block of 64)."""
    stored = _rows(kv_format, [0, 5, 37, 96, 64])
    queries = torch.randn(5, m, 32, generator=torch.Generator().manual_seed(1))
    assert triton_attention.reads_rows(stored)
    got = _kernel(queries, stored, 0.25)
    torch_part, exact = _reference(queries, stored, 0.25)
    for name, a, b, c in zip(("top", "den", "num"), got, torch_part, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(a.double(), c, rtol=1e-4, atol=1e-4, msg=f"{name} against float64")
    for empty in (0, 1):  # no entry, or none that holds anything: weights 0
        assert torch.isneginf(got[0][empty]).all() and (got[1][empty] == 0).all() and (got[2][empty] == 0).all()


@pytest.mark.parametrize("kv_format", ["int4", "int3[key_group=16]", None])
@pytest.mark.parametrize("per_split", [1, 2, 5, 1000])
def test_rows_cut_into_splits_merge_into_the_rows_part(kv_format, per_split):
    """Long rows cut into splits of 1, 2 or 5 pages (one split a row: 1000), merged by their maximum
    logits: the PyTorch path's part and float64's. One row's largest logits lie in its last page and
    another's in its first, so a merge that dropped a split's rescaling or a split would show."""
    stored = _rows(kv_format, [0, 300, 37, 5, 190], seed=3)
    queries = torch.randn(5, 4, 32, generator=torch.Generator().manual_seed(4))
    keys, _, _ = stored.to_padded()
    queries[1] = keys[1, 290:294].float() * 3  # row 1: its largest logits at its end
    queries[4] = keys[4, 0:4].float() * 3  # row 4: at its start
    got = _kernel(queries, stored, 0.25, per_split=per_split)
    torch_part, exact = _reference(queries, stored, 0.25)
    for name, a, b, c in zip(("top", "den", "num"), got, torch_part, exact, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(a.double(), c, rtol=1e-4, atol=1e-4, msg=f"{name} against float64")


def test_a_head_dimension_that_is_not_a_power_of_two():
    stored = _rows("int4", [9, 40], dim=48, value_dim=80)
    queries = torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(2))
    got = _kernel(queries, stored, 0.1)
    for a, b in zip(got, _reference(queries, stored, 0.1)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not triton_attention.interpreted(), reason="the CPU's interpreter (on a GPU: test_cuda.py)")
def test_stored_part_takes_the_kernel_where_it_applies(monkeypatch):
    """A decode on CUDA (here: the device check answered as on CUDA) reads the rows the kernel reads with
    it, and the others (fp8, value groups, outliers, key groups under 16 or not a power of two) by the
    PyTorch path."""
    calls = []
    real = triton_attention.stored_part_triton
    monkeypatch.setattr(quantized_attention, "stored_part_triton", lambda *a: calls.append(1) or real(*a))
    queries = torch.randn(2, 4, 32)
    assert not quantized_attention.triton_applies(queries, _rows("int4", [9, 40]))  # the CPU: its own kernel
    monkeypatch.setattr(quantized_attention, "triton_applies", lambda q, s: triton_attention.reads_rows(s))
    quantized_attention.stored_part(queries, _rows("int4", [9, 40]), 0.2)
    quantized_attention.stored_part(queries, _rows(None, [9, 40]), 0.2)
    assert len(calls) == 2
    for kv_format in ("fp8", "int4[value_group=8]", "int4[outliers=1]", "int4[key_group=8]", "int4[key_group=48]"):
        stored = _rows(kv_format, [9, 40])
        assert not triton_attention.reads_rows(stored), kv_format
        quantized_attention.stored_part(queries, stored, 0.2)
    assert len(calls) == 2
    rotated = _rows("int3[rotate=1]", [9, 40])  # the kernel reads rotated codes; the part is rotated back
    got = quantized_attention.stored_part(queries, rotated, 0.2)
    assert len(calls) == 3
    keys, values, beta = (t.double() for t in rotated.to_padded())
    weights = (queries.double() @ keys.transpose(1, 2) * 0.2 + beta[:, None]).softmax(-1)
    torch.testing.assert_close((got[2] / got[1][..., None]).double(), weights @ values, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not triton_attention.interpreted(), reason="the CPU's interpreter (on a GPU: test_cuda.py)")
@pytest.mark.parametrize("kind", ["int4", "int3", "rows"])
def test_a_decode_step_through_the_model_answers_as_with_the_pytorch_path(kind, monkeypatch):
    """A whole decode step of a tiny model over ragged stored rows, the kernel reading them (as on CUDA),
    gives the logits of the PyTorch path over the same cache."""
    from tests.pipeline.test_compiled_decode import _cache

    monkeypatch.setattr(quantized_attention, "native_applies", lambda *a: False)
    model, cache = _cache(kind)
    reference = cache.copy()
    n = cache.get_seq_length()
    calls = []
    real = triton_attention.stored_part_triton
    for step, token in enumerate([5, 17]):
        ids, position = torch.tensor([[token]]), torch.tensor([[n + step]])
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=position, past_key_values=reference).logits
            with monkeypatch.context() as patched:
                patched.setattr(quantized_attention, "triton_applies", lambda q, s: triton_attention.reads_rows(s))
                patched.setattr(quantized_attention, "stored_part_triton", lambda *a: calls.append(1) or real(*a))
                got = model(input_ids=ids, position_ids=position, past_key_values=cache).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(calls) == 2 * len(cache.layers)
