"""How the native kernels are built: once, even when several processes ask at the same moment."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvfold.runtime import native

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the build lock is flock, POSIX only")


def _slow_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in compiler that takes a second, counts its runs and writes the ``-o`` file."""
    runs = tmp_path / "runs"
    script = tmp_path / "cc"
    script.write_text(
        "#!/bin/sh\n"
        'while [ "$#" -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
        f'sleep 1; echo run >> {runs}; echo library > "$out"\n'
    )
    script.chmod(0o755)
    return script, runs


def test_processes_asking_at_once_compile_a_kernel_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    compiler, runs = _slow_compiler(tmp_path)
    source = tmp_path / "k.c"
    source.write_text("int kvfold_k(void) { return 1; }\n")
    built: list[Path] = []
    start = threading.Barrier(3)

    def build() -> None:  # each thread opens the lock file itself, as another process would
        start.wait()
        built.append(native._build(str(compiler), source_path=source))  # noqa: SLF001 - the build itself

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs.read_text().count("run") == 1  # one compiler run, not three
    assert len(set(built)) == 1 and built[0].read_text() == "library\n"
    err = capsys.readouterr().err
    assert err.count("kvfold: compiling k.c") == 1 and err.count("compiled k.c in") == 1
    assert err.count("waiting for another process compiling k.c") == 2
    assert not list(built[0].parent.glob("*.part"))


def test_a_slow_first_build_has_minutes_not_seconds(tmp_path, monkeypatch):
    """On 2 cores the pool kernel's first build has taken 96 s, several times that when busy: a limit near
    that would leave a server's requests on the PyTorch path, and try again in every new process."""
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "k.c"
    source.write_text("int kvfold_k(void) { return 1; }\n")
    given: dict = {}

    def run(argv, **options):  # the compiler's run as _build makes it
        given.update(options)
        Path(argv[argv.index("-o") + 1]).write_text("library\n")

    monkeypatch.setattr(native.subprocess, "run", run)
    native._build("cc", source_path=source)  # noqa: SLF001 - the build itself
    assert given["timeout"] == native.BUILD_SECONDS >= 600


def test_a_build_removes_libraries_unused_for_a_month_and_a_load_marks_its_own(tmp_path, monkeypatch):
    """Every kvfold version (and every baseline a benchmark builds) leaves a library; a build, the only time
    the folder grows, removes those not loaded for a month, partial builds and lock files without a library."""
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    folder = native.cache_dir()
    folder.mkdir(parents=True)
    month = time.time() - 31 * 86_400
    old, recent, partial = folder / "attend_codes-0ld.so", folder / "attend_pool-rec3nt.so", folder / "x.so.part"
    old_lock = folder / "attend_codes-0ld.lock"  # a lock named the way kvfold named them before
    for path in (old, recent, partial, old_lock):
        path.write_text("library\n")
    for path in (old, partial, old_lock):
        os.utime(path, (month, month))
    compiler, _ = _slow_compiler(tmp_path)
    source = tmp_path / "k.c"
    source.write_text("int kvfold_k(void) { return 1; }\n")
    umask = os.umask(0o022)
    try:
        built = native._build(str(compiler), source_path=source)  # noqa: SLF001 - the build itself
    finally:
        os.umask(umask)
    assert sorted(p.name for p in folder.iterdir()) == sorted([recent.name, built.name, built.name + ".lock"])
    assert built.stat().st_mode & 0o044 == 0o044  # readable by a shared cache's other users (umask 022)
    os.utime(built, (month, month))
    assert native._build(str(compiler), source_path=source) == built  # noqa: SLF001 - found, and marked used
    assert time.time() - built.stat().st_mtime < 60
