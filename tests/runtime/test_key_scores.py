"""Each key's largest shifted logit (kvfold.runtime.key_scores): the Triton kernel, run by Triton's interpreter
on the CPU, gives the PyTorch path's maxima and float64's; the check that decides where it runs; KVzip's and
KVzip+'s scores through it."""

from __future__ import annotations

import pytest
import torch

from kvfold.methods.core import repeat
from kvfold.runtime import key_scores, triton_attention
from kvfold.runtime.live_bytes import LiveBytes

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the kernel runs: the GPU, or the CPU under Triton's interpreter."""

needs_kernel = pytest.mark.skipif(
    not triton_attention.available() or (DEVICE == "cpu" and not triton_attention.interpreted()),
    reason="no Triton, or no GPU and Triton's interpreter not chosen before Triton was imported (tests/conftest.py)",
)


def _problem(dtype, groups: int, per_group: int = 70, n: int = 300, d: int = 80, seed: int = 0):
    """Two KV heads of ``groups`` groups of ``per_group`` rows, ``n`` keys read from a wider cache (a view whose
    entries are ``2·d`` apart),
    shifts that make every logit negative, one row left out (−inf), and one key whose largest logit is in
    the last row of the last group."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * per_group
    query = torch.randn(2, rows, d, generator=gen)
    cache = torch.randn(2, n + 20, 2, d, generator=gen)  # keys: a view, neither its heads nor its entries adjacent
    cache[1, 17, 1] = query[1, -1] * 3  # key 7 of head 1: its largest logit is the last row's
    shift = -12 - 4 * torch.rand(2, rows, generator=gen)
    shift[0, 3] = float("-inf")
    return query.to(DEVICE, dtype), cache.to(DEVICE, dtype)[:, 10 : 10 + n, 1], shift.to(DEVICE)


def _float64(query, keys, shift, scaling, groups):
    logits = scaling * query.double() @ keys.double().transpose(-1, -2) + shift.double()[:, :, None]
    return logits.reshape(query.shape[0], groups, -1, keys.shape[1]).amax(dim=2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("groups", "d"), [(1, 80), (3, 64), (4, 128)])
def test_the_kernel_gives_the_pytorch_paths_maxima_and_float64s(dtype, groups, d):
    query, keys, shift = _problem(dtype, groups, d=d)
    assert not keys.is_contiguous()  # read in place, by its strides
    fused = key_scores.fused_max_logits(query, keys, shift, d**-0.5, groups)
    blocked = key_scores.blocked_max_logits(query, keys, shift, d**-0.5, groups, block=32)
    exact = _float64(query, keys, shift, d**-0.5, groups)
    assert fused.shape == (2, groups, keys.shape[1]) and fused.dtype == torch.float32
    assert (fused.double() - exact).abs().max() < 1e-4
    assert (blocked.double() - exact).abs().max() < 1e-4
    assert float(fused[1, -1, 7]) == pytest.approx(float(exact[1, -1, 7]), abs=1e-4)  # the last row counts


@needs_kernel
def test_a_row_left_out_and_keys_past_the_end_do_not_count():
    query, keys, shift = _problem(torch.float16, 1, per_group=65, n=130)  # a second block of 1 row, of 2 keys
    shift[:, :64] = float("-inf")  # only the last row (alone in its block) is left
    fused = key_scores.fused_max_logits(query, keys, shift, 0.1, 1)
    exact = 0.1 * (keys.double() @ query.double()[:, 64, :, None])[..., 0] + shift.double()[:, 64, None]
    assert (fused[:, 0].double() - exact).abs().max() < 1e-4
    assert not key_scores.fused_max_logits(query, keys[:, :0], shift, 0.1, 1).numel()


def test_the_pytorch_path_runs_where_the_kernel_does_not_apply():
    query, keys, shift = _problem(torch.float32, 2)
    assert not key_scores.fused_applies(query.cpu(), keys.cpu())  # the CPU
    got = key_scores.max_shifted_logits(query.cpu(), keys.cpu(), shift.cpu(), 0.1, 2, block=16)
    assert (got.double() - _float64(query.cpu(), keys.cpu(), shift.cpu(), 0.1, 2)).abs().max() < 1e-4


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_check_finds_the_kernel_right_and_refuses_one_off_or_failing(monkeypatch, dtype):
    device = torch.device(DEVICE)
    assert key_scores.check_fused(device, dtype) == "fused"  # under the interpreter on the CPU, compiled on a GPU
    assert key_scores.check_fused(device, dtype, head_dim=128) == "fused"  # a decoder's head dimension
    real = key_scores.fused_max_logits
    monkeypatch.setattr(key_scores, "fused_max_logits", lambda *a: real(*a) + 0.01)
    assert key_scores.check_fused(device, dtype) == "float32 products (the kernel is off by 0.01)"

    def fails(*args):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_90a\nmore")

    monkeypatch.setattr(key_scores, "fused_max_logits", fails)
    assert key_scores.check_fused(device, dtype) == (
        "float32 products (the kernel failed: RuntimeError: PTX .version 8.7 does not support .target sm_90a)"
    )


def test_the_path_kvfold_bench_records(monkeypatch):
    cuda = torch.device("cuda:0")
    assert key_scores.scores_path(torch.device("cpu"), torch.bfloat16) == "float32 products (on cpu)"
    assert "16-bit" in key_scores.scores_path(cuda, torch.float32)
    monkeypatch.setattr(key_scores, "FUSED_STATUS", {})
    monkeypatch.setattr(key_scores, "available", lambda: True)
    assert key_scores.scores_path(cuda, torch.bfloat16) == "float32 products (not checked on this device yet)"
    key_scores.FUSED_STATUS["cuda:0 torch.bfloat16"] = "fused"
    assert key_scores.scores_path(cuda, torch.bfloat16) == "fused (Triton)"
    key_scores.FUSED_STATUS["cuda:0 torch.bfloat16"] = "float32 products (the kernel is off by 2)"
    assert key_scores.scores_path(cuda, torch.bfloat16) == "float32 products (the kernel is off by 2)"


@needs_kernel
@pytest.mark.parametrize("plus", [False, True])
def test_kvzip_and_kvzip_plus_scores_through_the_kernel_equal_the_pytorch_paths(monkeypatch, plus):
    """``max_received`` (KVzip's scores; KVzip+'s with row norms and column weights, a max per query head)
    with the kernel taken where a GPU takes it, against the PyTorch path."""
    gen = torch.Generator().manual_seed(1)
    b, h_kv, g, q_len, n, d = 2, 2, 3, 40, 150, 64
    query = torch.randn(b, h_kv * g, q_len, d, generator=gen).to(DEVICE, torch.bfloat16)
    keys = torch.randn(b, h_kv, n, d, generator=gen).to(DEVICE, torch.bfloat16)
    lse = (12 + torch.rand(b, h_kv * g, q_len, generator=gen)).to(DEVICE)
    extra = ()
    if plus:
        norms = (1 + torch.rand(b, q_len, generator=gen)).to(DEVICE)
        weights = torch.rand(b, h_kv * g, n, generator=gen).to(DEVICE)
        extra = (norms, weights)
    monkeypatch.setattr(key_scores, "fused_applies", lambda *a: False)
    want = repeat.max_received(query, keys, lse, d**-0.5, *extra)
    taken = []
    monkeypatch.setattr(key_scores, "fused_applies", lambda *a: taken.append(1) or True)
    got = repeat.max_received(query, keys, lse, d**-0.5, *extra)
    assert taken and got.shape == want.shape == (b, h_kv, n)
    assert ((got - want).abs() / want).max() < 1e-4


def test_the_pytorch_path_holds_one_block_of_logits_at_a_time():
    """The previous block's logits are freed before the next block's are made: one block held, not two
    (off the CPU a block is up to 512 MB)."""
    gen = torch.Generator().manual_seed(0)
    heads, rows, entries, block = 2, 256, 1024, 32
    query, keys = torch.randn(heads, rows, 8, generator=gen), torch.randn(heads, entries, 8, generator=gen)
    with torch.inference_mode(), LiveBytes() as ledger:
        key_scores.blocked_max_logits(query, keys, torch.zeros(heads, rows), 0.3, 1, block)
    assert ledger.peak < 1.5 * heads * block * entries * 4  # 1.09 blocks; 2.03 with the last block kept
