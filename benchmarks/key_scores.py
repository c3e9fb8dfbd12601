"""KVzip's scores for one layer and forward of the repeat pass: the Triton kernel against the float32 products.

Usage::

    python benchmarks/key_scores.py [--device cuda] [--entries 8192,32768] [--tokens 2048] [--kv-heads 8]
        [--group 4] [--head-dim 128] [--dtype bfloat16] [--reps 5] [--blocks 128x64,64x64] [--out FILE.jsonl]

Times :func:`kvfold.methods.core.repeat.max_received` on random queries and keys of one repeat forward's
shape (``--tokens`` repeat tokens of ``--kv-heads × --group`` query heads against ``--entries`` context
entries; Llama-3.1-8B's layout and a GPU's 2,048-token forwards by default) twice in one process,
alternating: by :func:`kvfold.runtime.key_scores.blocked_max_logits` (float32 products in the blocks a GPU
takes) and by :func:`kvfold.runtime.key_scores.fused_max_logits` (the Triton kernel; with ``--blocks``, with
each block of keys × rows given, for choosing :data:`~kvfold.runtime.key_scores.BLOCK_KEYS` and
:data:`~kvfold.runtime.key_scores.BLOCK_ROWS` on a GPU). Prints, at each length,
the median milliseconds of each, their ratio, the TFLOP/s of the products (``2 · rows · entries · head_dim``
a KV head) and the largest relative difference of the scores; ``--out`` appends the same as JSON lines.
A 32K context of the 8B shape runs 16 such forwards in each of 32 layers. On the CPU the kernel runs under
Triton's interpreter (``TRITON_INTERPRET=1``, set by this script): a check of the script at small sizes
(``--entries 300 --tokens 40``), not a timing. docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

DTYPES = ("bfloat16", "float16")


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (Triton's interpreter: small sizes only)")
    parser.add_argument("--entries", default="8192,32768", help="context entries scored, comma-separated")
    parser.add_argument("--tokens", type=int, default=2048, help="repeat tokens a forward")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads")
    parser.add_argument("--group", type=int, default=4, help="query heads a KV head")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="queries' and keys' dtype")
    parser.add_argument("--reps", type=int, default=5, help="timed calls of each path (after one warm-up)")
    parser.add_argument(
        "--blocks",
        default=None,
        help="the kernel's blocks to time, KEYSxROWS comma-separated (e.g. 128x64,64x64,128x128; default: "
        "kvfold's own, key_scores.BLOCK_KEYS x BLOCK_ROWS)",
    )
    parser.add_argument("--out", default=None, help="a JSON-lines file to append each length's record to")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    import torch

    from kvfold.methods.core import repeat
    from kvfold.runtime import key_scores
    from kvfold.runtime.timing import device_clock

    dtype = getattr(torch, args.dtype)
    b, h_kv, g, q_len, d = 1, args.kv_heads, args.group, args.tokens, args.head_dim
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(b, h_kv * g, q_len, d, generator=gen).to(args.device, dtype)
    lse = (12 + torch.rand(b, h_kv * g, q_len, generator=gen)).to(args.device)
    print(f"scores path on {args.device}: {key_scores.scores_path(torch.device(args.device), dtype)}")
    own = (key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS)
    blocks = [own] if not args.blocks else [tuple(int(x) for x in pair.split("x")) for pair in args.blocks.split(",")]
    for n in (int(x) for x in args.entries.split(",")):
        keys = torch.randn(b, h_kv, n, d, generator=gen).to(args.device, dtype)
        paths = {"float32 products": (False, own)} | {
            f"triton kernel {k}x{r}" if args.blocks else "triton kernel": (True, (k, r)) for k, r in blocks
        }
        found, times = {}, {name: [] for name in paths}
        for rep in range(args.reps + 1):  # alternating; the first call of each is a warm-up (and compiles)
            for name, (fused, sizes) in paths.items():
                key_scores.FUSED_FORCED = fused
                key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS = sizes  # read by fused_max_logits at each call
                start = device_clock(args.device)
                found[name] = repeat.max_received(query, keys, lse, d**-0.5)
                if rep:
                    times[name].append(device_clock(args.device) - start)
        key_scores.FUSED_FORCED = None
        key_scores.BLOCK_KEYS, key_scores.BLOCK_ROWS = own
        _report(args, n, g * q_len, h_kv, d, found, times)


def _report(args, n: int, rows: int, h_kv: int, d: int, found: dict, times: dict) -> None:
    """Print (and with ``--out`` append) one length's record: each path's median ms and TFLOP/s, the
    products' time over each kernel's, and the largest relative difference from the products."""
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    flop = 2 * h_kv * rows * n * d
    base = found["float32 products"]
    kernels = [name for name in ms if name != "float32 products"]
    record = {
        "device": args.device,
        "dtype": args.dtype,
        "entries": n,
        "rows": rows,
        "kv_heads": h_kv,
        "head_dim": d,
        "ms": ms,
        "products_over_kernel": {name: ms["float32 products"] / ms[name] for name in kernels},
        "tflops": {name: flop / (t * 1e-3) / 1e12 for name, t in ms.items()},
        "largest_relative_difference": max(float(((found[name] - base).abs() / base).max()) for name in kernels),
    }
    said = ", ".join(
        f"{name} {ms[name]:.2f} ms ({record['tflops'][name]:.1f} TFLOP/s)" for name in ["float32 products", *kernels]
    )
    ratios = ", ".join(f"{record['products_over_kernel'][name]:.2f}x" for name in kernels)
    print(f"{n:>7,} entries: {said}; {ratios}; largest relative difference {record['largest_relative_difference']:.2g}")
    if args.out:
        with open(args.out, "a") as handle:
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
