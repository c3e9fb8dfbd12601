"""Saved caches: a compacted :class:`~kvfold.runtime.cache.FoldedCache` in a file, loaded in another process.

A cache file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file. Its tensors are
what the cache physically holds and nothing more (:func:`kvfold.store.layer_tensors.layer_tensors`): per layer
``layer.<i>.keys``, ``.values``, ``.log_mass`` (β; absent when every β is 0), ``.row_lengths``
(paged layers, per-head lengths), ``.stat.<name>`` (per-entry statistics an online policy
continues from) and, for online methods, ``.captured_queries``; optionally ``context.token_ids``
(the tokens the cache was made from; methods that re-read them, e.g. Attention Matching, need
them to compact a saved chat again) and ``context.last_logits`` (query-aware caches). So the
file is the budget's size, not the context's.

The JSON header (safetensors metadata key ``kvfold``) holds the format name and version, the
kvfold version, a fingerprint of the model (:func:`model_fingerprint`), dtype and device, the
method spec and budget, the context's token count, hashes of its tokens and source text, the
per-layer layout and logical lengths, and a SHA-256 checksum over the header and every tensor's
name, dtype, shape and bytes.

This module defines the format: the header, the fingerprint, the checksum, and reading and
checking a file (:func:`read_info`, :func:`read_tensors`, :func:`check_model`). Writing is
:mod:`kvfold.store.save` (:func:`~kvfold.store.save.save_cache`, :func:`~kvfold.store.save.save_context`);
loading (:func:`~kvfold.store.load.load_cache`, :func:`~kvfold.store.load.load_context`) reads and
checks the header before any tensor, memory-maps the file (``safetensors.safe_open``), verifies the
checksum, checks every tensor against the header and the model (:mod:`kvfold.store.validate`: the
checksum proves integrity, not safety, since whoever edits a file can recompute it), and builds a
new cache; every failure raises a :class:`CacheFileError` (a ``ValueError``) whose message, one
line, says what to do, and nothing is returned half-built.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import struct
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from kvfold.runtime.errors import UserError

FORMAT = "kvfold-cache"
FORMAT_VERSION = 2
"""The version this kvfold writes; files of a higher version are refused with a clear error.
Version 2 adds quantized layers (layout ``quantized``: ``q.*`` codes, scales and zero points, a
``kv_format`` per layer) and the header's byte counts; version 1 files load as before."""
SUPPORTED_VERSIONS = (1, 2)
METADATA_KEY = "kvfold"
CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "rms_norm_eps",
    "sliding_window",
    "layer_types",
    "attention_bias",
    "tie_word_embeddings",
)
"""Config fields that decide what a key or value means (hashed into the model fingerprint)."""
WEIGHT_SAMPLES = 16
"""Values sampled from each of three parameters to tell checkpoints of one architecture apart."""
REDO = "re-create it with `kvfold compress` (or kvfold.save_context)"
"""How to get a usable file again, the end of every message about a bad file."""


def kvfold_version() -> str:
    """The installed kvfold's version (its package metadata; ``"unknown"`` in a tree not installed).

    Read from the metadata rather than from ``kvfold.__version__``: this module sits below the
    package root and does not import it.
    """
    try:
        return importlib.metadata.version("kvfold")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class CacheFileError(UserError):
    """A cache file cannot be used as asked; the message says what to do."""


class CorruptCacheFileError(CacheFileError):
    """Not a kvfold cache file, truncated, or altered after it was written (checksum)."""


class CacheFileVersionError(CacheFileError):
    """The file was written in a format version this kvfold does not read."""


class ModelMismatchError(CacheFileError):
    """The file was made by another model (architecture, config, weights or tokenizer)."""


class DtypeDeviceError(CacheFileError):
    """The file's dtype or device differs from the model's and no explicit conversion was asked."""


class InvalidCacheFileError(CorruptCacheFileError):
    """A file whose contents contradict its header or the model: a shape, a dtype, a length, a
    non-finite scale. Its checksum may well hold (anyone who edits a file can recompute it), so
    :mod:`kvfold.store.validate` checks every tensor before anything reads it; the message names
    the layer and the tensor."""


def one_line(value: object, limit: int = 300) -> str:
    """``value`` as text on one line (runs of whitespace, newlines included, become one space),
    cut to ``limit`` characters: how a message quotes what a file or a library said."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------- fingerprint


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _weight_sample(model: PreTrainedModel) -> list[float]:
    """A few values of the first, middle and last parameters (float32), in a fixed order."""
    params = [p for _, p in model.named_parameters()]
    if not params:
        return []
    picks = [params[0], params[len(params) // 2], params[-1]]
    out: list[float] = []
    for p in picks:
        flat = p.detach().reshape(-1)
        idx = (torch.arange(WEIGHT_SAMPLES) * (flat.numel() - 1) // max(1, WEIGHT_SAMPLES - 1)).to(flat.device)
        out.extend(float(v) for v in flat[idx].float().cpu())
    return out


_VOCAB_HASHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Each tokenizer's vocabulary hash with its size then (``len(tokenizer)``): hashing a 49K-token vocabulary
takes about 0.1 s, most of a small file's check when a server checks every version of a file."""


def _vocab_hash(tokenizer) -> str | None:
    """The SHA-256 of the tokenizer's sorted vocabulary, None without one. Kept per tokenizer object and
    computed again when its size changes (tokens added)."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if tokenizer is None or get_vocab is None:
        return None
    try:
        size = len(tokenizer)
        kept = _VOCAB_HASHES.get(tokenizer)
    except TypeError:  # no size, or not weakly referenceable: not kept
        size, kept = None, None
    if kept is not None and kept[0] == size:
        return kept[1]
    digest = _sha256_json(sorted(get_vocab().items()))
    if size is not None:
        _VOCAB_HASHES[tokenizer] = (size, digest)
    return digest


def model_fingerprint(model: PreTrainedModel, tokenizer=None) -> dict[str, Any]:
    """What identifies the model a cache belongs to.

    Returns:
        ``architecture`` (the model class), ``config_sha256`` (over :data:`CONFIG_KEYS` of the text
        config), ``weights_sample`` (values of three parameters), ``vocab_sha256`` (the tokenizer's
        vocabulary, None without a tokenizer), ``dtype`` and ``name`` (``config.name_or_path``,
        informative only).
    """
    config = model.config.get_text_config(decoder=True)
    fields = {key: getattr(config, key, None) for key in CONFIG_KEYS}
    return {
        "architecture": type(model).__name__,
        "config_sha256": _sha256_json(fields),
        "weights_sample": _weight_sample(model),
        "vocab_sha256": _vocab_hash(tokenizer),
        "dtype": str(model.dtype).replace("torch.", ""),
        "name": str(getattr(model.config, "name_or_path", "") or ""),
    }


def _numbers(value: Any) -> list[float] | None:
    """``value`` as a list of finite floats, or None when it is not one (a damaged or crafted header)."""
    if not isinstance(value, list) or not all(type(v) in (int, float) for v in value):
        return None
    return [float(v) for v in value] if all(abs(v) < float("inf") for v in value) else None


def _fingerprint_differences(saved: dict, current: dict) -> list[str]:
    diffs = []
    if saved.get("architecture") != current["architecture"]:
        diffs.append(
            f"architecture ({one_line(saved.get('architecture'), 80)} in the file, {current['architecture']} given)"
        )
    if saved.get("config_sha256") != current["config_sha256"]:
        diffs.append("config (layers, heads, sizes or RoPE differ)")
    a, b = _numbers(saved.get("weights_sample") or []), current["weights_sample"]
    if a is None or len(a) != len(b) or not torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-2, atol=1e-6):
        diffs.append("weights")
    if saved.get("vocab_sha256") and current["vocab_sha256"] and saved["vocab_sha256"] != current["vocab_sha256"]:
        diffs.append("tokenizer vocabulary")
    return diffs


# ---------------------------------------------------------------------------- checks


def dtype_name(dtype: torch.dtype | None) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``: how the header and the messages name a dtype."""
    return str(dtype).replace("torch.", "")


def checksum(header: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the header (without its checksum) and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"\0{name}\0{dtype_name(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
        t = tensor.detach().contiguous().cpu()
        if t.numel():
            digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


# ---------------------------------------------------------------------------- reading


@dataclass
class CacheFileInfo:
    """A cache file's header, read and checked without loading any tensor.

    Attributes:
        path: the file.
        header: the JSON header (see the module docstring).
        file_bytes: the size of the file.
        tensor_names: names of the stored tensors.
    """

    path: Path
    header: dict[str, Any]
    file_bytes: int
    tensor_names: list[str] = field(default_factory=list)

    @property
    def method(self) -> str | None:
        return self.header.get("method")

    @property
    def budget(self) -> str | None:
        return self.header.get("budget")

    @property
    def context_tokens(self) -> list[int] | None:
        return self.header.get("context_tokens")

    @property
    def extra(self) -> dict[str, Any]:
        return self.header.get("extra") or {}


def read_info(path: str | os.PathLike) -> CacheFileInfo:
    """Read and check the header of a cache file (format, version, completeness).

    Raises:
        CorruptCacheFileError: missing, not a kvfold cache file, or truncated.
        CacheFileVersionError: written in a format version this kvfold does not read.
    """
    p = Path(path)
    if not p.is_file():
        raise CorruptCacheFileError(f"cache file not found: {p}")
    size = p.stat().st_size
    with p.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CorruptCacheFileError(f"{p} is truncated or not a kvfold cache file ({size} bytes); {REDO}")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CorruptCacheFileError(f"{p} is truncated (its header is cut off); {REDO}")
        raw = handle.read(header_len)
    try:
        index = json.loads(raw)
        meta = json.loads(index["__metadata__"][METADATA_KEY])
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CorruptCacheFileError(f"{p} is not a kvfold cache file (no kvfold header); {REDO}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = one_line(repr(meta.get("format") if isinstance(meta, dict) else None), 60)
        raise CorruptCacheFileError(f"{p} is not a kvfold cache file (format {found}); {REDO}")
    version = meta.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        newer = isinstance(version, int) and version > max(SUPPORTED_VERSIONS)
        hint = (
            f"it was written by kvfold {one_line(meta.get('kvfold_version'), 40)}: upgrade kvfold to read it, or {REDO}"
            if newer
            else REDO
        )
        raise CacheFileVersionError(
            f"{p} is a kvfold cache file of format version {one_line(repr(version), 40)}; this kvfold reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {hint}"
        )
    names = [name for name in index if name != "__metadata__"]
    try:
        data_end = max((int(index[name]["data_offsets"][1]) for name in names), default=0)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError):
        raise CorruptCacheFileError(f"{p} has a damaged tensor index; {REDO}") from None
    if size < 8 + header_len + data_end:
        raise CorruptCacheFileError(
            f"{p} is truncated: {size} bytes of the {8 + header_len + data_end} its header announces; {REDO}"
        )
    return CacheFileInfo(path=p, header=meta, file_bytes=size, tensor_names=names)


def read_tensors(info: CacheFileInfo, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of a checked file (memory-mapped), its checksum verified when ``verify``.

    Raises:
        CorruptCacheFileError: unreadable, or altered after it was written.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(info.path), framework="pt", device="cpu") as handle:  # memory-mapped
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types
        raise CorruptCacheFileError(f"{info.path} cannot be read ({one_line(err)}); {REDO}") from None
    if verify:
        recorded = info.header.get("checksum")
        expected = recorded.get("value") if isinstance(recorded, dict) else None
        if expected != checksum(info.header, tensors.items()):
            raise CorruptCacheFileError(
                f"{info.path} fails its checksum: it was changed or damaged after it was written; {REDO}"
            )
    return tensors


def check_model(info: CacheFileInfo, model: PreTrainedModel, tokenizer) -> None:
    """Refuse a file made by another model (architecture, config, weights or tokenizer vocabulary).

    Raises:
        ModelMismatchError: with what differs.
    """
    saved = info.header.get("model") or {}
    if not isinstance(saved, dict):
        raise InvalidCacheFileError(f"{info.path}: header model: not a model fingerprint; {REDO}")
    current = model_fingerprint(model, tokenizer)
    diffs = _fingerprint_differences(saved, current)
    if diffs:
        raise ModelMismatchError(
            f"{info.path} was made by another model ({one_line(saved.get('name') or saved.get('architecture'), 80)}); "
            f"the given model differs in: {', '.join(diffs)}. Load the model the cache was made with "
            "(the same --model), or compress the context again with this model"
        )
