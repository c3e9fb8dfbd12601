"""Timed stretches wait for the device's queue (CUDA is asynchronous)."""

from __future__ import annotations

import torch

from kvfold.runtime import timing


def test_device_clock_waits_for_cuda_and_not_for_the_cpu(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    before = timing.device_clock("cpu")
    assert not waited
    after = timing.device_clock("cuda:0")
    assert waited == ["cuda:0"] and after >= before
    timing.device_clock(torch.device("cuda"))
    timing.device_clock(None)
    assert len(waited) == 2


def test_the_bench_and_the_pipeline_time_with_the_device_clock(monkeypatch):
    """Every timed stretch of the bench, the prefill, the compression and the decode reads the
    device clock (a stretch timed with the bare clock on CUDA measures launches only)."""
    import inspect

    from kvfold.evaluate.bench import speed
    from kvfold.pipeline import chunked, context

    for module in (speed, context, chunked):
        source = inspect.getsource(module)
        assert "perf_counter" not in source and "device_clock(" in source, module.__name__
