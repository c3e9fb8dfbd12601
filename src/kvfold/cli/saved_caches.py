"""Command line for saved caches and chat: ``kvfold compress``, ``kvfold ask``, ``kvfold chat`` and
``kvfold generate --cache``.

* ``kvfold compress --context-file F [--method M --budget B] --out doc.kvc`` — prefill and compress
  once (by default with the recommended pipeline at a tenth), write the cache file.
* ``kvfold generate --cache doc.kvc --question Q`` — answer from the file, no prefill.
* ``kvfold ask --cache doc.kvc [--questions FILE]`` — many questions (a file, or stdin), one a
  line, each answered from a fresh copy of the same loaded cache.
* ``kvfold chat [--context-file F | --cache doc.kvc] [--method M --budget B]`` — a conversation kept
  in a cache of fixed size (:class:`kvfold.pipeline.chat.ChatSession`), read from stdin (a tty or a pipe),
  with ``/save PATH``, ``/load PATH``, ``/stats`` and ``/quit``. A ``/save`` that cannot write its file
  says so in one line and the conversation goes on; the command then ends with status 2.

The module exposes ``add_parsers(sub)`` and ``COMMANDS`` (name → handler), which the command line
gathers; importing it loads no model and no torch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from kvfold.cli.args import (
    add_memory_args,
    add_method_args,
    add_model_args,
    add_new_tokens,
    compress_options,
    deprecated_alias,
    progress,
    read_context,
    read_document,
    read_text_file,
)
from kvfold.runtime.defaults import DEFAULT_BUDGET, DEFAULT_CHAT_BUDGET, RECOMMENDED
from kvfold.runtime.errors import UserError


def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """``--cache-dtype`` / ``--cache-device``: explicit conversion of a cache file on load."""
    parser.add_argument(
        "--cache-dtype", default=None, help="convert the cache file's keys and values to this dtype (the model's)"
    )
    parser.add_argument("--cache-device", default=None, help="load the cache file onto this device (the model's)")


def _model_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``compress``, ``ask`` and ``chat``."""
    p = sub.add_parser("compress", help="prefill and compress a context once, write a cache file (.kvc)")
    _model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="file with the context text")
    src.add_argument("--context", help="the context text")
    add_method_args(p, budget_default=None)
    add_memory_args(p)
    p.add_argument("--out", required=True, type=Path, help="the cache file to write (one file, e.g. doc.kvc)")
    p.add_argument(
        "--resumable",
        action="store_true",
        help="also store the token ids and last query states, so a chat on this file can compact it again",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the methods that draw at random")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("ask", help="answer many questions from one saved cache file, no prefill")
    _model_args(p)
    p.add_argument("--cache", required=True, type=Path, help="a cache file written by kvfold compress")
    p.add_argument("--questions", type=Path, default=None, help="file with one question a line (default: stdin)")
    p.add_argument("--answer-prefix", default="", help="text every answer starts with (decoding continues it)")
    add_new_tokens(p, "the most tokens generated for each answer", default=64)
    deprecated_alias(p, "--max-new-tokens", "--new-tokens", type=int)
    p.add_argument("--json", action="store_true", help="print one JSON object a line")
    add_cache_args(p)

    p = sub.add_parser("chat", help="a conversation in a cache of fixed size (stdin; /save, /load, /stats, /quit)")
    _model_args(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--context-file", type=Path, help="a document the conversation is about")
    src.add_argument("--cache", type=Path, help="a cache file (kvfold compress, or /save) to continue from")
    p.add_argument(
        "--method",
        default=None,
        help=f"method spec used to compact the conversation (default: {RECOMMENDED}; with --cache: the file's)",
    )
    p.add_argument(
        "--budget",
        default=None,
        help="entries per KV head kept after a compaction: a token count, or a fraction of --context-file "
        f"(default: {DEFAULT_CHAT_BUDGET}; with --cache: the file's)",
    )
    add_memory_args(p)
    p.add_argument(
        "--cap", type=int, default=None, help="physical entries that trigger a compaction (default: 2 x budget)"
    )
    add_new_tokens(p, "the most tokens of each reply", default=128)
    deprecated_alias(p, "--max-new-tokens", "--new-tokens", type=int)
    p.add_argument("--system", default=None, help="a system message (chat template permitting)")
    p.add_argument(
        "--no-pin",
        action="store_true",
        help="re-rank the document with the conversation at every compaction (default, for kvzip and "
        "kvzip+am_fit: the document is compressed once and its entries kept)",
    )
    add_cache_args(p)


# ----------------------------------------------------------------------------- compress


def run_compress(args: argparse.Namespace) -> int:
    """``kvfold compress``: prefill and compress a context once, write the cache file."""
    from kvfold.methods import build_method
    from kvfold.methods.core.base import with_format
    from kvfold.pipeline.context import prefill
    from kvfold.runtime.budget import Budget
    from kvfold.runtime.models import load_model
    from kvfold.store.save import save_context

    options = compress_options(args, DEFAULT_BUDGET if args.budget is None and args.memory is None else args.budget)
    spec = with_format(args.method, options.pop("kv_format"))
    method = build_method(spec)
    target = Budget.of_memory(options["memory"]) if "memory" in options else Budget.parse(options["budget"])
    text = read_context(args)
    progress(args, f"loading {args.model}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    progress(args, "prefilling the context")
    prefilled = prefill(model, tokenizer, text, methods=[method])
    what = f"memory {target}" if target.memory is not None else str(target)
    progress(args, f"compressing {prefilled.context_tokens} tokens with {_describe(spec)} to {what}")
    compressed = prefilled.compress(method, target, seed=args.seed)
    budget = compressed.budget
    progress(args, f"writing {args.out}")
    start = time.perf_counter()
    size = save_context(compressed, args.out, source_text=text, resumable=args.resumable)
    save_seconds = time.perf_counter() - start
    record = {
        "out": str(args.out),
        "method": compressed.method.spec,
        "budget": budget.label(),
        "context_tokens": prefilled.context_tokens,
        "file_bytes": size,
        **compressed.memory_record(),
        "file_ratio": size / compressed.kv_bytes_full,
        "prefill_seconds": prefilled.prefill_seconds,
        "compress_seconds": compressed.compress_seconds,
        "save_seconds": save_seconds,
        "model": args.model,
    }
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(
            f"{args.out}: {record['context_tokens']} tokens, {_describe(record['method'])} @ {budget}: "
            f"{size / 2**20:.2f} MB of {record['kv_bytes_full'] / 2**20:.2f} MB full "
            f"({100 * record['file_ratio']:.1f}%; the cache is {record['memory_ratio']:.4f} of the full cache in "
            f"16 bits); prefill {record['prefill_seconds']:.2f}s, "
            f"compress {record['compress_seconds']:.2f}s, save {save_seconds:.2f}s"
        )
    return 0


# ----------------------------------------------------------------------------- generate / ask


def _load_saved(args: argparse.Namespace):
    """Model, tokenizer and the loaded :class:`CompressedContext` of ``args.cache``, with load time."""
    from kvfold.runtime.models import load_model
    from kvfold.store.load import load_context

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    context = load_context(
        args.cache,
        model,
        tokenizer,
        dtype=getattr(args, "cache_dtype", None),
        device=getattr(args, "cache_device", None),
    )
    return model, tokenizer, context, time.perf_counter() - start


def _answer_record(context, question: str, args: argparse.Namespace) -> dict:
    answer = context.generate(question, answer_prefix=args.answer_prefix, max_new_tokens=args.new_tokens)[0]
    return {
        "question": question,
        "answer": answer.text,
        "new_tokens": answer.new_tokens,
        "decode_seconds": answer.decode_seconds,
    }


def run_generate_cached(args: argparse.Namespace) -> int:
    """``kvfold generate --cache doc.kvc --question Q``: the answer from a saved cache, no prefill."""
    _refuse_with_cache(args, "--query-aware" if args.query_aware else None)
    if args.new_tokens < 1:
        raise UserError(f"--new-tokens must be ≥ 1; got {args.new_tokens}")
    progress(args, f"loading {args.model} and {args.cache}")
    _, _, context, load_seconds = _load_saved(args)
    record = _answer_record(context, args.question, args)
    record.update(
        cache=str(args.cache),
        method=context.method.spec,
        budget=context.budget.label(),
        context_tokens=context.source.context_tokens,
        kv_bytes=context.kv_bytes,
        kv_bytes_full=context.kv_bytes_full,
        load_seconds=load_seconds,
        model=args.model,
    )
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(record["answer"])
        print(
            f"[{record['method']} @ {record['budget']} from {args.cache}] context {record['context_tokens']} tokens, "
            f"KV {record['kv_bytes'] / 2**20:.2f} MB of {record['kv_bytes_full'] / 2**20:.2f} MB, "
            f"load {load_seconds:.2f}s, decode {record['decode_seconds']:.2f}s",
            file=sys.stderr,
        )
    return 0


def _questions(path: Path | None, stream: TextIO) -> Iterator[str]:
    if path is not None:
        lines: Iterator[str] = iter(read_text_file(path, "questions file").splitlines())
    else:
        lines = (line.rstrip("\n") for line in stream)
    for line in lines:
        if line.strip():
            yield line.strip()


def run_ask(args: argparse.Namespace) -> int:
    """``kvfold ask --cache doc.kvc``: one answer a line, each from a fresh copy of the loaded cache."""
    if args.new_tokens < 1:
        raise UserError(f"--new-tokens must be ≥ 1; got {args.new_tokens}")
    progress(args, f"loading {args.model} and {args.cache}")
    _, _, context, load_seconds = _load_saved(args)
    print(
        f"[{context.method.spec} @ {context.budget.label()} from {args.cache}] loaded in {load_seconds:.2f}s",
        file=sys.stderr,
    )
    count = 0
    for question in _questions(args.questions, sys.stdin):
        record = _answer_record(context, question, args)
        print(json.dumps(record) if args.json else record["answer"], flush=True)
        count += 1
    if count == 0:
        raise UserError("no questions: give --questions FILE or one question a line on stdin")
    return 0


# ----------------------------------------------------------------------------- chat


def _chat_memory(model, spec: str, memory: float) -> tuple[str, float]:
    """The method spec (with its storage) and the fraction of the document a chat under ``--memory``
    keeps (:func:`kvfold.pipeline.memory.split_memory`); ``full`` keeps all of it in the widest storage
    that fits (:func:`kvfold.pipeline.memory.full_formats`) or is refused in one line."""
    from kvfold.methods import build_method
    from kvfold.pipeline.memory import full_formats, full_out_of_reach, split_memory
    from kvfold.runtime.budget import Budget

    Budget.of_memory(memory)  # a fraction in (0, 1], or a one-line error
    method = build_method(spec)
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if method.is_identity:
        formats = full_formats(memory, method, head_dim, head_dim)
        if not formats:
            raise full_out_of_reach(memory, method, head_dim, head_dim)
        fraction, quant = 1.0, formats[0]
    else:
        fraction, quant = split_memory(memory, method, head_dim, head_dim)
    stored = spec if method.precision_fixed else f"{spec}@{'16' if quant is None else quant.describe()}"
    return stored, fraction


def run_chat(args: argparse.Namespace, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """``kvfold chat``: read lines from stdin; a line is a user turn unless it is a command."""
    from kvfold.methods.core.base import with_format
    from kvfold.pipeline.chat import ChatSession
    from kvfold.runtime.models import load_model
    from kvfold.store.chat import load_chat

    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    if args.new_tokens < 1:
        raise UserError(f"--new-tokens must be ≥ 1; got {args.new_tokens}")
    if args.cache is not None:
        _refuse_with_cache(args)
    context = read_document(args.context_file) if args.context_file is not None else None
    progress(args, f"loading {args.model}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    load_kwargs = {"dtype": args.cache_dtype, "device": args.cache_device}
    if args.cache is not None:
        session = load_chat(args.cache, model, tokenizer, cap=args.cap, **load_kwargs)
    else:
        method = with_format(RECOMMENDED if args.method is None else args.method, args.kv_bits)
        budget = DEFAULT_CHAT_BUDGET if args.budget is None else args.budget
        if args.memory is not None:
            if args.budget is not None or context is None:
                raise UserError("--memory takes the place of --budget and needs --context-file (a fraction of it)")
            method, budget = _chat_memory(model, method, args.memory)
        if context is not None:
            progress(args, f"prefilling the document; the conversation is compacted with {_describe(method)}")
        session = ChatSession(
            model,
            tokenizer,
            method,
            budget,
            cap=args.cap,
            context=context,
            system=args.system,
            pin_context=not args.no_pin,
        )
    session.max_new_tokens = args.new_tokens
    saved_all = True  # a failed /save ends the command with status 2 (the conversation goes on)
    interactive = stdin.isatty()
    if interactive:
        print("kvfold chat: /save PATH, /load PATH, /stats, /quit", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            rest = rest.strip()
            if command in ("/quit", "/exit"):
                break
            if command == "/stats":
                print(json.dumps(session.stats()), file=stdout, flush=True)
            elif command == "/save" and rest:
                saved_all = _save_chat(session, rest, stdout) and saved_all
            elif command == "/load" and rest:
                session = load_chat(rest, model, tokenizer, cap=args.cap, **load_kwargs)
                session.max_new_tokens = args.new_tokens
                print(f"loaded {rest} ({session.stats()['turns']} turns)", file=stdout, flush=True)
            else:
                print(f"unknown command {line!r}: /save PATH, /load PATH, /stats, /quit", file=stdout, flush=True)
            continue
        print(session.ask(line), file=stdout, flush=True)
    return 0 if saved_all else 2


def _save_chat(session, path: str, stdout: TextIO) -> bool:
    """``/save PATH``: write the conversation; a file that cannot be written is one line on stderr
    (its path and what to do) and the conversation goes on. Whether it was saved."""
    from kvfold.runtime.files import OutputError
    from kvfold.store.chat import save_chat

    try:
        size = save_chat(session, path)
    except OutputError as err:
        print(f"kvfold chat: error: {err} (the conversation goes on: /save elsewhere)", file=sys.stderr, flush=True)
        return False
    print(f"saved {path} ({size} bytes)", file=stdout, flush=True)
    return True


def _refuse_with_cache(args: argparse.Namespace, *others: str | None) -> None:
    """``--method`` and ``--budget`` (and ``others`` given) do not apply to a saved cache: one error,
    the same for ``generate --cache`` and ``chat --cache``."""
    flags = (("--method", args.method), ("--budget", args.budget))
    flags += (("--memory", getattr(args, "memory", None)), ("--kv-bits", getattr(args, "kv_bits", None)))
    given = [flag for flag, value in flags if value is not None]
    given += [flag for flag in others if flag]
    if given:
        raise UserError(
            f"{' and '.join(given)} do not apply with --cache: the file was compressed already "
            "(its method and budget are in its header; see kvfold compress)"
        )


def _describe(spec: str) -> str:
    """The spec, marked when it is the recommended pipeline."""
    return f"{spec} (the recommended pipeline)" if spec == RECOMMENDED else spec


COMMANDS = {"compress": run_compress, "ask": run_ask, "chat": run_chat}
"""The subcommands of this module."""
