"""The ``kvfold`` command line: ``methods``, ``generate``, ``demo`` (and the evaluation commands).

The arguments are parsed before anything heavy is imported: ``kvfold --help``, ``kvfold SUB --help``
and ``kvfold --version`` load no torch and answer in a fraction of a second; each handler imports
the model code it needs when it runs.

Errors: bad input (:class:`~kvfold.runtime.errors.UserError`, a file that is missing or cannot be
written) is one line and exit status 2; anything else is a fault of kvfold's own, reported in one
line as an internal error (exit 1) with the hint to rerun with ``--debug`` (or ``KVFOLD_DEBUG=1``),
which shows the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvfold.cli.args import (
    Handler,
    HelpFormatter,
    add_memory_args,
    add_model_args,
    add_new_tokens,
    add_quiet,
    compress_options,
    deprecated_alias,
    progress,
    read_context,
)
from kvfold.runtime.defaults import DEFAULT_BUDGET, RECOMMENDED
from kvfold.runtime.errors import UserError
from kvfold.runtime.files import explain
from kvfold.runtime.version import __version__

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
"""Modules that each expose ``add_parsers(sub)`` and ``COMMANDS``; optional (a missing one is skipped).
Importing them must not import torch (``tests/cli/test_main.py`` checks it)."""


def command(name: str) -> Callable[[Handler], Handler]:
    """Register one of this module's own subcommands under ``name``."""

    def decorate(fn: Handler) -> Handler:
        COMMANDS[name] = fn
        return fn

    return decorate


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors (an unknown option, a missing one) are one line, not the usage,
    and whose help shows every flag's default (:class:`~kvfold.cli.args.HelpFormatter`)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

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
    """The whole ``kvfold`` parser: this module's subcommands, then those of :data:`SUBCOMMAND_MODULES`
    (call :func:`_load_extra_commands` first), each with ``--quiet``."""
    parser = OneLineParser(
        prog="kvfold",
        description="Compress a language model's KV cache: keep a long context in a tenth of the memory "
        f"(default pipeline {RECOMMENDED}). Run 'kvfold SUB --help' for a command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"kvfold {__version__}")
    add_debug(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("methods", help="list the registered methods")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = sub.add_parser(
        "generate",
        help=f"compress a context and answer a question (default: {RECOMMENDED} at {DEFAULT_BUDGET})",
    )
    add_model_args(p)
    p.add_argument(
        "--method",
        default=None,
        help=f"method spec, e.g. snapkv, adakv:snapkv+grkv; 'full' keeps everything (default: {RECOMMENDED}; "
        "with --cache: the file's)",
    )
    p.add_argument(
        "--budget",
        default=None,
        help=f"fraction in (0, 1] of the context to keep, or a token count (default: {DEFAULT_BUDGET}; "
        "with --cache: the file's)",
    )
    add_memory_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="file with the context text")
    src.add_argument("--context", help="the context text")
    src.add_argument("--cache", type=Path, help="a cache file (kvfold compress --out): answer from it, no prefill")
    p.add_argument("--question", required=True, help="the question asked about the context")
    p.add_argument("--answer-prefix", default="", help="text the answer starts with (decoding continues it)")
    add_new_tokens(p, "the most tokens generated for the answer", default=64)
    deprecated_alias(p, "--max-new-tokens", "--new-tokens", type=int)
    p.add_argument("--query-aware", action="store_true", help="compress the question together with the context")
    p.add_argument("--seed", type=int, default=0, help="seed of the methods that draw at random")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    from kvfold.cli.saved_caches import add_cache_args

    add_cache_args(p)

    p = sub.add_parser("demo", help="compress a built-in long context with a few methods and answer questions")
    add_model_args(p)
    p.add_argument(
        "--budget", default=None, help=f"fraction of the context each method keeps (default: {DEFAULT_BUDGET})"
    )
    add_memory_args(p)
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated specs, or 'all' for every method (default: kvzip, leverage and the recommended "
        "pipeline, beside the full cache)",
    )
    p.add_argument("--length", type=int, default=3000, help="tokens of the built-in context")
    deprecated_alias(p, "--context-tokens", "--length", type=int)

    for register in EXTRA_PARSERS:
        register(sub)
    for subparser in sub.choices.values():
        if "--quiet" not in subparser._option_string_actions:
            add_quiet(subparser)
        add_debug(subparser, default=argparse.SUPPRESS)  # kvfold SUB --debug sets the global flag
    return parser


DEBUG_ENV = "KVFOLD_DEBUG"
"""Set to 1 (or true, yes, on) for what ``--debug`` does: the traceback of every error."""


def add_debug(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--debug``: show the traceback of an error instead of its one line (also ``KVFOLD_DEBUG=1``)."""
    parser.add_argument(
        "--debug",
        action="store_true",
        default=default,
        help=f"on an error, show its traceback instead of one line (also {DEBUG_ENV}=1)",
    )


def debugging(args: argparse.Namespace) -> bool:
    """Whether ``--debug`` was given, before or after the subcommand, or ``KVFOLD_DEBUG`` is set."""
    flag = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    return bool(getattr(args, "debug", False)) or flag


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
    """``kvfold generate``: prefill, compress (the recommended pipeline at a tenth unless told
    otherwise) and answer; with ``--cache``, answer from a saved cache."""
    if args.cache is not None:  # a saved cache: no prefill
        from kvfold.cli.saved_caches import run_generate_cached

        return run_generate_cached(args)
    from kvfold.methods import build_method
    from kvfold.methods.core.base import with_format
    from kvfold.pipeline.context import prefill
    from kvfold.runtime.budget import Budget

    options = compress_options(args, DEFAULT_BUDGET if args.budget is None and args.memory is None else args.budget)
    spec = with_format(RECOMMENDED if args.method is None else args.method, options.pop("kv_format"))
    method = build_method(spec)
    target = Budget.of_memory(options["memory"]) if "memory" in options else Budget.parse(options["budget"])
    if args.new_tokens < 1:
        raise UserError(f"--new-tokens must be ≥ 1; got {args.new_tokens}")
    context = read_context(args)
    from kvfold.runtime.models import load_model

    progress(args, f"loading {args.model}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    progress(args, "prefilling the context")
    prefilled = prefill(
        model,
        tokenizer,
        context,
        question=args.question if args.query_aware else None,
        query_aware=args.query_aware,
        answer_prefix=args.answer_prefix if args.query_aware else "",
        methods=[method],
    )
    what = f"memory {target}" if target.memory is not None else str(target)
    progress(args, f"compressing {prefilled.context_tokens} tokens with {describe_method(spec)} to {what}")
    compressed = prefilled.compress(method, target, seed=args.seed)
    budget = compressed.budget
    progress(args, "answering")
    if args.query_aware:
        answer = compressed.generate(max_new_tokens=args.new_tokens)[0]
    else:
        answer = compressed.generate(args.question, answer_prefix=args.answer_prefix, max_new_tokens=args.new_tokens)[0]
    record = {
        "answer": answer.text,
        "method": compressed.method.spec,
        "budget": budget.label(),
        "query_aware": args.query_aware,
        "context_tokens": prefilled.context_tokens,
        **compressed.memory_record(),
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
            f"[{describe_method(record['method'])} @ {budget}] context {record['context_tokens']} tokens, "
            f"KV {record['kv_bytes'] / 2**20:.2f} MB of {record['kv_bytes_full'] / 2**20:.2f} MB "
            f"({record['memory_ratio']:.4f} of the 16-bit cache), prefill {record['prefill_seconds']:.2f}s, "
            f"compress {record['compress_seconds']:.2f}s",
            file=sys.stderr,
        )
    return 0


def describe_method(spec: str) -> str:
    """``"kvzip+am_fit (the recommended pipeline)"`` for the recommended spec, else the spec: what a
    command says it compressed with."""
    return f"{spec} (the recommended pipeline)" if spec == RECOMMENDED else spec


@command("demo")
def run_demo(args: argparse.Namespace) -> int:
    from kvfold.cli.demo import run_demo as demo

    options = compress_options(args, DEFAULT_BUDGET if args.budget is None and args.memory is None else args.budget)
    return demo(
        args.model,
        options.get("budget"),
        args.methods,
        args.dtype,
        args.device,
        args.length,
        quiet=args.quiet,
        memory=options.get("memory"),
        kv_format=options.get("kv_format"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvfold`` command.

    A user error (:class:`~kvfold.runtime.errors.UserError`: bad input, a damaged cache file, a model
    that cannot be found; a missing file; a feature asked of a model or cache that lacks it, a
    :class:`NotImplementedError` that says so) prints one line and exits with 2. So do files that
    cannot be written (:class:`~kvfold.runtime.files.OutputError`: the path and what to do); Ctrl-C
    prints one line (a sweep: the count of finished answers kept) and exits with 130. Any other
    exception is kvfold's own fault, not the input's: one line that says so, with the hint to rerun
    with ``--debug``, and exit status 1. With ``--debug`` (or ``KVFOLD_DEBUG=1``) every error but
    Ctrl-C is raised with its traceback. The arguments are parsed before torch is imported.
    """
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False):
        _silence_progress_bars()
    debug = debugging(args)
    try:
        status = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below, not at exit
        return status
    except BrokenPipeError:  # the reader left (`kvfold methods | head`): stop quietly, as cat does
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command its pipe closed
    except KeyboardInterrupt as err:  # Ctrl-C: a sweep says what it kept (SweepInterrupted)
        print(f"kvfold {args.command}: {str(err) or 'interrupted'}", file=sys.stderr)
        return 130  # 128 + SIGINT
    except Exception as err:
        if debug:
            raise
        line, status = describe_error(err)
        print(f"kvfold {args.command}: {line}", file=sys.stderr)
        return status


def describe_error(err: Exception) -> tuple[str, int]:
    """The one line (after ``kvfold COMMAND: ``) and the exit status :func:`main` reports ``err`` with:
    2 for the user's input or a file, 1 for a fault of kvfold's own (an internal error)."""
    if isinstance(err, (UserError, FileNotFoundError)):  # ModelLoadError is a UserError
        return f"error: {err}", 2
    if isinstance(err, NotImplementedError) and str(err):  # a feature this model or cache lacks, said why
        return f"error: {err}", 2
    if isinstance(err, OSError):  # a file that cannot be written (or read): its path and what to do
        return f"error: {explain(err, verb=None)}", 2
    what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    first = what.splitlines()[0] if what.strip() else type(err).__name__
    return (
        f"internal error: {first} (a fault in kvfold, not in the input; rerun with --debug, or {DEBUG_ENV}=1, "
        "for the traceback and report it)",
        1,
    )


def _silence_progress_bars() -> None:
    """``--quiet``: no progress bars from transformers and the hub either (loading weights, downloads)."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when transformers is imported
    if "transformers" in sys.modules:  # already imported (a caller in this process): switch it off there
        from transformers.utils import logging

        logging.disable_progress_bar()


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
