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
