"""The peak bytes of the torch tensors a piece of work makes and holds (:class:`kvfold.runtime.live_bytes.LiveBytes`:
torch's allocator statistics are CUDA-only, and tracemalloc does not see torch's CPU buffers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfold.runtime.live_bytes import LiveBytes


def peak_live_bytes(run: Callable[[], object]) -> int:
    """The peak bytes ``run()`` adds to what was alive before it (a buffer freed since counts against a new one:
    a cache whose buffers are reallocated larger counts the growth only), every operator counted."""
    with torch.inference_mode(), LiveBytes() as ledger:
        result = run()
        del result
    return ledger.peak
