"""Argument helpers shared by the ``kvfold`` subcommands.

The command line (:mod:`kvfold.cli.main`) gathers the subcommands; a subcommand module exposes
``add_parsers(sub)`` and ``COMMANDS`` (name → handler) and takes what it shares with the others
from here, so no subcommand imports the command line itself.

Nothing here imports torch: ``kvfold --help`` and ``kvfold SUB --help`` build every parser and
answer before any model code is loaded. Handlers import what they need when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvfold.runtime.defaults import DEFAULT_BUDGET, DEFAULT_MODEL, RECOMMENDED
from kvfold.runtime.errors import UserError

Handler = Callable[[argparse.Namespace], int]
"""A subcommand: parsed arguments in, exit status out."""

ALIASES_REMOVED_IN = "0.4.0"
"""The version whose command line drops the deprecated flag names (kept for one version)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default after its help, except where there is nothing to show.

    No ``(default: None)`` (the help says what happens without the flag), no default for on/off
    switches, and none where the help already states it.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            any(action.default is value for value in (None, False, True, argparse.SUPPRESS))
            or action.default == ""
            or "%(default)" in text
            or "(default" in text
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--dtype`` and ``--device``, as every command that loads a model takes them."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model: smollm2-135m (embedded, 8,192 positions), a .gguf file, a local directory or a hub id",
    )
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")


def add_method_args(
    parser: argparse.ArgumentParser, *, required: bool = False, budget_default: str | None = str(DEFAULT_BUDGET)
) -> None:
    """``--method`` and ``--budget`` of a command that compresses one context (the recommended
    pipeline at a tenth of the context unless given; ``budget_default=None`` when ``--memory`` may
    take the budget's place, the tenth then applied by the command)."""
    parser.add_argument(
        "--method",
        default=RECOMMENDED,
        help="method spec, e.g. kvzip+am_fit, snapkv, adakv:snapkv+grkv; 'full' keeps everything",
    )
    parser.add_argument(
        "--budget",
        default=budget_default,
        help="what to keep: a fraction in (0, 1] of the context's tokens, or a token count"
        + ("" if budget_default is not None else f" (default: {DEFAULT_BUDGET}, unless --memory)"),
    )


def read_text_file(path: Path, what: str = "context file") -> str:
    """The UTF-8 text of a file the user named; a missing file, or one that is not UTF-8 text, is a
    one-line :class:`~kvfold.runtime.errors.UserError` that names it (``what``: how the message calls it)."""
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        where = f"{err.reason} at byte {err.start}"
        raise UserError(f"{what} {path} is not UTF-8 text ({where}); give a text file") from None


def read_document(path: Path, what: str = "context file") -> str:
    """:func:`read_text_file` for a document a command reads into a model: one of only white space is a
    one-line :class:`~kvfold.runtime.errors.UserError` too (a model given nothing would say nothing of it)."""
    text = read_text_file(path, what)
    if not text.strip():
        raise UserError(f"{what} {path} is empty; give a file with the text")
    return text


def read_context(args: argparse.Namespace) -> str:
    """The context a command compresses: ``--context``, or the text of ``--context-file``. An empty one is a
    one-line :class:`~kvfold.runtime.errors.UserError`, said before a model is loaded."""
    if args.context is None:
        return read_document(args.context_file)
    if not args.context.strip():
        raise UserError("the context is empty; give a text to compress")
    return args.context


def add_quiet(parser: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress lines or bars on stderr (errors and results still print)."""
    parser.add_argument("--quiet", action="store_true", help="print no progress on stderr")


def add_length(parser: argparse.ArgumentParser, help: str, *, default: Any = None, type: Any = int) -> None:
    """``--length``: context tokens, the one name every command uses for it."""
    parser.add_argument("--length", type=type, default=default, help=help)


def add_new_tokens(parser: argparse.ArgumentParser, help: str, *, default: int) -> None:
    """``--new-tokens``: tokens after the context (generated, decoded or scored), the one name for them."""
    parser.add_argument("--new-tokens", type=int, default=default, help=help)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, **kwargs: Any) -> None:
    """Accept ``old`` as a hidden name of ``new`` for one more version, with a note on stderr.

    ``kwargs`` are those of ``new`` that change how the value is read (``type``, ``choices``).
    """
    dest = new.lstrip("-").replace("-", "_")
    parser.add_argument(
        old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, action=_Deprecated, new=new, **kwargs
    )


class _Deprecated(argparse.Action):
    """Stores the value under the new name's ``dest`` and says once that the old name is going."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str, **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"{parser.prog}: note: {option_string} is deprecated; use {self.new} "
            f"(the old name goes in kvfold {ALIASES_REMOVED_IN})",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def progress(args: argparse.Namespace, message: str) -> None:
    """One progress line on stderr, ``kvfold COMMAND: message``, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(f"kvfold {args.command}: {message}", file=sys.stderr, flush=True)


def add_memory_args(parser: argparse.ArgumentParser) -> None:
    """``--memory`` (in place of ``--budget``) and ``--kv-bits``, as the commands that compress one
    context take them."""
    parser.add_argument(
        "--memory",
        type=float,
        default=None,
        help="in place of --budget: the fraction of the 16-bit full cache's bytes the compressed cache may "
        "hold (e.g. 0.0625); kvfold chooses how many tokens to keep at how many bits",
    )
    parser.add_argument(
        "--kv-bits",
        default=None,
        help="store the compressed entries as 8, 4, 3 or 2-bit integers, fp8, or 16 (the model's dtype); "
        "default: the model's dtype, or the memory rule's choice with --memory",
    )


def compress_options(args: argparse.Namespace, budget: Any) -> dict[str, Any]:
    """The keywords of :meth:`PrefilledContext.compress` for ``--budget`` / ``--memory`` / ``--kv-bits``.

    Raises:
        ValueError: both a budget and ``--memory``, or neither.
    """
    memory = getattr(args, "memory", None)
    if memory is not None and budget is not None:
        raise UserError("give --budget or --memory, not both")
    if memory is None and budget is None:
        raise UserError("give --budget (a fraction or a token count) or --memory (a fraction of the 16-bit cache)")
    if memory is not None:
        return {"memory": memory, "kv_format": getattr(args, "kv_bits", None)}
    return {"budget": budget, "kv_format": getattr(args, "kv_bits", None)}


def add_ray_args(parser: argparse.ArgumentParser, unit: str = "work item") -> None:
    """``--ray [ADDRESS]`` and the worker shape, as ``eval``, ``fidelity`` and ``bench`` take them
    (see :mod:`kvfold.evaluate.running.distributed`); ``unit`` names what one worker takes at a time."""
    group = parser.add_argument_group("Ray (pip install 'kvfold[ray]')")
    group.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run the sweep on Ray workers that each load the model once: alone, a local Ray instance with "
        "one worker per core; with HOST:PORT (or auto), a running cluster (ray start --head)",
    )
    group.add_argument(
        "--ray-workers",
        type=int,
        default=None,
        help=f"Ray workers to start (default: as many as the CPUs allow, at most one per {unit})",
    )
    group.add_argument("--ray-worker-cpus", type=float, default=1, help="CPUs (torch threads) per worker")
    group.add_argument("--ray-worker-gpus", type=float, default=0, help="GPUs per worker")


def ray_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`kvfold.evaluate.running.distributed.run_on_ray` the flags give.

    Raises:
        ValueError: a worker count or shape out of range.
    """
    if args.ray_workers is not None and args.ray_workers < 1:
        raise UserError(f"--ray-workers must be ≥ 1; got {args.ray_workers}")
    if args.ray_worker_cpus <= 0 or args.ray_worker_gpus < 0:
        raise UserError("--ray-worker-cpus must be > 0 and --ray-worker-gpus ≥ 0")
    return {
        "address": None if args.ray == "local" else args.ray,
        "workers": args.ray_workers,
        "cpus_per_worker": args.ray_worker_cpus,
        "gpus_per_worker": args.ray_worker_gpus,
    }


def ray_where(args: argparse.Namespace) -> str:
    """``"a local Ray instance"`` or ``"the Ray cluster at ADDRESS"``, for the log."""
    return "a local Ray instance" if args.ray == "local" else f"the Ray cluster at {args.ray}"
