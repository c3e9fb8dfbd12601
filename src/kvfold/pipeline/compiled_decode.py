"""A compiled decode over a :class:`~kvfold.runtime.cache.FoldedCache`: one trace for every step.

A decode step of a small batch is bound by launching kernels, not by reading memory: on a GPU a step
of an 8B model over the full cache launches hundreds of small kernels a layer and waits for each
(docs/benchmarks.md). ``torch.compile`` fuses them and CUDA graphs (``mode="reduce-overhead"``) replay a
step with one launch, but only when a step has the shapes and the Python numbers of the step before:
a growing tail, a length read back to the host or an index built in the first step trace the step
again, or break it into pieces.

:class:`CompiledDecode` fixes the cache's tails first (:meth:`FoldedCache.fix_tails`: capacity for the
new tokens, the next slot a device counter, unwritten slots β = −inf, the stored rows' page index
built), then runs the model's forward through ``torch.compile`` with ``dynamic=False``: the first step
traces and compiles, every later one replays. Positions come from the cache's device counter (the
model reads ``get_seq_length()``, a tensor while the tails are fixed). On a GPU stored rows are read by
the Triton kernel (:mod:`kvfold.runtime.triton_attention`), which a compiled graph calls as it is; on
the CPU by the PyTorch path, which the compiler fuses (the C kernel is a ctypes call, outside any graph).

Works for the full cache and every compressed one whose layers kvfold holds (not sliding-window
layers, not online methods): the same logits as the eager decode within float tolerances
(``tests/pipeline/test_compiled_decode.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.errors import UserError
from kvfold.runtime.triton_attention import available as triton_available


def compile_mode(device: torch.device) -> str | None:
    """``reduce-overhead`` (CUDA graphs) on a GPU, the default (fused kernels) elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


class CompiledDecode:
    """Decode steps of one new token a row over ``cache``, its tails fixed for ``new_tokens`` steps,
    through the compiled forward of ``model``.

    Args:
        model: the model (kvfold attention enabled, :func:`kvfold.runtime.attention.enable`).
        cache: a prefilled or compressed cache; its tails are fixed here and released by :meth:`close`.
        new_tokens: how many steps the tails hold.
        backend: ``torch.compile``'s backend (``inductor``; ``eager`` or a counting backend traces
            without compiling, for tests).
        mode: ``torch.compile``'s mode; None: :func:`compile_mode` of the model's device.
        compile: False runs the same fixed-tail steps eagerly (what the compiled ones are checked against).

    Use as a context manager, or call :meth:`close`: the cache is growable again after it.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: FoldedCache,
        new_tokens: int,
        *,
        backend: str | Callable[..., Any] = "inductor",
        mode: str | None = None,
        compile: bool = True,
    ) -> None:
        cache.fix_tails(new_tokens)
        self.cache = cache
        self.remaining = new_tokens
        device = next(model.parameters()).device
        self._cuda = device.type == "cuda"
        forward: Callable[..., Any] = model.forward
        if self._cuda and triton_available():  # the kernel over stored rows, defined before the first trace
            import kvfold.runtime.triton_kernels  # noqa: F401
        if compile:
            mode = mode if mode is not None else compile_mode(device)
            forward = torch.compile(forward, backend=backend, mode=mode, dynamic=False)
        self._forward = forward

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One forward of ``tokens`` ``(B,)``, one new token a row, written into the fixed tails.

        Returns:
            The next-token logits ``(B, vocab)`` (a copy: CUDA graphs reuse their output buffers).

        Raises:
            UserError: the tails are full (every one of ``new_tokens`` steps taken).
        """
        if self.remaining <= 0:
            raise UserError("the compiled decode's tails are full; fix them for more new tokens")
        out = self._forward(input_ids=tokens[:, None], past_key_values=self.cache, use_cache=True)
        self.remaining -= 1
        logits = out.logits[:, -1]
        return logits.clone() if self._cuda else logits

    def close(self) -> None:
        """Release the tails (:meth:`FoldedCache.release_tails`): the cache grows again, its logical
        length read once from the device."""
        self.cache.release_tails()

    def __enter__(self) -> CompiledDecode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
