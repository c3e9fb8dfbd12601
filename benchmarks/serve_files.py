"""The cache files the serving benchmark (``benchmarks/serve_vllm.py``) serves, made once and kept.

Three workloads, each compressed with the recommended pipeline under ``--memory`` budgets and saved:

* ``logbook``: ``kvfold demo``'s logbook at ``--tokens`` tokens, one file per budget, and its five
  questions (asked in turn by as many requests as a run sends);
* ``needles``: ``--needles`` RULER ``niah_single_2`` contexts (a needle in prose) of about
  ``--needle-tokens`` tokens, one file each at 1/16;
* ``documents``: ``--documents`` distinct RULER ``niah_single_2`` contexts of about ``--tokens`` tokens,
  one question each, one file per budget each.

For every file it records the question, ``kvfold ask``'s answer from the file in the served dtype (token
ids, to check what the server answers), the context's tokens and the time compression took, apart
from the time the prefill took; for every document, the plain prompt's token ids (what stock vLLM is
given: the document, the question, the chat template, as ``kvfold ask`` builds it) and the needle.
Everything goes to ``files.json`` after each context, so an interrupted run goes on where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

MEMORY = {"mem16": 1 / 16, "mem32": 1 / 32}
SEED = 20261128


def _write(path: Path, data: dict) -> None:
    partial = path.with_suffix(".json.part")
    partial.write_text(json.dumps(data))
    os.replace(partial, path)


def _plain_ids(tokenizer, context: str, question: str, answer_prefix: str) -> list[int]:
    from kvfold.runtime.prompts import build_prompt, encode

    parts = build_prompt(tokenizer, context, question, answer_prefix)
    return encode(tokenizer, parts.context, special=True) + encode(tokenizer, parts.suffix, special=False)


def make_files(out: Path, args) -> dict:
    """Make (or finish making) every file the run serves under ``out / "caches"``; the record of them.

    ``args`` has ``method``, ``dtype``, ``tokens``, ``needle_tokens``, ``needles``, ``documents`` (the
    largest count a run sends) and ``max_tokens``.
    """
    import kvfold
    from kvfold.evaluate.data.logbook import FACTS, build_logbook
    from kvfold.evaluate.data.ruler import generate_ruler

    caches = out / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    record_path = out / "files.json"
    made = json.loads(record_path.read_text()) if record_path.is_file() else {"files": {}, "documents": []}
    model, tokenizer = kvfold.load_model()
    served_model = None

    def compress(name: str, text: str, budgets: dict[str, float], questions: list[tuple[str, str]]) -> None:
        nonlocal served_model
        wanted = {f"{name}-{b}": m for b, m in budgets.items()}
        if all(n in made["files"] and (caches / f"{n}.kvc").is_file() for n in wanted):
            return
        start = time.perf_counter()
        context = kvfold.prefill(model, tokenizer, text, methods=[args.method])
        prefill_seconds = time.perf_counter() - start
        if served_model is None:
            served_model, _ = kvfold.load_model(dtype=args.dtype)
        for file, memory in wanted.items():
            small = context.compress(args.method, memory=memory)
            kvfold.save_context(small, caches / f"{file}.kvc", source_text=text)
            loaded = kvfold.load_context(caches / f"{file}.kvc", served_model, tokenizer, dtype=args.dtype)
            answers = [
                loaded.generate(q, answer_prefix=p, max_new_tokens=args.max_tokens)[0].token_ids for q, p in questions
            ]
            made["files"][file] = {
                "memory": memory,
                "context_tokens": context.context_tokens,
                "prefill_seconds": prefill_seconds,
                "compress_seconds": small.compress_seconds,
                "questions": [list(q) for q in questions],
                "kvfold_ask": [list(map(int, a)) for a in answers],
            }
        _write(record_path, made)

    print("files: the logbook", flush=True)
    logbook = build_logbook(tokenizer, args.tokens)
    made["logbook_prompt_ids"] = [_plain_ids(tokenizer, logbook, q, "") for _, q, _ in FACTS]
    compress("logbook", logbook, MEMORY, [(q, "") for _, q, _ in FACTS])
    needles = generate_ruler(tokenizer, args.needle_tokens, args.needles, seed=SEED, tasks=["niah_single_2"])
    for index, sample in enumerate(needles):
        print(f"files: needle context {index + 1} of {len(needles)}", flush=True)
        compress(f"needle{index}", sample.context, {"mem16": 1 / 16}, [(sample.question, sample.answer_prefix)])
    documents = generate_ruler(tokenizer, args.tokens, args.documents, seed=SEED + 1, tasks=["niah_single_2"])
    for index, sample in enumerate(documents):
        print(f"files: document {index + 1} of {len(documents)}", flush=True)
        compress(f"doc{index}", sample.context, MEMORY, [(sample.question, sample.answer_prefix)])
        if index >= len(made["documents"]):
            made["documents"].append(
                {
                    "question": sample.question,
                    "answer_prefix": sample.answer_prefix,
                    "needles": list(sample.answers),
                    "prompt_ids": _plain_ids(tokenizer, sample.context, sample.question, sample.answer_prefix),
                }
            )
            _write(record_path, made)
    made["eos_token_id"] = tokenizer.eos_token_id
    _write(record_path, made)
    return made
