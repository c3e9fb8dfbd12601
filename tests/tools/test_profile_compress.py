"""benchmarks/profile_compress.py --count: the matrix products' floating-point operations it adds up, by phase
and function (a GPU's compute for a compression, counted on the CPU)."""

from __future__ import annotations

import torch

from tests.tools.scripts import load_script


def _module():
    return load_script("benchmarks/profile_compress.py")


def test_the_count_adds_each_products_operations_and_the_cpus_fused_attention_as_cudas():
    module = _module()
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 11)
    q, k, v = torch.randn(1, 4, 6, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    with module.OperatorCount() as ops:
        torch.bmm(a, b)
        torch.baddbmm(torch.zeros(3, 5, 11), a, b)
        torch.mm(a[0], b[0])
        a + 1  # no product
        module.CPU_FLASH(q, k, v)
    products = 2 * (2 * 3 * 5 * 7 * 11 + 5 * 7 * 11)
    attention = 4 * 4 * 6 * 9 * 16  # Q Kᵀ and P V, no discount for a mask (torch's sdpa_flop_count)
    assert sum(ops.phase_flops.values()) == products + attention
    assert sum(ops.function_flops.values()) == products + attention
    assert sum(ops.phases.values()) >= 5


def test_the_count_adds_the_products_that_reach_it_whole_under_inference_mode():
    """``@``, ``torch.matmul`` (batched, broadcast, a vector on either side) and ``linear``: counted as the
    ``bmm`` and ``mm`` they run (the fits' normal equations are ``Φᵀ Φ`` by ``@``)."""
    module = _module()
    a, b, w = torch.randn(3, 5, 7), torch.randn(3, 7, 11), torch.randn(13, 7)
    with torch.inference_mode(), module.OperatorCount() as ops:
        a @ b
        torch.matmul(a[:1, None], b[None])  # (1, 1, 5, 7) @ (1, 3, 7, 11): a batch of 3
        a[0, 0] @ b  # (7,) @ (3, 7, 11)
        b @ b[0, 0]  # (3, 7, 11) @ (11,)
        torch.nn.functional.linear(a, w, torch.zeros(13))
    want = 2 * (3 * 5 * 7 * 11 + 3 * 5 * 7 * 11 + 3 * 7 * 11 + 3 * 7 * 11 + 3 * 5 * 7 * 13)
    assert sum(ops.function_flops.values()) == want


def test_the_peak_names_the_kvfold_function_that_made_each_storage_and_leaves_the_hosts_queries_out():
    """``--peak``: a GPU holds the repeat pass's queries in host memory (``query_buffer``); the rest is named by
    its phase and the innermost kvfold function."""
    from kvfold.methods.core.repeat import query_buffer
    from kvfold.runtime.key_scores import blocked_max_logits
    from kvfold.runtime.live_bytes import LiveBytes

    module = _module()
    query, keys, shift = torch.randn(2, 8, 16), torch.randn(2, 32, 16), torch.zeros(2, 8)
    with torch.inference_mode(), LiveBytes(site=module._caller_phase, left_out=module.HOST_BUFFERS) as ledger:
        held = query_buffer((1000,), torch.float32, torch.device("cpu"))
        best = blocked_max_logits(query, keys, shift, 0.25, 1, 4)
    assert held.numel() == 1000 and best.shape == (2, 1, 32)
    assert ("other", "runtime/key_scores.py:blocked_max_logits") in ledger.at_peak
    assert not any("query_buffer" in where for _, where in ledger.at_peak)
    assert ledger.peak < 4000


def test_the_peak_takes_kvzips_scores_as_the_fused_kernel_holds_them(monkeypatch):
    """``--peak --as-accelerator``: the scores' blocks of logits are not the GPU's (its kernel holds its output
    only); the values are the PyTorch path's."""
    from kvfold.runtime import key_scores
    from kvfold.runtime.live_bytes import LiveBytes

    module = _module()
    monkeypatch.setattr(key_scores, "blocked_max_logits", key_scores.blocked_max_logits)  # restored after
    query, keys, shift = torch.randn(2, 64, 16), torch.randn(2, 512, 16), torch.zeros(2, 64)
    want = key_scores.blocked_max_logits(query, keys, shift, 0.25, 1, 16)
    module.scores_by_fused_kernel()
    with torch.inference_mode(), LiveBytes() as ledger:
        best = key_scores.max_shifted_logits(query, keys, shift, 0.25, 1, 16)
    assert torch.equal(best, want)
    assert ledger.peak == best.numel() * 4  # the output only: a block of logits is 2 · 16 · 512 · 4 bytes
