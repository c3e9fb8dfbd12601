"""The ``kvfold`` command line: ``methods``, ``generate``, ``demo`` (and the evaluation commands)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvfold.cli.args import Handler, add_model_args
from kvfold.methods.core.spec import SpecError
from kvfold.runtime.files import explain
from kvfold.runtime.models import ModelLoadError

COMMANDS: dict[str, Handler] = {}
"""Every subcommand by name: this module's own, then those of :data:`SUBCOMMAND_MODULES`."""

EXTRA_PARSERS: list[Callable[[argparse._SubParsersAction], None]] = []
"""The ``add_parsers`` of the subcommand modules, gathered by :func:`_load_extra_commands`."""

SUBCOMMAND_MODULES = (
    "kvfold.cli.evaluate",
    "kvfold.cli.bench",
    "kvfold.cli.diagnostics",
    "kvfold.cli.saved_caches",
    "kvfold.cli.schedule",
    "kvfold.cli.serve",
)
"""Modules that each expose ``add_parsers(sub)`` and ``COMMANDS``; optional (a missing one is skipped)."""


def command(name: str) -> Callable[[Handler], Handler]:
    """Register one of this module's own subcommands under ``name``."""

    def decorate(fn: Handler) -> Handler:
        COMMANDS[name] = fn
        return fn

    return decorate


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown option, a missing one) are one line, not the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        """As argparse's, with arguments no one takes named by the subcommand they were given to."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="kvfold", description="KV-cache merging and compaction for HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the registered methods")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser("generate", help="compress a context and answer a question")
    add_model_args(p)
    p.add_argument("--method", default="full", help="method spec, e.g. snapkv, adakv:snapkv+grkv, zsmerge[residual=0]")
    p.add_argument("--budget", default="1.0", help="fraction in (0, 1] of the context to keep, or a token count")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="file with the context text")
    src.add_argument("--context", help="the context text")
    src.add_argument("--cache", type=Path, help="a cache file (kvfold compress --out): answer from it, no prefill")
    p.add_argument("--question", required=True)
    p.add_argument("--answer-prefix", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--query-aware", action="store_true", help="compress the question together with the context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from kvfold.cli.saved_caches import add_cache_args

    add_cache_args(p)

    p = sub.add_parser("demo", help="compress a built-in long context with a few methods and answer questions")
    add_model_args(p)
    p.add_argument("--budget", default="0.1")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated specs, or 'all' for every method (default: kvzip, leverage and the recommended "
        "pipeline, beside the full cache)",
    )
    p.add_argument("--context-tokens", type=int, default=3000, help="length of the built-in context")

    for register in EXTRA_PARSERS:
        register(sub)
    return parser


@command("methods")
def run_methods(args: argparse.Namespace) -> int:
    from kvfold.methods import available_methods

    rows = [
        {
            "name": c.name,
            "role": c.role,
            "description": c.description,
            "paper": c.paper,
            "options": c.option_names(),
        }
        for c in available_methods()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        opts = f" [{', '.join(r['options'])}]" if r["options"] else ""
        print(f"{r['name']:<{width}}  {r['role']:<10}  {r['description']}{opts}")
        print(f"{'':<{width}}  {'':<10}  {r['paper']}")
    return 0


@command("generate")
def run_generate(args: argparse.Namespace) -> int:
    from kvfold.methods import build_method
    from kvfold.pipeline.context import prefill
    from kvfold.runtime.budget import Budget
    from kvfold.runtime.models import load_model

    if args.cache is not None:  # a saved cache: no prefill
        from kvfold.cli.saved_caches import run_generate_cached

        return run_generate_cached(args)
    method = build_method(args.method)
    budget = Budget.parse(args.budget)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be ≥ 1; got {args.max_new_tokens}")
    context = args.context if args.context is not None else _read_text(args.context_file)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    prefilled = prefill(
        model,
        tokenizer,
        context,
        question=args.question if args.query_aware else None,
        query_aware=args.query_aware,
        answer_prefix=args.answer_prefix if args.query_aware else "",
    )
    compressed = prefilled.compress(method, budget, seed=args.seed)
    if args.query_aware:
        answer = compressed.generate(max_new_tokens=args.max_new_tokens)[0]
    else:
        answer = compressed.generate(
            args.question, answer_prefix=args.answer_prefix, max_new_tokens=args.max_new_tokens
        )[0]
    record = {
        "answer": answer.text,
        "method": args.method,
        "budget": budget.label(),
        "query_aware": args.query_aware,
        "context_tokens": prefilled.context_tokens,
        "kv_bytes": compressed.kv_bytes,
        "kv_bytes_full": compressed.kv_bytes_full,
        "kv_ratio": compressed.kv_bytes / compressed.kv_bytes_full,
        "prefill_seconds": prefilled.prefill_seconds,
        "compress_seconds": compressed.compress_seconds,
        "decode_seconds": answer.decode_seconds,
        "new_tokens": answer.new_tokens,
        "model": args.model,
    }
    if compressed.report:
        record["report"] = compressed.report
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(answer.text)
        print(
            f"[{args.method} @ {budget}] context {record['context_tokens']} tokens, "
            f"KV {record['kv_bytes'] / 2**20:.2f} MB "
            f"of {record['kv_bytes_full'] / 2**20:.2f} MB, prefill {record['prefill_seconds']:.2f}s, "
            f"compress {record['compress_seconds']:.2f}s",
            file=sys.stderr,
        )
    return 0


@command("demo")
def run_demo(args: argparse.Namespace) -> int:
    from kvfold.cli.demo import run_demo as demo

    return demo(args.model, args.budget, args.methods, args.dtype, args.device, args.context_tokens)


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ValueError(f"context file not found: {path}")
    return path.read_text(encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfold`` command; user errors print one line and exit with 2.

    So do files that cannot be written (:class:`~kvfold.runtime.files.OutputError`: the path and
    what to do); Ctrl-C prints one line (a sweep: the count of finished answers kept) and exits
    with 130. No traceback for any of them.
    """
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return status
    except (ValueError, SpecError, ModelLoadError, FileNotFoundError, NotImplementedError) as err:
        print(f"kvfold {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`kvfold methods | head`): stop quietly, as cat does
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command its pipe closed
    except OSError as err:  # a file that cannot be written (or read): its path and what to do
        print(f"kvfold {args.command}: error: {explain(err, verb=None)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C: a sweep says what it kept (SweepInterrupted)
        print(f"kvfold {args.command}: {str(err) or 'interrupted'}", file=sys.stderr)
        return 130  # 128 + SIGINT


def _silence_stdout() -> None:
    """Point stdout at the null device, so that the flush at exit does not fail on the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _load_extra_commands() -> None:
    """Gather the subcommands that live in their own modules: their parsers and their handlers."""
    import importlib

    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue
        if module.add_parsers not in EXTRA_PARSERS:
            EXTRA_PARSERS.append(module.add_parsers)
        COMMANDS.update(module.COMMANDS)


if __name__ == "__main__":
    raise SystemExit(main())
