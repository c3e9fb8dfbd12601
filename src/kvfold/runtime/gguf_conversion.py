"""A GGUF model dequantized once per machine into a transformers directory under
``$KVFOLD_CACHE/converted`` (:func:`kvfold.runtime.defaults.cache_root`), found again by the file's
contents.

A conversion is named by the GGUF's bytes (SHA-256), the transformers version that reads it and
:data:`CONVERSION_VERSION`: a fresh virtual environment, a reinstall or a second clone of the same
package finds the conversion made before (it is about half a gigabyte for SmolLM2-135M in float32).
Hashing the file takes about a third of a second, so its digest is remembered per path, size and
modification time (``converted/keys/``). One process converts while others wait under a lock
(:func:`kvfold.runtime.machine_cache.exclusive`), into a folder of its own renamed whole when written.

Each conversion sweeps the folder (:func:`sweep`): conversions unused for
:data:`~kvfold.runtime.machine_cache.KEEP_UNUSED_DAYS` days, partial ones, and conversions named
the way kvfold named them before 0.3.0 (by the GGUF's path and modification time, so that every new
environment made one more) whose file is gone or has changed: no version can find those again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvfold.runtime.defaults import cache_root
from kvfold.runtime.machine_cache import exclusive, mark_used, partial_path, remove_orphan_locks, remove_unused

CONVERSION_VERSION = 2
"""What a conversion writes (1: named by the GGUF's path, before kvfold 0.3.0; 2: by its contents)."""
SOURCE_FILE = "kvfold-source.json"
"""A conversion's record of what it was made from: ``gguf`` (a path), and from version 2 ``sha256``
(the first 16 hex digits) and ``transformers``."""
TEMPORARY_SUFFIX = ".tmp"


def converted_root() -> Path:
    """The folder of conversions: ``converted/`` under :func:`kvfold.runtime.defaults.cache_root`."""
    return cache_root() / "converted"


def location_key(gguf_path: Path) -> str:
    """16 hex digits of the file's resolved path, size and modification time (what a conversion was
    named by in version 1, and where the file's digest is remembered)."""
    stat = gguf_path.stat()
    return hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read a mebibyte at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def content_digest(gguf_path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256, remembered in ``converted/keys/<location key>``."""
    memo = converted_root() / "keys" / location_key(gguf_path)
    try:
        digest = memo.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) == 16 and all(c in "0123456789abcdef" for c in digest):
        mark_used(memo)
        return digest
    digest = file_sha256(gguf_path)[:16]
    try:  # remembered whole or not at all
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = partial_path(memo, TEMPORARY_SUFFIX)
        partial.write_text(digest)
        os.replace(partial, memo)
    except OSError:
        pass
    return digest


def conversion_dir(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` is (or will be) kept."""
    key = f"{content_digest(gguf_path)}:{transformers.__version__}:{CONVERSION_VERSION}"
    return converted_root() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _complete(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def write_conversion(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` into ``out``: the model in float32 safetensors, and its tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # The dequantized weights are plain float32: drop the GGUF quantizer so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def convert_gguf(gguf_path: Path) -> Path:
    """The transformers directory of ``gguf_path``, converted on first use (then :func:`sweep`)."""
    target = conversion_dir(gguf_path)
    if _complete(target):
        mark_used(target)
        return target
    with exclusive(target, f"converting {gguf_path.name}"):
        if _complete(target):  # another process converted it while this one waited
            return target
        print(
            f"kvfold: converting {gguf_path.name} to float32 in {target.parent}, once per machine (seconds)",
            file=sys.stderr,
            flush=True,
        )
        began = time.monotonic()
        partial = partial_path(target, TEMPORARY_SUFFIX)
        try:
            partial.mkdir()
            write_conversion(gguf_path, partial)
            record = {"gguf": str(gguf_path), "sha256": content_digest(gguf_path)}
            (partial / SOURCE_FILE).write_text(json.dumps({**record, "transformers": transformers.__version__}))
            if target.exists():  # an incomplete one, from before
                shutil.rmtree(target)
            partial.rename(target)
        finally:
            if partial.exists():
                shutil.rmtree(partial, ignore_errors=True)
        print(f"kvfold: converted {gguf_path.name} in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    sweep(target)
    return target


def _unreachable(folder: Path) -> bool:
    """A version-1 conversion (no ``sha256`` in its record) whose GGUF is gone or has changed since:
    it was named by that file's path, size and time, which no version will compute again."""
    try:
        record = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False  # not a conversion this code made: left to the age rule
    if not isinstance(record, dict) or "sha256" in record or not isinstance(record.get("gguf"), str):
        return False
    source = Path(record["gguf"])
    try:
        return not folder.name.endswith("-" + location_key(source))
    except OSError:  # the file is gone
        return True


def sweep(made: Path, now: float | None = None) -> list[Path]:
    """Remove, beside the conversion ``made``: conversions and remembered digests unused for
    :data:`~kvfold.runtime.machine_cache.KEEP_UNUSED_DAYS` days, partial ones, unreachable version-1
    conversions (:func:`_unreachable`), and lock files without a conversion. Returns what was removed."""
    root = made.parent
    now = time.time() if now is None else now
    keys = root / "keys"
    listed = [*root.iterdir(), *(keys.iterdir() if keys.is_dir() else ())]  # each folder read once
    partials = [p for p in listed if p.name.endswith(TEMPORARY_SUFFIX)]
    folders = [p for p in listed if p.parent == root and p.is_dir() and p != keys and p not in partials]
    remembered = [p for p in listed if p.parent == keys and p not in partials]
    removed = remove_unused([*folders, *remembered], partials, keep=[made], now=now)
    unreachable = [p for p in folders if p not in removed and p != made and _unreachable(p)]
    removed += remove_unused(unreachable, keep=[made], days=0, now=now)
    for folder in (root, keys):
        removed += remove_orphan_locks(folder, now=now)
    return removed
