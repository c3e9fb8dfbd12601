"""What a method is given while it compresses a prefilled cache: :class:`CompressionContext`.

The model and the cache, the context's tokens and its padding, the budget, a seed, a report for
diagnostics, scratch space for the parts of one method (``memo``), results shared by every compression
of one prefilled context (``shared``, with the time they cost counted once), the entries a chat pins,
a pre-selection scale and the storage format of the result. The methods that read it are
:mod:`kvfold.methods.core.base`'s parts (selectors, wrappers, folders and standalone methods).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.folded_layer import FoldedLayer
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.timing import device_clock


@dataclass
class CompressionContext:
    """Everything a method may read while compressing a prefilled cache.

    Attributes:
        model: the model (already prefilled into ``cache``).
        cache: the cache to compress in place.
        input_ids: ``(B, N)`` the context tokens.
        attention_mask: ``(B, N)`` 1 for real tokens (left padding = 0), or None.
        budget: the requested budget.
        seed: seed for methods that draw random numbers.
        report: free-form diagnostics a method records (e.g. fallbacks used).
        tokenizer: the model's tokenizer, or None (methods that build prompts, e.g. KVzip's
            repeat prompt, fall back to prompt-free variants without it).
        memo: scratch space shared by the parts of a method during this one compression
            (e.g. scores computed for every layer at once in :meth:`Method.prepare`).
        shared: results that depend on the prefilled context only, not on the method's budget,
            kept across every compression of one :class:`~kvfold.pipeline.context.PrefilledContext` (e.g.
            KVzip's repeat-pass scores); read and filled through :meth:`shared_result`. Empty (and
            private to this compression) when the cache is not a fresh copy of a prefilled context.
        merge_recorder: optional diagnostic sink (``kvfold mergemap``,
            :class:`kvfold.evaluate.diagnostics.mergemap.MergeRecorder`); None in normal runs. Methods report
            through :meth:`record_kept` and :meth:`record_merges`, which do nothing without it.
            Positions are **slot indices of the layer before compression** (= indices into
            ``input_ids``, left padding included). ``ComposedMethod`` records the kept slots of
            every layer itself; a folder that assigns evicted tokens to carriers (CaM, D2O,
            KeepKV, ZSMerge, …) also calls ``ctx.record_merges(layer_idx, carrier, absorbed,
            share)`` with ``(B, H, M)`` tensors: carrier slot, absorbed (evicted) slot, and the
            share of that absorbed token given to that carrier (1 for a single carrier; pairs
            with ``absorbed < 0`` are ignored). Update magnitudes ``‖Δk‖``, ``‖Δv‖`` of every kept
            entry (GRKV) are computed by the recorder from the kept slots, so a folder that
            writes its entries in ``keep`` order needs no call at all.
        pinned: per layer ``(B, H)``, leading valid entries of every row that this compression
            keeps as they are (a conversation's compressed document:
            :class:`kvfold.pipeline.chat.ChatSession`), or None. The chat ranks them first in the
            repeat pass's scores; ``am_fit`` leaves them unfitted, as it leaves the sinks.
        selection_scale: the selector keeps this many times the budget (a pre-selection) and the
            folder cuts each head back to its share of the budget (``am_fit[preselect=f]``: the
            keys Attention Matching chooses from a larger KVzip selection); 1 by default.
        quant: how the compressed entries will be stored (None: full precision); a folder that
            fits entries to the cache (``am_fit``) fits them to the keys as they will be stored.
    """

    model: PreTrainedModel
    cache: FoldedCache
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    budget: Budget
    seed: int = 0
    report: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    memo: dict[str, Any] = field(default_factory=dict)
    merge_recorder: Any = None
    shared: dict[Any, tuple[Any, float]] = field(default_factory=dict)
    pinned: dict[int, torch.Tensor] | None = None
    selection_scale: float = 1.0
    quant: QuantConfig | None = None
    _charged: set = field(default_factory=set, init=False, repr=False)

    def slots_are_tokens(self, layer: FoldedLayer) -> bool:
        """Whether ``layer`` holds one slot per column of :attr:`input_ids`, in order (a fresh
        prefill's cache, left padding included), so that slot ``j`` is context token ``j``."""
        width = self.input_ids.shape[1]
        return layer.physical_length == width and layer.logical_length == width

    def is_fresh_prefill(self, cache: FoldedCache | None = None) -> bool:
        """Whether every layer of ``cache`` (default :attr:`cache`) holds one slot per context
        token (:meth:`slots_are_tokens`): nothing compressed, merged or appended yet."""
        return all(self.slots_are_tokens(layer) for _, layer in (cache or self.cache).folded_layers)

    def shared_result(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per prefilled context: later compressions of it reuse the result.

        The first reuse within a compression adds the seconds the computation took to
        ``report["reused_seconds"]``, so that a compression's reported time is what it costs when
        run alone (two parts of one method reading the same result count it once).
        """
        hit = self.shared.get(key)
        if hit is None:
            start = device_clock(getattr(self.model, "device", None))
            value = compute()
            hit = self.shared[key] = (value, device_clock(getattr(self.model, "device", None)) - start)
        elif key not in self._charged:
            self.report["reused_seconds"] = self.report.get("reused_seconds", 0.0) + hit[1]
        self._charged.add(key)
        return hit[0]

    def extend_shared(self, key: Any, value: Any, seconds: float) -> None:
        """Store ``value`` under ``key`` as a shared result that extends the one there (if any),
        computed in ``seconds`` more: its cost is the sum, and the part computed before counts in
        this compression's ``reused_seconds`` once (as :meth:`shared_result` counts a reuse)."""
        hit = self.shared.get(key)
        if hit is not None and key not in self._charged:
            self.report["reused_seconds"] = self.report.get("reused_seconds", 0.0) + hit[1]
        self.shared[key] = (value, (0.0 if hit is None else hit[1]) + seconds)
        self._charged.add(key)

    def record_kept(self, layer_idx: int, keep: torch.Tensor, lengths: torch.Tensor) -> None:
        """Diagnostics: the slots ``(B, H, K)`` held by a layer after compression, in entry order."""
        if self.merge_recorder is not None:
            self.merge_recorder.kept(layer_idx, keep, lengths)

    def record_merges(
        self, layer_idx: int, carrier: torch.Tensor, absorbed: torch.Tensor, share: torch.Tensor | None = None
    ) -> None:
        """Diagnostics: evicted slot ``absorbed`` was folded into kept slot ``carrier`` (see above)."""
        if self.merge_recorder is not None:
            self.merge_recorder.merges(layer_idx, carrier, absorbed, share)

    @property
    def context_lengths(self) -> torch.Tensor:
        """Valid (non-padding) tokens per batch row, ``(B,)`` long, on CPU."""
        if self.attention_mask is None:
            return torch.full((self.input_ids.shape[0],), self.input_ids.shape[1], dtype=torch.long)
        return self.attention_mask.sum(-1).long().cpu()

    @property
    def row_budgets(self) -> torch.Tensor:
        """Entries the selector keeps per KV head and layer (on average), per batch row, ``(B,)``:
        the budget's, times :attr:`selection_scale` (at most the context) when a folder asks for a
        pre-selection."""
        budgets = self.target_row_budgets
        if self.selection_scale == 1.0:
            return budgets
        scaled = torch.floor(budgets.double() * self.selection_scale).long()
        return torch.minimum(scaled, self.context_lengths)

    @property
    def target_row_budgets(self) -> torch.Tensor:
        """Entries per KV head and layer (on average) after compression, per batch row, ``(B,)``."""
        return self.budget.counts(self.context_lengths)

    @property
    def num_layers(self) -> int:
        return len(self.cache.layers)

    def generator(self, layer_idx: int = 0) -> torch.Generator:
        """A reproducible generator for one layer."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + layer_idx)
