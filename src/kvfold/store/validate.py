"""Checking a cache file's header and tensors against each other and the model, before anything reads them.

A cache file's checksum (:func:`kvfold.store.format.checksum`) is stored in the file, so anyone who
edits a file can recompute it: it proves that a file was not damaged by accident, not that it is
safe to read. The quantized attention reads codes, scales and row lengths by index (in PyTorch, or
in the compiled kernel of :mod:`kvfold.runtime.native`, which trusts every shape). So every file is
checked here, once, below every reader (:func:`kvfold.store.load.load_context` and the rest of the
library, ``kvfold ask``, ``kvfold serve``'s catalog, the vLLM connector):

* :func:`validate_header`, before any tensor is read: dtype and device names, one entry a model
  layer, the layer kinds and layouts, KV heads against the model, logical lengths within the
  model's positions, sizes the header declares (entries, rows) within the file's bytes, the token
  counts, the method and the budget;
* :func:`validate_tensors` (and :func:`validate_layer` for one layer, the function a serving
  backend that receives raw tensors calls): every tensor's name, dtype and shape, checked from its
  metadata before its values are read; then row lengths (non-negative, adding up to the stored
  entries), finite keys, values, scales, zero points and β (β = −inf only where the dense and paged
  layouts mark an empty slot; a quantized entry's β is finite), outlier indices in range.

Every refusal is an :class:`~kvfold.store.format.InvalidCacheFileError` whose message is one line
that names the layer and the tensor (``layer 3 q.key_scale: shape (5, 16), expected (6, 16)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from kvfold.methods import build_method
from kvfold.runtime.budget import Budget
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantized_checks import QuantizedTensorsError, check_quantized_tensors, check_tensor
from kvfold.store.format import InvalidCacheFileError, one_line

__all__ = ["Expected", "validate_header", "validate_layer", "validate_tensors"]

DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}
"""The dtypes a file's keys and values may have (its header's ``dtype``)."""
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
LAYOUTS = ("dense", "paged", "quantized")
FLOATS = tuple(DTYPES.values())
INTEGERS = (torch.int32, torch.int64)
_LAYER_NAME = re.compile(r"layer\.(\d{1,6})\.(.+)")


@dataclass(frozen=True)
class Expected:
    """What the model says a file must hold.

    Attributes:
        num_layers: decoder layers (one header entry each).
        num_kv_heads: KV heads a layer (the rows of a batch element).
        num_attention_heads: query heads (captured queries).
        head_dim: channels of a key and of a value.
        vocab_size: token ids are below it (None: unchecked).
        max_positions: logical lengths and token counts are at most it (None: unchecked).
        sliding_window: a sliding layer holds at most this many entries (None: unchecked).
    """

    num_layers: int
    num_kv_heads: int
    num_attention_heads: int
    head_dim: int
    vocab_size: int | None = None
    max_positions: int | None = None
    sliding_window: int | None = None

    @classmethod
    def from_config(cls, config: Any) -> Expected:
        """From a transformers config (its text config for a multimodal model)."""
        getter = getattr(config, "get_text_config", None)
        text = getter(decoder=True) if getter is not None else config
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        return cls(
            num_layers=int(text.num_hidden_layers),
            num_kv_heads=int(kv_heads),
            num_attention_heads=heads,
            head_dim=int(head_dim),
            vocab_size=getattr(text, "vocab_size", None),
            max_positions=getattr(text, "max_position_embeddings", None),
            sliding_window=getattr(text, "sliding_window", None),
        )


def _fail(where: str, problem: str) -> NoReturn:
    raise InvalidCacheFileError(one_line(f"{where}: {problem}"))


def _whole(value: Any, where: str, low: int = 0, high: int | None = None) -> int:
    """``value`` if it is a whole number (not a bool) in ``[low, high]``."""
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f"≥ {low}"
        _fail(where, f"{one_line(repr(value), 40)} is not a whole number {bound}")
    return value


# ------------------------------------------------------------------------------------ header


def validate_header(header: dict[str, Any], expected: Expected, file_bytes: int | None = None) -> None:
    """Refuse a header that does not describe a cache of this model, before any tensor is read.

    Args:
        header: the file's JSON header (:attr:`kvfold.store.format.CacheFileInfo.header`).
        expected: the model's sizes (:meth:`Expected.from_config`).
        file_bytes: the file's size: every size the header declares must fit in it (so a header
            that claims 2**40 entries is refused before anything is allocated).

    Raises:
        InvalidCacheFileError: one line naming the field (``header dtype``, ``layer 2 num_heads``).
    """
    if not isinstance(header.get("dtype"), str) or header["dtype"] not in DTYPES:
        _fail("header dtype", f"{one_line(repr(header.get('dtype')), 40)} is not one of {', '.join(DTYPES)}")
    device = header.get("device")
    try:
        kind = torch.device(device).type if isinstance(device, str) else None
    except (RuntimeError, ValueError):
        kind = None
    if kind not in DEVICE_TYPES:
        _fail("header device", f"{one_line(repr(device), 40)} is not a device ({', '.join(DEVICE_TYPES)})")
    layers = header.get("layers")
    if not isinstance(layers, list) or len(layers) != expected.num_layers:
        count = len(layers) if isinstance(layers, list) else "no"
        _fail("header layers", f"{count} layers in the file, the model has {expected.num_layers}")
    batches = set()
    logical = []
    for index, spec in enumerate(layers):
        batch, length = _check_layer_header(index, spec, expected, file_bytes, header.get("format_version"))
        if batch is not None:
            batches.add(batch)
            logical.append(length)
    if len(batches) > 1:
        _fail("header layers", f"layers of different batch sizes {sorted(batches)}")
    _check_header_context(header, next(iter(batches), None), min(logical, default=None), expected)


def _check_layer_header(
    index: int, spec: Any, expected: Expected, file_bytes: int | None, version: Any
) -> tuple[int | None, int | None]:
    """One layer's header entry; its batch size and logical length (None for other kinds)."""
    where = f"layer {index}"
    if not isinstance(spec, dict) or spec.get("kind") not in ("empty", "folded", "sliding"):
        _fail(where, f"kind {one_line(repr(spec.get('kind') if isinstance(spec, dict) else spec), 40)} is unknown")
    positions = expected.max_positions
    if spec["kind"] == "sliding":
        _whole(spec.get("cumulative_length"), f"{where} cumulative_length", 0, positions)
    if spec["kind"] != "folded":
        return None, None
    if spec.get("layout") not in LAYOUTS:
        _fail(f"{where} layout", f"{one_line(repr(spec.get('layout')), 40)} is not one of {', '.join(LAYOUTS)}")
    length = _whole(spec.get("logical_length"), f"{where} logical_length", 0, positions)
    batch = _whole(spec.get("batch_size"), f"{where} batch_size", 1, file_bytes)  # a row holds a byte or more
    heads = spec.get("num_heads")
    if heads != expected.num_kv_heads:
        _fail(f"{where} num_heads", f"{one_line(repr(heads), 40)}, the model has {expected.num_kv_heads} KV heads")
    if "entries" in spec or version != 1:
        _whole(spec.get("entries"), f"{where} entries", 0, file_bytes)
    kv_format = spec.get("kv_format")
    if spec["layout"] == "quantized":
        try:
            config = QuantConfig.parse(kv_format) if isinstance(kv_format, str) else None
        except ValueError as err:
            _fail(f"{where} kv_format", str(err))
        if config is None:
            _fail(f"{where} kv_format", f"{one_line(repr(kv_format), 40)} is not a quantized format")
    elif kv_format is not None:
        _fail(f"{where} kv_format", f"a {spec['layout']} layer holds no quantized format")
    return batch, length


def _check_header_context(header: dict[str, Any], batch: int | None, logical: int | None, expected: Expected) -> None:
    """The token counts (one a batch row, within the logical length), the method, budget, the cache's
    storage format and extras."""
    tokens = header.get("context_tokens")
    if tokens is not None:
        if not isinstance(tokens, list) or (batch is not None and len(tokens) != batch):
            _fail("header context_tokens", f"not a list of {batch} token counts (one a batch row)")
        for count in tokens:
            _whole(count, "header context_tokens", 0, logical if logical is not None else expected.max_positions)
    method = header.get("method")
    if method is not None:
        if not isinstance(method, str):
            _fail("header method", f"{one_line(repr(method), 40)} is not a method spec")
        try:
            build_method(method)
        except (ValueError, KeyError, TypeError) as err:
            _fail("header method", f"{one_line(repr(method), 60)}: {err}")
    budget = header.get("budget")
    if budget is not None:
        try:
            if type(budget) not in (int, float, str):
                raise ValueError("not a number")
            Budget.parse(budget)
        except (ValueError, TypeError, OverflowError) as err:
            _fail("header budget", f"{one_line(repr(budget), 40)}: {err}")
    kv_format = header.get("kv_format")
    if kv_format is not None:  # the cache's own format (a layer's may differ: ``wide``)
        try:
            if not isinstance(kv_format, str) or QuantConfig.parse(kv_format) is None:
                raise ValueError("not a quantized format")
        except ValueError as err:
            _fail("header kv_format", f"{one_line(repr(kv_format), 40)}: {err}")
    extra = header.get("extra")
    if extra is not None and not isinstance(extra, dict):
        _fail("header extra", "not a JSON object")
    suffixes = (extra or {}).get("query_aware_suffixes")
    if suffixes is not None and (
        not isinstance(suffixes, list)
        or not all(isinstance(s, str) for s in suffixes)
        or (batch is not None and len(suffixes) != batch)
    ):
        _fail("header extra.query_aware_suffixes", f"not a list of {batch} texts (one a batch row)")


# ------------------------------------------------------------------------------------ tensors


def tensors_by_layer(tensors: dict[str, Tensor], layer_count: int) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """A file's tensors in one pass: ``layer.<i>.<name>`` as ``name`` in the ``i``-th of ``layer_count``
    dicts, every other tensor by its full name.

    Raises:
        InvalidCacheFileError: a layer's tensor whose index is not one of the header's layers.
    """
    own: list[dict[str, Tensor]] = [{} for _ in range(layer_count)]
    others: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        found = _LAYER_NAME.fullmatch(name)
        if found is None:
            others[name] = tensor
        elif int(found.group(1)) < layer_count and found.group(1) == str(int(found.group(1))):
            own[int(found.group(1))][found.group(2)] = tensor
        else:
            _fail(one_line(name, 60), f"there is no layer {one_line(found.group(1), 10)} in the file's header")
    return own, others


def validate_tensors(header: dict[str, Any], tensors: dict[str, Tensor], expected: Expected) -> None:
    """Refuse a file whose tensors do not fit its header (checked by :func:`validate_header`) and the model.

    Every tensor belongs to a layer the header describes (:func:`validate_layer`), or is one of
    ``context.token_ids``, ``context.last_logits``, ``extra.<name>``; nothing else is accepted.

    Raises:
        InvalidCacheFileError: one line naming the layer and the tensor.
    """
    layers = header["layers"]
    dtype = DTYPES[header["dtype"]]
    batch = next((spec["batch_size"] for spec in layers if spec["kind"] == "folded"), None)
    own, others = tensors_by_layer(tensors, len(layers))
    for index, spec in enumerate(layers):
        validate_layer(index, spec, own[index], expected, dtype, batch)
    _check_context_tensors(others, expected, dtype, batch, layers)


def validate_layer(
    index: int,
    spec: dict[str, Any],
    tensors: dict[str, Tensor],
    expected: Expected,
    dtype: torch.dtype,
    batch_size: int | None = None,
) -> None:
    """Refuse one layer's tensors unless they are exactly what its header entry describes.

    Args:
        index: the layer's number (for the message).
        spec: its header entry (checked by :func:`validate_header`: ``kind``, ``layout``,
            ``logical_length``, ``batch_size``, ``num_heads``, ``entries``, ``kv_format``).
        tensors: its tensors by their name within the layer (``keys``, ``q.key_codes``, ``stat.h2o``).
        expected: the model's sizes.
        dtype: the keys' and values' dtype (the header's).
        batch_size: the cache's batch size (a sliding layer's header does not record it).

    Raises:
        InvalidCacheFileError: one line naming the layer and the tensor.
    """
    where = f"layer {index}"
    kind = spec["kind"]
    if kind == "empty":
        for name in sorted(tensors):
            _fail(f"{where} {one_line(name, 40)}", "an empty layer holds no tensors")
        return
    if kind == "sliding":
        _check_sliding(where, spec, tensors, expected, dtype, batch_size)
        return
    check = {"dense": _check_dense_layer, "paged": _check_paged_layer, "quantized": _check_quantized_layer}
    stat_shapes, entries, known = check[spec["layout"]](where, spec, tensors, expected, dtype)
    if "entries" in spec and spec["entries"] != entries:
        _fail(f"{where} entries", f"the header says {spec['entries']}, the tensors hold {entries}")
    for name in sorted(set(tensors) - known):
        if name.startswith("stat."):
            _check_stat(f"{where} {one_line(name, 40)}", tensors[name], stat_shapes)
        elif name == "captured_queries":
            _check_queries(f"{where} captured_queries", tensors[name], spec["batch_size"], expected, dtype)
        else:
            _fail(f"{where} {one_line(name, 40)}", f"not a tensor of a {spec['layout']} layer")


def _tensor(where: str, tensors: dict[str, Tensor], name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``tensors[name]``, refused unless present with exactly ``shape`` and ``dtype``."""
    if name not in tensors:
        _fail(f"{where} {name}", "missing")
    try:
        check_tensor(name, tensors[name], shape, dtype)
    except QuantizedTensorsError as err:
        _fail(f"{where} {name}", err.problem)
    return tensors[name]


def _dims(where: str, tensors: dict[str, Tensor], name: str, dims: int) -> tuple[int, ...]:
    if name not in tensors:
        _fail(f"{where} {name}", "missing")
    if tensors[name].dim() != dims:
        _fail(f"{where} {name}", f"{tensors[name].dim()} dimensions, expected {dims}")
    return tuple(tensors[name].shape)


def _finite_where(where: str, tensor: Tensor, valid: Tensor | None) -> None:
    """Refuse NaN or ±inf in ``tensor`` ``(..., D)`` at the entries ``valid`` (None: all of them)."""
    if not tensor.numel():
        return
    bad = ~torch.isfinite(tensor).all(-1)
    if valid is not None:
        bad &= valid
    if bool(bad.any()):
        _fail(where, "holds NaN or infinite numbers")


def _check_beta(where: str, log_mass: Tensor) -> Tensor:
    """β of a dense or paged layer: finite, or −inf for an empty slot; the slots that hold an entry."""
    if log_mass.numel() and bool((torch.isnan(log_mass) | (log_mass == float("inf"))).any()):
        _fail(f"{where} log_mass", "holds NaN or +inf (only −inf, an empty slot, is not a finite β)")
    return torch.isfinite(log_mass)


def _check_dense(where: str, spec: dict[str, Any], tensors: dict[str, Tensor], expected: Expected, dtype) -> tuple:
    """The dense part (a dense layer, or a quantized layer's tail): its slots and the entries they hold."""
    b, h, d = spec["batch_size"], spec["num_heads"], expected.head_dim
    slots = _dims(where, tensors, "keys", 4)[2]
    keys = _tensor(where, tensors, "keys", (b, h, slots, d), dtype)
    values = _tensor(where, tensors, "values", (b, h, slots, d), dtype)
    valid = None
    if "log_mass" in tensors:
        valid = _check_beta(where, _tensor(where, tensors, "log_mass", (b, h, slots), torch.float32))
    _finite_where(f"{where} keys", keys, valid)
    _finite_where(f"{where} values", values, valid)
    entries = b * h * slots if valid is None else int(valid.sum())
    return slots, entries


def _check_dense_layer(where: str, spec: dict[str, Any], tensors: dict[str, Tensor], expected: Expected, dtype):
    slots, entries = _check_dense(where, spec, tensors, expected, dtype)
    if slots > spec["logical_length"]:
        _fail(f"{where} keys", f"{slots} slots, past the logical length {spec['logical_length']}")
    return [(spec["batch_size"], spec["num_heads"], slots)], entries, {"keys", "values", "log_mass"}


def _check_paged_layer(where: str, spec: dict[str, Any], tensors: dict[str, Tensor], expected: Expected, dtype):
    b, h, d = spec["batch_size"], spec["num_heads"], expected.head_dim
    stored = _dims(where, tensors, "keys", 2)[0]
    keys = _tensor(where, tensors, "keys", (stored, d), dtype)
    values = _tensor(where, tensors, "values", (stored, d), dtype)
    valid = _check_beta(where, _tensor(where, tensors, "log_mass", (stored,), torch.float32))
    lengths = _tensor(where, tensors, "row_lengths", (b, h), torch.int64)
    if lengths.numel() and (bool((lengths < 0).any()) or bool((lengths > stored).any())):
        _fail(f"{where} row_lengths", f"a row length is negative or past the {stored} stored entries")
    total = sum(int(n) for n in lengths.flatten().tolist())
    if total != stored:
        _fail(f"{where} row_lengths", f"they add up to {total}, the layer stores {stored} entries")
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > spec["logical_length"]:
        _fail(f"{where} row_lengths", f"a row of {longest} entries, past the logical length {spec['logical_length']}")
    _finite_where(f"{where} keys", keys, valid)
    _finite_where(f"{where} values", values, valid)
    return [(stored,), (b, h, longest)], stored, {"keys", "values", "log_mass", "row_lengths"}


def _check_quantized_layer(where: str, spec: dict[str, Any], tensors: dict[str, Tensor], expected: Expected, dtype):
    config = QuantConfig.parse(spec["kv_format"])
    rows = spec["batch_size"] * spec["num_heads"]
    own = {name[2:]: t for name, t in tensors.items() if name.startswith("q.")}
    try:
        check_quantized_tensors(own, config, expected.head_dim, expected.head_dim, dtype, rows=rows)
    except QuantizedTensorsError as err:
        _fail(f"{where} q.{one_line(err.tensor, 40)}", err.problem)
    tail, tail_entries = _check_dense(where, spec, tensors, expected, dtype)
    lengths = own["lengths"]
    width = int(lengths.max()) if lengths.numel() else 0
    if width + tail > spec["logical_length"]:
        _fail(f"{where} q.lengths", f"rows of {width + tail} entries, past the logical length {spec['logical_length']}")
    entries = sum(int(n) for n in lengths.tolist()) + tail_entries
    stat_shapes = [(spec["batch_size"], spec["num_heads"], width + tail)]
    return stat_shapes, entries, {"keys", "values", "log_mass", *(f"q.{name}" for name in own)}


def _check_stat(where: str, stat: Tensor, shapes: list[tuple[int, ...]]) -> None:
    """A per-entry statistic: float or integer (positions), aligned with the layer's slots (``shapes``:
    ``(B, H, slots)``; a paged layer's also ``(entries,)``), without NaN (±inf may mark a sink or an
    empty slot)."""
    if stat.dtype not in FLOATS + INTEGERS or tuple(stat.shape) not in shapes:
        _fail(where, f"{str(stat.dtype).replace('torch.', '')} {tuple(stat.shape)}, expected {shapes[0]}")
    if stat.dtype in FLOATS and stat.numel() and bool(torch.isnan(stat).any()):
        _fail(where, "holds NaN")


def _check_queries(where: str, queries: Tensor, batch: int | None, expected: Expected, dtype) -> None:
    """Captured queries ``(B, heads, window, head_dim)`` of the file's dtype, finite."""
    if queries.dim() != 4:
        _fail(where, f"{queries.dim()} dimensions, expected 4")
    shape = (batch if batch is not None else queries.shape[0], expected.num_attention_heads, queries.shape[2])
    if tuple(queries.shape) != (*shape, expected.head_dim) or queries.dtype != dtype:
        _fail(where, f"{queries.dtype} {tuple(queries.shape)}, expected {dtype} {(*shape, expected.head_dim)}")
    _finite_where(where, queries, None)


def _check_sliding(where: str, spec: dict[str, Any], tensors: dict[str, Tensor], expected: Expected, dtype, batch):
    """A sliding-window layer: keys and values ``(B, H, window, D)``, at most the window and the tokens seen."""
    window = _dims(where, tensors, "keys", 4)[2]
    b = batch if batch is not None else tensors["keys"].shape[0]
    keys = _tensor(where, tensors, "keys", (b, expected.num_kv_heads, window, expected.head_dim), dtype)
    values = _tensor(where, tensors, "values", tuple(keys.shape), dtype)
    limit = min(spec["cumulative_length"], expected.sliding_window or window)
    if window > limit:
        _fail(f"{where} keys", f"{window} entries, more than the window or the tokens seen ({limit})")
    _finite_where(f"{where} keys", keys, None)
    _finite_where(f"{where} values", values, None)
    for name in sorted(set(tensors) - {"keys", "values"}):
        _fail(f"{where} {one_line(name, 40)}", "not a tensor of a sliding-window layer")


def _check_context_tensors(
    tensors: dict[str, Tensor], expected: Expected, dtype: torch.dtype, batch: int | None, layers: list
) -> None:
    """``context.token_ids`` (ids below the vocabulary), ``context.last_logits`` (one row of the
    vocabulary a batch row), ``extra.turn_queries.<layer>`` (a folded layer's queries); other
    ``extra.<name>`` tensors pass through; anything else is refused."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if name == "context.token_ids":
            if tensor.dtype not in INTEGERS or tensor.dim() != 2 or (batch is not None and tensor.shape[0] != batch):
                _fail(name, f"{tensor.dtype} {tuple(tensor.shape)}, expected int32 ({batch}, tokens)")
            vocab = expected.vocab_size
            if tensor.numel() and (bool((tensor < 0).any()) or (vocab is not None and bool((tensor >= vocab).any()))):
                _fail(name, f"a token id outside the vocabulary [0, {vocab})")
        elif name == "context.last_logits":
            shape = (batch if batch is not None else tensor.shape[0], expected.vocab_size or tensor.shape[-1])
            if tensor.dtype not in FLOATS or tuple(tensor.shape) != shape:
                _fail(name, f"{tensor.dtype} {tuple(tensor.shape)}, expected float {shape}")
            if tensor.numel() and bool(torch.isnan(tensor).any()):
                _fail(name, "holds NaN")
        elif name.startswith("extra.turn_queries."):
            layer = name.rsplit(".", 1)[1]
            if not layer.isdigit() or int(layer) >= len(layers) or layers[int(layer)]["kind"] != "folded":
                _fail(one_line(name, 60), "names no folded layer of the file")
            _check_queries(f"extra turn_queries.{layer}", tensor, batch, expected, dtype)
        elif not name.startswith("extra."):
            _fail(one_line(name, 60), "not a tensor of a kvfold cache file")
