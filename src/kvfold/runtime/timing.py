"""Wall-clock time of work queued on a device.

CUDA runs kernels asynchronously: ``time.perf_counter()`` around a forward measures their launches,
and the next operation that reads a result waits for the rest, so its time absorbs the earlier
work (on the H200, timed so, a compressed cache decoded at 1 token/s beside the reference's 18 in
one interleaved run, and a prefill read 0.3 s from 2K to 16K tokens: docs/results). Every timed
stretch reads :func:`device_clock`, which first waits for the device's queue; on the CPU it is
``time.perf_counter()``.
"""

from __future__ import annotations

import time

import torch


def device_clock(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished (CUDA); on the
    CPU, or with no device, the plain clock."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
