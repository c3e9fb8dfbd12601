"""A fast path's check, run once a device and dtype before the path is taken.

kvfold takes a device's fast kernels (CUDA's flash attention with its log-sum-exp, the Triton kernel of KVzip's
scores, 16-bit products with float32 sums) only once each has given, on a small problem, what the plain path
gives. Each keeps what its check found in a dictionary keyed by :func:`status_key`, a word for "taken" or the
reason it is not, which ``kvfold bench`` records; :func:`checked_once` runs the check the first time a device
and dtype ask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def status_key(device: torch.device | str, dtype: torch.dtype) -> str:
    """``"cuda:0 torch.bfloat16"``: the key a check's result is kept under."""
    return f"{device} {dtype}"


def checked_once(status: dict[str, str], device: torch.device, dtype: torch.dtype, check: Callable[[], str]) -> str:
    """What ``status`` holds for ``device`` and ``dtype``, from ``check()`` the first time they are asked for."""
    key = status_key(device, dtype)
    if key not in status:
        status[key] = check()
    return status[key]


def error_line(err: BaseException) -> str:
    """The first line of an error's message, at most 120 characters: a check's reason, on one line."""
    return str(err).splitlines()[0][:120] if str(err) else ""
