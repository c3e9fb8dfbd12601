"""The cache catalog's verdicts when a file is replaced while it is checked (no model, no engine: the check
itself is a fake that reads the file's text).

* a file replaced during its check (``os.replace``, as a writer does) is checked again, and the verdict
  is the new file's, never "damaged";
* a file replaced during every check is answered 503 ("ask again"), and nothing is kept;
* a verdict is kept while the file is the same (inode, size, modification time), and checked again once
  it is replaced, even by a file of the same size and time;
* a request on a file whose verdict holds is answered while another file is being checked, and
  requests on one new file arriving together check it once.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvfold.integrations.vllm.requests import CHECK_TRIES, CacheCatalog, CacheRequestError, CheckedCache


def _write(folder: Path, name: str, text: str) -> None:
    """Replace ``name.kvc`` atomically by a file holding ``text``."""
    temporary = folder / f".{name}.tmp"
    temporary.write_text(text)
    os.replace(temporary, folder / f"{name}.kvc")


def _verdict(name: str, path: Path) -> CheckedCache:
    return CheckedCache(name, path, path.read_text(), 10, 32, "full", "1.0")


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    """A catalog whose check returns the file's text as its checksum, after ``catalog.during(path)``."""
    made = CacheCatalog(tmp_path, "unused")
    made.checks = 0
    made.during = lambda path: None

    def check(name, path):
        made.checks += 1
        text = path.read_text()
        made.during(path)  # the file may be replaced here, between the check's reads
        try:
            if path.read_text() != text:
                return CacheRequestError(f"cache {name!r} cannot be served: fails its checksum", status=422)
        except OSError:
            return CacheRequestError(f"cache {name!r} cannot be served: not found", status=422)
        return _verdict(name, path)

    monkeypatch.setattr(made, "_check", check)
    return made


def test_a_file_replaced_during_its_check_is_checked_again(catalog, tmp_path):
    _write(tmp_path, "doc", "first")
    replaced = []

    def once(path):
        if not replaced:
            replaced.append(True)
            _write(tmp_path, "doc", "second")

    catalog.during = once
    assert catalog.check("doc").checksum == "second"
    assert catalog.checks == 2


def test_a_file_replaced_during_every_check_is_answered_503(catalog, tmp_path):
    _write(tmp_path, "doc", "a")
    turn = iter(range(100))
    catalog.during = lambda path: _write(tmp_path, "doc", f"v{next(turn)}")
    with pytest.raises(CacheRequestError, match="replaced while it was being checked") as raised:
        catalog.check("doc")
    assert raised.value.status == 503 and catalog.checks == CHECK_TRIES
    catalog.during = lambda path: None
    assert catalog.check("doc").checksum == (tmp_path / "doc.kvc").read_text()  # nothing kept from the tries


def test_a_verdict_is_kept_until_the_file_is_replaced_even_by_one_of_the_same_size_and_time(catalog, tmp_path):
    _write(tmp_path, "doc", "first")
    assert catalog.check("doc").checksum == "first"
    assert catalog.check("doc").checksum == "first" and catalog.checks == 1  # kept
    stat = (tmp_path / "doc.kvc").stat()
    _write(tmp_path, "doc", "secon")  # same size ...
    os.utime(tmp_path / "doc.kvc", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and time: another inode
    assert catalog.check("doc").checksum == "secon" and catalog.checks == 2


def test_a_file_gone_during_its_check_is_404(catalog, tmp_path):
    _write(tmp_path, "doc", "first")
    catalog.during = lambda path: path.unlink()
    with pytest.raises(CacheRequestError) as raised:
        catalog.check("doc")
    assert raised.value.status == 404


def _blocking(catalog, tmp_path, name: str) -> tuple[threading.Event, threading.Event]:
    """Make the check of ``name`` wait, once inside, until released: (inside, release)."""
    inside, release = threading.Event(), threading.Event()

    def during(path):
        if path.stem == name:
            inside.set()
            assert release.wait(30)

    catalog.during = during
    return inside, release


def test_a_known_file_is_answered_while_a_new_one_is_being_checked(catalog, tmp_path):
    _write(tmp_path, "known", "k")
    _write(tmp_path, "new", "n")
    assert catalog.check("known").checksum == "k"
    inside, release = _blocking(catalog, tmp_path, "new")
    checking = threading.Thread(target=catalog.check, args=("new",))
    checking.start()
    try:
        assert inside.wait(30)
        answered = []
        asking = threading.Thread(target=lambda: answered.append(catalog.check("known").checksum))
        asking.start()
        asking.join(5)
        assert answered == ["k"], "a request on a checked file waited for another file's check"
    finally:
        release.set()
        checking.join(30)
    assert catalog.checks == 2


def test_requests_on_one_new_file_arriving_together_check_it_once(catalog, tmp_path):
    _write(tmp_path, "new", "n")
    inside, release = _blocking(catalog, tmp_path, "new")
    verdicts = []
    threads = [threading.Thread(target=lambda: verdicts.append(catalog.check("new").checksum)) for _ in range(4)]
    for thread in threads:
        thread.start()
    assert inside.wait(30)
    time.sleep(0.2)  # the others reach the check meanwhile
    release.set()
    for thread in threads:
        thread.join(30)
    assert verdicts == ["n"] * 4 and catalog.checks == 1
