"""The ``kvfold eval``, ``kvfold fidelity`` and ``kvfold report`` commands (loaded by :mod:`kvfold.cli.main`).

``eval`` and ``fidelity`` take the same selection flags::

    kvfold eval --dataset ruler --length 2048 --samples 3 --methods full,streamingllm \\
        --budgets 0.5,0.2 --out runs/ruler-2k
    kvfold fidelity --dataset ruler --length 1024 --samples 1 --methods full,streamingllm \\
        --budgets 0.5,0.2,0.1 --out runs/fid-1k

``kvfold eval --ray [ADDRESS]`` and ``kvfold fidelity --ray [ADDRESS]`` run the same sweep on Ray
workers (:mod:`kvfold.evaluate.running.distributed`).

``kvfold report`` prints the results of finished runs, several of one kind on the same samples
merged (:mod:`kvfold.evaluate.running.results`); ``--markdown`` prints the tables of ``report.md``
(retention with 95% intervals, scores, KV-cache size, score by task) and of ``fidelity.md``::

    kvfold report runs/ruler-2k runs/ruler-2k-kvzip runs/fid-1k --markdown > tables.md

Methods and budgets are checked before the model loads, so a typo fails at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfold.cli.args import (
    Handler,
    add_model_args,
    add_new_tokens,
    add_ray_args,
    deprecated_alias,
    ray_options,
    ray_where,
)
from kvfold.runtime.defaults import DEFAULT_LENGTH
from kvfold.runtime.errors import UserError

if TYPE_CHECKING:  # imported by the handlers when they run: ``kvfold eval --help`` loads no torch
    from kvfold.evaluate.data.samples import Sample
    from kvfold.evaluate.running.sweep import ItemRunner

DATASET_HELP = (
    "ruler[:TASKS] (synthetic, generated locally), PATH.jsonl (one {context, question, answers, ...} a line), "
    "longbench[:TASKS][@DIR_OR_REPO], xsum[@PATH_OR_REPO], ruler-official[:TASKS]@PATH_OR_REPO"
)

Runs = Callable[[Callable[["ItemRunner"], Any]], Any]
"""Where a sweep runs: ``runs(sweep.run)`` answers it and returns its result."""


def _add_selection_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--dataset", required=True, help=DATASET_HELP)
    parser.add_argument(
        "--length",
        type=int,
        default=DEFAULT_LENGTH,
        help="context length in tokens (RULER), prompt limit (LongBench, XSum)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per task: contexts per task for ruler (default 3); for a file or a published "
        "benchmark every sample runs unless this (or --limit) is given",
    )
    parser.add_argument("--limit", type=int, default=None, help="run at most this many samples in all")
    parser.add_argument("--tasks", default=None, help="comma-separated task names to keep")
    parser.add_argument("--methods", required=True, help="comma-separated method specs, e.g. full,streamingllm")
    parser.add_argument(
        "--budgets",
        default="0.5,0.2,0.1",
        help="comma-separated fractions in (0, 1] or token counts",
    )
    parser.add_argument(
        "--memory",
        default=None,
        help="comma-separated memory budgets in place of --budgets: fractions of the 16-bit full cache's "
        "bytes (e.g. 0.0625,0.03125); each method keeps as many tokens at as many bits as fit (a spec's "
        "@int4 / @16 fixes the precision)",
    )
    parser.add_argument(
        "--kv-bits",
        default=None,
        help="store every compressed method's entries in this format: 8, 4, 3, 2, fp8 or 16 (a spec's own "
        "@format wins; full stays the uncompressed reference)",
    )
    parser.add_argument("--seed", type=int, default=0, help="dataset and method seed")
    parser.add_argument(
        "--out", required=True, help="output directory (its results are kept: a run again resumes what is missing)"
    )
    parser.add_argument("--quiet", action="store_true", help="print no progress on stderr")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``eval``, ``fidelity`` and ``report`` sub-parsers to the ``kvfold`` parser."""
    p = sub.add_parser("eval", help="score methods × budgets on a dataset (resumable)")
    _add_selection_args(p)
    p.add_argument("--query-aware", action="store_true", help="compress each context together with its question")
    add_ray_args(p, "context")

    p = sub.add_parser("fidelity", help="attention-output error and NLL increase vs the full cache (resumable)")
    _add_selection_args(p)
    p.add_argument(
        "--continuation",
        choices=("answer", "next"),
        default="answer",
        help="answer: question + reference answer, teacher-forced; next: the document's last --new-tokens tokens",
    )
    add_new_tokens(p, "tokens held out at the end of the document and scored, with --continuation next", default=64)
    deprecated_alias(p, "--next-tokens", "--new-tokens", type=int)
    p.add_argument(
        "--online",
        action="store_true",
        help="run each method's decode-time policy while the continuation is teacher-forced (the cache "
        "held at its budget, as during generation); methods with no online path are reported, not run",
    )
    add_ray_args(p, "context")

    p = sub.add_parser(
        "report",
        help="print the results of finished eval, fidelity and bench runs (runs of one configuration merged)",
    )
    p.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="directories written by kvfold eval, fidelity or bench --out; runs on different datasets or lengths "
        "are reported apart",
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the Markdown tables of report.md (retention with 95%% intervals, average score and KV-cache "
        "size by budget, score by task) and of fidelity.md instead of one line per method and budget",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the merged eval runs' report.md and plots (retention against budget and against "
        "compression time, scores) into this directory (one subdirectory per configuration when there are several), "
        "and the bench directories' bench.md and plots",
    )


def _check_selection(args: argparse.Namespace) -> tuple[list[str], list[Any]]:
    """Validate methods, budgets and counts before anything slow happens."""
    from kvfold.methods import build_method, split_specs
    from kvfold.methods.core.base import apply_kv_bits
    from kvfold.runtime.budget import Budget

    methods = [apply_kv_bits(spec, getattr(args, "kv_bits", None)) for spec in split_specs(args.methods)]
    for spec in methods:
        build_method(spec)
    if getattr(args, "memory", None):
        budgets = [Budget.of_memory(m) for m in args.memory.split(",") if m.strip()]
    else:
        budgets = [Budget.parse(b) for b in args.budgets.split(",") if b.strip()]
    if not budgets:
        raise UserError("--budgets (or --memory) is empty; give e.g. 0.5,0.2")
    if args.samples is not None and args.samples < 1:
        raise UserError(f"--samples must be ≥ 1; got {args.samples}")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be ≥ 1; got {args.limit}")
    if args.length < 1:
        raise UserError(f"--length must be a positive number of tokens; got {args.length}")
    return methods, budgets


def _is_jsonl(spec: str) -> bool:
    return spec.lower().endswith(".jsonl")


def _check_dataset(spec: str) -> None:
    """Fail on a malformed JSONL file or an unknown dataset form before the model loads."""
    from kvfold.evaluate.data.jsonl import load_jsonl
    from kvfold.evaluate.data.loaders import load_dataset_spec

    if _is_jsonl(spec):
        if not Path(spec).is_file():
            raise UserError(f"dataset file not found: {spec}")
        load_jsonl(spec)
        return
    name = spec.partition("@")[0].partition(":")[0].strip().lower()
    if name not in ("ruler", "longbench", "xsum", "ruler-official"):
        load_dataset_spec(spec)  # raises the list of valid forms


def load_samples(args: argparse.Namespace, tokenizer: Any) -> list:
    """The samples the flags select: ``--tasks`` kept, ``--samples`` per task, at most ``--limit``.

    A file or a published benchmark runs whole unless ``--samples`` or ``--limit`` is given. For
    ``ruler`` ``--samples`` counts contexts: a context with several questions (the multi-query
    task) keeps all of them.
    """
    from kvfold.evaluate.data.loaders import load_dataset_spec

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    spec = args.dataset
    synthetic = spec.strip().lower() == "ruler"
    if tasks and synthetic:
        spec = "ruler:" + ",".join(tasks)  # generate only what is asked
    samples = load_dataset_spec(
        spec,
        tokenizer,
        length=args.length,
        samples=args.samples if synthetic or spec.lower().startswith("ruler:") else None,
        seed=args.seed,
    )
    if tasks:
        unknown = sorted(set(tasks) - {s.task for s in samples})
        if unknown:
            found = ", ".join(dict.fromkeys(s.task for s in samples))
            raise UserError(f"--tasks: no samples for {', '.join(unknown)}; this dataset has: {found}")
        samples = [s for s in samples if s.task in tasks]
    if args.samples is not None and not (synthetic or spec.lower().startswith("ruler:")):
        per_task: dict[str, int] = {}
        kept = []
        for sample in samples:
            per_task[sample.task] = per_task.get(sample.task, 0) + 1
            if per_task[sample.task] <= args.samples:
                kept.append(sample)
        samples = kept
    if args.limit is not None:
        samples = samples[: args.limit]
    return samples


def describe_samples(samples: list) -> str:
    """``"40 samples (34 contexts) in 8 tasks: niah_single_1 5, ..."`` for the log."""
    per_task: dict[str, int] = {}
    for sample in samples:
        per_task[sample.task] = per_task.get(sample.task, 0) + 1
    contexts = len({s.context for s in samples})
    listing = ", ".join(f"{task} {n}" for task, n in per_task.items())
    return f"{len(samples)} samples ({contexts} contexts) in {len(per_task)} tasks: {listing}"


def _run_config(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "dataset": args.dataset, "length": args.length, "seed": args.seed}


def _prepare(args: argparse.Namespace) -> tuple[list[str], list[Any], list[Sample], Runs]:
    """Check the flags, read the samples, and say where the sweep runs; fails before anything slow.

    Returns ``(methods, budgets, samples, runs)``: without ``--ray`` the model is loaded here and
    ``runs`` answers on it; with ``--ray`` this process reads the data only, and ``runs`` answers
    on Ray workers that each load the model (and logs their counts).
    """
    from kvfold.evaluate.running.distributed import ModelLoader, require_ray, run_on_ray
    from kvfold.evaluate.running.sweep import local_runner
    from kvfold.runtime import models

    methods, budgets = _check_selection(args)
    if args.ray is None:
        _check_dataset(args.dataset)
        model, tokenizer = models.load_model(args.model, dtype=args.dtype, device=args.device)
        return methods, budgets, load_samples(args, tokenizer), lambda drive: drive(local_runner(model, tokenizer))
    options = ray_options(args)
    require_ray()
    _check_dataset(args.dataset)
    samples = load_samples(args, models.load_tokenizer(args.model))
    loader = ModelLoader(args.model, dtype=args.dtype, device=args.device)

    def on_ray(drive: Callable[[ItemRunner], Any]) -> Any:
        result, runner = run_on_ray(loader, drive, **options)
        print(runner.summary(), file=sys.stderr)
        return result

    return methods, budgets, samples, on_ray


def _where(args: argparse.Namespace) -> str:
    """`` on a local Ray instance`` (or the cluster) with ``--ray``, else nothing: for the log."""
    return "" if args.ray is None else f" on {ray_where(args)}"


def run_eval(args: argparse.Namespace) -> int:
    """``kvfold eval``: write results.json, predictions.jsonl, report.md and plots to ``--out``."""
    from kvfold.evaluate.running.runner import EvalSweep

    methods, budgets, samples, runs = _prepare(args)
    print(f"{describe_samples(samples)}{_where(args)} → {args.out}", file=sys.stderr)
    sweep = EvalSweep(
        samples,
        methods,
        budgets,
        _run_config(args),
        query_aware=args.query_aware,
        seed=args.seed,
        out_dir=args.out,
        progress=not args.quiet,
    )
    _print_summary(runs(sweep.run).records)
    print(
        f"wrote {args.out}/results.json, predictions.jsonl, report.md, scores.png, scores_by_task.png", file=sys.stderr
    )
    return 0


def _print_summary(records: Sequence[Mapping[str, Any]]) -> None:
    """One line per (method, budget): the average and headline score, retention and KV-cache ratio."""
    from kvfold.evaluate.scoring.records import AVERAGE_TASK, HEADLINE_TASK

    for record in records:
        if record["task"] in (AVERAGE_TASK, HEADLINE_TASK):
            retention = record.get("retention")
            kept = f"  retention {100 * retention:5.1f}%" if retention is not None else ""
            print(
                f"{record['method']:<24} budget {record['budget']!s:<6} {record['task']:<8} "
                f"score {record['score']:6.1f}{kept}  "
                f"memory {record.get('memory_ratio', record['kv_ratio']):.4f} of 16-bit  (n={record['n']})"
            )


def run_fidelity(args: argparse.Namespace) -> int:
    """``kvfold fidelity``: write fidelity.json, fidelity.md and fidelity.png to ``--out``."""
    from kvfold.evaluate.running.fidelity import FidelitySweep

    methods, budgets, samples, runs = _prepare(args)
    mode = "online" if args.online else "offline"
    print(
        f"{describe_samples(samples)}, continuation '{args.continuation}', {mode}{_where(args)} → {args.out}",
        file=sys.stderr,
    )
    sweep = FidelitySweep(
        samples,
        methods,
        budgets,
        _run_config(args),
        continuation=args.continuation,
        next_tokens=args.new_tokens,
        online=args.online,
        seed=args.seed,
        out_dir=args.out,
        progress=not args.quiet,
    )
    _print_fidelity(runs(sweep.run).records)
    print(f"wrote {args.out}/fidelity.json, fidelity.md, fidelity.png", file=sys.stderr)
    return 0


def _print_fidelity(records: Sequence[Mapping[str, Any]]) -> None:
    """One line per (method, budget): the attention-output error, NLL increase and KL."""
    for record in records:
        if "rel_error" not in record:
            print(f"{record['method']:<24} budget {record['budget']!s:<6} no online path (not measured)")
            continue
        print(
            f"{record['method']:<24} budget {record['budget']!s:<6} rel_error {record['rel_error']:.4g}  "
            f"nll_delta {record['nll_delta']:+.4g}  kl {record['kl']:.4g}  (n={record['n']})"
        )


def run_report(args: argparse.Namespace) -> int:
    """``kvfold report FOLDER...``: the results of finished runs, those of one kind and configuration merged.

    Eval runs give the tables of ``report.md``, fidelity runs those of ``fidelity.md``, bench directories
    that of ``bench.md`` (in that order); without ``--markdown``, the lines ``kvfold eval``,
    ``kvfold fidelity`` and ``kvfold bench`` print. Runs of different configurations (another
    dataset, length, model) are reported apart, each under a heading that names it.
    """
    from kvfold.evaluate.bench.report import BENCH_FILE, read_bench_run
    from kvfold.evaluate.running.results import RUN_KINDS, group_runs, read_run

    benches = [path for path in args.runs if (path / BENCH_FILE).is_file()]
    runs = [read_run(path) for path in args.runs if path not in benches]
    sections: list[str] = []
    groups = group_runs(runs)
    for kind in RUN_KINDS:
        chosen = [group for group in groups if group[0].kind == kind]
        for index, group in enumerate(chosen):
            out = (
                None if args.out is None else (args.out if len(chosen) == 1 else args.out / f"{kind.name}-{index + 1}")
            )
            _report_group(args, group, out, len(chosen) > 1, sections)
    if benches:
        _report_benches(args, [read_bench_run(path) for path in benches], sections)
    print("\n".join(sections), end="")
    return 0


def _report_group(args: argparse.Namespace, group: list, out: Path | None, several: bool, sections: list[str]) -> None:
    """One group of runs of one kind and configuration: merged, printed (or its Markdown added to
    ``sections``), and with ``out`` an eval group's report written there."""
    from kvfold.evaluate.reporting import eval_markdown, fidelity_markdown, write_eval_report
    from kvfold.evaluate.running.results import describe_config, merge_runs

    kind = group[0].kind.name
    records, config = merge_runs(group)
    if out is not None and kind == "eval":
        out.mkdir(parents=True, exist_ok=True)
        written = write_eval_report(out, records, config)
        print(f"wrote {', '.join(path.name for path in written)} to {out}", file=sys.stderr)
    heading = f"{kind} runs on {describe_config(config)} ({', '.join(str(run.path) for run in group)})"
    if args.markdown:
        title = f"## {heading}\n\n" if several else ""
        sections.append(title + (eval_markdown if kind == "eval" else fidelity_markdown)(records, config))
    else:
        if several:
            print(f"# {heading}")
        (_print_summary if kind == "eval" else _print_fidelity)(records)


def _report_benches(args: argparse.Namespace, results: list[dict], sections: list[str]) -> None:
    """Bench directories: merged (one model), their table printed or added to ``sections``, and with
    ``--out`` their ``bench.md``, ``bench.json`` and plots written there."""
    from kvfold.evaluate.bench.report import bench_markdown, merge_bench_results, write_bench_report

    result = merge_bench_results(results)
    if args.out is not None:
        out = args.out / "bench" if (args.out / "results.json").exists() else args.out
        out.mkdir(parents=True, exist_ok=True)
        write_bench_report(result, out)
        print(f"wrote bench.json, bench.md, bench.png to {out}", file=sys.stderr)
    if args.markdown:
        sections.append(bench_markdown(result))
        return
    for r in result["records"]:
        print(
            f"{r['method']:<24} budget {r['budget']!s:<6} {r['length']:>6} tokens x {r['batch']}  "
            f"prefill {r['prefill_s']:.2f}s  compress {r['compress_s']:.2f}s  "
            f"decode {r['decode_tokens_per_s']:.1f} tok/s  "
            f"memory {r.get('memory_ratio', r['kv_bytes'] / r['kv_bytes_full']):.4f} of 16-bit  "
            f"peak RSS {r['peak_rss_mb']:.0f} MB"
        )


COMMANDS: dict[str, Handler] = {"eval": run_eval, "fidelity": run_fidelity, "report": run_report}
"""The subcommands of this module, gathered by :mod:`kvfold.cli.main`."""
