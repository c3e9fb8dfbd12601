"""A :class:`~kvfold.runtime.folded_layer.FoldedLayer` as the tensors a cache file holds, and back.

:func:`layer_tensors` gives what a layer physically holds and nothing more (no spare capacity, no
padding of ragged rows) under one of three layouts, ``dense``, ``paged`` and ``quantized``;
:func:`layer_from_tensors` rebuilds the same layer, same slots and same statistics, from them. The
file around these tensors (header, fingerprint, checksum) is :mod:`kvfold.store.format`; the checks of
every tensor read from a file, before this module sees it, are :mod:`kvfold.store.validate`.
"""

from __future__ import annotations

import torch

from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import FloatRows


def layer_tensors(layer: FoldedLayer, *, queries: bool = False) -> tuple[str, dict[str, torch.Tensor]]:
    """What ``layer`` holds, without spare capacity: the content a cache file stores.

    Args:
        queries: also return the captured prefill queries (``captured_queries``).

    Returns:
        ``(layout, tensors)``. ``dense`` (no stored rows): ``keys``/``values`` ``(B, H, N, D)``
        of the N slots, ``log_mass`` ``(B, H, N)`` (absent when every β is 0). ``paged`` (stored
        rows at full precision): ``keys``/``values`` ``(L, D)`` of the L entries, row after row
        in slot order (a row's stored entries, then its tail's entries of finite β),
        ``log_mass`` ``(L,)`` and ``row_lengths`` ``(B, H)``. ``quantized``: the stored rows'
        tensors as ``q.<name>``, and the tail as a dense layout. Statistics of ``entry_stats``
        come as ``stat.<name>``, aligned the same way.
    """
    out: dict[str, torch.Tensor] = {}
    slot = None
    if layer.stored is None or layer.is_quantized:
        layout = "dense" if layer.stored is None else "quantized"
        if layer.stored is not None:
            out.update({f"q.{name}": t for name, t in layer.stored.tensors().items()})
        keys, values, log_mass = layer.tail()
        out.update(keys=keys, values=values)
        if log_mass is not None:
            out["log_mass"] = log_mass
    else:
        layout = "paged"
        keys, values, log_mass, _ = layer.padded()
        width = layer.stored.width
        slot = torch.isfinite(log_mass)
        slot[:, :, :width] = torch.arange(width, device=slot.device) < layer.stored_lengths()[..., None]
        out.update(keys=keys[slot], values=values[slot], log_mass=log_mass[slot], row_lengths=slot.sum(-1))
    for name, stat in layer.entry_stats.items():
        out[f"stat.{name}"] = stat if slot is None or stat.shape != slot.shape else stat[slot]
    if queries and layer.captured_queries is not None:
        out["captured_queries"] = layer.captured_queries
    return layout, {name: t.detach().contiguous() for name, t in out.items()}


def layer_from_tensors(
    layout: str,
    tensors: dict[str, torch.Tensor],
    *,
    logical_length: int,
    batch_size: int,
    num_heads: int,
    quant: QuantConfig | None = None,
    checked: bool = False,
) -> FoldedLayer:
    """Rebuild a layer from :func:`layer_tensors` (same layout, same slots, same statistics).

    A ``quantized`` layout needs its format (``quant``); its codes are taken as they are, checked first
    unless ``checked`` (:meth:`QuantizedRows.from_tensors`: the caller checked these very tensors).

    Raises:
        ValueError: unknown layout or tensors of inconsistent shapes.
    """
    keys, values = tensors["keys"], tensors["values"]
    layer = FoldedLayer()
    head_dim, value_dim = keys.shape[-1], values.shape[-1]
    layer.lazy_initialization(
        keys.new_zeros(batch_size, num_heads, 0, head_dim), values.new_zeros(batch_size, num_heads, 0, value_dim)
    )
    stats = {name[5:]: t for name, t in tensors.items() if name.startswith("stat.")}
    if layout in ("quantized", "dense"):
        if layout == "quantized":
            if quant is None:
                raise ValueError("quantized layer: the file names no KV format")
            own = {name[2:]: t for name, t in tensors.items() if name.startswith("q.")}
            layer.stored = QuantizedRows.from_tensors(own, quant, head_dim, value_dim, keys.dtype, checked=checked)
            if layer.stored.num_rows != batch_size * num_heads:
                raise ValueError("quantized layer: row count differs from batch × heads")
        elif keys.shape[:2] != (batch_size, num_heads) or values.shape[:3] != keys.shape[:3]:
            raise ValueError(f"dense layer: keys {tuple(keys.shape)} and values {tuple(values.shape)} disagree")
        layer.adopt_tail(keys, values, tensors.get("log_mass"))
    elif layout == "paged":
        lengths = tensors["row_lengths"].to(torch.long)
        if lengths.shape != (batch_size, num_heads) or int(lengths.sum()) != keys.shape[0]:
            raise ValueError("paged layer: row lengths do not add up to the stored entries")
        beta = tensors["log_mass"].float()
        plain = bool((beta == 0).all())
        layer.stored = FloatRows(lengths.reshape(-1), keys, values, None if plain else beta)
        n = layer.stored.width
        slot = torch.arange(n, device=keys.device)[None, None, :] < lengths[..., None]
        for name, stat in list(stats.items()):
            if stat.dim() == 1 and stat.shape[0] == keys.shape[0]:
                full = stat.new_zeros(batch_size, num_heads, n)
                full[slot] = stat
                stats[name] = full
    else:
        raise ValueError(f"unknown layer layout {layout!r}")
    layer.logical_length = int(logical_length)
    layer.entry_stats = stats
    layer.captured_queries = tensors.get("captured_queries")
    return layer
