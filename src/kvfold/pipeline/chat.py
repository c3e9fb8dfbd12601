"""A conversation kept in a KV cache of fixed size: :class:`ChatSession`.

Every turn is appended to one :class:`~kvfold.runtime.cache.FoldedCache` (the model never re-reads the
history). Before a turn would take the cache past its ``cap`` (physical entries per KV head), the
history is compacted to ``budget`` entries with any kvfold method:

* **one-shot methods** (``snapkv``, ``snapkv+keepkv``, ``am_highest_fast``, …): everything but the
  last completed turn is compressed as a prefilled context would be, then the last turn is put
  back after it unchanged (Attention Matching §3 and Appendix F.3: compact all but the last
  turn). β of entries already compacted is carried: a method sees a cache whose entries may
  already stand for several tokens, as in a chunked prefill. The window of query states a method
  reads (SnapKV, GRKV, …) is the one captured when the last turn began, i.e. the queries of the
  history's own last tokens.
* **online methods** (``h2o``, ``zsmerge``, ``streamingllm``, ``tova``, ``knorm``, KeepKV on an online
  selector): the first compaction compresses the whole cache one-shot, then the method's
  decode-time policy keeps every layer at its budget inside every forward (prompt and decode).
* **the recommended pipeline** (``kvzip+am_fit``, ``kvzip``: a selector scored by the repeat pass):
  compacted one-shot as above, by a repeat pass over the compacted cache whose input is every
  token the cache stands for (:attr:`ChatSession.token_ids`), replayed against the current cache:
  KVzip's score of an entry, compacted or new, is the most attention it receives, and ``am_fit``
  refits the kept entries to the current cache's attention, β included
  (:mod:`kvfold.pipeline.recompact`). No KV head keeps more entries than the cap leaves room for
  (KVzip ranks the entries of all layers and heads at once). With a document (``context``) the
  chat **pins** it (``pin_context``, the default): the document is compressed once, to ``budget``,
  before the first question (each KV head keeping at most half the room between the budget and the
  cap), and later compactions keep those entries and compact the conversation after them into half
  the room the document leaves. Without pinning, every compaction re-ranks the document with the
  conversation, and facts wear down: 29 re-compactions of a 2,239-token logbook lost one digit of
  a four-digit number the full cache answers (docs/results).

Positions stay logical: compaction frees memory, not positions, so a conversation ends when it
reaches the model's ``max_position_embeddings``.

Example:
    >>> chat = ChatSession(model, tokenizer, "kvzip+am_fit", budget=512, cap=1024)  # doctest: +SKIP
    >>> chat.ask("My name is Ada. Remember it.")  # doctest: +SKIP
    >>> chat.stats()  # doctest: +SKIP
    >>> kvfold.save_chat(chat, "talk.kvc"); chat = kvfold.load_chat("talk.kvc", model, tokenizer)  # doctest: +SKIP

Saving and loading a conversation is :mod:`kvfold.store.chat` (:meth:`ChatSession.checkpoint` and
:meth:`ChatSession.resume` are what it builds on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.methods import ComposedMethod, CompressionContext, build_method
from kvfold.pipeline.context import DEFAULT_SNAPSHOT_WINDOW, build_prompt, encode, greedy_decode
from kvfold.pipeline.recompact import limit_head_entries, pin_entries, recompacts_by_repeat_pass
from kvfold.runtime.budget import Budget
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.defaults import DEFAULT_CHAT_BUDGET, RECOMMENDED
from kvfold.runtime.errors import UserError
from kvfold.runtime.folded_layer import FoldedLayer

MARK = "\u241e"
"""A character that tokenizers and templates leave alone (as in :func:`kvfold.pipeline.context.build_prompt`)."""
CHAT_STATE_VERSION = 1
READS_TOKENS = ("am_", "kvzip")
"""Method names (prefixes) that re-read the conversation's tokens when they compact it."""


def compact_history(
    cache: FoldedCache,
    model: PreTrainedModel,
    method: ComposedMethod,
    budget: int,
    token_ids: torch.Tensor,
    *,
    keep_last: int = 0,
    window_queries: dict[int, torch.Tensor] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    head_limit: int | None = None,
    pinned: dict[int, torch.Tensor] | None = None,
) -> bool:
    """Compress all but the last ``keep_last`` tokens of ``cache`` to ``budget`` entries, in place.

    The last ``keep_last`` entries of every row are put back unchanged after the compressed history
    (the logical length is unchanged); history entries keep the β the method leaves them.

    Args:
        cache: the conversation's cache (one batch row).
        model: the model.
        method: a built method.
        budget: entries per KV head to keep for the history.
        token_ids: ``(1, logical)`` every token the cache has seen (methods that re-read them).
        keep_last: tokens of the last turn, kept whole (0 = compress everything).
        window_queries: per layer, the query states the method reads as its window (restored after).
        tokenizer: the tokenizer, for methods that build prompts.
        head_limit, pinned: for methods that re-compact by the repeat pass (:mod:`~kvfold.pipeline.recompact`),
            the most entries one KV head keeps (≥ ``budget``) and, per layer ``(B, H)``, the first
            entries of every row kept whatever their scores, counted in ``budget``.

    Returns:
        True when something was compressed; False when the history fits the budget already.
    """
    layers = cache.folded_layers
    tails: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    history_rows = []
    for index, layer in layers:
        keys, values, log_mass, _ = layer.padded()
        slots = layer.row_ends()
        if keep_last > int(slots.min()):
            raise ValueError(f"cannot keep the last {keep_last} tokens: layer {index} holds {int(slots.min())}")
        history_rows.append(layer.row_lengths() - _valid_tail(log_mass, slots, keep_last))
        if keep_last:
            tails[index] = _take(keys, values, log_mass, slots, keep_last)
    if all(int(rows.max()) <= budget for rows in history_rows):
        return False  # the history already fits: nothing to compress
    saved_queries = {}
    for index, layer in layers:
        if keep_last:
            keys, values, log_mass, _ = layer.padded()
            slots = layer.row_ends()
            head = slots - keep_last
            width = int(head.max())
            layer.replace(keys[:, :, :width], values[:, :, :width], log_mass[:, :, :width], head)
            layer.logical_length -= keep_last
        saved_queries[index] = layer.captured_queries
        if window_queries is not None and window_queries.get(index) is not None:
            layer.captured_queries = window_queries[index]
    logical = cache.get_seq_length()
    ids = token_ids[:, :logical]
    ctx = CompressionContext(
        model=model,
        cache=cache,
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        budget=Budget(tokens=budget) if budget > 1 else Budget(fraction=1.0 / max(1, logical)),
        tokenizer=tokenizer,
        pinned=pinned if recompacts_by_repeat_pass(method) else None,
        quant=method.quant or cache.quant,
    )
    with torch.inference_mode():
        _rank_for_repeat_pass(ctx, method, budget, head_limit, pinned)
        method.compress(ctx)
    for index, layer in layers:
        layer.captured_queries = saved_queries[index]
        if keep_last:
            _append_tail(layer, *tails[index])
            layer.logical_length += keep_last
    return True


def _rank_for_repeat_pass(
    ctx: CompressionContext,
    method: ComposedMethod,
    budget: int,
    head_limit: int | None,
    pinned: dict[int, torch.Tensor] | None,
) -> None:
    """For a method that re-compacts by the repeat pass: its pass, the pinned entries ranked first,
    and no head above ``head_limit`` (:mod:`kvfold.pipeline.recompact`); nothing for other methods."""
    if not recompacts_by_repeat_pass(method):
        return
    if pinned is not None:
        pin_entries(ctx, method, pinned)
    if head_limit is not None:
        limit_head_entries(ctx, method, max(budget, head_limit))


def _valid_tail(log_mass: torch.Tensor, slots: torch.Tensor, keep_last: int) -> torch.Tensor:
    """Valid entries among the last ``keep_last`` slots of every row, ``(B, H)``."""
    if not keep_last:
        return torch.zeros_like(slots)
    index = (slots[..., None] - keep_last + torch.arange(keep_last, device=slots.device)).clamp_min(0)
    return torch.isfinite(torch.gather(log_mass, 2, index)).sum(-1)


def _take(
    keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor, slots: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last ``count`` slots of every row (rows end at ``slots``), cloned."""
    index = slots[..., None] - count + torch.arange(count, device=slots.device)  # (B, H, T)
    k = torch.gather(keys, 2, index[..., None].expand(-1, -1, -1, keys.shape[-1])).clone()
    v = torch.gather(values, 2, index[..., None].expand(-1, -1, -1, values.shape[-1])).clone()
    return k, v, torch.gather(log_mass, 2, index).clone()


def _append_tail(layer: FoldedLayer, keys: torch.Tensor, values: torch.Tensor, log_mass: torch.Tensor) -> None:
    """Put ``T`` entries back after every row's content (paged rows after their own length)."""
    head_k, head_v, head_lm, _ = layer.padded()
    slots = layer.row_ends()
    count = keys.shape[2]
    b, h = slots.shape
    width = int(slots.max()) + count
    new_k = head_k.new_zeros(b, h, width, head_k.shape[-1])
    new_v = head_v.new_zeros(b, h, width, head_v.shape[-1])
    new_lm = torch.full((b, h, width), float("-inf"), dtype=torch.float32, device=head_lm.device)
    n = head_k.shape[2]
    new_k[:, :, :n], new_v[:, :, :n], new_lm[:, :, :n] = head_k, head_v, head_lm
    index = slots[..., None] + torch.arange(count, device=slots.device)
    new_k.scatter_(2, index[..., None].expand(-1, -1, -1, keys.shape[-1]), keys.to(new_k.dtype))
    new_v.scatter_(2, index[..., None].expand(-1, -1, -1, values.shape[-1]), values.to(new_v.dtype))
    new_lm.scatter_(2, index, log_mass.float())
    layer.replace(new_k, new_v, new_lm, slots + count)


def check_chat_method(method: ComposedMethod) -> None:
    """Refuse methods that cannot compact a conversation again and again (see the module docstring).

    A chat compacts a cache that already holds compacted entries followed by new turns, which is
    what a chunked prefill asks of a method (``supports_chunked_prefill``), or what a selector scored
    by the repeat pass does with a pass over the compacted cache (``kvzip``, ``kvzip+am_fit``:
    :func:`kvfold.pipeline.recompact.recompacts_by_repeat_pass`); methods that keep their budget
    online between chunks must have their online policy on.

    Raises:
        ValueError: with the methods that can.
    """
    from kvfold.pipeline.chunked import chunked_methods, runs_online_between_chunks, supports_chunked_prefill

    if method.is_identity:
        return
    if not supports_chunked_prefill(method) and not recompacts_by_repeat_pass(method):
        raise UserError(
            f"{method.spec} compresses a freshly prefilled context only and cannot compact a conversation again "
            f"after its first compaction; methods that can: {', '.join(chunked_methods())} (and folders after them)"
        )
    parts_off = [part for part in method.parts if getattr(part, "online", True) is False]
    if runs_online_between_chunks(method) and parts_off:
        raise UserError(
            f"{method.spec} keeps its budget with its online policy, which is off here; in a chat leave "
            f"{parts_off[0].name}'s online=true (the default)"
        )


class ChatSession:
    """A conversation in a cache of fixed size (see the module docstring).

    Args:
        model: an enabled model (:func:`kvfold.load_model`).
        tokenizer: its tokenizer (its chat template formats the turns when it has one).
        method: the method spec that compacts the conversation (default
            :data:`kvfold.methods.RECOMMENDED`).
        budget: entries per KV head kept after a compaction: a token count (default
            :data:`kvfold.runtime.defaults.DEFAULT_CHAT_BUDGET`, 512), or a fraction of ``context`` (then
            required).
        cap: physical entries that trigger a compaction before a turn would pass them
            (default ``2 × budget``); must exceed the budget. The cache never holds more than the
            cap as long as the budget plus one turn (message and reply) fits in it; a longer turn
            goes through whole, and the next one compacts again.
        context: a document the conversation is about: prefilled first (compressed at the
            first compaction), and the first question completes its user turn, exactly as
            :meth:`kvfold.pipeline.context.CompressedContext.answer` asks it.
        system: a system message (chat templates only; with ``context`` the first turn is the
            context's, as :func:`kvfold.pipeline.context.build_prompt` writes it, and this is not used).
        max_new_tokens: the longest reply.
        pin_context: with ``context`` and a method that re-compacts by the repeat pass
            (``kvzip+am_fit``, ``kvzip``): compress the document once, before the first question,
            and keep its entries through every later compaction (module docstring).
        refit_conversation: after a pinned document, compact the conversation with the whole
            method; by default a folder that refits from the repeat pass (``am_fit``) is left out
            there (:meth:`conversation_method`), and the document was compressed with it.

    Attributes:
        cache: the conversation's :class:`FoldedCache`.
        messages: the transcript, ``[{"role", "content"}]`` (the context is not repeated there).
        compactions: how many times the history was compacted.
        last_compaction: ``{"turn", "physical_before", "history_entries", "kept_tokens",
            "physical_after"}`` of the last compaction (``history_entries`` = the budget).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        method: str | ComposedMethod = RECOMMENDED,
        budget: float | int | str = DEFAULT_CHAT_BUDGET,
        *,
        cap: int | None = None,
        context: str | None = None,
        system: str | None = None,
        max_new_tokens: int = 128,
        use_chat_template: bool | None = None,
        pin_context: bool = True,
        refit_conversation: bool = False,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.method = build_method(method) if isinstance(method, str) else method
        check_chat_method(self.method)
        from kvfold.pipeline.chunked import runs_online_between_chunks

        if self.method.quant is not None and runs_online_between_chunks(self.method):
            raise UserError(
                f"{self.method.spec}: a quantized conversation is compacted one-shot; this method keeps its budget "
                "while decoding (write its selector with online=false, or drop the @format)"
            )
        self.use_chat_template = (
            bool(getattr(tokenizer, "chat_template", None)) if use_chat_template is None else use_chat_template
        )
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.messages: list[dict[str, str]] = []
        self.compactions = 0
        self.last_compaction: dict[str, int] | None = None
        self.token_ids: list[int] = []
        self.tokens_known = True
        self.context_open = False  # the cache ends inside the first user turn (after a context)
        self.turn_start = 0  # logical length where the last completed turn began
        self.pending: list[int] = []  # a reply's last token, not yet fed (max_new_tokens reached)
        self.policy = None
        self._turn_queries: dict[int, torch.Tensor] | None = None
        self.pinned: dict[int, torch.Tensor] | None = None  # per layer (B, H): the document's entries
        self.refit_conversation = refit_conversation
        self.cache = FoldedCache(model.config)
        parsed = Budget.parse(budget)
        if context is not None:
            from kvfold.pipeline.context import prefill

            prefilled = prefill(
                model, tokenizer, context, use_chat_template=self.use_chat_template, methods=[self.method]
            )
            self.cache = prefilled.cache
            self.token_ids = prefilled.input_ids[0].tolist()
            self.context_open = True
            self.budget = parsed.count(prefilled.context_tokens)
        elif parsed.fraction is not None:
            raise UserError("a chat without a context needs its budget as a token count (e.g. 512), not a fraction")
        else:
            self.budget = int(parsed.tokens)
        self.cap = 2 * self.budget if cap is None else int(cap)
        if self.cap <= self.budget:
            raise UserError(f"the cap ({self.cap}) must exceed the budget ({self.budget}): compaction needs room")
        self.cache.capture_window = max(DEFAULT_SNAPSHOT_WINDOW, self.method.query_window)
        if context is not None and pin_context and recompacts_by_repeat_pass(self.method):
            self._pin_document()

    # ------------------------------------------------------------------------- turns
    @property
    def online(self) -> bool:
        """Whether the method's decode-time policy holds the budget (after the first compaction)."""
        return self.policy is not None

    def ask(self, message: str, *, max_new_tokens: int | None = None) -> str:
        """Append a user turn, compacting first if it would pass the cap; return the reply.

        Raises:
            UserError: an empty message, or a conversation past the model's positions.
        """
        if not message or not message.strip():
            raise UserError("the message is empty")
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if limit < 1:
            raise UserError(f"max_new_tokens must be ≥ 1; got {limit}")
        first = self.cache.get_seq_length() == 0
        ids = self.pending + encode(self.tokenizer, self._turn_text(message), special=first)
        self._check_positions(len(ids) + limit)
        self._make_room(len(ids) + limit)
        if self.policy is None:
            self._turn_queries = {i: layer.captured_queries for i, layer in self.cache.folded_layers}
        before = self.cache.get_seq_length()
        answer = greedy_decode(self.model, self.tokenizer, self.cache, ids, limit)
        fed = self.cache.get_seq_length() - before - len(ids)  # the last token is not fed at the limit
        self.token_ids.extend(ids + answer.token_ids[:fed])
        self.pending = answer.token_ids[fed:]
        self.turn_start = before
        self.context_open = False
        self.messages += [
            {"role": "user", "content": message},
            {"role": "assistant", "content": self.tokenizer.decode(answer.token_ids, skip_special_tokens=False)},
        ]
        return answer.text

    def _turn_text(self, message: str) -> str:
        """The text a user turn appends to what the cache holds (closing the previous reply)."""
        if self.context_open:
            return build_prompt(self.tokenizer, "", message, use_chat_template=self.use_chat_template).suffix
        if not self.use_chat_template:
            return message + "\n" if not self.messages else "\n" + message + "\n"
        if not self.messages and self.cache.get_seq_length() == 0:
            turns = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": message}
            ]
            return self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        previous = self.messages[-1]["content"] if self.messages else ""
        rendered = self.tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "."},
                {"role": "assistant", "content": previous + MARK},
                {"role": "user", "content": message},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        return rendered.split(MARK, 1)[1]

    def _check_positions(self, incoming: int) -> None:
        config = self.model.config.get_text_config(decoder=True)
        limit = getattr(config, "max_position_embeddings", None)
        used = self.cache.get_seq_length()
        if limit is not None and used + incoming > limit:
            raise UserError(
                f"the conversation has used {used} of the model's {limit} positions and this turn needs {incoming} "
                "more; compaction frees memory, not positions: start a new chat (or lower max_new_tokens)"
            )

    # ------------------------------------------------------------------------- compaction
    def physical_length(self) -> int:
        """The most entries any row of any layer holds."""
        return max((layer.physical_length for _, layer in self.cache.folded_layers), default=0)

    def _pin_document(self) -> None:
        """Compress the document to the budget now and pin its entries (``pin_context``): each KV head
        keeps at most half the room between the budget and the cap, the rest is the conversation's."""
        self._compact(0, head_limit=self.budget + (self.cap - self.budget) // 2)
        self.pinned = {i: layer.row_lengths() for i, layer in self.cache.folded_layers}

    def conversation_method(self) -> ComposedMethod:
        """What compacts the conversation after a pinned document: the method, without a folder that
        refits its kept entries unless ``refit_conversation`` (``am_fit`` refitting entries it fitted
        at the turn before drifts: in a 30-turn chat on the demo's logbook, ``kvzip+am_fit`` refitting
        every compaction lost a fact of the pinned document that ``kvzip`` selection kept)."""
        if self.refit_conversation or self.method.folder is None or not self.method.folder.uses_repeat_pass:
            return self.method
        return dataclasses.replace(self.method, folder=None)

    def _pinned_plan(self, keep_last: int, incoming: int) -> tuple[int, int]:
        """``(budget, head_limit)`` of a compaction after a pinned document: the document's entries
        plus half the room they leave the conversation (after the kept last turn and the next one)."""
        widest = max(int(p.max()) for p in self.pinned.values())
        mean = max(float(p.float().mean()) for p in self.pinned.values())
        share = max(1, (self.cap - widest - incoming - keep_last) // 2)
        return int(mean) + share, widest + share

    def _make_room(self, incoming: int) -> None:
        if self.policy is not None or self.physical_length() + incoming <= self.cap:
            return
        if self.method.is_identity:
            raise UserError(f"method 'full' cannot compact: the conversation passes its cap of {self.cap} entries")
        online = self.method.online_policy(self._context()) is not None
        last = 0 if online or self.context_open else self.cache.get_seq_length() - self.turn_start
        floor = self.budget if self.pinned is None else max(int(p.max()) for p in self.pinned.values()) + 1
        if last and floor + last + incoming > self.cap:
            last = 0  # the last turn alone leaves no room: compact it too
        self._compact(last, incoming)
        if online:
            self.policy = self.method.online_policy(self._context())
            self.cache.policy = self.policy

    def _compact(self, keep_last: int, incoming: int = 0, head_limit: int | None = None) -> None:
        if not self.tokens_known and self.method.selector.name.startswith(READS_TOKENS):
            raise UserError(
                f"{self.method.spec} re-reads the conversation's tokens to compact it, and this cache file has none: "
                "write it with `kvfold compress --resumable` (kvfold.save_context(..., resumable=True)), "
                "or chat with another --method"
            )
        window = self._turn_queries if keep_last else None
        self._check_window(window, keep_last)
        before = self.physical_length()
        budget, limit = self.budget, self.cap - incoming - keep_last if head_limit is None else head_limit
        method = self.method
        if self.pinned is not None:
            budget, limit = self._pinned_plan(keep_last, incoming)
            method = self.conversation_method()
        done = compact_history(
            self.cache,
            self.model,
            method,
            budget,
            self.token_tensor(),
            keep_last=keep_last,
            window_queries=window,
            tokenizer=self.tokenizer,
            head_limit=limit,
            pinned=self.pinned,
        )
        quant = self.method.quant or self.cache.quant
        if done and quant is not None:  # the compacted conversation is stored as the method names
            self.cache.quantize(quant)
        if done:
            self.compactions += 1
            self.last_compaction = {
                "turn": len(self.messages) // 2,
                "physical_before": before,
                "history_entries": self.physical_length() - keep_last,
                "kept_tokens": keep_last,
                "physical_after": self.physical_length(),
            }

    def _check_window(self, window: dict[int, torch.Tensor] | None, keep_last: int) -> None:
        """Refuse a compaction whose method would find fewer query states than its window needs."""
        width = self.method.query_window
        if not width:
            return
        for index, layer in self.cache.folded_layers:
            queries = window.get(index) if window is not None else layer.captured_queries
            have = 0 if queries is None else queries.shape[2]
            needed = min(width, layer.physical_length - keep_last)
            if have < needed:
                raise UserError(
                    f"{self.method.spec} reads the last {width} query states to compact, and this conversation has "
                    f"{have} since its cache was loaded: write the cache file with `kvfold compress --resumable` "
                    f"(resumable=True), or give a larger --cap (at least the budget + {width})"
                )

    def token_tensor(self) -> torch.Tensor:
        """``(1, N)`` every token the cache has seen, on the model's device."""
        return torch.tensor([self.token_ids], dtype=torch.long, device=self.model.device)

    def _context(self) -> CompressionContext:
        ids = self.token_tensor()
        return CompressionContext(
            model=self.model,
            cache=self.cache,
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            budget=Budget(tokens=max(2, self.budget)),
            tokenizer=self.tokenizer,
        )

    # ------------------------------------------------------------------------- reporting
    def stats(self) -> dict[str, Any]:
        """Entries, bytes, compactions and the ratio to an uncompressed cache of the conversation."""
        full = self.cache.full_nbytes()
        held = self.cache.nbytes()
        return {
            "turns": len(self.messages) // 2,
            "method": self.method.spec,
            "budget": self.budget,
            "cap": self.cap,
            "entries": self.physical_length(),
            "logical_tokens": self.cache.get_seq_length(),
            "bytes": held,
            "full_bytes": full,
            "ratio": held / full if full else 1.0,
            "compactions": self.compactions,
            "online": self.online,
        }

    # ------------------------------------------------------------------------- saving and resuming
    def checkpoint(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """What a file needs to continue this conversation (:func:`kvfold.store.chat.save_chat` writes it).

        The decode-time policy (online methods) first writes its live per-entry state into the
        cache's statistics, so the cache carries it.

        Returns:
            The conversation's state (JSON-serializable: budget, cap, transcript, turn bookkeeping,
            options; :meth:`resume` reads it) and the query states the next compaction reads as its
            window (``turn_queries.<layer>``).

        Raises:
            UserError: nothing to save yet.
        """
        if self.cache.get_seq_length() == 0:
            raise UserError("nothing to save yet: ask something first")
        if self.policy is not None:
            self.policy.export_state(self.cache)
        tensors = {}
        for index, queries in (self._turn_queries or {}).items():
            if queries is not None:
                tensors[f"turn_queries.{index}"] = queries
        state = {
            "version": CHAT_STATE_VERSION,
            "budget": self.budget,
            "cap": self.cap,
            "messages": self.messages,
            "compactions": self.compactions,
            "last_compaction": self.last_compaction,
            "context_open": self.context_open,
            "turn_start": self.turn_start,
            "pending": self.pending,
            "online": self.policy is not None,
            "system": self.system,
            "use_chat_template": self.use_chat_template,
            "max_new_tokens": self.max_new_tokens,
            "tokens_known": self.tokens_known,
            "pinned": None if self.pinned is None else {str(i): p.tolist() for i, p in self.pinned.items()},
            "refit_conversation": self.refit_conversation,
        }
        return state, tensors

    @classmethod
    def resume(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        method: str | ComposedMethod,
        cache: FoldedCache,
        token_ids: list[int] | None,
        *,
        budget: int | None = None,
        state: dict[str, Any] | None = None,
        turn_queries: dict[int, torch.Tensor] | None = None,
        cap: int | None = None,
    ) -> ChatSession:
        """Continue a conversation from its cache (what :func:`kvfold.store.chat.load_chat` loaded).

        Either a saved chat (``state`` and ``turn_queries`` from :meth:`checkpoint`), or a
        compressed context (no ``state``; ``budget`` in entries): a chat whose first question
        completes the context's user turn.

        Args:
            method: the method spec (or built method) that compacted the cache.
            cache: the conversation's cache, as saved.
            token_ids: every token the cache has seen; None when unknown (then only methods that
                do not re-read the tokens can compact it again).
            budget: without ``state``: entries kept after a compaction.
            state: a saved chat's state.
            turn_queries: a saved chat's query window (per layer).
            cap: overrides the saved cap (default: the saved one, else ``2 × budget``).

        Raises:
            ValueError: a method that cannot compact a conversation, or a cap not above the budget.
        """
        session = cls.__new__(cls)
        session.model, session.tokenizer = model, tokenizer
        session.method = build_method(method) if isinstance(method, str) else method
        check_chat_method(session.method)
        session.cache = cache
        session.tokens_known = token_ids is not None
        logical = cache.get_seq_length()
        if token_ids is not None:
            session.token_ids = list(token_ids)
        else:  # unknown tokens: only methods that do not re-read them can compact (see _compact)
            pad = getattr(tokenizer, "pad_token_id", None)
            session.token_ids = [pad if pad is not None else 0] * logical
        session.refit_conversation = bool(state.get("refit_conversation", False)) if state else False
        session._restore(state, turn_queries, budget, logical)
        if state is None and recompacts_by_repeat_pass(session.method):  # a compressed document: pinned
            session.pinned = {i: layer.row_lengths() for i, layer in cache.folded_layers}
        online = True if state is None else bool(state["online"])
        if state is not None and cap is None:
            cap = int(state["cap"])
        session.cap = 2 * session.budget if cap is None else int(cap)
        if session.cap <= session.budget:
            raise UserError(f"the cap ({session.cap}) must exceed the budget ({session.budget})")
        cache.capture_window = max(DEFAULT_SNAPSHOT_WINDOW, session.method.query_window)
        if online:  # a compressed context or a chat whose policy ran: the policy continues from its statistics
            with torch.inference_mode():
                session.policy = session.method.online_policy(session._context())
            cache.policy = session.policy
        return session

    def _restore(
        self,
        state: dict[str, Any] | None,
        turn_queries: dict[int, torch.Tensor] | None,
        budget: int | None,
        logical: int,
    ) -> None:
        """Set the turn bookkeeping of :meth:`resume`: a saved chat's, or a fresh one after a context."""
        self.messages = []
        self.compactions = 0
        self.last_compaction = None
        self.pending = []
        self.system = None
        self.max_new_tokens = 128
        self.policy = None
        self._turn_queries = None
        self.pinned = None
        if state is None:  # a compressed context (kvfold compress)
            if budget is None:
                raise ValueError("resuming a compressed context needs its budget in entries")
            self.budget = int(budget)
            self.use_chat_template = bool(getattr(self.tokenizer, "chat_template", None))
            self.context_open = True
            self.turn_start = logical
            return
        self.budget = int(state["budget"])
        self.messages = list(state["messages"])
        self.compactions = int(state["compactions"])
        self.last_compaction = state.get("last_compaction")
        self.context_open = bool(state["context_open"])
        self.turn_start = int(state["turn_start"])
        self.pending = list(state["pending"])
        self.system = state.get("system")
        self.use_chat_template = bool(state["use_chat_template"])
        self.max_new_tokens = int(state["max_new_tokens"])
        self.tokens_known = self.tokens_known and bool(state.get("tokens_known", True))
        self._turn_queries = turn_queries or None
        if state.get("pinned") is not None:
            self.pinned = {int(i): torch.tensor(p, dtype=torch.long) for i, p in state["pinned"].items()}
