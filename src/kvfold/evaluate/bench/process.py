"""What ``kvfold bench`` and ``kvfold bench --cachefile`` share: the measured prose context, the
C allocator's state between measurements, and flag parsing."""

from __future__ import annotations

import resource
import sys
from importlib import resources


def context_ids(tokenizer, length: int, batch: int):
    """``(batch, length)`` token ids of English prose (the shipped haystack), one offset per row."""
    import torch

    text = resources.files("kvfold.evaluate.data").joinpath("haystack.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False).input_ids
    rows = []
    for row in range(batch):
        offset = (row * 997) % max(1, len(ids))
        need = []
        while len(need) < length:
            need.extend(ids[offset:] if not need else ids)
        rows.append(need[:length])
    return torch.tensor(rows)


def release_freed_memory() -> bool:
    """Give the memory freed after prefill and compression back to the operating system.

    The full cache, the prefill's activations and the evicted entries are freed but stay in the
    C allocator's arenas; on this machine, decoding in such a process was 20–30% slower than in a
    fresh process holding the same small cache (snapkv at 4K → 410 tokens, batch 4: 99.5 against
    68.0 ms per step; 70.6 ms after the release). Every configuration, ``full`` included, calls
    this before its decode is timed, so the ratios compare caches, not allocator states.

    Returns:
        True where glibc's ``malloc_trim`` was called (Linux); other platforms only collect garbage.
    """
    import gc

    gc.collect()
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


MEASURED_MMAP_THRESHOLD = 128 << 10
"""glibc's mmap threshold while prefill and compression are measured (its default start)."""
DECODE_MMAP_THRESHOLD = 32 << 20
"""The threshold for decoding: the ceiling that glibc's dynamic threshold climbs to."""


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold (``mallopt(M_MMAP_THRESHOLD)``): blocks of at least ``nbytes``
    are mapped on their own and unmapped when freed.

    By default glibc raises the threshold to the size of each large block freed (up to 32 MB), so
    after the first layers a forward's temporaries come from the heap and stay there, fragmented:
    the peak RSS of a chunked prefill then follows the number of chunks, not what the process
    holds (H2O at budget 512, chunks of 1024: +149 MB from 2K to 8K tokens with the dynamic
    threshold, +34 MB with it fixed at 128 KiB). In a ``--prefill-chunk`` sweep, every
    configuration (``full`` included: ``BenchConfig.bounded_memory``) fixes it at
    :data:`MEASURED_MMAP_THRESHOLD` for prefill and compression, so peak RSS measures memory in
    use, and at :data:`DECODE_MMAP_THRESHOLD` before decoding is timed. Other sweeps keep glibc's
    default: mapping every temporary of 128 KiB or more costs time (ZSMerge's compression at 4K
    tokens, batch 2: 2.55 → 4.48 s), and their peak is the full prefill's anyway. Set
    ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment for the same in your process.

    Returns:
        True where it was set (glibc); False elsewhere.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_mmap_threshold = -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, int(nbytes)))


def _glibc():
    """The C library when it is glibc on Linux, else None."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl)
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated positive integers; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{flag} takes comma-separated positive integers; got {text!r}")
    return values
