"""What kvfold keeps once per machine is removed once unused for weeks, never while another process
holds it, and its use is what keeps it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvfold.runtime import machine_cache

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the locks are flock, POSIX only")

DAY = machine_cache.DAY_SECONDS


def _aged(path: Path, days: float, folder: bool = False) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        path.mkdir()
        (path / "weights").write_text("w")
    else:
        path.write_text("x")
    then = time.time() - days * DAY
    os.utime(path, (then, then))
    return path


def test_entries_unused_for_a_month_are_removed_with_their_locks_and_the_rest_kept(tmp_path):
    old = _aged(tmp_path / "old.so", 31)
    old_folder = _aged(tmp_path / "old-model", 45, folder=True)
    recent = _aged(tmp_path / "recent.so", 29)
    kept = _aged(tmp_path / "kept.so", 90)
    machine_cache.lock_path(old).write_text("")
    removed = machine_cache.remove_unused([old, old_folder, recent, kept], keep=[kept])
    assert set(removed) == {old, old_folder}
    assert not old.exists() and not old_folder.exists() and not machine_cache.lock_path(old).exists()
    assert recent.exists() and kept.exists()


def test_an_entry_another_process_holds_is_left(tmp_path):
    old = _aged(tmp_path / "old.so", 60)
    with machine_cache.exclusive(old, "making old.so"):  # a lock of its own open file, as another process's
        assert machine_cache.remove_unused([old]) == []
    assert old.exists()
    assert machine_cache.remove_unused([old]) == [old]


def test_an_entry_used_while_the_sweep_takes_its_lock_is_kept(tmp_path, monkeypatch):
    import fcntl

    old = _aged(tmp_path / "old.so", 60)
    real = fcntl.flock

    def flock(handle, operation):  # another process marks it used just before the sweep holds the lock
        if operation & fcntl.LOCK_NB:
            os.utime(old)
        return real(handle, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    assert machine_cache.remove_unused([old]) == []
    assert old.exists()


def test_partial_files_are_removed_after_an_hour(tmp_path):
    stale = _aged(tmp_path / "a.so.part", 2 / 24)
    fresh = _aged(tmp_path / "b.so.part", 0.5 / 24)
    assert machine_cache.remove_unused([], [stale, fresh]) == [stale]
    assert fresh.exists()


def test_use_is_marked_at_most_once_a_day(tmp_path):
    old = _aged(tmp_path / "old.so", 40)
    machine_cache.mark_used(old)
    assert time.time() - old.stat().st_mtime < 60
    assert machine_cache.remove_unused([old]) == []
    hours = _aged(tmp_path / "hours.so", 0.5)
    before = hours.stat().st_mtime
    machine_cache.mark_used(hours)  # used within the day: nothing written
    assert hours.stat().st_mtime == before
    machine_cache.mark_used(tmp_path / "missing.so")  # nothing to mark, no error


def test_lock_files_without_their_entry_are_removed_unless_held_or_new(tmp_path):
    orphan = _aged(tmp_path / "gone.so.lock", 2)
    held = _aged(tmp_path / "making.so.lock", 2)
    new = _aged(tmp_path / "new.so.lock", 0.1)
    with_entry = _aged(tmp_path / "there.so.lock", 2)
    _aged(tmp_path / "there.so", 0)
    assert set(machine_cache.orphan_locks(tmp_path)) == {orphan, held, new}
    with machine_cache.exclusive(tmp_path / "making.so", "making"):
        assert machine_cache.remove_orphan_locks(tmp_path) == [orphan]
    assert held.exists() and new.exists() and with_entry.exists()


def test_a_waiting_process_says_what_it_waits_for(tmp_path, capsys):
    import threading

    entry = tmp_path / "k.so"
    started, release = threading.Event(), threading.Event()

    def hold() -> None:
        with machine_cache.exclusive(entry, "compiling k.c"):
            started.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    started.wait(5)
    threading.Timer(0.3, release.set).start()
    with machine_cache.exclusive(entry, "compiling k.c"):
        pass
    holder.join()
    assert capsys.readouterr().err == "kvfold: waiting for another process compiling k.c\n"
