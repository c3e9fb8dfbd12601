"""Reading published benchmarks: rows from the hub or a local copy (through the optional ``datasets``
package, ``pip install 'kvfold[datasets]'``), and LongBench's middle truncation of long prompts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

from kvfold.evaluate.data.samples import Sample
from kvfold.evaluate.data.text import count_tokens, token_ids
from kvfold.runtime.errors import UserError

__all__ = [
    "first_rows",
    "hub_rows",
    "import_datasets",
    "local_rows",
    "maybe_truncate",
    "truncate_context",
    "truncate_middle",
]


def import_datasets() -> Any:
    """Imports the optional ``datasets`` package or says how to install it."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(
            "loading published benchmarks needs the optional 'datasets' package: pip install 'kvfold[datasets]'"
        ) from exc
    return datasets


def local_rows(file: Path, cache_dir: str | None) -> Any:
    """Rows of a local JSON Lines file, read through ``datasets``' JSON builder."""
    datasets = import_datasets()
    return datasets.load_dataset("json", data_files=str(file), split="train", cache_dir=cache_dir)


def hub_rows(repo: str, config: str | None, split: str, cache_dir: str | None, hint: str) -> Any:
    """Rows of a hub dataset; a failure is re-raised with how to use a local copy instead."""
    datasets = import_datasets()
    try:
        return datasets.load_dataset(repo, config, split=split, cache_dir=cache_dir)
    except Exception as exc:
        raise RuntimeError(
            f"could not load {repo!r} (config {config!r}, split {split!r}) from the hub: {exc}. {hint}"
        ) from exc


def first_rows(rows: Iterable[Mapping[str, Any]], max_samples: int | None) -> list[Mapping[str, Any]]:
    """The first ``max_samples`` rows (all when ``None``)."""
    return list(rows if max_samples is None else islice(rows, max_samples))


def truncate_middle(token_ids: Sequence[int], max_len: int) -> list[int]:
    """LongBench's truncation: keep the first and the last tokens, drop the middle.

    Keeps ``max_len // 2`` tokens from the start and ``max_len - max_len // 2`` from the end, so the
    result has exactly ``max_len`` tokens (LongBench keeps ``max_len // 2`` at each end, one fewer
    for odd ``max_len``). Sequences no longer than ``max_len`` are returned unchanged.

    Args:
        token_ids: Token ids.
        max_len: Maximum number of tokens to keep; positive.

    Returns:
        The kept token ids.

    Example:
        >>> truncate_middle(list(range(10)), 5)
        [0, 1, 7, 8, 9]
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be positive; got {max_len}")
    ids = list(token_ids)
    if len(ids) <= max_len:
        return ids
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head) :]


def truncate_context(tokenizer: Any, context: str, question: str, max_length: int) -> str:
    """Middle-truncates ``context`` so that the whole prompt ``context + question`` fits ``max_length``
    tokens, as LongBench truncates its prompt: the question stays inside the kept tail.

    The kept head and tail are decoded separately and joined, as LongBench does.
    """
    context_ids = token_ids(tokenizer, context)
    question_tokens = count_tokens(tokenizer, question)
    if len(context_ids) + question_tokens <= max_length:
        return context
    head = max_length // 2
    if question_tokens > max_length - head:
        raise UserError(f"max_length={max_length} is too small: the question alone takes {question_tokens} tokens")
    # truncate_middle(context + question) keeps `head` tokens and a tail that ends with the question;
    # the context's share of that tail is what precedes the question.
    tail = max_length - head - question_tokens
    kept_tail = context_ids[len(context_ids) - tail :] if tail else []
    decode = tokenizer.decode
    return decode(context_ids[:head], skip_special_tokens=True) + decode(kept_tail, skip_special_tokens=True)


def maybe_truncate(samples: list[Sample], tokenizer: Any, max_length: int | None) -> list[Sample]:
    """Applies LongBench's middle truncation when a tokenizer and ``max_length`` are given."""
    if tokenizer is None or max_length is None:
        return samples
    truncated = []
    for s in samples:
        context = truncate_context(tokenizer, s.context, s.question, max_length)
        truncated.append(s if context == s.context else replace(s, context=context))
    return truncated
