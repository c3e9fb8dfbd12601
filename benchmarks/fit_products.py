"""Attention Matching's fit of one layer's problems: 16-bit queries and keys with float32 sums against float32.

Usage::

    python benchmarks/fit_products.py [--device cuda] [--problems 8,128] [--entries 2048] [--queries 8192]
        [--kept 205] [--head-dim 128] [--dtype bfloat16] [--reps 3] [--out FILE.jsonl]

Times :func:`kvfold.methods.compaction.attention_matching.solve.fit_problems` on random problems of one
layer's shape with the kept keys given (as ``kvzip+am_fit`` fits them): ``--problems`` problems (a layer's
KV heads × its repeat chunks: 8 at one chunk, 128 for the 16 chunks of 32K tokens of Llama-3.1-8B's
shape), each of ``--entries`` entries, ``--queries`` reference queries (4 query heads × a chunk's 2,048
repeat tokens) and ``--kept`` kept keys, in the block sizes the device takes. Each size is fitted twice in
one process, alternating: with the queries and keys converted to float32 (``exact_products.FORCED =
False``) and as 16-bit operands with float32 sums (:mod:`kvfold.runtime.exact_products`, where the device's
check admits them). Prints the median milliseconds of each, their ratio, the fits' logit products'
TFLOP/s and how far the two fits' output errors and values are apart; ``--out`` appends the same as JSON
lines. A 32K context of the 8B shape fits 32 such layers. On the CPU both paths take float32 products
(a check of the script, not a timing). docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import json
import statistics

DTYPES = ("bfloat16", "float16")


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (a check of the script at small sizes)")
    parser.add_argument("--problems", default="8,128", help="problems fitted together, comma-separated")
    parser.add_argument("--entries", type=int, default=2048, help="entries a problem (a chunk's)")
    parser.add_argument("--queries", type=int, default=8192, help="reference queries a problem")
    parser.add_argument("--kept", type=int, default=205, help="kept keys a problem")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="queries', keys' and values' dtype")
    parser.add_argument("--reps", type=int, default=3, help="timed fits of each path (after one warm-up)")
    parser.add_argument("--out", default=None, help="a JSON-lines file to append each size's record to")
    return parser.parse_args(argv)


def _problems(torch, args, count: int) -> tuple:
    """Random problems of one layer's shape: keys, values, log-masses, queries, their validity, counts and
    the given kept positions (ascending)."""
    gen = torch.Generator().manual_seed(count)
    dtype, d, n, t = getattr(torch, args.dtype), args.head_dim, args.entries, args.kept
    keys = torch.randn(count, n, d, generator=gen).to(args.device, dtype)
    values = torch.randn(count, n, d, generator=gen).to(args.device, dtype)
    queries = (2 * torch.randn(count, args.queries, d, generator=gen)).to(args.device, dtype)
    log_mass = torch.zeros(count, n, device=args.device)
    valid = torch.ones(count, args.queries, dtype=torch.bool, device=args.device)
    given = torch.stack([torch.randperm(n, generator=gen)[:t].sort().values for _ in range(count)]).to(args.device)
    return keys, values, log_mass, queries, valid, torch.full((count,), t, device=args.device), given


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    import torch

    from kvfold.methods.compaction.attention_matching.solve import FitConfig, fit_problems
    from kvfold.runtime import exact_products
    from kvfold.runtime.timing import device_clock

    device = torch.device(args.device)
    config = FitConfig().sized(device)
    for count in (int(x) for x in args.problems.split(",")):
        keys, values, log_mass, queries, valid, counts, given = _problems(torch, args, count)
        paths = {"float32 products": False, "16-bit operands": None}
        found, times = {}, {name: [] for name in paths}
        for rep in range(args.reps + 1):  # alternating; the first fit of each is a warm-up (and the check)
            for name, forced in paths.items():
                exact_products.FORCED = forced
                start = device_clock(device)
                found[name] = fit_problems(
                    keys, values, log_mass, queries, valid, counts, args.head_dim**-0.5, config, given=given
                )
                if rep:
                    times[name].append(device_clock(device) - start)
        exact_products.FORCED = None
        taken = exact_products.products_path(device, queries.dtype)
        _report(args, count, taken, found, times)


def _report(args, count: int, taken: str, found: dict, times: dict) -> None:
    """Print (and with ``--out`` append) one size's record: each path's median ms, the float32 path's time
    over the 16-bit one's, the logit products' TFLOP/s (``2 · queries · (entries + kept) · head_dim`` a
    problem) and how far apart the two fits are."""
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    flop = 2 * count * args.queries * (args.entries + args.kept) * args.head_dim
    upcast, sixteen = found["float32 products"], found["16-bit operands"]
    record = {
        "device": args.device,
        "dtype": args.dtype,
        "problems": count,
        "entries": args.entries,
        "queries": args.queries,
        "kept": args.kept,
        "head_dim": args.head_dim,
        "fit_products": taken,
        "ms": ms,
        "float32_over_16_bit": ms["float32 products"] / ms["16-bit operands"],
        "logit_tflops": {name: flop / (t * 1e-3) / 1e12 for name, t in ms.items()},
        "output_error": {name: float(fit.output_error.mean()) for name, fit in found.items()},
        "largest_value_difference": float((sixteen.values - upcast.values).abs().max()),
    }
    said = ", ".join(f"{name} {t:.1f} ms" for name, t in ms.items())
    errors = record["output_error"]
    print(
        f"{count:>4} problems ({taken}): {said}; {record['float32_over_16_bit']:.2f}x; output error "
        f"{errors['float32 products']:.4g} / {errors['16-bit operands']:.4g}; values apart by at most "
        f"{record['largest_value_difference']:.2g}"
    )
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
