"""Command line of the benchmarks: ``kvfold bench`` and ``kvfold bench --cachefile``.

* ``kvfold bench --out DIR [--methods M --budgets B --length L --batch N]`` — prefill, compression
  and decode speed and memory against ``full`` (by default the recommended pipeline at a tenth, at
  2,048 tokens, batch 1) (:mod:`kvfold.evaluate.bench.speed`), serially or
  on Ray workers (``--ray``).
* ``kvfold bench --cachefile ...`` — what a saved cache buys, and what a long chat holds
  (:mod:`kvfold.evaluate.bench.saved_caches`).

The module exposes ``add_parsers(sub)`` and ``COMMANDS`` (name → handler), which the command line
gathers; the measuring itself lives in :mod:`kvfold.evaluate.bench`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfold.cli.args import (
    add_model_args,
    add_new_tokens,
    add_ray_args,
    deprecated_alias,
    progress,
    ray_options,
    ray_where,
)
from kvfold.runtime.defaults import DEFAULT_BUDGET, DEFAULT_LENGTH, RECOMMENDED
from kvfold.runtime.errors import UserError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The ``kvfold bench`` sub-parser (gathered by :mod:`kvfold.cli.main`)."""
    p = sub.add_parser("bench", help="measure prefill/compression/decode speed and memory against full")
    add_model_args(p)
    p.add_argument(
        "--methods",
        default=RECOMMENDED,
        help="comma-separated method specs (full is always measured beside them); stock and stock-static measure "
        "stock transformers (DynamicCache with SDPA; StaticCache, the forward compiled) beside kvfold's full cache",
    )
    p.add_argument("--budgets", default=str(DEFAULT_BUDGET), help="comma-separated budgets")
    p.add_argument(
        "--memory",
        default=None,
        help="comma-separated memory budgets in place of --budgets: fractions of the 16-bit full cache's "
        "bytes (e.g. 0.0625), spent on tokens x bits (a spec's @int4 / @16 fixes the precision)",
    )
    p.add_argument(
        "--length",
        default=str(DEFAULT_LENGTH),
        help="context length in tokens; comma-separated for a sweep, e.g. 2048,4096,8192",
    )
    deprecated_alias(p, "--lengths", "--length")
    p.add_argument("--batch", default="1", help="batch size; comma-separated for a sweep, e.g. 1,4")
    add_new_tokens(p, "decode steps measured after warm-up", default=64)
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prefill in chunks of this many tokens, compressing as it goes (default: one prefill)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="output directory (bench.json, bench.md, plots; a run again on it measures only what is missing)",
    )
    p.add_argument(
        "--positions",
        type=int,
        default=None,
        help="raise the model's positions to N for lengths past its window (RoPE models; cost only: "
        "the answers mean nothing there; default: the model's own)",
    )
    p.add_argument(
        "--compiled",
        action="store_true",
        help="decode kvfold's caches through torch.compile over fixed tails (CUDA graphs on a GPU; the first "
        "steps compile, untimed); methods that compress while decoding are refused",
    )
    p.add_argument(
        "--cachefile",
        action="store_true",
        help="cache files and chat memory (kvfold.evaluate.bench.saved_caches)",
    )
    p.add_argument("--turns", type=int, default=50, help="with --cachefile: turns of the measured chat (0: none)")
    p.add_argument("--chat-budget", type=int, default=256, help="with --cachefile: entries the chat keeps")
    add_ray_args(p, "length and batch")


def _grid(args: argparse.Namespace) -> tuple[list[str], list[str], list[int]]:
    """The method specs (each built once: unknown methods or options fail here), budget labels and
    lengths of the sweep."""
    from kvfold.evaluate.bench.records import STOCK
    from kvfold.methods import build_method, split_specs
    from kvfold.runtime.budget import Budget

    methods = split_specs(args.methods)
    for spec in methods:
        if spec not in STOCK:
            build_method(spec)  # fail fast on unknown methods or options
    if getattr(args, "memory", None):
        budgets = [Budget.of_memory(m).label() for m in args.memory.split(",") if m.strip()]
    else:
        budgets = [Budget.parse(b).label() for b in args.budgets.split(",")]
    return methods, budgets, _positive_ints(args.length, "--length")


def run_bench_command(args: argparse.Namespace) -> int:
    """``kvfold bench``: measure the sweep (serially, or on Ray with ``--ray``), print ``bench.md``."""
    from kvfold.evaluate.bench.speed import bench

    if args.cachefile:
        if args.ray is not None:
            raise UserError("--ray does not apply to --cachefile")
        return run_cachefile_command(args)

    methods, budgets, lengths = _grid(args)
    batches = _positive_ints(args.batch, "--batch")
    if args.new_tokens < 1:
        raise UserError("--new-tokens must be ≥ 1")
    grid = (args.model, methods, budgets, lengths, batches, args.new_tokens, args.prefill_chunk, args.out)
    if args.ray is None:
        progress(
            args,
            f"{', '.join(methods)} at {', '.join(map(str, budgets))} against full, "
            f"{', '.join(map(str, lengths))} tokens, batch {', '.join(map(str, batches))} → {args.out}",
        )
        result = bench(
            *grid,
            args.dtype,
            args.device,
            progress=not args.quiet,
            positions=args.positions,
            memory=bool(args.memory),
            compiled=args.compiled,
        )
    else:
        from kvfold.evaluate.running.distributed import require_ray, run_on_ray

        options = ray_options(args)
        require_ray()
        threads = max(1, int(args.ray_worker_cpus))
        print(f"kvfold bench on {ray_where(args)}, {threads} threads a measurement → {args.out}", file=sys.stderr)
        result, ray_runner = run_on_ray(
            None,
            lambda runner: bench(
                *grid,
                args.dtype,
                args.device,
                progress=not args.quiet,
                runner=runner,
                threads=threads,
                positions=args.positions,
                memory=bool(args.memory),
                compiled=args.compiled,
            ),
            **options,
        )
        print(ray_runner.summary(), file=sys.stderr)
    print((Path(args.out) / "bench.md").read_text())
    return 0 if result["records"] else 1


def run_cachefile_command(args: argparse.Namespace) -> int:
    """``kvfold bench --cachefile``: the bench command's arguments, the cache-file measurements."""
    from kvfold.evaluate.bench.saved_caches import bench_cachefile, report

    methods, budgets, lengths = _grid(args)
    if args.turns < 0:
        raise UserError("--turns must be ≥ 0")
    result = bench_cachefile(
        args.model,
        methods,
        budgets,
        lengths,
        args.out,
        new_tokens=args.new_tokens,
        turns=args.turns,
        chat_budget=args.chat_budget,
        dtype=args.dtype,
        device=args.device,
    )
    print(report(result))
    return 0


def _positive_ints(text: str, flag: str) -> list[int]:
    """``"1,4"`` → ``[1, 4]``; anything but comma-separated positive integers is refused naming ``flag``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} takes comma-separated positive integers; got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} takes comma-separated positive integers; got {text!r}")
    return values


COMMANDS = {"bench": run_bench_command}
"""The subcommand of this module, gathered by :mod:`kvfold.cli.main`."""
