"""``kvfold head-schedule``: a head-budget schedule for one model (loaded by :mod:`kvfold.cli.main`).

Attention Matching's nonuniform head budgets (Zweiger et al. 2026, §3.4, Appendix E): every KV
head's sensitivity to compaction is measured on calibration texts, Algorithm 4 turns the curves
into per-head shares, and the JSON file is read by ``am_*[schedule=F]`` and ``kvzip[schedule=F]``::

    kvfold head-schedule --out schedules/smollm2.json                       # 4 texts of shipped prose
    kvfold head-schedule --method "kvzip[layerwise=true]+am_fit" --texts 8 --length 2048 --out s.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfold.cli.args import Handler, add_model_args, add_new_tokens, deprecated_alias, progress, read_document
from kvfold.runtime.defaults import DEFAULT_LENGTH
from kvfold.runtime.errors import UserError

DEFAULT_METHOD = "am_highest_fast"
"""The compaction whose per-head sensitivity is measured (the paper's)."""
DEFAULT_RATIOS = (0.0125, 0.025, 0.05, 0.1, 0.2, 0.4)
"""The compaction ratios of the sensitivity curves (those of
:data:`kvfold.methods.compaction.attention_matching.schedule.DEFAULT_RATIOS`, written here so that
``--help`` imports no torch; a test checks they agree)."""


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``head-schedule`` sub-parser to the ``kvfold`` parser."""
    p = sub.add_parser("head-schedule", help="per-head budget shares for one model (Attention Matching §3.4)")
    add_model_args(p)
    p.add_argument("--out", type=Path, required=True, help="the schedule's JSON file (one file)")
    p.add_argument("--method", default=DEFAULT_METHOD, help="the compaction measured at each ratio, uniform over heads")
    p.add_argument(
        "--text-file",
        type=Path,
        action="append",
        help="a calibration text (repeat the option for more); default: --texts pieces of the shipped English prose",
    )
    p.add_argument("--texts", type=int, default=4, help="pieces of the shipped prose")
    p.add_argument("--length", type=int, default=DEFAULT_LENGTH, help="tokens of each piece of prose")
    p.add_argument(
        "--ratios",
        default=",".join(str(r) for r in DEFAULT_RATIOS),
        help="comma-separated compaction ratios of the sensitivity curves",
    )
    p.add_argument("--r0", type=float, default=0.05, help="the reference ratio of Algorithm 4")
    add_new_tokens(p, "tokens at the end of each text scored (the held-out continuation)", default=32)
    deprecated_alias(p, "--continuation", "--new-tokens", type=int)
    p.add_argument("--seed", type=int, default=0, help="seed of the methods that draw at random")


def prose_pieces(tokenizer, count: int, length: int) -> list[str]:
    """``count`` consecutive pieces of ``length`` tokens of the shipped English prose (wrapping round)."""
    from kvfold.evaluate.bench.process import context_ids

    ids = context_ids(tokenizer, count * length, 1)[0].tolist()  # the bench's prose, wrapped round
    return [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(count)]


def _ratios(text: str) -> list[float]:
    try:
        ratios = sorted(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise UserError(f"--ratios takes comma-separated numbers in (0, 1]; got {text!r}") from None
    if not ratios or not all(0 < r <= 1 for r in ratios):
        raise UserError(f"--ratios takes comma-separated numbers in (0, 1]; got {text!r}")
    return ratios


def run_head_schedule(args: argparse.Namespace) -> int:
    """``kvfold head-schedule``: measure, run Algorithm 4, write the JSON (atomically)."""
    from kvfold.methods import build_method
    from kvfold.methods.compaction.attention_matching.schedule import build_head_schedule
    from kvfold.runtime import models

    build_method(args.method)
    ratios = _ratios(args.ratios)
    if not 0 < args.r0 <= 1:
        raise UserError(f"--r0 must be in (0, 1]; got {args.r0}")
    if args.texts < 1 or args.length < 64 or args.new_tokens < 1:
        raise UserError("--texts must be ≥ 1, --length ≥ 64 and --new-tokens ≥ 1")
    documents = [read_document(path, "text file") for path in args.text_file or []]
    if args.out.is_dir():
        raise UserError(f"--out names a file for the schedule's JSON; {args.out} is a directory")
    model, tokenizer = models.load_model(args.model, dtype=args.dtype, device=args.device)
    texts = documents or prose_pieces(tokenizer, args.texts, args.length)
    schedule = build_head_schedule(
        model,
        tokenizer,
        texts,
        args.out,
        method=args.method,
        ratios=ratios,
        r0=args.r0,
        continuation_tokens=args.new_tokens,
        seed=args.seed,
        progress=lambda line: progress(args, line),
    )
    shares = [share for row in schedule.shares for share in row]
    print(
        f"wrote {args.out}: {len(shares)} heads, shares {min(shares):.4f} to {max(shares):.4f} "
        f"(uniform {1 / len(shares):.4f}); use it as kvzip[schedule={args.out}] or am_highest[schedule={args.out}]"
    )
    return 0


COMMANDS: dict[str, Handler] = {"head-schedule": run_head_schedule}
"""The subcommands of this module, gathered by :mod:`kvfold.cli.main`."""
