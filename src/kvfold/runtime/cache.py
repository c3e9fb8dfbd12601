"""The folded KV cache: a transformers ``Cache`` whose full-attention layers are
:class:`~kvfold.runtime.folded_layer.FoldedLayer` (stored rows, then a dense tail; β per entry).

Every method of the seed papers ends in this object (see docs/architecture.md): a shorter cache whose
entries may stand for several tokens. Besides the layers it holds what applies to all of them: an online
policy, the query capture window, prefill observers, the storage format of compressed entries, memory
accounting (bytes held, bytes of the content, bytes of the full cache at 16 bits), fixed tails for a
compiled decode and a scratch area for passes that read the context again (KVzip's repeat pass).
Sliding-window layers stay transformers' own and are counted, not compressed.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quant_config import SIXTEEN_BIT, QuantConfig


class FoldedCache(Cache):
    """A transformers ``Cache`` whose layers are :class:`FoldedLayer` (see the module docstring).

    Args:
        config: the model config (used for the number of layers and sliding-window layers).
        num_layers: number of layers when no config is given.

    Attributes:
        policy: an optional online policy, called by the kvfold attention after every forward
            (decode-time compression under a fixed budget).
        capture_window: when > 0, the kvfold attention keeps the last ``capture_window`` query
            states of every layer in ``layer.captured_queries`` (SnapKV, GRKV windows).
        prefill_observers: callables ``observer(layer_idx, layer, query, scaling)`` that the kvfold
            attention calls during the prefill of an empty layer, after the layer holds the keys
            and values (e.g. H2O's accumulated attention, written to ``layer.entry_stats``).
    """

    def __init__(self, config=None, num_layers: int | None = None) -> None:
        if config is None and num_layers is None:
            raise ValueError("FoldedCache needs a model config or num_layers")
        text_config = config.get_text_config(decoder=True) if config is not None else None
        n = num_layers if num_layers is not None else text_config.num_hidden_layers
        layer_types = getattr(text_config, "layer_types", None) if text_config is not None else None
        layers: list[CacheLayerMixin] = []
        for i in range(n):
            kind = layer_types[i] if layer_types else "full_attention"
            if kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(sliding_window=text_config.sliding_window))
            else:
                layers.append(FoldedLayer())
        super().__init__(layers=layers)
        self.policy = None
        self.capture_window = 0
        self.prefill_observers: list = []
        self.quant: QuantConfig | None = None
        """The storage of the compressed entries (None: full precision); a re-compaction stores
        its result the same way."""

    @property
    def folded_layers(self) -> list[tuple[int, FoldedLayer]]:
        """``(index, layer)`` for every layer that kvfold compresses (full-attention layers)."""
        return [(i, layer) for i, layer in enumerate(self.layers) if isinstance(layer, FoldedLayer)]

    def shrink_to_fit(self, headroom: int = 16) -> None:
        """Release unused dense capacity in every folded layer (see :meth:`FoldedLayer.shrink_to_fit`)."""
        for _, layer in self.folded_layers:
            layer.shrink_to_fit(headroom)

    def nbytes(self) -> int:
        """Exact bytes held by all layers' tensors (stored rows, keys, values, log-mass)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, FoldedLayer):
                total += layer.nbytes()
            elif getattr(layer, "is_initialized", False):
                total += layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        return total

    def full_nbytes(self, *, sixteen_bit: bool = False) -> int:
        """Bytes an uncompressed cache of the same logical length would hold (keys + values); with
        ``sixteen_bit`` at 2 bytes an element, the full cache a GPU user holds in bf16 / fp16."""
        total = 0
        for layer in self.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if isinstance(layer, FoldedLayer):
                per = layer.batch_size * layer.num_heads * layer.head_dim * 2
                element = SIXTEEN_BIT if sixteen_bit else torch.empty(0, dtype=layer.dtype).element_size()
                total += per * layer.logical_length * element
            else:
                total += _sliding_bytes(layer, sixteen_bit)
        return total

    def content_nbytes(self, *, sixteen_bit: bool = False) -> int:
        """Bytes of what the cache holds: codes, scales, zero points, β, keys and values, row
        lengths, without spare capacity (:meth:`FoldedLayer.content_nbytes`)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, FoldedLayer):
                total += layer.content_nbytes(sixteen_bit=sixteen_bit)
            elif getattr(layer, "is_initialized", False):
                total += _sliding_bytes(layer, sixteen_bit)
        return total

    def memory_ratio(self) -> float:
        """The cache's bytes over the full cache's, both as a GPU user holds them (unquantized
        elements at 16 bits): comparable between token-only, quantized and combined pipelines."""
        full = self.full_nbytes(sixteen_bit=True)
        return self.content_nbytes(sixteen_bit=True) / full if full else 1.0

    def quantize(self, config: QuantConfig | None) -> None:
        """Store every folded layer's entries quantized (:meth:`FoldedLayer.quantize`), each in its
        layer's format (:meth:`QuantConfig.layer_format`: ``wide`` layers of short rows wider or in the
        model's dtype), and remember the format for later re-compactions; None leaves the cache as it is."""
        if config is None:
            return
        for _, layer in self.folded_layers:
            if layer.is_initialized:
                own = config.layer_format(layer.row_lengths())
                if own is not None:
                    layer.quantize(own)
        self.quant = config

    def fix_tails(self, new_tokens: int) -> None:
        """Fix every layer's tail for ``new_tokens`` decode steps of one token (:meth:`FoldedLayer.fix_tail`):
        what a compiled decode step needs (:mod:`kvfold.pipeline.compiled_decode`).

        Raises:
            UserError: a layer kvfold does not hold (sliding-window layers grow and drop entries every
                step), an online policy (it edits the cache between steps), or an empty cache.
        """
        if any(not isinstance(layer, FoldedLayer) for layer in self.layers):
            raise UserError(
                "a compiled decode needs every layer to be a full-attention FoldedLayer; this model has "
                "sliding-window layers (decode it without --compiled)"
            )
        if self.policy is not None:
            raise UserError("a compiled decode takes no online (decode-time) method; decode it without --compiled")
        if not all(layer.is_initialized for layer in self.layers):
            raise UserError("a compiled decode needs a prefilled cache")
        for layer in self.layers:
            layer.fix_tail(new_tokens)

    def release_tails(self) -> None:
        """Make every fixed tail growable again (:meth:`FoldedLayer.release_tail`)."""
        for _, layer in self.folded_layers:
            layer.release_tail()

    def set_spare_capacity(self, tokens: int) -> None:
        """Give every folded layer ``tokens`` slots of capacity beyond what its first fill (the
        prefill) needs, allocated with it: a pass that appends up to that many tokens over the
        prefilled cache (:meth:`scratch`, KVzip's repeat pass) then writes in place, where growing
        each layer's buffers would allocate the whole cache again (glibc keeps the freed buffers in
        its heap: the repeat pass of an 8K-token context held 2.6 times the cache)."""
        for _, layer in self.folded_layers:
            layer.spare = max(0, int(tokens))

    def supports_scratch(self) -> bool:
        """Whether :meth:`scratch` applies: every layer a filled dense :class:`FoldedLayer` of one row."""
        return all(
            isinstance(layer, FoldedLayer) and layer.is_initialized and layer.stored is None and layer.batch_size == 1
            for layer in self.layers
        )

    @contextmanager
    def scratch(self, reserve: int = 0) -> Iterator[FoldedCache]:
        """Run forwards over this cache and undo what they append, without copying it.

        Inside, the cache holds ``reserve`` more slots of capacity a layer (allocated once), no
        policy and no query capture; on exit every layer is truncated back to its entries, its
        logical length, captured queries and capacity, and the cache's policy and capture window
        are restored. The entries present before are never written: appends go after them, so the
        cache after is the cache before. This is what a pass that reads the context again needs
        (KVzip's repeat pass, Kim et al. 2025 §3) at the memory of the appended tokens only, where
        a copy would hold the whole cache twice.

        Raises:
            ValueError: when :meth:`supports_scratch` is False (use :meth:`copy`).
        """
        if not self.supports_scratch():
            raise ValueError("scratch() needs filled dense layers of one batch row; use copy()")
        layers = [layer for _, layer in self.folded_layers]
        saved = [
            (layer.tail_length, layer.logical_length, layer.captured_queries, dict(layer.entry_stats))
            for layer in layers
        ]
        policy, window = self.policy, self.capture_window
        for layer in layers:
            layer.make_tail_writable()
        capacities = [layer.reserve(layer.tail_length + reserve) for layer in layers]
        self.policy, self.capture_window = None, 0
        try:
            yield self
        finally:
            for layer, (length, logical, queries, stats), capacity in zip(layers, saved, capacities, strict=True):
                layer.truncate(length)
                layer.logical_length, layer.captured_queries, layer.entry_stats = logical, queries, stats
                layer.release_to(capacity)
            self.policy, self.capture_window = policy, window

    def copy(self) -> FoldedCache:
        """A deep copy (policy not copied): prefill once, then compress copies with many methods."""
        new = copy.copy(self)
        new.layers = [layer.copy() if isinstance(layer, FoldedLayer) else copy.deepcopy(layer) for layer in self.layers]
        new.policy = None
        new.prefill_observers = []
        return new


def _sliding_bytes(layer: CacheLayerMixin, sixteen_bit: bool) -> int:
    """Bytes of a sliding-window layer's keys and values (not compressed by kvfold)."""
    if not sixteen_bit:
        return layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
    return (layer.keys.numel() + layer.values.numel()) * SIXTEEN_BIT
