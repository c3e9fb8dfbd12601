"""Peak bytes of the torch tensors alive while something runs (torch's allocator statistics are
CUDA-only and tracemalloc does not see torch's CPU buffers)."""

from __future__ import annotations

import gc

import torch

from kvfold.methods.core import repeat


class LiveBytes:
    """Peak bytes of the tensors alive at any census beyond the bytes alive at the start (a buffer
    freed since the start counts against a new one: a cache whose buffers are reallocated larger
    counts the growth only).

    A census sums the storages (counted once) of every tensor the garbage collector tracks (torch
    tensors are tracked, locals of running frames included). It runs after every forward of the
    model and inside the repeat pass's first attention layer of every forward (its attention
    probabilities are alive then, handed to its recorder): torch's allocator statistics are
    CUDA-only, and tracemalloc does not see torch's CPU buffers.
    """

    def __init__(self) -> None:
        self.baseline = sum(self._storages().values())
        self.peak = 0

    @staticmethod
    def _storages() -> dict[int, int]:
        found = {}
        for obj in gc.get_objects():
            if type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter:
                storage = obj.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
        return found

    def census(self, *args, **kwargs) -> None:
        self.peak = max(self.peak, sum(self._storages().values()) - self.baseline)


def peak_live_bytes(model, run, monkeypatch) -> int:
    """The peak of :class:`LiveBytes` while ``run()`` runs: a census after every forward of ``model``
    and inside every repeat-pass forward (its first layer), and one after ``run`` returns."""
    counter = LiveBytes()
    real_after = repeat.RepeatRecorder.after_forward

    def after_forward(self, layer_idx, *args, **kwargs):
        real_after(self, layer_idx, *args, **kwargs)
        if layer_idx == 0:
            counter.census()

    monkeypatch.setattr(repeat.RepeatRecorder, "after_forward", after_forward)
    hook = model.register_forward_hook(counter.census)
    try:
        result = run()
        counter.census()
        del result
    finally:
        hook.remove()
        monkeypatch.setattr(repeat.RepeatRecorder, "after_forward", real_after)
    return counter.peak
