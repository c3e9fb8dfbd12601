"""Count the operations that would make a CUDA host wait for the device, on any device.

On CUDA, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``)
or an operation whose output size depends on values (``nonzero``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``) waits until every kernel queued before it has run:
the host stops launching and the GPU runs dry, once per such call. A decode step that makes one a
layer is bound by launches and round trips, not by memory. ``torch.cuda.set_sync_debug_mode`` finds
them on a GPU only; :class:`HostSyncCounter` finds the same calls on the CPU (where they cost
nothing) by watching every torch function called inside it, so a test on the CPU can hold the
decode step to none.

It counts calls, not waits: on CUDA a call on a CPU tensor does not wait (``lengths.tolist()`` of a
CPU tensor), and here every such call is counted, so what it reports is an upper bound of what a
GPU would wait for.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

SYNCING = frozenset(
    {
        "__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist", "numpy", "cpu",
        "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
    }
)  # fmt: skip
"""Torch functions and tensor methods that read values on the host (or size their output by them)."""

_KVFOLD_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_ROOT = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.abspath(__file__)


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def _has_bool_index(args: tuple, kwargs: dict) -> bool:
    """Whether an indexing call's index holds a boolean tensor (its result's size depends on values)."""
    index = args[1] if len(args) > 1 else kwargs.get("indices")
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def is_host_sync(func, args: tuple, kwargs: dict) -> bool:
    """Whether the torch call ``func(*args, **kwargs)`` reads tensor values on the host."""
    name = _name(func)
    if name in SYNCING:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        return _has_bool_index(args, kwargs)
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        tensor_repeats = isinstance(repeats, torch.Tensor) or (len(args) == 1 and isinstance(args[0], torch.Tensor))
        return tensor_repeats and kwargs.get("output_size") is None
    if name == "where":
        return len(args) + len(kwargs) == 1
    return False


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _HERE and not path.startswith(_TORCH_ROOT):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostSyncCounter(TorchFunctionMode):
    """A context in which every host-reading torch call (:func:`is_host_sync`) is counted by where
    it was made: ``kvfold`` (this package's code), ``other`` (the rest: transformers, the caller).

    Example::

        with HostSyncCounter() as syncs:
            model(input_ids=token, past_key_values=cache)
        assert not syncs.kvfold, syncs.summary()
    """

    def __init__(self) -> None:
        super().__init__()
        self.kvfold: Counter[str] = Counter()
        self.other: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_host_sync(func, args, kwargs):
            where = _caller()
            own = where.startswith(_KVFOLD_ROOT) and os.sep + "host_syncs.py" not in where
            (self.kvfold if own else self.other)[f"{_name(func)} at {where}"] += 1
        return func(*args, **kwargs)

    def summary(self) -> str:
        """``"kvfold 0, other 3 (…)"``: the counts and the places of the calls."""
        parts = []
        for label, counts in (("kvfold", self.kvfold), ("other", self.other)):
            places = ", ".join(f"{where} ×{n}" for where, n in counts.most_common(8))
            parts.append(f"{label} {sum(counts.values())}" + (f" ({places})" if places else ""))
        return "; ".join(parts)
