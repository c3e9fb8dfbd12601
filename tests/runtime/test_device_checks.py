"""A fast path's check, run once a device and dtype (:mod:`kvfold.runtime.device_checks`)."""

from __future__ import annotations

import torch

from kvfold.runtime.device_checks import checked_once, error_line, status_key


def test_a_check_runs_the_first_time_a_device_and_dtype_ask_and_is_kept():
    status, calls = {}, []

    def check():
        calls.append(1)
        return "fused"

    cuda = torch.device("cuda:0")
    assert checked_once(status, cuda, torch.bfloat16, check) == "fused"
    assert checked_once(status, cuda, torch.bfloat16, lambda: "never asked") == "fused"
    assert checked_once(status, cuda, torch.float16, lambda: "float32 products (why)") == "float32 products (why)"
    assert len(calls) == 1
    assert status == {"cuda:0 torch.bfloat16": "fused", "cuda:0 torch.float16": "float32 products (why)"}
    assert status_key("cpu", torch.float32) == "cpu torch.float32"


def test_an_errors_reason_is_its_first_line_cut_at_120_characters():
    assert error_line(RuntimeError("no kernel image\nfor this device")) == "no kernel image"
    assert error_line(RuntimeError("x" * 200)) == "x" * 120
    assert error_line(RuntimeError()) == ""
