"""Crafting cache files as an attacker would: edit a file's tensors or header, then recompute its checksum.

The checksum (:func:`kvfold.store.format.checksum`) is stored in the file, so a crafted file passes
it; what refuses such a file is :mod:`kvfold.store.validate`. Tests of every reader (the library,
``kvfold ask``, ``kvfold serve``'s HTTP 422) build their bad files with :func:`craft`.

Example:
    >>> craft(good, bad, tensors=set_tensor("layer.0.q.lengths", lambda t: t + 5))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvfold.store.format import METADATA_KEY, checksum

Tensors = dict[str, torch.Tensor]


def read_raw(path: str | Path) -> tuple[dict[str, Any], Tensors]:
    """A cache file's kvfold header and its tensors, unchecked (copies: free to edit)."""
    from safetensors.torch import load_file

    raw = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(json.loads(raw[8 : 8 + length])["__metadata__"][METADATA_KEY])
    return header, {name: t.clone() for name, t in load_file(str(path)).items()}


def write_raw(path: str | Path, header: dict[str, Any], tensors: Tensors, *, recompute: bool = True) -> Path:
    """Write ``tensors`` with ``header`` as a cache file, its checksum recomputed (unless ``recompute``
    is False) as anyone who edits a file can."""
    from safetensors.torch import save_file

    header = dict(header)
    if recompute:
        header["checksum"] = {"algorithm": "sha256", "value": checksum(header, tensors.items())}
    contiguous = {name: t.contiguous() for name, t in tensors.items()}
    save_file(contiguous, str(path), metadata={METADATA_KEY: json.dumps(header, sort_keys=True)})
    return Path(path)


def craft(
    source: str | Path,
    target: str | Path,
    *,
    tensors: Callable[[Tensors], Any] | None = None,
    header: Callable[[dict[str, Any]], Any] | None = None,
) -> Path:
    """Copy the cache file ``source`` to ``target`` with edits, its checksum recomputed.

    Args:
        source: a good cache file.
        target: the crafted file to write.
        tensors: edits the dict of tensors in place (replace, delete or add entries).
        header: edits the kvfold header (a dict) in place.

    Returns:
        ``target``.
    """
    meta, content = read_raw(source)
    if tensors is not None:
        tensors(content)
    if header is not None:
        header(meta)
    return write_raw(target, meta, content)


def set_tensor(name: str, edit: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], None]:
    """A ``tensors`` edit for :func:`craft`: replace tensor ``name`` by ``edit(tensor)``."""

    def apply(content: Tensors) -> None:
        content[name] = edit(content[name])

    return apply


def poke(name: str, value: float, index: int = 0) -> Callable[[Tensors], None]:
    """A ``tensors`` edit for :func:`craft`: set element ``index`` of the flattened tensor ``name`` to ``value``."""

    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[index] = value
        return t

    return set_tensor(name, edit)


def truncate_file(source: str | Path, target: str | Path, keep: int) -> Path:
    """Copy ``source`` to ``target`` cut to its first ``keep`` bytes (a file cut short: no checksum to fix)."""
    Path(target).write_bytes(Path(source).read_bytes()[:keep])
    return Path(target)


def _negative_first(lengths: torch.Tensor) -> torch.Tensor:
    """Row lengths with the same sum, the first row's negative."""
    out = torch.zeros_like(lengths)
    out[0], out[1] = -1, int(lengths.sum()) + 1
    return out


def _beta(fill: float, short: int = 0) -> Callable[[Tensors], None]:
    """Add layer 0's quantized β: ``fill`` for every entry, ``short`` entries too few."""

    def apply(content: Tensors) -> None:
        content[L0 + "log_mass"] = torch.full((content[L0 + "key_codes"].shape[0] - short,), fill)

    return apply


def _layer(index: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    """A header edit: update layer ``index``'s entry."""
    return lambda meta: meta["layers"][index].update(fields)


L0 = "layer.0.q."
NAN, INF = float("nan"), float("inf")
CRAFTED_INT4: list[tuple[str, Callable[[Tensors], Any] | None, Callable[[dict], Any] | None, str]] = [
    ("row lengths past the entries", set_tensor(L0 + "lengths", lambda t: t + 5), None, "row lengths (q.lengths)"),
    ("a negative row length", set_tensor(L0 + "lengths", _negative_first), None, "layer 0 q.lengths"),
    ("key codes of the wrong width", set_tensor(L0 + "key_codes", lambda t: t[:, :-1]), None, "layer 0 q.key_codes"),
    ("value codes of the wrong width", set_tensor(L0 + "value_codes", lambda t: t[:, :-2]), None, "q.value_codes"),
    ("key codes cut short", set_tensor(L0 + "key_codes", lambda t: t[:-1]), None, "layer 0 q.key_codes"),
    ("value codes cut short", set_tensor(L0 + "value_codes", lambda t: t[:-3]), None, "layer 0 q.value_codes"),
    ("key scales of the wrong shape", set_tensor(L0 + "key_scale", lambda t: t[:-1]), None, "layer 0 q.key_scale"),
    ("key zero points cut short", set_tensor(L0 + "key_zero", lambda t: t[:-1]), None, "layer 0 q.key_zero"),
    ("key zero points flattened", set_tensor(L0 + "key_zero", lambda t: t.reshape(-1)), None, "layer 0 q.key_zero"),
    ("value scales flattened", set_tensor(L0 + "value_scale", lambda t: t.reshape(-1)), None, "layer 0 q.value_scale"),
    ("value zero points cut short", set_tensor(L0 + "value_zero", lambda t: t[:-1]), None, "layer 0 q.value_zero"),
    ("β of the wrong length", _beta(0.0, short=1), None, "layer 0 q.log_mass"),
    ("NaN key scales", poke(L0 + "key_scale", NAN), None, "layer 0 q.key_scale"),
    ("infinite key scales", poke(L0 + "key_scale", INF, 3), None, "layer 0 q.key_scale"),
    ("NaN value scales", poke(L0 + "value_scale", NAN, 5), None, "layer 0 q.value_scale"),
    ("infinite key zero points", poke(L0 + "key_zero", -INF), None, "layer 0 q.key_zero"),
    ("NaN value zero points", poke(L0 + "value_zero", NAN), None, "layer 0 q.value_zero"),
    ("NaN β", _beta(NAN), None, "layer 0 q.log_mass"),
    ("infinite β", _beta(-INF), None, "layer 0 q.log_mass"),
    ("key scales of another dtype", set_tensor(L0 + "key_scale", lambda t: t.float()), None, "layer 0 q.key_scale"),
    ("row lengths of another dtype", set_tensor(L0 + "lengths", lambda t: t.int()), None, "layer 0 q.lengths"),
    ("an outlier out of range", set_tensor(L0 + "outlier_index", lambda t: torch.tensor([10**6])), None, "outlier"),
    ("a missing tensor", lambda c: c.pop(L0 + "value_zero"), None, "layer 0 q.value_zero"),
    ("an unknown tensor", lambda c: c.update({L0 + "bogus": torch.zeros(3)}), None, "layer 0 q.bogus"),
    ("a layer the model lacks", lambda c: c.update({"layer.7.keys": torch.zeros(1)}), None, "layer.7.keys"),
    ("2**40 entries in the header", None, _layer(0, entries=2**40), "layer 0 entries"),
    ("a logical length of 2**40", None, _layer(0, logical_length=2**40), "layer 0 logical_length"),
    ("another head count", None, _layer(1, num_heads=3), "layer 1 num_heads"),
    ("a batch of 2**40 rows", None, _layer(1, batch_size=2**40), "layer 1 batch_size"),
    ("another key group", None, _layer(0, kv_format="int4[key_group=16]"), "layer 0 q.key_scale"),
    ("a layer missing from the header", None, lambda h: h["layers"].pop(), "header layers"),
    ("a dtype that is not one", None, lambda h: h.update(dtype="load"), "header dtype"),
]
"""Every tensor of an int4 file (made with the tiny test Llama: 2 layers, 2 KV heads, head_dim 16),
crafted wrong: ``(case, tensors edit, header edit, words the one-line refusal holds)``."""
