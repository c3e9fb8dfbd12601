"""One layer of the folded KV cache: keys, values and a per-entry log-mass β, with real per-head lengths.

The cache itself, a transformers ``Cache`` of these layers, is :class:`kvfold.runtime.cache.FoldedCache`.
Every method of the seed papers ends in the same object (see docs/architecture.md):
a shorter cache whose entries may stand for several tokens. An entry with log-mass β adds β to
its attention logit, ``logits_j = q·k_j / sqrt(d) + β_j``, so one entry with β = log k attends
exactly like k identical copies. β is ZSMerge's α·log w (§3), KeepKV's log of electoral votes
(eq. 7) and Attention Matching's fitted bias (§2). β = −inf marks a slot that holds nothing
(left padding of a batch, or the unused tail of a shorter row).

A layer holds at most two parts, in this order:

* **stored rows** (``FoldedLayer.stored``) — compressed entries, ragged: rows (batch × KV head)
  of different lengths, one after another, so the memory held is Σ row lengths, not rows × the
  longest row (per-head budgets: AdaKV, Attention Matching head schedules, global rankings).
  Quantized (:class:`kvfold.runtime.quantize.QuantizedRows`, :meth:`FoldedLayer.quantize`) or at
  full precision (:class:`kvfold.runtime.rows.FloatRows`, what :meth:`FoldedLayer.replace` stores
  for rows of different lengths). Never edited in place.
* **a dense tail** — ``(B, H_kv, capacity, D)`` buffers with one length for all rows: what is
  appended after the stored rows (the question, generated tokens, a chat's new turns), or the
  whole content of an uncompressed layer, or of a compressed one whose rows are equal. Decoding
  writes the new token in place; capacity grows geometrically, so a decode step never copies the
  cache. Online (decode-time) methods edit it in place (:meth:`FoldedLayer.dense_buffers`).

For a compiled decode (``torch.compile``, CUDA graphs) :meth:`FoldedLayer.fix_tail` fixes the tail's
shape for a number of new tokens: each step writes its token at a slot counted on the device, the slots
not yet written hold β = −inf, and no Python number changes from step to step, so the step is traced
once (transformers' ``StaticLayer`` does the same for a full cache). :meth:`FoldedLayer.release_tail`
makes it growable again.

The layer also keeps a **logical length** (positions seen, including compressed ones) that is
what ``get_seq_length()`` reports, so RoPE positions of new tokens continue where the
uncompressed context ended (architecture invariant 4).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from transformers.cache_utils import CacheLayerMixin

from kvfold.runtime.errors import UserError
from kvfold.runtime.quant_config import SIXTEEN_BIT, QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.rows import NEG_INF, FloatRows, compact_rows, grow_capacity, ragged_saves_memory


def _content_view(index: int, name: str) -> property:
    """``FoldedLayer.keys`` (``index`` 0) or ``FoldedLayer.values`` (1), as transformers reads them.

    Reading gives the padded rows of a layer with stored rows (:meth:`FoldedLayer.padded`), else the
    filled part of the dense buffer (None before the first tokens); assigning anything but None is
    refused: a layer's content changes through :meth:`FoldedLayer.replace`.
    """
    buffer = f"_{name}"

    def read(layer: FoldedLayer) -> torch.Tensor | None:
        if layer.stored is not None:
            return layer.padded()[index]
        dense = getattr(layer, buffer)
        return None if dense is None else dense[:, :, : layer._length]

    def refuse(layer: FoldedLayer, value: torch.Tensor | None) -> None:
        if value is not None:
            raise AttributeError(f"assign {name} through FoldedLayer.replace()")

    return property(read, refuse, doc=f"``(B, H, N, D)`` the layer's {name} (read-only; see :meth:`replace`).")


class FoldedLayer(CacheLayerMixin):
    """One attention layer of a :class:`FoldedCache`: stored rows, then a dense tail (module docstring).

    Read the contents with :meth:`padded` (keys, values, log-mass and per-row lengths as padded
    tensors) and write a compressed result with :meth:`replace`. Decode-time methods can edit
    a layer without stored rows in place through :meth:`dense_buffers`.
    """

    is_sliding = False
    is_croppable = False
    is_compileable = False

    def __init__(self) -> None:
        self.is_initialized = False
        self.stored: QuantizedRows | FloatRows | None = None  # ragged compressed entries, before the tail
        self._keys: torch.Tensor | None = None  # the dense tail (B, H, capacity, D)
        self._values: torch.Tensor | None = None
        self._log_mass: torch.Tensor | None = None  # (B, H, capacity) float32 or None (all zero)
        self._length = 0  # entries per row in the dense tail
        self.logical_length = 0
        self.captured_queries: torch.Tensor | None = None  # last window of prefill queries
        # Per-entry statistics ``(B, H, N)`` aligned with the slots (e.g. H2O's accumulated
        # attention, written by a prefill observer). Batch edits and copies keep them; replace()
        # drops them (the caller re-aligns what it keeps); in-place decode edits make them stale.
        self.entry_stats: dict[str, torch.Tensor] = {}
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.batch_size = 0
        self.num_heads = 0
        self.head_dim = 0
        self.spare = 0  # slots of capacity beyond the first fill (FoldedCache.set_spare_capacity)
        # A fixed tail (fix_tail): the slots written, on the device, and the logical position of slot 0.
        self._filled: torch.Tensor | None = None
        self._fixed_base = 0
        self._fixed_plain = False  # every β of the tail was 0 before it was fixed

    # ----------------------------------------------------------------- transformers API
    keys = _content_view(0, "keys")  # type: ignore[assignment]
    values = _content_view(1, "values")  # type: ignore[assignment]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads, _, self.head_dim = key_states.shape
        self._empty_tail(value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new entries (β = 0) to the dense tail and return the tail (what attention reads
        when the layer holds no stored rows; the kvfold attention reads those itself)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._filled is not None:
            return self._write_fixed(key_states, value_states)
        self.logical_length += key_states.shape[-2]
        self._append_dense(key_states, value_states)
        return self._keys[:, :, : self._length], self._values[:, :, : self._length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        physical = self.physical_length
        return physical + query_length, self.logical_length - physical

    def get_seq_length(self) -> int | torch.Tensor:
        """Positions seen (compressed ones included); a 0-d device tensor while the tail is fixed (as
        transformers' ``StaticLayer``: read on the device by a compiled step, never back on the host)."""
        if self._filled is not None:
            return self._filled + self._fixed_base
        return self.logical_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "a FoldedLayer cannot be cropped (compressed entries no longer map to positions); "
            "re-run the prefill instead"
        )

    def offload(self) -> None:
        self._map_tensors(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.device is not None:
            self._map_tensors(lambda t: t.to(self.device, non_blocking=True))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._batch_edit(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_edit(lambda t: t[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_edit(lambda t: t.repeat_interleave(repeats, dim=0))

    # ------------------------------------------------------------------- kvfold API
    @property
    def physical_length(self) -> int:
        """Slots of a padded row: the longest stored row, then the dense tail."""
        return self._length + (self.stored.width if self.stored is not None else 0)

    @property
    def tail_length(self) -> int:
        """Slots of the dense tail in use (a fixed tail: its whole capacity, :meth:`fix_tail`)."""
        return self._length

    def tail(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The dense tail's slots in use, as views (no copy; do not write to them): keys and values
        ``(B, H, n, D)`` and β ``(B, H, n)`` float32, None when every β of the tail is 0. What the
        attention and a cache file read; write through :meth:`dense_buffers` or :meth:`replace`."""
        n = self._length
        log_mass = None if self._log_mass is None else self._log_mass[:, :, :n]
        return self._keys[:, :, :n], self._values[:, :, :n], log_mass

    def adopt_tail(self, keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor | None) -> None:
        """Hold ``keys``/``values`` ``(B, H, n, D)`` and β ``(B, H, n)`` (None: all 0) as the whole dense
        tail, as they are (no copy, no checks): what a loader that has checked their shapes and dtypes
        builds a layer from (:mod:`kvfold.store.layer_tensors`)."""
        self._keys, self._values, self._log_mass = keys, values, log_mass
        self._length = keys.shape[2]

    def make_tail_writable(self) -> None:
        """Copy a tail made under ``torch.inference_mode`` once, when called outside it: such tensors take
        no in-place writes there (what :meth:`kvfold.runtime.cache.FoldedCache.scratch` appends)."""
        if self._keys is not None and self._keys.is_inference() and not torch.is_inference_mode_enabled():
            self._resize(self._keys.shape[2])

    @property
    def has_log_mass(self) -> bool:
        """False when every entry has β = 0 (plain tokens): attention can skip the bias."""
        return self.stored is not None or self._log_mass is not None

    @property
    def is_quantized(self) -> bool:
        """Whether the layer's stored rows are quantized (:meth:`quantize`)."""
        return isinstance(self.stored, QuantizedRows)

    def row_lengths(self) -> torch.Tensor:
        """Valid entries per row, ``(B, H)`` long (the stored rows' entries, then the tail's slots
        whose β is finite)."""
        if self._log_mass is None:
            tail = torch.full((self.batch_size, self.num_heads), self._length, dtype=torch.long, device=self.device)
        else:
            tail = torch.isfinite(self._log_mass[:, :, : self._length]).sum(-1)
        return tail + self.stored_lengths().to(tail.device)

    def row_ends(self) -> torch.Tensor:
        """``(B, H)`` the slot after each row's last entry in :meth:`padded`: a row's own length when
        the layer holds stored rows and no tail, else the physical length (the tail comes last)."""
        if self.stored is not None and self._length == 0:
            return self.stored_lengths().clone()
        return torch.full((self.batch_size, self.num_heads), self.physical_length, dtype=torch.long, device=self.device)

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Contents as padded tensors: the stored rows (padded to the longest), then the tail.

        Returns:
            ``(keys (B, H, N, D), values (B, H, N, D), log_mass (B, H, N) float32, lengths (B, H))``
            where N is the physical length and β = −inf marks empty or padding slots. Without
            stored rows keys and values are views of the cache (do not write to them).
        """
        n = self._length
        keys, values, log_mass = self.tail()
        if log_mass is None:
            log_mass = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        if self.stored is not None:  # the stored rows padded, then the tail (a copy of this layer)
            sk, sv, slm = self.stored_padded()
            if n == 0:
                return sk, sv, slm, self.row_lengths()
            keys, values = torch.cat([sk, keys.to(sk.dtype)], 2), torch.cat([sv, values.to(sv.dtype)], 2)
            log_mass = torch.cat([slm, log_mass], 2)
        return keys, values, log_mass, self.row_lengths()

    def stored_padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored rows as padded ``(B, H, W, D)`` keys and values in the layer's dtype (quantized
        ones dequantized) and β ``(B, H, W)`` (−inf past a row's length): one layer's copy, built on
        demand."""
        if self.stored is None:
            raise ValueError("stored_padded(): this layer holds no stored rows")
        k, v, lm = self.stored.to_padded()
        b, h = self.batch_size, self.num_heads
        return k.view(b, h, *k.shape[1:]), v.view(b, h, *v.shape[1:]), lm.view(b, h, -1)

    def quantize(self, config: QuantConfig) -> None:
        """Store the layer's entries quantized (:mod:`kvfold.runtime.quantize`); β stays float32.

        Everything the layer holds becomes the stored rows (a tail appended after an earlier
        compression included); later appends go to a new full-precision tail. The logical length
        and the entry statistics are unchanged.
        """
        if not self.is_initialized:
            raise ValueError("quantize() needs a layer that has been filled by a forward pass first")
        keys, values, log_mass, lengths = self.padded()
        valid = torch.isfinite(log_mass)
        if not bool((valid == (torch.arange(valid.shape[-1], device=valid.device) < lengths[..., None])).all()):
            keys, values, log_mass = compact_rows(keys, values, log_mass, valid, lengths)
        b, h, n, d = keys.shape
        rows = b * h
        self.stored = QuantizedRows.from_padded(
            keys.reshape(rows, n, d).to(self.dtype),
            values.reshape(rows, n, -1).to(self.dtype),
            log_mass.reshape(rows, n),
            lengths.reshape(rows),
            config,
        )
        self._empty_tail(values)

    def valid_mask(self) -> torch.Tensor:
        """``(B, H, N)`` bool: True where a slot holds an entry."""
        return torch.isfinite(self.padded()[2])

    def replace(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        log_mass: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """Store a new (compressed) content for this layer; the logical length is unchanged.

        Args:
            keys: ``(B, H, N, D)`` padded keys.
            values: ``(B, H, N, D)`` padded values.
            log_mass: ``(B, H, N)`` β per entry (None = all zero). Slots at or past a row's
                length are ignored.
            lengths: ``(B, H)`` valid entries per row (None = all N). Rows of different
                lengths are stored ragged (:class:`~kvfold.runtime.rows.FloatRows`) when that saves
                memory (:func:`~kvfold.runtime.rows.ragged_saves_memory`), so the memory held
                follows Σ lengths; else in the dense tail, padded with β = −inf.

        Raises:
            ValueError: on shape mismatches or non-finite keys, values or β of valid entries.
        """
        if not self.is_initialized:
            raise ValueError("replace() needs a layer that has been filled by a forward pass first")
        b, h, n, _ = keys.shape
        if (b, h) != (self.batch_size, self.num_heads) or values.shape[:3] != keys.shape[:3]:
            raise ValueError(
                f"replace(): expected keys/values of shape ({self.batch_size}, {self.num_heads}, N, D); "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if lengths is None:
            lengths = torch.full((b, h), n, dtype=torch.long, device=keys.device)
        lengths = lengths.to(device=keys.device, dtype=torch.long)
        if bool((lengths > n).any()) or bool((lengths < 0).any()):
            raise ValueError(f"replace(): lengths must be in [0, {n}]")
        slot_valid = torch.arange(n, device=keys.device)[None, None, :] < lengths[..., None]
        if log_mass is None:
            log_mass = torch.zeros(b, h, n, dtype=torch.float32, device=keys.device)
        log_mass = torch.where(slot_valid, log_mass.float(), torch.full_like(log_mass, NEG_INF, dtype=torch.float32))
        self._check_finite(keys, values, log_mass, slot_valid)
        self.entry_stats = {}  # slots changed: the caller re-aligns the statistics it keeps
        self.stored = None  # a new full-precision content (FoldedCache.quantize stores it again)
        rows_equal = bool((lengths == lengths.flatten()[0]).all())
        if rows_equal or not ragged_saves_memory(lengths, n):
            self._store_dense_padded(keys, values, log_mass)
            return
        r = b * h
        self.stored = FloatRows.from_padded(
            keys.reshape(r, n, -1).to(self.dtype),
            values.reshape(r, n, -1).to(self.dtype),
            log_mass.reshape(r, n),
            lengths.reshape(r),
        )
        self._empty_tail(values)

    def unpack(self) -> None:
        """Move stored rows at full precision into the dense tail, before it, padded with β = −inf
        (the slots of :meth:`padded`): what an online policy, which edits entries in place, works on.
        Quantized rows stay as they are."""
        if isinstance(self.stored, FloatRows):
            keys, values, log_mass, _ = self.padded()
            self.stored = None
            self._store_dense_padded(keys, values, log_mass)

    def dense_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """In-place access for online (decode-time) methods: keys, values, log-mass views.

        The log-mass buffer is created (zeros) if the layer had none. Only a layer without stored
        rows (its whole content in the dense tail) supports in-place edits.
        """
        if self.is_quantized:
            raise NotImplementedError(
                "online (decode-time) compression edits entries in place; this layer is quantized. "
                "Quantize after a one-shot method only (e.g. kvzip+am_fit@int4)."
            )
        if self.stored is not None:
            raise NotImplementedError(
                "online (decode-time) compression needs equal row lengths; this layer holds per-head "
                "lengths (e.g. after adakv). Use a one-shot method, or no per-head budgets, with online methods."
            )
        self._ensure_log_mass()
        return self.tail()

    def truncate(self, length: int) -> None:
        """Shrink a layer without stored rows to its first ``length`` slots (after an in-place compaction)."""
        if self.stored is not None or length > self._length:
            raise ValueError("truncate() applies to a layer without stored rows and cannot grow it")
        self._length = length

    def shrink_to_fit(self, headroom: int = 16) -> None:
        """Release dense capacity beyond ``length + headroom`` slots (e.g. the last chunk of a chunked
        prefill that an online policy evicted in place); stored rows are already compact."""
        if self._keys is not None and self._keys.shape[2] > self._length + headroom:
            self._resize(self._length + headroom)

    def reserve(self, capacity: int) -> int:
        """Grow the dense buffers to hold at least ``capacity`` slots without another copy (one copy
        of this layer now); returns the capacity before. Content and length are unchanged."""
        if self._keys is None:
            raise ValueError("reserve() applies to a filled layer")
        before = self._keys.shape[2]
        if capacity > before:
            self._resize(capacity)
        return before

    def release_to(self, capacity: int) -> None:
        """Give back dense capacity beyond ``capacity`` slots (never below the length): undoes
        :meth:`reserve`."""
        if self._keys is not None and self._keys.shape[2] > max(capacity, self._length):
            self._resize(max(capacity, self._length))

    # -------------------------------------------------------- a fixed tail (compiled decode)
    @property
    def is_fixed(self) -> bool:
        """Whether the tail's shape is fixed (:meth:`fix_tail`)."""
        return self._filled is not None

    def fix_tail(self, new_tokens: int) -> None:
        """Give the dense tail room for ``new_tokens`` more entries and fix its shape, for a decode step
        that is compiled once (module docstring).

        The tail's capacity becomes its length plus ``new_tokens``; the slots not yet written get β = −inf
        and attention reads the whole capacity. Each later :meth:`update` of one token writes the slot a
        device counter names, sets its β to 0 and advances the counter, in place; :meth:`get_seq_length`
        is then that counter plus the positions before the tail (a device tensor). The stored rows'
        page index is built now, not in the first compiled step.

        Raises:
            ValueError: an empty layer, or a tail already fixed.
        """
        if not self.is_initialized or self._keys is None:
            raise ValueError("fix_tail() needs a layer filled by a forward pass")
        if self._filled is not None:
            raise ValueError("fix_tail(): the tail is already fixed; release_tail() first")
        if new_tokens < 1:
            raise ValueError(f"fix_tail() needs at least one new token; got {new_tokens}")
        n = self._length
        self._fixed_plain = self._log_mass is None
        self._resize(n + new_tokens)
        self._ensure_log_mass()
        self._log_mass[:, :, n:] = NEG_INF
        self._filled = torch.tensor(n, dtype=torch.long, device=self._keys.device)
        self._fixed_base = self.logical_length - n
        self._length = n + new_tokens
        self.is_compileable = True
        held = (self._keys, self._values, self._log_mass, self._filled, *self._stored_tensors())
        self.physical_length  # noqa: B018 - the stored rows' width read now (a compiled step reads it as a constant)
        if not torch.compiler.is_compiling():  # buffers a captured graph writes in place, or reads every step
            for tensor in held:
                torch._dynamo.mark_static_address(tensor)

    def release_tail(self) -> None:
        """Make a fixed tail growable again (:meth:`fix_tail`): its written slots kept, the rest given
        back, the logical length read once from the device counter."""
        if self._filled is None:
            return
        filled = int(self._filled)
        self._filled = None
        self.logical_length = self._fixed_base + filled
        self._length = filled
        self._resize(filled)
        if self._fixed_plain and not bool((self._log_mass != 0).any()):
            self._log_mass = None
        del self.is_compileable  # the class's False again

    def _write_fixed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token written in place at the fixed tail's next slot (:meth:`fix_tail`)."""
        if key_states.shape[-2] != 1:
            raise UserError(
                f"a fixed tail takes one new token a step; got {key_states.shape[-2]} "
                "(feed the question before fixing the tail, or release_tail() first)"
            )
        slot = self._filled.view(1)
        self._keys.index_copy_(2, slot, key_states)
        self._values.index_copy_(2, slot, value_states)
        self._log_mass.index_fill_(2, slot, 0.0)
        self._filled.add_(1)
        return self._keys, self._values

    def _stored_tensors(self) -> Iterator[torch.Tensor]:
        """The stored rows' tensors and the index a decode step reads (built here if it was not)."""
        if self.stored is not None:
            yield from self.stored.tensors().values()
            yield from self.stored.index_tensors()

    def set_log_mass(self, log_mass: torch.Tensor) -> None:
        """Overwrite β of the dense tail, ``(B, H, N)`` (−inf marks empty slots)."""
        self._ensure_log_mass()
        self._log_mass[:, :, : self._length] = log_mass.float()

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (capacity included), exactly."""
        total = 0
        for t in self._tensors():
            total += t.untyped_storage().nbytes()
        return total

    def content_nbytes(self, *, sixteen_bit: bool = False) -> int:
        """Bytes of what the layer holds, without the capacity kept free for appending (reported
        apart: :meth:`nbytes` minus this).

        Args:
            sixteen_bit: count unquantized keys and values at 2 bytes an element, as a GPU user
                holds them whatever dtype the model computes in here (codes, scales, β and row
                lengths as held).
        """
        if not self.is_initialized:
            return 0
        element = SIXTEEN_BIT if sixteen_bit else torch.empty(0, dtype=self.dtype).element_size()
        total = 0
        if self.stored is not None:
            total += self.stored.gpu_nbytes() if sixteen_bit else self.stored.nbytes()
        n = self._length
        rows = self.batch_size * self.num_heads
        total += rows * n * (self.head_dim + self._values.shape[-1]) * element
        if self._log_mass is not None:
            total += rows * n * 4
        return total

    def copy(self) -> FoldedLayer:
        """A deep copy whose tensors are compact clones."""
        new = copy.copy(self)
        if self.stored is not None:
            new.stored = self.stored.clone()
        if self._keys is not None:
            n = self._length
            new._keys = self._keys[:, :, :n].clone()
            new._values = self._values[:, :, :n].clone()
            new._log_mass = None if self._log_mass is None else self._log_mass[:, :, :n].clone()
        if self.captured_queries is not None:
            new.captured_queries = self.captured_queries.clone()
        if self._filled is not None:
            new._filled = self._filled.clone()
        new.entry_stats = {name: t.clone() for name, t in self.entry_stats.items()}
        return new

    def stored_lengths(self) -> torch.Tensor:
        """``(B, H)`` entries of each stored row (zeros without stored rows)."""
        if self.stored is None:
            return torch.zeros(self.batch_size, self.num_heads, dtype=torch.long, device=self.device)
        return self.stored.lengths.view(self.batch_size, self.num_heads).to(self.device)

    # -------------------------------------------------------------------- internals
    def _tensors(self) -> Iterator[torch.Tensor]:
        if self.stored is not None:
            yield from self.stored.tensors().values()
        for t in (self._keys, self._values, self._log_mass):
            if t is not None:
                yield t

    def _empty_tail(self, like: torch.Tensor) -> None:
        """An empty dense tail (no capacity) on ``like``'s device, values as wide as ``like``'s: what a
        layer holds before its first tokens, and after its entries became stored rows."""
        b, h = self.batch_size, self.num_heads
        self._keys = like.new_zeros(b, h, 0, self.head_dim, dtype=self.dtype)
        self._values = like.new_zeros(b, h, 0, like.shape[-1], dtype=self.dtype)
        self._log_mass = None
        self._length = 0

    def _ensure_log_mass(self) -> None:
        if self._log_mass is None and self._keys is not None:
            b, h, cap, _ = self._keys.shape
            self._log_mass = torch.zeros(b, h, cap, dtype=torch.float32, device=self._keys.device)

    def _append_dense(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        q = key_states.shape[-2]
        needed = self._length + q
        capacity = self._keys.shape[2]
        if needed > capacity:
            new_cap = needed + self.spare if self._length == 0 else grow_capacity(capacity, needed)
            self._resize(new_cap)
        self._keys[:, :, self._length : needed] = key_states
        self._values[:, :, self._length : needed] = value_states
        if self._log_mass is not None:
            self._log_mass[:, :, self._length : needed] = 0.0
        self._length = needed

    def _resize(self, capacity: int) -> None:
        n = self._length
        b, h, _, d = self._keys.shape
        keys = self._keys.new_zeros(b, h, capacity, d)
        values = self._values.new_zeros(b, h, capacity, self._values.shape[-1])
        keys[:, :, :n] = self._keys[:, :, :n]
        values[:, :, :n] = self._values[:, :, :n]
        self._keys, self._values = keys, values
        if self._log_mass is not None:
            log_mass = self._log_mass.new_full((b, h, capacity), NEG_INF)
            log_mass[:, :, :n] = self._log_mass[:, :, :n]
            self._log_mass = log_mass

    def _store_dense_padded(self, keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor) -> None:
        n = keys.shape[2]
        self._keys = keys.to(self.dtype).contiguous().clone()
        self._values = values.to(self.dtype).contiguous().clone()
        self._length = n
        lm = log_mass.float()
        plain = bool((lm == 0).all()) if lm.numel() else True
        self._log_mass = None if plain else lm.contiguous().clone()

    def _check_finite(
        self, keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor, slot_valid: torch.Tensor
    ) -> None:
        bad_kv = ~(torch.isfinite(keys).all(-1) & torch.isfinite(values).all(-1)) & slot_valid
        bad_beta = torch.isnan(log_mass) | (log_mass == float("inf"))
        if bool(bad_kv.any()) or bool(bad_beta.any()):
            raise UserError(
                "replace(): the compressed cache holds NaN or inf in keys, values or log-mass; "
                "the method produced an invalid result (try another method or budget, or float32)"
            )

    def _map_tensors(self, fn) -> None:
        if self.stored is not None:
            self.stored = self.stored.map(fn)
        if self._keys is not None:
            self._keys, self._values = fn(self._keys), fn(self._values)
        if self._log_mass is not None:
            self._log_mass = fn(self._log_mass)

    def _batch_edit(self, fn) -> None:
        """Apply a batch edit to every tensor: stored rows are picked as they are (nothing is
        re-quantized or re-packed), the tail, captured queries and statistics edited along."""
        if not self.is_initialized:
            return
        if self._filled is not None:
            raise ValueError("a batch edit changes the rows of a fixed tail; release_tail() first")
        before = after = 0
        if self.stored is not None:
            rows, before = self.stored.num_rows, self.stored.width
            picked = fn(torch.arange(rows, device=self.stored.lengths.device).view(self.batch_size, self.num_heads))
            self.stored = self.stored.select_rows(picked.reshape(-1))
            after = self.stored.width
        n = self._length
        self._keys, self._values = fn(self._keys[:, :, :n]).clone(), fn(self._values[:, :, :n]).clone()
        if self._log_mass is not None:  # a row left without padding may leave every β 0: none held
            log_mass = fn(self._log_mass[:, :, :n])
            self._log_mass = None if bool((log_mass == 0).all()) else log_mass.clone()
        self.batch_size = self._keys.shape[0]
        if self.captured_queries is not None:
            self.captured_queries = fn(self.captured_queries)
        self.entry_stats = {name: _narrowed(fn(t), before, after, n) for name, t in self.entry_stats.items()}


def _narrowed(stat: torch.Tensor, before: int, after: int, tail: int) -> torch.Tensor:
    """A statistic ``(B, H, before + tail)`` of a layer whose stored rows, padded, were ``before`` slots
    wide and are ``after`` now (rows picked by a batch edit): the padding slots no row uses dropped."""
    if after < before and stat.dim() == 3 and stat.shape[-1] == before + tail:
        return torch.cat([stat[..., :after], stat[..., before:]], -1)
    return stat
