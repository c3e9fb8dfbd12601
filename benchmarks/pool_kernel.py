"""The pool kernel alone: one layer's call for a serving step's requests on files, timed.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/pool_kernel.py [--formats int4,int3,int8] [--requests 24] [--rows 440]
        [--dtype float32] [--repeat 20] [--layers 1] [--files N] [--group 3] [--head-dim 64] [--baseline OLD.c]
        [--out runs/pool-kernel]

Builds ``--requests`` files of random rows (``--rows`` entries in each of SmolLM2-135M's 3 KV heads, head
size 64, β on; about what a 1,759-token context keeps under ``--memory 1/16``), packed into an engine's
blocks of 32 tokens in ``--dtype`` as ``kvfold serve`` packs them, and times
:meth:`kvfold.runtime.pool_attention.PoolStep.attend` (9 query heads, one kernel call a layer, ``torch``'s
threads) for two steps: every request's first step on a 40-token question (a tile of 120 queries a KV
head), and a decode step (one token a request, 40 own tokens before it). It prints, for each format and
step, the milliseconds a layer's call and the multiply-adds a second over the file's rows (queries × rows
× (key + value) × head size), and writes ``results.json`` under ``--out`` when given.

``--layers N`` gives the files N layers and times a pass over all of them (reported per layer): at 30
(SmolLM2's layers) and 1,240 rows the rows no longer fit the caches and stream from memory, as in an
engine's step; at 1 a call reads rows the last call left in the caches.

``--group G --head-dim D`` gives the model G query heads a KV head and heads of D channels (default
SmolLM2's 3 and 64; Llama-3.1-8B's are 4 and 128): a decode step's pass over a row then holds G queries.

``--files N`` puts the requests on N files in turn (default: a file each); the requests on one file share
its blocks and its tables, as an engine's prefix cache and the vLLM backend give them, so that the kernel
reads the file once for their queries (``PoolStep.tiles``).

``--baseline OLD.c`` compares the kernel with another version of its source (for instance
``git show REV:src/kvfold/runtime/kernels/attend_pool.c > OLD/attend_pool.c``, and from 84246ac on that
revision's ``attend_blocks.h`` beside it, which the source includes) in this process, on the same rows:
each repeat times both, in alternating order, and the ratio of each pair (this kernel ÷ the baseline)
is reported with its 10th and 90th percentiles, with the largest difference between their outputs.
Timings on a shared machine move by a quarter between runs; a ratio within one run moves far less.

The kernel is built for the machine it runs on (``-march=native``); what it reaches depends on the
machine's vectors (``kvfold.runtime.native``'s build notes). docs/benchmarks.md, "The pool kernel".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch

from kvfold.runtime.native import attend_pool_kernel, build_pool_kernel, pool_status
from kvfold.runtime.pool_attention import EngineCaches, PoolStep, StepRequest, pooled_file
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.row_pool import pack_pool

BLOCK, QUESTION = 32, 40


class Shape(NamedTuple):
    """The model's attention as the engine holds it: KV heads, query heads a KV head, and the head size.
    The default is SmolLM2-135M's (3 KV heads of 64, 9 query heads); ``--group 4 --head-dim 128`` is
    Llama-3.1-8B's layout a KV head (4 query heads a KV head, head size 128)."""

    kv_heads: int = 3
    group: int = 3
    head_dim: int = 64

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def inv_freq(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim))


SMOLLM2 = Shape()


def _file_rows(fmt: str, rows: int, g: torch.Generator, shape: Shape) -> QuantizedRows:
    keys = torch.randn(shape.kv_heads, rows, shape.head_dim, generator=g)
    values = torch.randn(shape.kv_heads, rows, shape.head_dim, generator=g)
    beta = torch.randn(shape.kv_heads, rows, generator=g)
    lengths = torch.full((shape.kv_heads,), rows)
    return QuantizedRows.from_padded(keys, values, beta, lengths, QuantConfig.parse(fmt))


def _scene(
    fmt: str,
    requests: int,
    rows: int,
    layers: int,
    dtype: torch.dtype,
    new: int,
    files: int | None = None,
    shape: Shape = SMOLLM2,
):
    """An engine's caches holding ``files`` files (default: one a request) of ``layers`` layers, the step's
    ``requests`` requests on them in turn (those on one file share its blocks, as an engine's prefix cache
    has them share), and the step's query."""
    files = requests if files is None else files
    g = torch.Generator().manual_seed(0)
    kv_heads, head_dim = shape.kv_heads, shape.head_dim
    chunk_bytes = kv_heads * BLOCK * 2 * head_dim * torch.empty((), dtype=dtype).element_size()
    packed = [pack_pool([_file_rows(fmt, rows, g, shape) for _ in range(layers)], chunk_bytes) for _ in range(files)]
    placeholders = [math.ceil(plan.num_chunks / layers) * BLOCK for plan, _ in packed]
    own = math.ceil((QUESTION + (new == 1)) / BLOCK)  # each request's own blocks, after its file's
    file_blocks = [p // BLOCK for p in placeholders]
    caches = [torch.zeros(sum(file_blocks) + requests * own, kv_heads, BLOCK, 2 * head_dim, dtype=dtype)]
    caches += [torch.zeros_like(caches[0]) for _ in range(layers - 1)]
    engine = EngineCaches(caches, shape.q_heads, head_dim**-0.5, threads=torch.get_num_threads())
    held, pooled, first_block = [], [], 0
    for (plan, chunks), count, p in zip(packed, file_blocks, placeholders, strict=True):
        pooled.append(pooled_file(plan, p, 2 * p, shape.inv_freq))  # one a file, as an engine makes it
        blocks = torch.arange(first_block, first_block + count, dtype=torch.int32)
        for c in range(plan.num_chunks):
            engine.chunk(blocks, c, layers).copy_(chunks[c])
        held.append(blocks)
        first_block += count
    step, start = [], 0
    for n in range(requests):
        which = n % files
        p = placeholders[which]
        mine = torch.arange(first_block, first_block + own, dtype=torch.int32)
        blocks = torch.cat([held[which], mine, torch.zeros(1, dtype=torch.int32)])
        step.append(StepRequest(start, new, p + QUESTION + (new == 1), pooled[which], blocks))
        first_block, start = first_block + own, start + new
    query = torch.randn(start, shape.q_heads, head_dim, generator=g).to(dtype)
    return engine, step, query


def step_times(
    fmt: str,
    requests: int,
    rows: int,
    dtype: torch.dtype,
    new: int,
    repeat: int,
    layers: int = 1,
    kernels=(None,),
    files: int | None = None,
    shape: Shape = SMOLLM2,
) -> tuple[list[list[float]], float]:
    """Seconds a layer's call for ``requests`` requests of ``new`` tokens each on ``files`` files (default:
    one a request), ``repeat`` times for each of ``kernels`` (None: the project's kernel), alternating their
    order; and the largest difference between the kernels' outputs."""
    engine, step, query = _scene(fmt, requests, rows, layers, dtype, new, files, shape)
    calls = [PoolStep(engine, step, kernel=kernel) for kernel in kernels]
    outputs = [torch.empty_like(query) for _ in kernels]
    for call, output in zip(calls, outputs, strict=True):  # warm
        for layer in range(layers):
            call.attend(layer, query, output)
    if not all(bool(torch.isfinite(output).all()) for output in outputs):
        raise SystemExit("the kernel wrote numbers that are not finite")
    difference = max((float((o.float() - outputs[0].float()).abs().max()) for o in outputs[1:]), default=0.0)
    times: list[list[float]] = [[] for _ in kernels]
    for r in range(repeat):
        order = range(len(calls)) if r % 2 == 0 else reversed(range(len(calls)))
        for which in order:
            began = time.perf_counter()
            for layer in range(layers):
                calls[which].attend(layer, query, outputs[which])
            times[which].append((time.perf_counter() - began) / layers)
    return times, difference


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,int3,int8")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--files", type=int, help="files the requests are on, in turn (default: one a request)")
    parser.add_argument("--rows", type=int, default=440, help="entries a KV head keeps of each file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--layers", type=int, default=1, help="layers of each file, all attended in each timed pass")
    parser.add_argument("--group", type=int, default=SMOLLM2.group, help="query heads a KV head (SmolLM2: 3)")
    parser.add_argument("--head-dim", type=int, default=SMOLLM2.head_dim, choices=[64, 128])
    parser.add_argument("--baseline", type=Path, help="another version of the kernel's C source, timed beside it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.repeat < 1 or args.requests < 1 or args.rows < 1:
        raise SystemExit("--layers, --repeat, --requests and --rows take a positive number")
    if args.group < 1:
        raise SystemExit("--group takes a positive number (query heads a KV head)")
    if args.files is not None and not 1 <= args.files <= args.requests:
        raise SystemExit(f"--files takes 1 to --requests ({args.requests})")
    if attend_pool_kernel() is None:
        raise SystemExit(f"no pool kernel here: {pool_status()}")
    kernels: tuple = (None,)
    if args.baseline is not None:
        if not args.baseline.is_file():
            raise SystemExit(f"--baseline {args.baseline}: no such file (a version of the pool kernel's C source)")
        baseline, why = build_pool_kernel(source=args.baseline)
        if baseline is None:
            raise SystemExit(f"--baseline {args.baseline}: {why}")
        kernels = (None, baseline)
    dtype = getattr(torch, args.dtype)
    shape = Shape(SMOLLM2.kv_heads, args.group, args.head_dim)
    records = []
    for fmt in args.formats.split(","):
        for label, new in (("first step, 40 tokens", QUESTION), ("decode step", 1)):
            times, difference = step_times(
                fmt, args.requests, args.rows, dtype, new, args.repeat, args.layers, kernels, args.files, shape
            )
            seconds = _median(times[0])
            work = args.requests * new * shape.q_heads * args.rows * 2 * shape.head_dim
            rate = work / seconds / 1e9
            record = {"format": fmt, "step": label, "tokens": new, "ms": seconds * 1e3, "gmac_per_s": rate}
            line = f"{fmt:6} {label:22} {seconds * 1e3:8.2f} ms a call  {rate:6.2f} G multiply-adds/s"
            if len(times) == 2:
                ratios = [mine / theirs for mine, theirs in zip(*times, strict=True)]
                record |= {
                    "baseline_ms": _median(times[1]) * 1e3,
                    "ratio": _median(ratios),
                    "ratio_p10": _percentile(ratios, 0.1),
                    "ratio_p90": _percentile(ratios, 0.9),
                    "max_difference": difference,
                }
                line += (
                    f"  baseline {record['baseline_ms']:8.2f} ms  ratio {record['ratio']:.3f} "
                    f"[{record['ratio_p10']:.3f}, {record['ratio_p90']:.3f}]  max |difference| {difference:.1e}"
                )
            records.append(record)
            print(line)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
        settings["threads"] = torch.get_num_threads()
        (args.out / "results.json").write_text(json.dumps({"settings": settings, "records": records}, indent=1))


if __name__ == "__main__":
    main()
