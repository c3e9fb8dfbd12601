"""Where a compression's time goes: cProfile's functions and torch.profiler's operators.

Usage::

    python benchmarks/profile_compress.py --length 4096 --method kvzip+am_fit [--budget 0.1]
        [--model smollm2-135m] [--device cpu] [--top 25] [--ops]

Prefills ``--length`` tokens of the bench's prose, then compresses once under cProfile (and, with
``--ops``, a second time under ``torch.profiler``) and prints the prefill and compression seconds,
the functions with the most cumulative time, and the method's own report (``ctx.report``: the repeat
pass, the fits). docs/benchmarks.md, "Profiling".
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from kvfold.evaluate.bench.process import context_ids
from kvfold.methods import build_method
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.budget import Budget
from kvfold.runtime.models import load_model
from kvfold.runtime.timing import device_clock


def _compress(source, method, budget: Budget) -> tuple[float, dict]:
    cache = source.cache.copy()
    ctx = source.compression_context(cache, budget, shared=source.shared)
    start = device_clock(source.model.device)
    with torch.inference_mode():
        method.apply(ctx)
    return device_clock(source.model.device) - start, ctx.report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--method", default="kvzip+am_fit")
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--ops", action="store_true", help="also profile the operators (torch.profiler)")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = context_ids(tokenizer, args.length, 1).to(model.device)
    method = build_method(args.method)
    budget = Budget.parse(float(args.budget) if "." in args.budget else int(args.budget))
    with torch.inference_mode():
        start = time.perf_counter()
        source = prefill_ids(model, tokenizer, ids, capture_window=64, methods=[method])
        prefill = time.perf_counter() - start
    profiler = cProfile.Profile()
    profiler.enable()
    seconds, report = _compress(source, method, budget)
    profiler.disable()
    threads = torch.get_num_threads()
    print(f"{args.method} at {args.budget}, {args.length} tokens ({threads} threads): prefill {prefill:.2f} s, "
          f"compression {seconds:.2f} s under cProfile ({seconds / prefill:.1f} prefills)")  # fmt: skip
    print(f"report: { {k: v for k, v in report.items() if not isinstance(v, (list, dict))} }")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    if args.ops:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _compress(source, method, budget)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
