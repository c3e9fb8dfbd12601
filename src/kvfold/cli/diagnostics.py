"""The diagnostic commands: ``kvfold mergemap`` and ``kvfold merged-entries`` (loaded by :mod:`kvfold.cli.main`).

What a merge did to the cache (:mod:`kvfold.evaluate.diagnostics`)::

    kvfold mergemap --context-file notes.txt --methods snapkv,snapkv+cam,snapkv+grkv --budget 0.1 --out runs/mm
    kvfold merged-entries --task niah_single_2 --index 0 --budget 0.05 --base kvzip \\
        --methods kvzip+cam,kvzip+d2o_merge,kvzip+keepkv

``mergemap`` writes which retained entry absorbed which evicted token, and how concentrated the load
is (``mergemap.json``, ``mergemap.md``, ``mergemap.png``, ``carrier_load.png``); ``merged-entries``
prints how much each folder changed the entries its selection kept, by where they sit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvfold.cli.args import Handler, add_model_args, progress, read_document
from kvfold.runtime.defaults import DEFAULT_LENGTH
from kvfold.runtime.errors import UserError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``mergemap`` and ``merged-entries`` sub-parsers to the ``kvfold`` parser."""
    p = sub.add_parser("mergemap", help="which retained entry absorbed which evicted token, and carrier load")
    add_model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--context-file", type=Path, help="file with the context text")
    src.add_argument("--dataset", help="ruler[:TASKS] (synthetic), PATH.jsonl, …: the contexts of its first samples")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH, help="context length in tokens for --dataset ruler")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="samples per task of --dataset; measures are averaged over their contexts",
    )
    p.add_argument("--methods", required=True, help="comma-separated specs, e.g. snapkv,snapkv+cam,snapkv+grkv")
    p.add_argument("--budget", default="0.1", help="fraction in (0, 1] or token count")
    p.add_argument("--layer", type=int, default=None, help="layer drawn (default: the middle one)")
    p.add_argument("--head", type=int, default=0, help="KV head drawn")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the methods that draw at random")
    p.add_argument("--out", required=True, help="output directory (mergemap.json, mergemap.md and plots)")

    p = sub.add_parser(
        "merged-entries", help="how much each folder changes the entries its selection kept, by where they sit"
    )
    add_model_args(p)
    p.add_argument("--task", required=True, help="a synthetic RULER task, e.g. niah_single_2 (docs/evaluation.md)")
    p.add_argument("--index", type=int, default=0, help="the task's sample")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH, help="the sample's length in tokens")
    p.add_argument("--budget", type=float, default=0.05, help="fraction in (0, 1] of the context kept")
    p.add_argument("--base", required=True, help="the plain selection, e.g. kvzip")
    p.add_argument("--methods", required=True, help="comma-separated folders on it, e.g. kvzip+cam,kvzip+keepkv")


def _checked_specs(text: str) -> list[str]:
    """The comma-separated method specs, each built once so that a typo fails before the model loads."""
    from kvfold.methods import build_method, split_specs

    specs = split_specs(text)
    for spec in specs:
        build_method(spec)
    return specs


def run_mergemap(args: argparse.Namespace) -> int:
    """``kvfold mergemap``: write mergemap.json, mergemap.md, mergemap.png and carrier_load.png."""
    from kvfold.evaluate.data.loaders import load_dataset_spec
    from kvfold.evaluate.diagnostics.mergemap import merge_maps
    from kvfold.evaluate.diagnostics.mergemap_report import short_number
    from kvfold.pipeline.context import prefill
    from kvfold.runtime import models
    from kvfold.runtime.budget import Budget

    methods = _checked_specs(args.methods)
    budget = Budget.parse(args.budget)
    if args.samples < 1:
        raise UserError(f"--samples must be ≥ 1; got {args.samples}")
    document = read_document(args.context_file) if args.context_file is not None else None
    progress(args, f"loading {args.model}")
    model, tokenizer = models.load_model(args.model, dtype=args.dtype, device=args.device)
    if document is not None:
        texts = [(document, None)]
        source = str(args.context_file)
    else:
        samples = load_dataset_spec(args.dataset, tokenizer, length=args.length, samples=args.samples, seed=args.seed)
        unique = list({s.context: s for s in samples}.values())  # one per context
        if not unique:
            raise UserError(f"--dataset {args.dataset}: no samples")
        texts = [(s.context, None if s.chat_template else False) for s in unique]
        source = f"{args.dataset} @ {args.length}"
    contexts = [
        prefill(model, tokenizer, text, use_chat_template=template, methods=methods) for text, template in texts
    ]
    config = {
        "model": args.model,
        "context": source,
        "contexts": len(contexts),
        "context_tokens": [c.context_tokens for c in contexts],
        "seed": args.seed,
    }
    result = merge_maps(
        contexts, methods, budget, layer=args.layer, head=args.head, seed=args.seed, out_dir=args.out, run_config=config
    )
    for r in result.records:
        s = r["summary"]
        print(
            f"{r['method']:<28} merged {short_number(s.get('merged_fraction'))}  "
            f"top10% {short_number(s.get('top10_share'))}  gini {short_number(s.get('gini'))}  "
            f"boundary {short_number(s.get('boundary_share'))}  dv-gini {short_number(s.get('dv_gini'))}"
        )
    print(f"wrote {args.out}/mergemap.json, mergemap.md, mergemap.png, carrier_load.png", file=sys.stderr)
    return 0


def run_merged_entries(args: argparse.Namespace) -> int:
    """``kvfold merged-entries``: per folder, the change of the kept entries by group, and the answers."""
    from kvfold.evaluate.data.ruler import RULER_TASKS
    from kvfold.evaluate.diagnostics.merged_entries import merged_entries
    from kvfold.runtime import models
    from kvfold.runtime.budget import Budget

    if args.task not in RULER_TASKS:
        raise UserError(f"--task {args.task!r} is no RULER task; valid tasks: {', '.join(RULER_TASKS)}")
    if args.index < 0:
        raise UserError(f"--index must be ≥ 0; got {args.index}")
    Budget.parse(args.budget)
    base, folded = _checked_specs(args.base), _checked_specs(args.methods)
    if len(base) != 1:
        raise UserError(f"--base takes one method spec; got {args.base!r}")
    progress(args, f"loading {args.model}")
    model, tokenizer = models.load_model(args.model, dtype=args.dtype, device=args.device)
    lines = merged_entries(model, tokenizer, args.task, args.index, args.budget, base[0], folded, length=args.length)
    for line in lines:
        print(line, flush=True)
    return 0


COMMANDS: dict[str, Handler] = {"mergemap": run_mergemap, "merged-entries": run_merged_entries}
"""The subcommands of this module, gathered by :mod:`kvfold.cli.main`."""
