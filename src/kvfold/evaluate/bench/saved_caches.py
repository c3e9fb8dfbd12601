"""``kvfold bench --cachefile``: what a saved cache buys, and what a long chat holds.

For every (method, budget, length) one worker process measures, on the shipped prose haystack:

* **file** — the cache file's size against the bytes of the full cache (``file_ratio``);
* **answer from scratch** — prefill, compress and answer one question (``scratch_s``);
* **answer from the file** — load the file (header check, memory map, checksum, rebuild) and
  answer the same question (``from_file_s``), and whether both answers are the same tokens;
  ``speedup = scratch_s / from_file_s``; ``setup_speedup = (prefill_s + compress_s) / load_s``
  (what the file replaces, without the answer's decoding, which both share). The model is loaded
  once, before either is timed, and the file was just written (the operating system's page cache
  holds it: a cold disk adds its read time, about ``file_bytes`` / disk speed).

A second worker process per (method, budget) runs a :class:`~kvfold.pipeline.chat.ChatSession` of
``turns`` scripted turns (no context, ``chat_budget`` entries, cap twice that) and records its
resident memory (``VmRSS``) and cache entries after every turn: ``rss_growth_after_first_compaction_mb``
is the largest RSS after the first compaction minus the RSS right after it.

Records are appended to ``OUT/cachefile.jsonl``; ``OUT/cachefile.md`` is the table.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfold.evaluate.bench.process import (
    context_ids,
    current_rss_mb,
    peak_rss_mb,
    release_freed_memory,
    spawn_worker,
    worker_main,
)
from kvfold.evaluate.reporting.tables import markdown_table
from kvfold.methods import build_method
from kvfold.runtime.files import DirectoryLock, append_jsonl, atomic_write_text
from kvfold.runtime.models import load_model

QUESTION = "What is this text about? Answer in one sentence."
CHAT_TURNS = [
    "Tell me one fact about the sea.",
    "Name a city in Europe.",
    "What is 3 plus 4?",
    "Give me a word that rhymes with cat.",
    "What colour is the sky on a clear day?",
    "Name an animal that lives in the forest.",
    "Say something kind in one sentence.",
]


USER_ERRORS = (
    "UserError",
    "QuantSpecError",
    "NotImplementedError",
    "ModelLoadError",
    "SpecError",
    "CacheFileError",
    "CorruptCacheFileError",
    "CacheFileVersionError",
    "ModelMismatchError",
    "DtypeDeviceError",
)


@dataclass(frozen=True)
class FileConfig:
    """One cache-file measurement."""

    model: str
    method: str
    budget: float | int
    length: int
    new_tokens: int
    out: str
    dtype: str = "auto"
    device: str = "auto"


@dataclass(frozen=True)
class ChatConfig:
    """One chat memory measurement."""

    model: str
    method: str
    chat_budget: int
    turns: int
    new_tokens: int
    dtype: str = "auto"
    device: str = "auto"


def context_text(tokenizer, length: int) -> str:
    """About ``length`` tokens of the shipped prose haystack, as text."""
    return tokenizer.decode(context_ids(tokenizer, length, 1)[0].tolist())


def run_file_config(config: FileConfig) -> dict:
    """Measure one cache file in this process (a worker)."""
    import torch

    from kvfold.pipeline.context import prefill
    from kvfold.store.load import load_context
    from kvfold.store.save import save_context

    model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    text = context_text(tokenizer, config.length)
    method = build_method(config.method)
    with torch.inference_mode():
        start = time.perf_counter()
        prefilled = prefill(model, tokenizer, text, methods=[method])
        compressed = prefilled.compress(method, config.budget)
        scratch = compressed.generate(QUESTION, max_new_tokens=config.new_tokens)[0]
        scratch_s = time.perf_counter() - start
    path = Path(config.out)
    start = time.perf_counter()
    file_bytes = save_context(compressed, path, source_text=text)
    save_s = time.perf_counter() - start
    record = {
        **asdict(config),
        "context_tokens": prefilled.context_tokens,
        "kv_bytes": compressed.kv_bytes,
        "kv_bytes_full": compressed.kv_bytes_full,
        "file_bytes": file_bytes,
        "file_ratio": file_bytes / compressed.kv_bytes_full,
        "prefill_s": prefilled.prefill_seconds,
        "compress_s": compressed.compress_seconds,
        "scratch_answer_s": scratch.decode_seconds,
        "scratch_s": scratch_s,
        "save_s": save_s,
    }
    del prefilled, compressed
    release_freed_memory()
    with torch.inference_mode():
        start = time.perf_counter()
        loaded = load_context(path, model, tokenizer)
        load_s = time.perf_counter() - start
        again = loaded.generate(QUESTION, max_new_tokens=config.new_tokens)[0]
        from_file_s = time.perf_counter() - start
    record.update(
        load_s=load_s,
        file_answer_s=again.decode_seconds,
        from_file_s=from_file_s,
        speedup=scratch_s / from_file_s,
        setup_speedup=(record["prefill_s"] + record["compress_s"]) / load_s,
        same_answer=again.token_ids == scratch.token_ids,
        new_tokens_answered=again.new_tokens,
    )
    return record


def run_chat_config(config: ChatConfig) -> dict:
    """Run a scripted chat in this process (a worker); RSS and entries after every turn."""
    from kvfold.pipeline.chat import ChatSession

    model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    chat = ChatSession(model, tokenizer, config.method, config.chat_budget, max_new_tokens=config.new_tokens)
    base = current_rss_mb()
    per_turn = []
    first_compaction = None
    start = time.perf_counter()
    for turn in range(config.turns):
        chat.ask(CHAT_TURNS[turn % len(CHAT_TURNS)])
        stats = chat.stats()
        per_turn.append(
            {"turn": turn + 1, "rss_mb": current_rss_mb(), "entries": stats["entries"], "bytes": stats["bytes"]}
        )
        if first_compaction is None and stats["compactions"]:
            first_compaction = turn
    elapsed = time.perf_counter() - start
    stats = chat.stats()
    after = [p["rss_mb"] for p in per_turn[first_compaction:]] if first_compaction is not None else []
    return {
        **asdict(config),
        "chat_cap": chat.cap,
        "chat_seconds": elapsed,
        "base_rss_mb": base,
        "peak_rss_mb": peak_rss_mb(),
        "first_compaction_turn": None if first_compaction is None else first_compaction + 1,
        "rss_after_first_compaction_mb": after[0] if after else None,
        "rss_growth_after_first_compaction_mb": (max(after) - after[0]) if after else None,
        "max_entries": max(p["entries"] for p in per_turn),
        "max_cache_bytes": max(p["bytes"] for p in per_turn),
        "final": stats,
        "per_turn": per_turn,
    }


def _spawn(kind: str, config: FileConfig | ChatConfig, timeout: float | None = None) -> dict:
    """Measure one configuration in a worker process (:func:`~kvfold.evaluate.bench.process.spawn_worker`)."""
    module, what = "kvfold.evaluate.bench.saved_caches", "cache-file bench worker"
    options = {"where": config.method, "what": what, "user_errors": USER_ERRORS, "timeout": timeout}
    return spawn_worker(module, kind, asdict(config), **options)


def bench_cachefile(
    model: str,
    methods: list[str],
    budgets: list[float | int],
    lengths: list[int],
    out_dir: str | Path,
    *,
    new_tokens: int = 16,
    turns: int = 50,
    chat_budget: int = 256,
    chat_new_tokens: int = 32,
    dtype: str = "auto",
    device: str = "auto",
) -> dict:
    """Measure cache files and chat memory; write ``cachefile.jsonl`` and ``cachefile.md`` into ``out_dir``.

    Returns:
        ``{"files": [...], "chats": [...]}`` (see the module docstring for the fields).
    """
    out = Path(out_dir)
    files, chats = [], []
    with DirectoryLock(out):
        for method in methods:
            for budget in budgets:
                for length in lengths:
                    path = out / f"{method.replace(':', '_')}-{budget}-{length}.kvc"
                    config = FileConfig(model, method, budget, length, new_tokens, str(path), dtype, device)
                    record = {"kind": "file", **_spawn("file", config)}
                    files.append(record)
                    append_jsonl(out / "cachefile.jsonl", record)
            if turns > 0:
                config = ChatConfig(model, method, chat_budget, turns, chat_new_tokens, dtype, device)
                record = {"kind": "chat", **_spawn("chat", config)}
                chats.append(record)
                append_jsonl(out / "cachefile.jsonl", record)
        result = {"model": model, "files": files, "chats": chats}
        atomic_write_text(out / "cachefile.md", report(result))
    return result


FILE_COLUMNS = (
    "method", "budget", "context tokens", "file MB", "full KV MB", "file / full", "prefill+compress+answer s",
    "load+answer s", "speedup", "prefill+compress s", "load s", "speedup", "same answer",
)  # fmt: skip
CHAT_COLUMNS = (
    "method", "turns", "budget", "cap", "compactions", "max entries", "max cache MB", "RSS after 1st compaction MB",
    "RSS growth after MB", "peak RSS MB", "seconds",
)  # fmt: skip


def report(result: dict) -> str:
    """The measurements as Markdown tables: the cache files, then the chats."""
    lines = [f"# kvfold bench --cachefile — {result['model']}", ""]
    lines.append(markdown_table(FILE_COLUMNS, map(_file_row, result["files"])))
    if result["chats"]:
        lines += ["", markdown_table(CHAT_COLUMNS, map(_chat_row, result["chats"]))]
    return "\n".join(lines) + "\n"


def _file_row(r: dict) -> list[str]:
    return [
        r["method"], str(r["budget"]), str(r["context_tokens"]), f"{r['file_bytes'] / 2**20:.2f}",
        f"{r['kv_bytes_full'] / 2**20:.2f}", f"{r['file_ratio']:.3f}", f"{r['scratch_s']:.2f}",
        f"{r['from_file_s']:.2f}", f"{r['speedup']:.1f}x", f"{r['prefill_s'] + r['compress_s']:.2f}",
        f"{r['load_s']:.3f}", f"{r['setup_speedup']:.0f}x", str(r["same_answer"]),
    ]  # fmt: skip


def _chat_row(r: dict) -> list[str]:
    growth = r["rss_growth_after_first_compaction_mb"]
    first = r["rss_after_first_compaction_mb"]
    return [
        r["method"], str(r["turns"]), str(r["chat_budget"]), str(r["chat_cap"]), str(r["final"]["compactions"]),
        str(r["max_entries"]), f"{r['max_cache_bytes'] / 2**20:.2f}", "-" if first is None else f"{first:.0f}",
        "-" if growth is None else f"{growth:.1f}", f"{r['peak_rss_mb']:.0f}", f"{r['chat_seconds']:.0f}",
    ]  # fmt: skip


WORKERS = {
    "file": lambda raw: run_file_config(FileConfig(**raw)),
    "chat": lambda raw: run_chat_config(ChatConfig(**raw)),
}
"""The measurements a worker process runs (:func:`_spawn`)."""

if __name__ == "__main__":
    raise SystemExit(worker_main("kvfold.evaluate.bench.saved_caches", WORKERS))
