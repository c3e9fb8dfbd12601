"""XSum: one-sentence summaries of news articles (Narayan et al., 2018), scored by ROUGE-L (:func:`load_xsum`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfold.evaluate.data.hub import first_rows, hub_rows, local_rows, maybe_truncate
from kvfold.evaluate.data.samples import Sample

__all__ = ["XSUM_MAX_NEW_TOKENS", "load_xsum"]

XSUM_MAX_NEW_TOKENS = 64
_XSUM_INSTRUCTION = "Summarize the following news article in one sentence.\n\nArticle:\n"
_XSUM_QUESTION = "\n\nNow write a one-sentence summary of the article above.\n\nSummary:"


def load_xsum(
    path_or_repo: str | Path = "EdinburghNLP/xsum",
    split: str = "test",
    max_samples: int | None = None,
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    cache_dir: str | None = None,
) -> list[Sample]:
    """Loads XSum (one-sentence news summaries), scored by ROUGE-L with ROUGE-1/2 also reported.

    Args:
        path_or_repo: A hub dataset repo, a local ``.jsonl`` file or a folder holding
            ``{split}.jsonl``; rows have ``document``, ``summary`` and ``id``.
        split: Split to read.
        max_samples: At most this many samples.
        tokenizer: With ``max_length``, middle-truncates long articles (as for LongBench).
        max_length: Prompt length limit in tokens.
        cache_dir: ``datasets`` cache folder.

    Returns:
        Samples with ``metric="rouge_l"`` and ``extra_metrics=("rouge_1", "rouge_2")``.
    """
    local = Path(path_or_repo)
    if local.is_file():
        rows = local_rows(local, cache_dir)
    elif local.is_dir():
        rows = local_rows(local / f"{split}.jsonl", cache_dir)
    else:
        hint = "Pass a local .jsonl file (or a folder with {split}.jsonl) with document/summary/id fields."
        rows = hub_rows(str(path_or_repo), None, split, cache_dir, hint)
    samples = [
        Sample(
            context=_XSUM_INSTRUCTION + row["document"],
            question=_XSUM_QUESTION,
            answers=(row["summary"],),
            task="xsum",
            max_new_tokens=XSUM_MAX_NEW_TOKENS,
            metric="rouge_l",
            sample_id=str(row.get("id") or f"xsum/{i}"),
            extra_metrics=("rouge_1", "rouge_2"),
        )
        for i, row in enumerate(first_rows(rows, max_samples))
    ]
    return maybe_truncate(samples, tokenizer, max_length)
