"""Loading saved caches (:func:`load_cache`, :func:`load_context`): the file format and its checks live
in :mod:`kvfold.store.format`, the check of every tensor against the header and the model in
:mod:`kvfold.store.validate`, writing in :mod:`kvfold.store.save`; this module builds the objects."""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvfold.methods import CompressionContext, build_method
from kvfold.pipeline.context import CompressedContext, PrefilledContext
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.models import resolve_dtype
from kvfold.runtime.quant_config import QuantConfig
from kvfold.store.format import (
    REDO,
    CacheFileError,
    CacheFileInfo,
    CorruptCacheFileError,
    DtypeDeviceError,
    InvalidCacheFileError,
    ModelMismatchError,
    check_model,
    dtype_name,
    one_line,
    read_info,
    read_tensors,
)
from kvfold.store.layer_tensors import layer_from_tensors
from kvfold.store.validate import Expected, tensors_by_layer, validate_header, validate_tensors

__all__ = ["load_cache", "load_context", "load_file", "read_cache"]


def _resolve_target(
    info: CacheFileInfo, model: PreTrainedModel, dtype: torch.dtype | str | None, device: torch.device | str | None
) -> tuple[torch.dtype, torch.device]:
    """The dtype and device to load onto: the file's, which must be the model's unless converted explicitly."""
    saved_dtype = getattr(torch, info.header["dtype"])
    saved_device = torch.device(info.header["device"])
    model_dtype, model_device = model.dtype, model.device
    target_dtype = saved_dtype if dtype is None else resolve_dtype(dtype, model_device)
    target_device = saved_device if device is None else torch.device(device)
    if dtype is None and saved_dtype != model_dtype:
        raise DtypeDeviceError(
            f"{info.path} holds {dtype_name(saved_dtype)} keys and values but the model runs in "
            f"{dtype_name(model_dtype)}: load the model in {dtype_name(saved_dtype)} (--dtype "
            f"{dtype_name(saved_dtype)}), or convert the cache explicitly with dtype={dtype_name(model_dtype)} "
            f"(--cache-dtype {dtype_name(model_dtype)}; answers may differ slightly from the saved cache's)"
        )
    if device is None and saved_device.type != model_device.type:
        raise DtypeDeviceError(
            f"{info.path} was saved on {saved_device} but the model is on {model_device}: move the model "
            f"(--device {saved_device}), or load the cache onto the model's device with device='{model_device}' "
            f"(--cache-device {model_device.type})"
        )
    if target_dtype != model_dtype:
        raise DtypeDeviceError(
            f"dtype={dtype_name(target_dtype)} was asked but the model runs in {dtype_name(model_dtype)}; "
            f"convert the cache to the model's dtype ({dtype_name(model_dtype)})"
        )
    if target_device.type != model_device.type:
        raise DtypeDeviceError(
            f"device={target_device} was asked but the model is on {model_device}; "
            "load the cache onto the model's device"
        )
    if saved_device.type == target_device.type:
        target_device = model_device  # same kind of device: follow the model (cuda:0 vs cuda:1)
    return target_dtype, target_device


def _build_cache(
    info: CacheFileInfo, model: PreTrainedModel, tensors: dict[str, torch.Tensor], dtype, device
) -> FoldedCache:
    cache = FoldedCache(model.config)
    layers = info.header["layers"]
    if len(layers) != len(cache.layers):
        raise ModelMismatchError(
            f"{info.path} holds {len(layers)} layers but the model has {len(cache.layers)}; load the model the "
            "cache was made with"
        )
    float_types = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

    def convert(name: str, t: torch.Tensor) -> torch.Tensor:
        converted = ("keys", "values", "captured_queries", "q.outlier_keys", "q.outlier_values")
        if name in converted and t.dtype != dtype and t.dtype in float_types:
            t = t.to(dtype)
        return t.to(device)

    by_layer, _ = tensors_by_layer(tensors, len(layers))
    # validate_tensors checked the file's quantized rows; they are those tensors unless converted here
    checked = dtype_name(dtype) == info.header.get("dtype")
    for index, spec in enumerate(layers):
        own = {name: convert(name, t) for name, t in by_layer[index].items()}
        kind = spec.get("kind")
        slot = cache.layers[index]
        if kind == "empty":
            continue
        if kind == "folded" and isinstance(slot, FoldedLayer):
            cache.layers[index] = layer_from_tensors(
                spec["layout"],
                own,
                logical_length=spec["logical_length"],
                batch_size=spec["batch_size"],
                num_heads=spec["num_heads"],
                quant=QuantConfig.parse(spec["kv_format"]) if spec.get("kv_format") else None,
                checked=checked,
            )
        elif kind == "sliding" and isinstance(slot, DynamicSlidingWindowLayer):
            slot.lazy_initialization(own["keys"], own["values"])
            slot.keys, slot.values = own["keys"], own["values"]
            slot.cumulative_length = int(spec["cumulative_length"])
        else:
            raise ModelMismatchError(
                f"{info.path}: layer {index} is {kind} in the file but {type(slot).__name__} in this model; "
                "load the model the cache was made with"
            )
    formats = {spec.get("kv_format") for spec in layers if spec.get("kind") == "folded"}
    if isinstance(info.header.get("kv_format"), str):  # the cache's own format (layers may differ: ``wide``)
        cache.quant = QuantConfig.parse(info.header["kv_format"])
    elif len(formats) == 1 and None not in formats:
        cache.quant = QuantConfig.parse(formats.pop())
    return cache


def load_cache(
    path: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer=None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    verify: bool = True,
) -> FoldedCache:
    """Load a saved cache for ``model`` (a new :class:`FoldedCache`; no online policy attached).

    The cache works like the one that was saved: pass it as ``past_key_values`` to
    ``model.generate`` or a forward (positions continue at its logical length), or to
    :func:`kvfold.pipeline.context.greedy_decode`. To answer questions with the method's decode-time
    policy, use :func:`load_context`.

    Args:
        path: a file written by :func:`~kvfold.store.save.save_cache` or :func:`~kvfold.store.save.save_context`.
        model: the model the cache was made with (checked against the file's fingerprint).
        tokenizer: its tokenizer; when given, its vocabulary is checked too.
        dtype: convert keys and values to this dtype (must be the model's); by default the file's
            dtype must be the model's.
        device: load onto this device (must be the model's); by default the file's device type
            must be the model's.
        verify: check the SHA-256 checksum (reads every byte once).

    Raises:
        CorruptCacheFileError, InvalidCacheFileError, CacheFileVersionError, ModelMismatchError,
        DtypeDeviceError: see their docstrings; every one is a :class:`CacheFileError` (``ValueError``).
        A file is checked against its header and the model (:mod:`kvfold.store.validate`) before
        anything reads its tensors: a crafted file whose checksum was recomputed is refused too.
    """
    return load_file(path, model, tokenizer, dtype=dtype, device=device, verify=verify)[0]


def load_file(
    path: str | os.PathLike, model: PreTrainedModel, tokenizer=None, *, verify: bool = True,
    dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
) -> tuple[FoldedCache, CacheFileInfo, dict[str, torch.Tensor]]:  # fmt: skip
    """Everything a cache file holds: the cache, the checked header, and the other tensors.

    What :func:`load_cache`, :func:`load_context` and :func:`kvfold.store.chat.load_chat` build on;
    arguments and errors as :func:`load_cache`.

    Returns:
        The new :class:`FoldedCache`, the file's :class:`CacheFileInfo`, and its tensors that are
        not layers (``context.token_ids``, ``context.last_logits``, ``extra.<name>``), on the
        cache's device.
    """
    info = read_info(path)
    if getattr(model.config, "_attn_implementation", None) != "kvfold":
        raise CacheFileError(
            "the model does not run the kvfold attention, which a compacted cache needs (its entries carry β): "
            "load it with kvfold.load_model, or call kvfold.enable(model) first"
        )
    check_model(info, model, tokenizer)
    expected = Expected.from_config(model.config)
    _checked(info, lambda: validate_header(info.header, expected, info.file_bytes))
    target_dtype, target_device = _resolve_target(info, model, dtype, device)
    tensors = read_tensors(info, verify)
    _checked(info, lambda: validate_tensors(info.header, tensors, expected))
    cache = _build_checked(info, model, tensors, target_dtype, target_device)
    others = {n: t.to(target_device) for n, t in tensors.items() if not n.startswith("layer.")}
    return cache, info, others


def _checked(info: CacheFileInfo, check) -> None:
    """Run a check of :mod:`kvfold.store.validate`; its refusal names the file and what to do."""
    try:
        check()
    except InvalidCacheFileError as err:
        raise InvalidCacheFileError(
            f"{info.path} does not fit its header or the model ({err}): it is damaged or was crafted; {REDO}"
        ) from None


def _build_checked(info: CacheFileInfo, model, tensors: dict[str, torch.Tensor], dtype, device) -> FoldedCache:
    """:func:`_build_cache` on checked tensors; anything it still refuses is a :class:`CorruptCacheFileError`."""
    try:
        return _build_cache(info, model, tensors, dtype, device)
    except CacheFileError:
        raise
    except (KeyError, RuntimeError, IndexError, ValueError, TypeError) as err:
        raise CorruptCacheFileError(
            f"{info.path}: its tensors do not fit its header ({err.__class__.__name__}: {one_line(err)}); {REDO}"
        ) from None


def read_cache(path: str | os.PathLike, config, *, verify: bool = True) -> tuple[FoldedCache, CacheFileInfo]:
    """A file's cache and header for a model config, without the model (in the file's dtype, on the CPU).

    For a process that holds the model elsewhere (a vLLM worker): the file's own checks run (format,
    version, truncation, checksum, layers against ``config``) but not the model fingerprint, which
    needs the model's weights (:func:`load_file` checks it).

    Raises:
        CacheFileError: as :func:`load_cache`, except :class:`DtypeDeviceError`.
    """
    from types import SimpleNamespace

    info = read_info(path)
    expected = Expected.from_config(config)
    _checked(info, lambda: validate_header(info.header, expected, info.file_bytes))
    tensors = read_tensors(info, verify)
    _checked(info, lambda: validate_tensors(info.header, tensors, expected))
    dtype = getattr(torch, info.header["dtype"])
    return _build_checked(info, SimpleNamespace(config=config), tensors, dtype, torch.device("cpu")), info


def _check_online(method, cache: FoldedCache) -> None:
    """Refuse a cache that a method compressing while decoding cannot continue: a layer that is not
    dense (such a method edits entries in place), or one without the statistics its prefill
    observers record, one a slot (it continues from them).

    Raises:
        InvalidCacheFileError: naming the layer (no path: :func:`load_context` adds it).
    """
    keys = [observer.key for observer in method.prefill_observers()]
    for index, layer in cache.folded_layers:
        if layer.stored is not None:
            kind = "quantized" if layer.is_quantized else "paged"
            raise InvalidCacheFileError(f"layer {index} is {kind}; a method that compresses while decoding needs dense")
        slots = (layer.batch_size, layer.num_heads, layer.physical_length)
        for key in keys:
            stat = layer.entry_stats.get(key)
            if stat is None or tuple(stat.shape) != slots:
                raise InvalidCacheFileError(f"layer {index} stat.{key}: missing or not one a slot {slots}")


def load_context(
    path: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    verify: bool = True,
) -> CompressedContext:
    """Load a saved cache as a :class:`~kvfold.pipeline.context.CompressedContext` that answers questions.

    Its method's decode-time policy (online methods) is rebuilt from the method spec in the file,
    and continues from the statistics saved with the cache, so answers are those of the context
    that was saved. Arguments and errors as :func:`load_cache`; ``tokenizer`` is required.

    Example:
        >>> small = kvfold.load_context("doc.kvc", model, tokenizer)  # doctest: +SKIP
        >>> small.answer("Who signed the report?")  # doctest: +SKIP
    """
    cache, info, context = load_file(path, model, tokenizer, dtype=dtype, device=device, verify=verify)
    lengths = info.context_tokens or [cache.get_seq_length()]
    width = cache.get_seq_length()
    token_ids = context.get("context.token_ids")
    if token_ids is not None:
        input_ids = token_ids.to(torch.long)
    else:
        pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0
        input_ids = torch.full((len(lengths), width), pad, dtype=torch.long, device=model.device)
    mask = torch.zeros(len(lengths), width, dtype=torch.long, device=model.device)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    last_logits = context.get("context.last_logits")
    suffixes = info.extra.get("query_aware_suffixes")
    source = PrefilledContext(
        model=model,
        tokenizer=tokenizer,
        cache=cache,
        input_ids=input_ids.to(model.device),
        attention_mask=mask,
        prefill_seconds=0.0,
        suffixes=suffixes,
        last_logits=last_logits,
    )
    method = build_method(info.method or "full")
    budget = Budget.parse(info.budget or "1.0")
    policy = None
    if not budget.is_full:
        ctx = CompressionContext(
            model=model,
            cache=cache,
            input_ids=source.input_ids,
            attention_mask=mask,
            budget=budget,
            tokenizer=tokenizer,
        )
        try:
            with torch.inference_mode():
                policy = method.online_policy(ctx)
            if policy is not None:
                _check_online(method, cache)
        except ValueError as err:  # the header's method cannot continue these tensors
            raise InvalidCacheFileError(
                f"{info.path}: its method {one_line(repr(method.spec), 80)} cannot continue its cache "
                f"({one_line(err)}): it is damaged or was crafted; {REDO}"
            ) from None
    return CompressedContext(
        source=source, method=method, budget=budget, cache=cache, policy=policy, compress_seconds=0.0
    )
