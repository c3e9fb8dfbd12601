"""Products of 16-bit operands with float32 sums (:mod:`kvfold.runtime.exact_products`): where they are taken,
the check that admits a device's product, and the path ``kvfold bench`` records. The CUDA product itself is
tested on a GPU (``tests/runtime/test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from kvfold.runtime import exact_products

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(exact_products, "FORCED", None)
    monkeypatch.setattr(exact_products, "STATUS", {})


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_the_product_of_16_bit_operands_is_the_float32_upcasts(dtype):
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 7, 32, generator=gen).to(dtype), torch.randn(3, 9, 32, generator=gen).to(dtype).mT
    got = exact_products.float32_bmm(a, b)
    assert got.dtype == F32
    assert torch.equal(got, torch.bmm(a.float(), b.float()))
    assert not torch.equal(got, torch.bmm(a, b).float())  # 16-bit sums round: what the float32 sums avoid


def test_16_bit_operands_are_kept_only_on_cuda_of_one_16_bit_dtype_unless_forced(monkeypatch):
    a, b = torch.randn(2, 4, 8).to(BF16), torch.randn(2, 8, 4).to(BF16)
    assert not exact_products.applies(a, b)  # the CPU: its float32 products are its fast ones
    assert exact_products.STATUS == {}  # nothing to check off CUDA
    monkeypatch.setattr(exact_products, "FORCED", True)
    assert exact_products.applies(a, b) and exact_products.applies(a, b, a)
    assert not exact_products.applies(a, b.float()) and not exact_products.applies(a, b.half())
    assert not exact_products.applies(a.float(), b.float())  # float32 operands are multiplied as they are
    monkeypatch.setattr(exact_products, "FORCED", False)
    assert not exact_products.applies(a, b)


def test_the_check_admits_the_exact_product_and_says_why_it_refuses_another(monkeypatch):
    cpu = torch.device("cpu")
    assert exact_products.check(cpu, BF16) == "exact"
    monkeypatch.setattr(exact_products, "float32_bmm", lambda a, b: torch.bmm(a, b).float())  # 16-bit sums
    assert exact_products.check(cpu, BF16).startswith("float32 products (the 16-bit product is off by ")
    monkeypatch.setattr(exact_products, "float32_bmm", lambda a, b: torch.bmm(a, b))
    assert exact_products.check(cpu, BF16) == "float32 products (the 16-bit product gave torch.bfloat16 (3, 70, 300))"

    def fails(a, b):
        raise RuntimeError("bmm.dtype is not implemented\nfor this device")

    monkeypatch.setattr(exact_products, "float32_bmm", fails)
    assert exact_products.check(cpu, F16) == (
        "float32 products (the 16-bit product failed: RuntimeError: bmm.dtype is not implemented)"
    )


def test_the_path_names_what_a_fit_multiplies(monkeypatch):
    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert exact_products.products_path(cpu, BF16) == "float32 products (on cpu)"
    assert exact_products.products_path(cuda, F32) == "float32 products (torch.float32 operands)"
    assert exact_products.products_path(cuda, BF16) == "float32 products (not checked on this device yet)"
    exact_products.STATUS["cuda:0 torch.bfloat16"] = "exact"
    assert exact_products.products_path(cuda, BF16) == "16-bit operands, float32 sums"
    exact_products.STATUS["cuda:0 torch.bfloat16"] = "float32 products (the 16-bit product is off by 0.01 of its scale)"
    assert exact_products.products_path(cuda, BF16).endswith("(the 16-bit product is off by 0.01 of its scale)")
    monkeypatch.setattr(exact_products, "FORCED", True)
    assert exact_products.products_path(cpu, BF16) == "16-bit operands, float32 sums"
    assert exact_products.products_path(cpu, F32) == "float32 products (torch.float32 operands)"
    monkeypatch.setattr(exact_products, "FORCED", False)
    assert exact_products.products_path(cuda, BF16) == "float32 products (forced)"
