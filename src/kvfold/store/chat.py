"""Saved conversations: a :class:`~kvfold.pipeline.chat.ChatSession` in a cache file, continued later.

A chat file is a cache file (:mod:`kvfold.store.format`) whose header carries the conversation's
state under ``extra.chat`` (:meth:`ChatSession.checkpoint`), with its token ids and the query
window of its next compaction. :func:`load_chat` also starts a chat on a compressed context's file
(``kvfold compress``): its first question completes the context's user turn.

Example:
    >>> kvfold.save_chat(chat, "talk.kvc")  # doctest: +SKIP
    >>> chat = kvfold.load_chat("talk.kvc", model, tokenizer)  # doctest: +SKIP
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from kvfold.pipeline.chat import CHAT_STATE_VERSION, ChatSession
from kvfold.runtime.budget import Budget
from kvfold.store.load import load_file
from kvfold.store.save import save_cache

__all__ = ["load_chat", "save_chat"]


def save_chat(session: ChatSession, path: str | os.PathLike) -> int:
    """Write a conversation (cache, policy state, transcript, token ids) to a cache file.

    Raises:
        ValueError: nothing to save yet.

    Returns:
        The size of the file in bytes.
    """
    state, extra_tensors = session.checkpoint()
    token_ids = session.token_tensor() if session.token_ids else None
    cache = session.cache
    return save_cache(
        cache, path, session.model, session.tokenizer, method=session.method.spec, budget=session.budget,
        context_tokens=[cache.get_seq_length()], token_ids=token_ids, include_tokens=token_ids is not None,
        queries=True, extra={"chat": state}, extra_tensors=extra_tensors,
    )  # fmt: skip


def load_chat(
    path: str | os.PathLike,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    cap: int | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> ChatSession:
    """Continue a conversation saved by :func:`save_chat`, or start one on a ``kvfold compress`` file.

    A compressed context file becomes a chat whose first question completes the context's user
    turn, with the file's method and its budget in entries.

    Args:
        path: the file.
        model, tokenizer: the model the file was made with, and its tokenizer.
        cap: physical entries that trigger a compaction (default: the saved chat's, else
            ``2 × budget``).
        dtype, device: explicit conversion, as :func:`kvfold.store.load.load_cache` takes them.

    Raises:
        ValueError: a file without a method or of an unknown chat state version, a method that
            cannot compact a conversation; and the errors of :func:`kvfold.store.load.load_cache`.
    """
    cache, info, tensors = load_file(path, model, tokenizer, dtype=dtype, device=device)
    if info.method is None:
        raise ValueError(f"{path} records no method; write it with kvfold compress or kvfold.save_chat")
    state = info.extra.get("chat")
    saved_ids = tensors.get("context.token_ids")
    token_ids = None if saved_ids is None else saved_ids[0].tolist()
    if state is None:  # a compressed context (kvfold compress)
        lengths = info.context_tokens or [cache.get_seq_length()]
        budget = Budget.parse(info.budget or "1.0").count(int(lengths[0]))
        return ChatSession.resume(model, tokenizer, info.method, cache, token_ids, budget=budget, cap=cap)
    if state.get("version") != CHAT_STATE_VERSION:
        raise ValueError(f"{path}: chat state version {state.get('version')!r} is not supported")
    turn_queries = {
        int(name.split(".")[-1]): t for name, t in tensors.items() if name.startswith("extra.turn_queries.")
    }
    return ChatSession.resume(
        model, tokenizer, info.method, cache, token_ids, state=state, turn_queries=turn_queries, cap=cap
    )
