"""A GGUF is converted once per machine, found again by its contents (a new environment's copy of the
same file included), by one process at a time, and the folder of conversions does not grow without end."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest
import transformers

from kvfold.runtime import gguf_conversion

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the locks are flock, POSIX only")

DAY = 86_400


@pytest.fixture
def conversions(tmp_path, monkeypatch) -> list[Path]:
    """A stand-in for the dequantization (it takes seconds and the real model): records each run."""
    monkeypatch.setenv("KVFOLD_CACHE", str(tmp_path / "cache"))
    runs: list[Path] = []

    def write(gguf_path: Path, out: Path) -> None:
        time.sleep(0.2)
        runs.append(gguf_path)
        (out / "config.json").write_text(json.dumps({"from": gguf_path.read_text()}))
        (out / "model.safetensors").write_text("weights")

    monkeypatch.setattr(gguf_conversion, "write_conversion", write)
    return runs


def _gguf(path: Path, text: str = "model bytes") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_copies_of_one_file_in_two_environments_share_one_conversion(tmp_path, conversions):
    first = _gguf(tmp_path / "venv-a" / "m.gguf")
    second = _gguf(tmp_path / "venv-b" / "m.gguf")
    os.utime(second, (time.time() - 3600, time.time() - 3600))  # installed at another time
    target = gguf_conversion.convert_gguf(first)
    assert gguf_conversion.convert_gguf(second) == target
    assert conversions == [first]
    record = json.loads((target / gguf_conversion.SOURCE_FILE).read_text())
    assert record["transformers"] == transformers.__version__ and len(record["sha256"]) == 16
    other = gguf_conversion.convert_gguf(_gguf(tmp_path / "venv-c" / "m.gguf", "other bytes"))
    assert other != target and len(conversions) == 2
    assert not list(target.parent.glob("*.tmp"))


def test_a_files_digest_is_computed_once_per_path_and_time(tmp_path, conversions, monkeypatch):
    gguf = _gguf(tmp_path / "m.gguf")
    digests = []
    real = gguf_conversion.file_sha256
    monkeypatch.setattr(gguf_conversion, "file_sha256", lambda path: digests.append(1) or real(path))
    first = gguf_conversion.convert_gguf(gguf)
    assert gguf_conversion.convert_gguf(gguf) == first
    assert len(digests) == 1
    gguf.write_text("new bytes")  # the package was upgraded in place
    assert gguf_conversion.convert_gguf(gguf) != first and len(digests) == 2


def test_processes_asking_at_once_convert_once(tmp_path, conversions, capsys):
    gguf = _gguf(tmp_path / "m.gguf")
    start, found = threading.Barrier(3), []

    def convert() -> None:
        start.wait()
        found.append(gguf_conversion.convert_gguf(gguf))

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1 and len(set(found)) == 1
    err = capsys.readouterr().err
    assert err.count("kvfold: waiting for another process converting m.gguf") == 2
    assert err.count("kvfold: converting m.gguf to float32 in ") == 1 and err.count("converted m.gguf in") == 1


def test_a_failed_conversion_leaves_nothing_half_written(tmp_path, conversions, monkeypatch):
    def fail(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise OSError("No space left on device")

    monkeypatch.setattr(gguf_conversion, "write_conversion", fail)
    gguf = _gguf(tmp_path / "m.gguf")
    with pytest.raises(OSError, match="No space"):
        gguf_conversion.convert_gguf(gguf)
    assert [p.name for p in gguf_conversion.converted_root().iterdir() if p.is_dir()] == ["keys"]


def _old_style(root: Path, gguf: Path, name: str, days: float = 0) -> Path:
    """A conversion as kvfold wrote it before 0.3.0: named by the GGUF's path and time."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / gguf_conversion.SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf)}))
    then = time.time() - days * DAY
    os.utime(folder, (then, then))
    return folder


def test_a_conversion_sweeps_what_no_one_can_load_again(tmp_path, conversions):
    root = gguf_conversion.converted_root()
    live = _gguf(tmp_path / "old-venv" / "m.gguf", "old bytes")
    reachable = _old_style(root, live, f"m-{gguf_conversion.location_key(live)}")
    deleted_venv = _old_style(root, tmp_path / "deleted-venv" / "m.gguf", "m-00000000deadbeef")
    changed = _old_style(root, live, "m-0123456789abcdef")  # the same path at an earlier time
    unused = root / "m-fedcba9876543210"
    unused.mkdir()
    (unused / "config.json").write_text("{}")
    month = time.time() - 40 * DAY
    os.utime(unused, (month, month))
    partial = root / "m-1111111111111111.abc.tmp"
    partial.mkdir()
    os.utime(partial, (time.time() - 2 * 3600,) * 2)
    made = gguf_conversion.convert_gguf(_gguf(tmp_path / "venv" / "m.gguf"))
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(["keys", made.name, made.name + ".lock", reachable.name])
    assert not deleted_venv.exists() and not changed.exists() and not unused.exists() and not partial.exists()


def test_what_is_made_has_the_umasks_permissions_for_a_shared_cache(tmp_path, conversions):
    """A temporary folder of ``tempfile`` is the owner's alone (0700): another user of a shared
    ``KVFOLD_CACHE`` could not read the conversion renamed from it."""
    old = os.umask(0o022)
    try:
        target = gguf_conversion.convert_gguf(_gguf(tmp_path / "m.gguf"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    memo = gguf_conversion.converted_root() / "keys" / gguf_conversion.location_key(tmp_path / "m.gguf")
    assert stat.S_IMODE(memo.stat().st_mode) == 0o644
