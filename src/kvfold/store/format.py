"""Saved caches: a compacted :class:`~kvfold.runtime.cache.FoldedCache` in a file, loaded in another process.

A cache file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file. Its tensors are
what the cache physically holds and nothing more (:meth:`FoldedLayer.live_tensors`): per layer
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

Loading (:func:`load_cache`, :func:`load_context`) reads and checks the header before any tensor,
memory-maps the file (``safetensors.safe_open``), verifies the checksum, and builds a new cache;
every failure raises a :class:`CacheFileError` (a ``ValueError``) whose message says what to do,
and nothing is returned half-built.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

FORMAT = "kvfold-cache"
FORMAT_VERSION = 1
"""The version this kvfold writes; files of a higher version are refused with a clear error."""
SUPPORTED_VERSIONS = (1,)
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


class CacheFileError(ValueError):
    """A cache file cannot be used as asked; the message says what to do."""


class CorruptCacheFileError(CacheFileError):
    """Not a kvfold cache file, truncated, or altered after it was written (checksum)."""


class CacheFileVersionError(CacheFileError):
    """The file was written in a format version this kvfold does not read."""


class ModelMismatchError(CacheFileError):
    """The file was made by another model (architecture, config, weights or tokenizer)."""


class DtypeDeviceError(CacheFileError):
    """The file's dtype or device differs from the model's and no explicit conversion was asked."""


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


def _vocab_hash(tokenizer) -> str | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if tokenizer is None or get_vocab is None:
        return None
    return _sha256_json(sorted(get_vocab().items()))


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


def _fingerprint_differences(saved: dict, current: dict) -> list[str]:
    diffs = []
    if saved.get("architecture") != current["architecture"]:
        diffs.append(f"architecture ({saved.get('architecture')} in the file, {current['architecture']} given)")
    if saved.get("config_sha256") != current["config_sha256"]:
        diffs.append("config (layers, heads, sizes or RoPE differ)")
    a, b = saved.get("weights_sample") or [], current["weights_sample"]
    if len(a) != len(b) or not torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-2, atol=1e-6):
        diffs.append("weights")
    if saved.get("vocab_sha256") and current["vocab_sha256"] and saved["vocab_sha256"] != current["vocab_sha256"]:
        diffs.append("tokenizer vocabulary")
    return diffs


# ---------------------------------------------------------------------------- writing


def _dtype_name(dtype: torch.dtype | None) -> str:
    return str(dtype).replace("torch.", "")


def _checksum(header: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over the header (without its checksum) and every tensor's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in header.items() if k != "checksum"}, sort_keys=True).encode())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        digest.update(f"\0{name}\0{_dtype_name(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
        t = tensor.detach().contiguous().cpu()
        if t.numel():
            digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _layer_tensors(cache: Any, queries: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    layers, tensors = [], {}
    for index, layer in enumerate(cache.layers):
        if hasattr(layer, "live_tensors"):  # a FoldedLayer (duck-typed: this module sits below cache.py)
            if not layer.is_initialized:
                layers.append({"kind": "empty"})
                continue
            layout, content = layer.live_tensors(queries=queries)
            layers.append(
                {
                    "kind": "folded",
                    "layout": layout,
                    "logical_length": layer.logical_length,
                    "batch_size": layer.batch_size,
                    "num_heads": layer.num_heads,
                    "entries": int(layer.row_lengths().sum()),
                }
            )
            tensors.update({f"layer.{index}.{name}": t for name, t in content.items()})
        elif isinstance(layer, DynamicSlidingWindowLayer):
            if not layer.is_initialized:
                layers.append({"kind": "empty"})
                continue
            layers.append({"kind": "sliding", "cumulative_length": int(layer.cumulative_length)})
            tensors[f"layer.{index}.keys"] = layer.keys.detach().contiguous()
            tensors[f"layer.{index}.values"] = layer.values.detach().contiguous()
        else:
            raise CacheFileError(
                f"layer {index} is a {type(layer).__name__}; kvfold cache files hold FoldedCache layers"
            )
    return layers, tensors


def save_cache(
    cache: Any,
    path: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer=None,
    *,
    method: str | None = None,
    budget: float | int | None = None,
    context_tokens: int | list[int] | None = None,
    source_text: str | None = None,
    token_ids: torch.Tensor | None = None,
    include_tokens: bool = False,
    queries: bool = False,
    last_logits: torch.Tensor | None = None,
    extra: dict[str, Any] | None = None,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> int:
    """Write ``cache`` to ``path`` (atomically: a temporary file renamed into place).

    Args:
        cache: the cache to save (not modified).
        path: the file to write.
        model: the model that made the cache; its fingerprint is checked when loading.
        tokenizer: its tokenizer (vocabulary hash), or None.
        method: the method spec the cache was compressed with (informative; used to continue
            online methods and to compact a saved chat again).
        budget: the budget label (``"0.1"``, ``"512"``).
        context_tokens: the context's token count (per batch row for a batch).
        source_text: the context text; only its SHA-256 is stored.
        token_ids: ``(B, N)`` the context tokens: their SHA-256 goes into the header.
        include_tokens: also store ``token_ids`` (4 bytes a token; a chat compacted again with a
            method that re-reads its context, e.g. Attention Matching, needs them).
        queries: store the captured prefill queries (online Attention Matching reads them).
        last_logits: ``(B, V)`` the last prefill logits (query-aware caches decode from them).
        extra: more JSON-serializable header fields (e.g. a chat's state).
        extra_tensors: more tensors, stored as ``extra.<name>`` (e.g. a chat's query window).

    Returns:
        The size of the written file in bytes.
    """
    from safetensors.torch import save_file

    import kvfold

    folded = [layer for _, layer in cache.folded_layers if layer.is_initialized]
    if not folded:
        raise CacheFileError("the cache is empty: prefill a context before saving it")
    layers, tensors = _layer_tensors(cache, queries)
    if token_ids is not None and include_tokens:
        tensors["context.token_ids"] = token_ids.detach().to(torch.int32).contiguous()
    if last_logits is not None:
        tensors["context.last_logits"] = last_logits.detach().contiguous()
    for name, tensor in (extra_tensors or {}).items():
        tensors[f"extra.{name}"] = tensor.detach().contiguous()
    tensors = {name: t.cpu() for name, t in tensors.items()}
    if isinstance(context_tokens, int):
        context_tokens = [context_tokens]
    header: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kvfold_version": kvfold.__version__,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_fingerprint(model, tokenizer),
        "dtype": _dtype_name(folded[0].dtype),
        "device": str(folded[0].device),
        "method": method,
        "budget": budget,
        "context_tokens": context_tokens,
        "source_sha256": hashlib.sha256(source_text.encode("utf-8")).hexdigest() if source_text else None,
        "tokens_sha256": _token_hash(token_ids) if token_ids is not None else None,
        "layers": layers,
        "live_bytes": sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("layer.")),
        "kv_bytes_full": cache.full_nbytes(),
        "extra": extra or {},
    }
    header["checksum"] = {"algorithm": "sha256", "value": _checksum(header, tensors.items())}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target.stat().st_size


def _token_hash(token_ids: torch.Tensor) -> str:
    return hashlib.sha256(token_ids.detach().to(torch.int64).cpu().numpy().tobytes()).hexdigest()


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
    redo = "re-create it with `kvfold compress` (or CompressedContext.save)"
    if not p.is_file():
        raise CorruptCacheFileError(f"cache file not found: {p}")
    size = p.stat().st_size
    with p.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise CorruptCacheFileError(f"{p} is truncated or not a kvfold cache file ({size} bytes); {redo}")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CorruptCacheFileError(f"{p} is truncated (its header is cut off); {redo}")
        raw = handle.read(header_len)
    try:
        index = json.loads(raw)
        meta = json.loads(index["__metadata__"][METADATA_KEY])
    except (ValueError, KeyError, TypeError):
        raise CorruptCacheFileError(f"{p} is not a kvfold cache file (no kvfold header); {redo}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCacheFileError(f"{p} is not a kvfold cache file (format {meta.get('format')!r}); {redo}")
    version = meta.get("format_version")
    if version not in SUPPORTED_VERSIONS:
        newer = isinstance(version, int) and version > max(SUPPORTED_VERSIONS)
        hint = (
            f"it was written by kvfold {meta.get('kvfold_version')}: upgrade kvfold to read it, or {redo}"
            if newer
            else redo
        )
        raise CacheFileVersionError(
            f"{p} is a kvfold cache file of format version {version!r}; this kvfold reads version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {hint}"
        )
    names = [name for name in index if name != "__metadata__"]
    try:
        data_end = max((int(index[name]["data_offsets"][1]) for name in names), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        raise CorruptCacheFileError(f"{p} has a damaged tensor index; {redo}") from None
    if size < 8 + header_len + data_end:
        raise CorruptCacheFileError(
            f"{p} is truncated: {size} bytes of the {8 + header_len + data_end} its header announces; {redo}"
        )
    return CacheFileInfo(path=p, header=meta, file_bytes=size, tensor_names=names)


def _read_tensors(info: CacheFileInfo, verify: bool) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    redo = "re-create it with `kvfold compress` (or CompressedContext.save)"
    try:
        with safe_open(str(info.path), framework="pt", device="cpu") as handle:  # memory-mapped
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises its own error types
        raise CorruptCacheFileError(f"{info.path} cannot be read ({err}); {redo}") from None
    if verify:
        expected = (info.header.get("checksum") or {}).get("value")
        if expected != _checksum(info.header, tensors.items()):
            raise CorruptCacheFileError(
                f"{info.path} fails its checksum: it was changed or damaged after it was written; {redo}"
            )
    return tensors


def _check_model(info: CacheFileInfo, model: PreTrainedModel, tokenizer) -> None:
    saved = info.header.get("model") or {}
    current = model_fingerprint(model, tokenizer)
    diffs = _fingerprint_differences(saved, current)
    if diffs:
        raise ModelMismatchError(
            f"{info.path} was made by another model ({saved.get('name') or saved.get('architecture')}); "
            f"the given model differs in: {', '.join(diffs)}. Load the model the cache was made with "
            "(the same --model), or compress the context again with this model"
        )


def save_context(
    compressed,
    path: str | os.PathLike,
    *,
    source_text: str | None = None,
    resumable: bool = False,
    extra: dict[str, Any] | None = None,
) -> int:
    """Write a :class:`~kvfold.pipeline.context.CompressedContext` (cache, method, budget, token count).

    Args:
        compressed: the compressed context.
        path: the file to write.
        source_text: the context text (only its hash is stored).
        resumable: also store the context's token ids and the last query states of every layer,
            so that a chat on this file (:meth:`kvfold.pipeline.chat.ChatSession.load`) can compact it again
            with any method (Attention Matching re-reads the tokens, SnapKV reads the queries).
            Costs 4 bytes a token plus the query window; off by default. Online methods always
            store the query states (their policy reads them).
        extra: more header fields.

    Returns:
        The size of the file in bytes.
    """
    src = compressed.source
    lengths = [int(n) for n in src.attention_mask.sum(-1).tolist()]
    queries = compressed.policy is not None or resumable
    header_extra = dict(extra or {})
    if src.suffixes is not None:
        header_extra["query_aware_suffixes"] = list(src.suffixes)
    return save_cache(
        compressed.cache,
        path,
        src.model,
        src.tokenizer,
        method=compressed.method.spec,
        budget=compressed.budget.label(),
        context_tokens=lengths,
        source_text=source_text,
        token_ids=src.input_ids,
        include_tokens=resumable,
        queries=queries,
        last_logits=src.last_logits if src.suffixes is not None else None,
        extra=header_extra,
    )
