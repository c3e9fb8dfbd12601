"""Writing files that survive faults: atomic replacement, durable appends, resumable reading, one writer.

Every file kvfold writes goes through here, so a full disk, a permission error, Ctrl-C or
``kill -9`` never leaves a half-written file, and a failed write says which path and what to do:

* :func:`atomic_path` — a temporary file in the target's folder, handed to any writer (safetensors,
  matplotlib), then flushed to disk (``fsync``) and renamed over the target (``os.replace``): a
  reader, or a process killed at any moment, sees the old file or the new one, never a part. A
  temporary file left by a killed process is removed by the next write to the same target.
  :func:`atomic_write_bytes` and :func:`atomic_write_text` write content this way.
* :class:`JsonlAppender` — one JSON object a line, each line flushed and synced as it is written:
  a finished row survives a crash; a crash in the middle of a line leaves a torn last line.
* :func:`read_jsonl` — reads such a file back, dropping (and with ``repair`` removing) a torn last
  line; a damaged line elsewhere is reported with its number and nothing is changed.
* :class:`DirectoryLock` — one writer per output folder: ``fcntl.flock`` on a lock file holding the
  owner's pid; the kernel drops the lock when its process dies, so a later run takes over.
* :class:`OutputError` — an :class:`OSError` whose message names the path and what to do
  (:func:`explain`); the command line prints it as one line and exits with 2.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfold.runtime.errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: folders are not locked
    fcntl = None

__all__ = [
    "LOCK_FILE",
    "TEMP_MARK",
    "DirectoryLock",
    "JsonlAppender",
    "OutputError",
    "append_jsonl",
    "atomic_path",
    "atomic_write_bytes",
    "atomic_write_text",
    "explain",
    "output_errors",
    "pid_alive",
    "read_jsonl",
    "remove_stale_temps",
    "sync_file",
]

TEMP_MARK = ".kvfold-tmp"
"""In the name of every temporary file (``.NAME.PID.RANDOM.kvfold-tmp.SUFFIX``, beside the target)."""

LOCK_FILE = ".kvfold.lock"
"""The lock file of an output folder (:class:`DirectoryLock`); it holds the owner's pid."""

ADVICE = {
    errno.ENOSPC: "the disk is full: free some space, or give a path on another disk, and run the same command again",
    errno.EDQUOT: "the disk quota is used up: free some space, or give a path elsewhere, and run the command again",
    errno.EACCES: "permission denied: give a path in a folder you can write to, or change the folder's permissions",
    errno.EPERM: "not permitted: give a path in a folder you can write to, or change the folder's permissions",
    errno.EROFS: "a read-only file system: give a path on a writable one",
    errno.ENOENT: "its folder does not exist or takes no new files: give a path in a folder you can write to",
    errno.ENOTDIR: "give a path whose folders are folders",
    errno.EISDIR: "it is a folder: give a file name",
    errno.ENAMETOOLONG: "the name is too long: give a shorter path",
}
"""What to do, by ``errno``; anything else: :data:`DEFAULT_ADVICE`."""
DEFAULT_ADVICE = "check the path and the disk, and run the same command again"


class OutputError(OSError):
    """A file could not be written (or an output folder is in use): the path, why, and what to do.

    An :class:`OSError` (``errno`` and ``filename`` kept from the cause), whose ``str`` is one line.
    """

    def __init__(self, path: str | os.PathLike, message: str, code: int | None = None) -> None:
        super().__init__(code, message, str(path))
        self.message = message

    def __str__(self) -> str:
        return self.message


def explain(err: OSError, path: str | os.PathLike | None = None, verb: str | None = "write") -> str:
    """One line for a failed file operation: ``cannot write PATH: why; what to do``.

    Args:
        err: the error (an :class:`OutputError` says itself).
        path: the file meant (default: the error's own ``filename``).
        verb: what was done (``write``, ``read``); None when it is not known (``PATH: why; …``).
    """
    if isinstance(err, OutputError):
        return err.message
    where = path if path is not None else err.filename
    why = err.strerror or str(err)
    advice = ADVICE.get(err.errno, DEFAULT_ADVICE)
    if not where:
        return f"{why}; {advice}"
    return f"cannot {verb} {where}: {why}; {advice}" if verb else f"{where}: {why}; {advice}"


@contextmanager
def output_errors(path: str | os.PathLike) -> Iterator[None]:
    """Turn an :class:`OSError` raised inside into an :class:`OutputError` about ``path``."""
    try:
        yield
    except OutputError:
        raise
    except OSError as err:
        raise OutputError(path, explain(err, path), err.errno) from err


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (it may be another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: str | os.PathLike, *, folder: bool = False) -> list[Path]:
    """Remove the temporary files of ``path`` (:func:`atomic_path`) whose writing process is gone.

    Args:
        path: the target whose temporary files are meant; with ``folder``, a folder: every
            temporary file in it.
        folder: see ``path``.

    Returns:
        The removed files.
    """
    path = Path(path)
    where, pattern = (path, "*") if folder else (path.parent, _glob_escape(f".{path.name}.") + "*")
    removed = []
    for candidate in where.glob(f"{pattern}{TEMP_MARK}*"):
        pid = candidate.name.split(TEMP_MARK, 1)[0].rsplit(".", 2)  # [".NAME", PID, RANDOM]
        if len(pid) == 3 and pid[1].isdigit() and not pid_alive(int(pid[1])):
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def _glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def sync_file(path: str | os.PathLike) -> None:
    """Flush a file's content to the disk (``fsync``)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (``fsync`` of the folder, where the platform allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without folder descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a folder
        pass
    finally:
        os.close(fd)


def _prepare_folder(path: Path) -> None:
    """Make the target's folder; a part of the path that is a file is said plainly."""
    parent = path.parent
    for part in (parent, *parent.parents):
        if part.exists():
            if not part.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{part} is a file, not a folder", str(part))
            break
    parent.mkdir(parents=True, exist_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path for a writer; on success it replaces ``path`` at once (fsync, then rename).

    The temporary file is made in the target's folder (a rename across file systems would copy),
    named ``.NAME.PID.RANDOM.kvfold-tmp.SUFFIX`` so that writers that read the suffix (matplotlib)
    keep the format. On any error, or an interruption, it is removed and the target is untouched;
    ``kill -9`` may leave it, and the next write to the same target removes it.

    Raises:
        OutputError: the folder cannot be made, the file cannot be written, synced or renamed.

    Example:
        >>> with atomic_path("runs/a/plot.png") as tmp:  # doctest: +SKIP
        ...     fig.savefig(tmp)
    """
    path = Path(path)
    with output_errors(path):
        _prepare_folder(path)
        remove_stale_temps(path)
        tmp = _new_temp(path)
    try:
        with output_errors(path):
            yield tmp
            sync_file(tmp)
            os.replace(tmp, path)
        _sync_folder(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def _new_temp(path: Path) -> Path:
    """A new empty file beside ``path``, made with the usual permissions (the umask; an existing
    target's own mode), not the private mode of :func:`tempfile.mkstemp`."""
    mode = stat.S_IMODE(path.stat().st_mode) if path.is_file() else 0o666
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_MARK}{path.suffix}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:  # pragma: no cover - 32 random bits taken
            continue
        os.close(fd)
        if path.is_file():
            os.chmod(tmp, mode)  # the umask applied at creation; an existing target keeps its mode
        return tmp


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_path`); returns the path.

    Raises:
        OutputError: the file cannot be written.
    """
    path = Path(path)
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_TRUNC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_path`); returns the path.

    Raises:
        OutputError: the file cannot be written.
    """
    return atomic_write_bytes(path, text.encode("utf-8"))


class JsonlAppender:
    """Appends JSON objects to a file, one a line, each flushed and synced before :meth:`write` returns.

    A crash leaves every written row whole; one in the middle of a line leaves a torn last line,
    which :func:`read_jsonl` drops. The file is opened on the first row.

    Example:
        >>> with JsonlAppender("runs/a/rows.jsonl") as rows:  # doctest: +SKIP
        ...     rows.write({"sample_id": "s1", "score": 100.0})
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._handle = None

    def write(self, row: Mapping[str, Any]) -> None:
        """Append one row; it is on the disk when this returns.

        Raises:
            OutputError: the row cannot be written (the file keeps the rows before it).
        """
        line = json.dumps(row) + "\n"
        with output_errors(self.path):
            if self._handle is None:
                self._handle = self.path.open("a", encoding="utf-8")
            self._handle.write(line)
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        """Close the file (a failed close after a failed write is not raised again)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            with suppress(OSError):
                handle.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def append_jsonl(path: str | os.PathLike, row: Mapping[str, Any]) -> None:
    """Append one row to a JSON-lines file, durably (:class:`JsonlAppender`)."""
    with JsonlAppender(path) as rows:
        rows.write(row)


def read_jsonl(
    path: str | os.PathLike,
    *,
    repair: bool = False,
    check: Callable[[dict[str, Any]], Any] | None = None,
    what: str = "JSON object",
) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file written by :class:`JsonlAppender`, as a resumed run reads them.

    A last line without its newline is torn (a crash in the middle of a write): it is left out, and
    with ``repair`` removed from the file (atomically), so that rows appended next start on a line
    of their own. A line elsewhere that is not a JSON object (or that ``check`` refuses with a
    ``KeyError``, ``TypeError`` or ``ValueError``) is reported with its number; nothing is changed.

    Args:
        path: the file (missing: no rows).
        repair: remove a torn last line from the file.
        check: called on every row; what it raises marks the row as damaged.
        what: what a row is, for the message (``"line 3 is not a prediction row"``).

    Raises:
        UserError: a damaged line (its number, and what to do).
        OutputError: the repair cannot be written.
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    complete, _, torn = data.rpartition(b"\n")
    rows = []
    for number, line in enumerate(complete.split(b"\n") if complete else [], start=1):
        if line.strip():
            rows.append(_parse_row(path, number, line, check, what))
    if repair and torn.strip():
        atomic_write_bytes(path, complete + b"\n" if complete else b"")
    return rows


def _parse_row(
    path: Path, number: int, line: bytes, check: Callable[[dict[str, Any]], Any] | None, what: str
) -> dict[str, Any]:
    """One line of :func:`read_jsonl`, parsed and checked."""
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        row, reason = None, "invalid JSON"
    else:
        reason = None if isinstance(row, dict) else "not a JSON object"
    if reason is None and check is not None:
        try:
            check(row)
        except KeyError as err:
            reason = f"no {err}"
        except (ValueError, TypeError) as err:
            reason = str(err)
    if reason is not None:
        raise UserError(
            f"{path} line {number} is not a {what} ({reason}): the file was edited or damaged; correct or "
            "delete that line and run again (nothing was changed)"
        )
    return row


class DirectoryLock:
    """One writer per output folder: an exclusive ``flock`` on ``FOLDER/.kvfold.lock``.

    The lock file holds the owner's pid, for the message a second writer gets. The kernel drops
    the lock when its process ends, however it ends (``kill -9`` included), so a later run takes
    over without anyone deleting anything; a clean release removes the file. The folder is made
    when missing, and the temporary files of writers killed in it are removed
    (:func:`remove_stale_temps`). Without ``fcntl`` (not POSIX) nothing is locked.

    Example:
        >>> with DirectoryLock("runs/a"):  # doctest: +SKIP
        ...     ...  # the only kvfold writing into runs/a

    Raises:
        OutputError: another process holds the folder (its pid in the message), or the folder or
            the lock file cannot be made.
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> DirectoryLock:
        """Take the folder (at once, or fail: a second writer is refused, not queued)."""
        with output_errors(self.folder):
            _prepare_folder(self.path)
            while self._fd is None:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                if not self._lock(fd):
                    owner = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
                    os.close(fd)
                    raise OutputError(
                        self.folder,
                        f"{self.folder} is in use by another kvfold (pid {owner}): wait for it to finish, "
                        "or give another output folder",
                        errno.EBUSY,
                    )
                if self._same_file(fd):
                    self._fd = fd
                else:  # the previous owner removed the file between our open and our lock: again
                    os.close(fd)
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode("ascii"), 0)
            remove_stale_temps(self.folder, folder=True)  # what writers killed here left
        return self

    def _lock(self, fd: int) -> bool:
        if fcntl is None:  # pragma: no cover - not POSIX
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Give the folder back: remove the lock file (still locked, so no one takes a removed file), unlock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
