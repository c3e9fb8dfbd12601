"""What kvfold keeps once per machine (compiled kernels, converted models): made once under a lock,
marked when used, and removed once unused for weeks.

Both folders under :func:`kvfold.runtime.defaults.cache_root` gain an entry whenever what it is made
from changes (a kernel's source or flags, a kvfold or transformers version, a model file): without a
sweep they only grow. So:

* :func:`exclusive` holds an entry's lock (``<entry>.lock``, an ``flock``) while one process makes it;
  others wait (and say so) and then find it made;
* :func:`mark_used` sets an entry's modification time to now (at most once a day), the clock of the sweep;
* :func:`remove_unused` removes the entries of a folder not used for :data:`KEEP_UNUSED_DAYS` days, each
  under its lock, never one another process is making or removing; the callers run it just after making
  an entry, the only time a folder grows.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

KEEP_UNUSED_DAYS = 30
"""An entry not used for this many days is removed when its folder next gains one."""
DAY_SECONDS = 86_400
PARTIAL_SECONDS = 3_600
"""A partial file or folder (a build or conversion killed before its rename) older than this is left over:
a kernel's compiler has at most 15 minutes, a model's conversion takes seconds."""


def partial_path(entry: Path, suffix: str) -> Path:
    """A name of this process's own beside ``entry`` to make it under (``<entry>.<pid>-<random><suffix>``),
    renamed to ``entry`` when whole. Not created: what makes it gives it the umask's permissions, as the
    entry would have (``tempfile``'s are the owner's alone, which another user of a shared cache cannot read)."""
    return entry.with_name(f"{entry.name}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def lock_path(entry: Path) -> Path:
    """The lock file of ``entry``: ``<entry>.lock`` beside it."""
    return entry.with_name(entry.name + ".lock")


@contextlib.contextmanager
def exclusive(entry: Path, what: str) -> Iterator[None]:
    """Hold ``entry``'s lock (an exclusive ``flock`` on :func:`lock_path`), saying on standard error that
    this process waits when another holds it ("kvfold: waiting for another process <what>"). Without
    ``fcntl`` (not POSIX) nothing is locked: each process makes its own copy and renames it whole."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows has no flock
        yield
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(entry), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"kvfold: waiting for another process {what}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def mark_used(entry: Path) -> None:
    """Set ``entry``'s modification time to now when it is older than a day (the sweep's clock: one
    write a day at most, none on a read-only folder)."""
    try:
        if time.time() - entry.stat().st_mtime > DAY_SECONDS:
            os.utime(entry)
    except OSError:
        pass


def _age(path: Path, now: float) -> float | None:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_when_free(entry: Path, older_than: float, now: float) -> bool:
    """Remove ``entry`` (and its lock file) if no process holds its lock and it is still older than
    ``older_than`` seconds once the lock is held. True when it was removed."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no lock to respect
        fcntl = None
    lock = lock_path(entry)
    if fcntl is None:  # pragma: no cover
        _remove(entry)
        return True
    try:
        with open(lock, "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another process makes or removes it
                return False
            try:
                age = _age(entry, now)
                if age is not None and age <= older_than:  # used while this process waited for the lock
                    return False
                _remove(entry)
                lock.unlink(missing_ok=True)
                return True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
    except OSError:  # a read-only folder, a file another user owns: left for the next sweep
        return False


def remove_unused(
    entries: Iterable[Path],
    partials: Iterable[Path] = (),
    keep: Iterable[Path] = (),
    days: float = KEEP_UNUSED_DAYS,
    now: float | None = None,
) -> list[Path]:
    """Remove the ``entries`` (files or folders) last used more than ``days`` days ago, the ``partials``
    older than :data:`PARTIAL_SECONDS`, and lock files whose entry is gone, each under its lock; never
    those in ``keep``. Returns what was removed. A failure to remove one is left for the next sweep."""
    now = time.time() if now is None else now
    kept = {Path(path) for path in keep}
    removed = []
    for paths, older_than in ((entries, days * DAY_SECONDS), (partials, PARTIAL_SECONDS)):
        for entry in paths:
            age = _age(entry, now)
            if entry in kept or age is None or age <= older_than:
                continue
            if _remove_when_free(entry, older_than, now):
                removed.append(entry)
    return removed


def orphan_locks(folder: Path) -> list[Path]:
    """The lock files in ``folder`` whose entry is gone (a removed entry's lock, or one of an entry
    another kvfold version named differently)."""
    if not folder.is_dir():
        return []
    return [lock for lock in folder.glob("*.lock") if not lock.with_name(lock.name[: -len(".lock")]).exists()]


def remove_orphan_locks(folder: Path, now: float | None = None) -> list[Path]:
    """Remove the :func:`orphan_locks` of ``folder`` older than a day that no process holds (one that
    is held belongs to an entry being made)."""
    now = time.time() if now is None else now
    removed = []
    for lock in orphan_locks(folder):
        age = _age(lock, now)
        entry = lock.with_name(lock.name[: -len(".lock")])
        if age is not None and age > DAY_SECONDS and _remove_when_free(entry, DAY_SECONDS, now):
            removed.append(lock)
    return removed
