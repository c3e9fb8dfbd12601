"""What ``kvfold bench`` and ``kvfold bench --cachefile`` share: one measurement a process (the
spawn and the worker's entry), the measured prose context, the process's memory, and the C
allocator's state between measurements."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from kvfold.runtime.errors import UserError


def spawn_worker(
    module: str,
    kind: str,
    config: Mapping[str, Any],
    *,
    where: str,
    what: str,
    user_errors: tuple[str, ...],
    timeout: float | None = None,
    threads: int | None = None,
) -> dict:
    """Measure in a fresh Python process (``python -m MODULE --worker KIND CONFIG``); its record.

    A process a measurement keeps its peak resident memory its own. The worker prints its record
    as JSON on its last line of output (:func:`worker_main`).

    Args:
        module: the module whose ``__main__`` runs :func:`worker_main`.
        kind: which of its measurements.
        config: the measurement's configuration (JSON-serializable).
        where: the configuration, for messages (``"snapkv @ 2048 tokens x 1"``).
        what: the kind of worker, for messages (``"bench worker"``).
        user_errors: exception class names (unqualified) that mean bad input rather than a crash.
        timeout: seconds before the worker is killed.
        threads: the worker's ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` (a Ray worker's CPU
            share); None leaves the environment as it is (torch's default: every core).

    Raises:
        ValueError: the worker failed on one of ``user_errors`` (said plainly, with ``where``).
        RuntimeError: the worker crashed (with the end of its error output).
    """
    cmd = [sys.executable, "-m", module, "--worker", kind, json.dumps(dict(config))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        last = lines[-1] if lines else ""
        name, _, message = last.partition(": ")
        if name.rsplit(".", 1)[-1] in user_errors:  # the user's input, not a crash: say it plainly
            raise UserError(f"{where}: {message}")
        tail = "\n".join(lines[-5:])
        raise RuntimeError(f"{what} failed for {where}:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def worker_main(module: str, measures: Mapping[str, Callable[[dict], dict]], argv: list[str] | None = None) -> int:
    """The entry of a worker process (:func:`spawn_worker`): run one measurement, print its record.

    Args:
        module: the worker's module (its ``prog`` name).
        measures: kind → a function of the configuration (a dict) that returns the record.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--worker", nargs=2, required=True, metavar=("KIND", "CONFIG"))
    kind, raw = parser.parse_args(argv).worker
    print(json.dumps(measures[kind](json.loads(raw))))
    return 0


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


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """Resident memory of this process now (Linux ``/proc/self/status``), in MB; 0 elsewhere."""
    return _status_mb("VmRSS:")


class PeakOver:
    """The peak memory of a stretch of work over what the process held when it began, in MB.

    On CUDA: torch's allocator statistics (``max_memory_allocated`` after
    ``reset_peak_memory_stats``). On Linux CPUs: the resident set's high-water mark (``VmHWM``),
    reset when the stretch begins by writing ``5`` to ``/proc/self/clear_refs``, less the resident
    memory then (freed memory given back first, :func:`release_freed_memory`). Elsewhere: None.

    Example::

        peak = PeakOver(device).start()
        compress(...)
        extra_mb = peak.stop()
    """

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.base: float | None = None

    def start(self) -> PeakOver:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
            return self
        release_freed_memory()
        self.base = current_rss_mb() if _reset_high_water_mark() else None
        return self

    def stop(self) -> float | None:
        """MB above the start at the stretch's peak (None where it cannot be measured)."""
        import torch

        if self.base is None:
            return None
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() / 2**20 - self.base
        return max(0.0, _status_mb("VmHWM:") - self.base)


def _reset_high_water_mark() -> bool:
    """Reset this process's peak resident memory (Linux ≥ 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as handle:
            handle.write("5")
    except OSError:
        return False
    return _status_mb("VmHWM:") > 0


def _status_mb(field: str) -> float:
    """A memory line of ``/proc/self/status`` in MB; 0 where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
