"""Files that survive faults: atomic replacement, durable appends, resumable reading, one writer a folder.

The commands met with the same faults: tests/test_faults.py.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvfold.runtime import files
from kvfold.runtime.files import (
    LOCK_FILE,
    TEMP_MARK,
    DirectoryLock,
    JsonlAppender,
    OutputError,
    append_jsonl,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    explain,
    read_jsonl,
    remove_stale_temps,
)


def _temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if TEMP_MARK in p.name)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "er" / "results.json"
    assert atomic_write_text(target, '{"a": 1}\n') == target  # folders made
    assert target.read_text() == '{"a": 1}\n'
    target.chmod(0o640)
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new" and _temps(target.parent) == []
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # an existing file keeps its mode
    fresh = atomic_write_text(tmp_path / "fresh.txt", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # not mkstemp's private 0600


@pytest.mark.parametrize("fault", [RuntimeError("writer failed"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_writer_leaves_the_old_file(tmp_path: Path, fault: BaseException) -> None:
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    with pytest.raises(type(fault)), atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.endswith(f"{TEMP_MARK}.png")  # the format's suffix kept
        tmp.write_bytes(b"ne")
        raise fault
    assert target.read_bytes() == b"old" and _temps(tmp_path) == []


def test_a_full_disk_in_the_middle_of_a_write_keeps_the_old_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "results.json"
    target.write_text('{"old": true}\n')
    real_write = os.write

    def half_then_full(fd: int, data) -> int:
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OutputError) as caught:
        atomic_write_text(target, json.dumps({"new": list(range(100))}))
    monkeypatch.undo()
    assert str(caught.value) == (
        f"cannot write {target}: No space left on device; the disk is full: free some space, or give a path on "
        "another disk, and run the same command again"
    )
    assert isinstance(caught.value, OSError) and caught.value.errno == errno.ENOSPC
    assert json.loads(target.read_text()) == {"old": True} and _temps(tmp_path) == []


def test_unwritable_places_are_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match=r"^cannot write /proc/x.kvc: No such file or directory; its folder"):
        atomic_write_bytes("/proc/x.kvc", b"x")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OutputError, match=rf"^cannot write {tmp_path}/a_file/out.kvc: {tmp_path}/a_file is a file"):
        atomic_write_bytes(tmp_path / "a_file" / "out.kvc", b"x")
    with pytest.raises(OutputError, match="it is a folder: give a file name"):
        atomic_write_bytes(tmp_path, b"x")
    denied = PermissionError(errno.EACCES, "Permission denied", "/data/run")
    assert explain(denied) == (
        "cannot write /data/run: Permission denied; permission denied: give a path in a folder you can write to, "
        "or change the folder's permissions"
    )
    assert explain(OSError(errno.EIO, "Input/output error"), "x", "read").startswith("cannot read x: Input/output")
    assert explain(OSError(errno.EIO, "Input/output error", "x"), verb=None).startswith("x: Input/output error; check")


def test_temporaries_of_a_killed_writer_go_with_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "doc.kvc"
    stale = tmp_path / f".doc.kvc.{_dead_pid()}.ab12cd34{TEMP_MARK}.kvc"
    live = tmp_path / f".doc.kvc.{os.getpid()}.ab12cd34{TEMP_MARK}.kvc"  # a writer still at work
    other = tmp_path / f".other.kvc.{_dead_pid()}.ab12cd34{TEMP_MARK}.kvc"  # another target's
    for path in (stale, live, other):
        path.write_bytes(b"half")
    assert remove_stale_temps(target) == [stale]
    atomic_write_bytes(target, b"whole")
    assert _temps(tmp_path) == sorted([live, other]) and target.read_bytes() == b"whole"
    with DirectoryLock(tmp_path):  # the owner of a folder removes what killed writers left in it
        assert _temps(tmp_path) == [live]


def test_appended_rows_are_synced_one_by_one(tmp_path: Path, monkeypatch) -> None:
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    path = tmp_path / "rows.jsonl"
    with JsonlAppender(path) as rows:
        assert not path.exists()  # opened on the first row
        rows.write({"a": 1})
        rows.write({"a": 2})
        assert len(synced) == 2 and path.read_text() == '{"a": 1}\n{"a": 2}\n'
    append_jsonl(path, {"a": 3})
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}, {"a": 3}]

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OutputError, match=rf"cannot write {path}: No space left on device; the disk is full"):
        append_jsonl(path, {"a": 4})


def test_a_torn_last_line_is_dropped_and_a_damaged_line_elsewhere_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    assert read_jsonl(path) == []
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}] and path.read_bytes().endswith(b'"b"')  # not repaired
    assert read_jsonl(path, repair=True) == [{"a": 1}, {"a": 2}]
    assert path.read_bytes() == b'{"a": 1}\n\n{"a": 2}\n'
    path.write_bytes(b'{"a": 1')
    assert read_jsonl(path, repair=True) == [] and path.read_bytes() == b""
    damaged = b'{"a": 1}\n{"a": 2\n{"a": 3}\n{"a": '
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match=r"rows.jsonl line 2 is not a row \(invalid JSON\): the file was edited"):
        read_jsonl(path, repair=True, what="row")
    assert path.read_bytes() == damaged  # nothing changed, the torn tail neither
    path.write_bytes(b'{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a JSON object \(not a JSON object\)"):
        read_jsonl(path)
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"line 2 is not a row \(no 'a'\)"):
        read_jsonl(path, check=lambda row: row["a"], what="row")


def test_one_writer_a_folder(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    with DirectoryLock(folder) as lock:
        assert lock.path == folder / LOCK_FILE and lock.path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(OutputError, match=rf"^{folder} is in use by another kvfold \(pid {os.getpid()}\): wait"):
            DirectoryLock(folder).acquire()
    assert not (folder / LOCK_FILE).exists()  # a clean release removes the file
    DirectoryLock(folder).acquire().release()


HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_a_folder_held_by_another_process_is_refused_then_taken_over_when_it_dies(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder / LOCK_FILE)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"held\n"
        with pytest.raises(OutputError, match=rf"in use by another kvfold \(pid {holder.pid}\)"):
            DirectoryLock(folder).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (folder / LOCK_FILE).read_text() == f"{holder.pid}\n"  # the dead owner's file stays
    with DirectoryLock(folder) as lock:  # the kernel dropped its lock: taken over
        assert lock.path.read_text() == f"{os.getpid()}\n"


def test_a_lock_file_removed_under_a_waiting_writer_is_not_trusted(tmp_path: Path, monkeypatch) -> None:
    lock = DirectoryLock(tmp_path)
    real_same = DirectoryLock._same_file
    calls = []

    def first_removed(self, fd):
        calls.append(fd)
        return False if len(calls) == 1 else real_same(self, fd)

    monkeypatch.setattr(DirectoryLock, "_same_file", first_removed)
    with lock:
        assert len(calls) == 2  # opened again after the file it locked was found replaced
    assert files.pid_alive(os.getpid()) and not files.pid_alive(_dead_pid())
