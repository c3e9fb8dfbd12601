"""The pool kernel alone: one layer's call for a serving step's requests on files, timed.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/pool_kernel.py [--formats int4,int3,int8] [--requests 24] [--rows 440]
        [--dtype float32] [--repeat 20] [--out runs/pool-kernel]

Builds ``--requests`` files of random rows (``--rows`` entries in each of SmolLM2-135M's 3 KV heads, head
size 64, β on; about what a 1,759-token context keeps under ``--memory 1/16``), packed into an engine's
blocks of 32 tokens in ``--dtype`` as ``kvfold serve`` packs them, and times
:meth:`kvfold.runtime.pool_attention.PoolStep.attend` (9 query heads, one kernel call, ``torch``'s
threads) for two steps: every request's first step on a 40-token question (a tile of 120 queries a KV
head), and a decode step (one token a request, 40 own tokens before it). It prints, for each format and
step, the milliseconds a call and the multiply-adds a second over the file's rows (queries × rows ×
(key + value) × head size), and writes ``results.json`` under ``--out`` when given.

The kernel is built for the machine it runs on (``-march=native``); what it reaches depends on the
machine's vectors (``kvfold.runtime.native``'s build notes). docs/benchmarks.md, "The pool kernel".
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from kvfold.runtime.native import attend_pool_kernel, pool_status
from kvfold.runtime.pool_attention import EngineCaches, PoolStep, StepRequest, pooled_file
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows
from kvfold.runtime.row_pool import pack_pool

HEAD_DIM, KV_HEADS, Q_HEADS, LAYERS, BLOCK, QUESTION = 64, 3, 9, 2, 32, 40
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))


def _file_rows(fmt: str, rows: int, g: torch.Generator) -> QuantizedRows:
    keys = torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g)
    values = torch.randn(KV_HEADS, rows, HEAD_DIM, generator=g)
    beta = torch.randn(KV_HEADS, rows, generator=g)
    return QuantizedRows.from_padded(keys, values, beta, torch.full((KV_HEADS,), rows), QuantConfig.parse(fmt))


def step_seconds(fmt: str, requests: int, rows: int, dtype: torch.dtype, new: int, repeat: int) -> float:
    """The median seconds of one layer's call for ``requests`` requests of ``new`` tokens each."""
    g = torch.Generator().manual_seed(0)
    num_blocks = requests * (math.ceil(rows * KV_HEADS / BLOCK) + 8)
    caches = [torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    engine = EngineCaches(caches, Q_HEADS, HEAD_DIM**-0.5, threads=torch.get_num_threads())
    chunk_bytes = KV_HEADS * BLOCK * 2 * HEAD_DIM * caches[0].element_size()
    free, step, start = list(range(num_blocks)), [], 0
    for _ in range(requests):
        plan, chunks = pack_pool([_file_rows(fmt, rows, g) for _ in range(LAYERS)], chunk_bytes)
        placeholders = math.ceil(plan.num_chunks / LAYERS) * BLOCK
        file = pooled_file(plan, placeholders, 2 * placeholders, INV_FREQ)
        seq_len = placeholders + QUESTION + (new == 1)
        held = [free.pop() for _ in range(math.ceil(seq_len / BLOCK))]
        blocks = torch.zeros(len(held) + 1, dtype=torch.int32)
        blocks[: len(held)] = torch.tensor(held, dtype=torch.int32)
        for c in range(plan.num_chunks):
            engine.chunk(blocks, c, LAYERS).copy_(chunks[c])
        step.append(StepRequest(start, new, seq_len, file, blocks))
        start += new
    query = torch.randn(start, Q_HEADS, HEAD_DIM, generator=g).to(dtype)
    output = torch.empty_like(query)
    call = PoolStep(engine, step)
    call.attend(0, query, output)  # warm
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        call.attend(0, query, output)
        times.append(time.perf_counter() - began)
    if not bool(torch.isfinite(output).all()):
        raise SystemExit("the kernel wrote numbers that are not finite")
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,int3,int8")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--rows", type=int, default=440, help="entries a KV head keeps of each file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if attend_pool_kernel() is None:
        raise SystemExit(f"no pool kernel here: {pool_status()}")
    dtype = getattr(torch, args.dtype)
    records = []
    for fmt in args.formats.split(","):
        for label, new in (("first step, 40 tokens", QUESTION), ("decode step", 1)):
            seconds = step_seconds(fmt, args.requests, args.rows, dtype, new, args.repeat)
            work = args.requests * new * Q_HEADS * args.rows * 2 * HEAD_DIM
            rate = work / seconds / 1e9
            records.append({"format": fmt, "step": label, "tokens": new, "ms": seconds * 1e3, "gmac_per_s": rate})
            print(f"{fmt:6} {label:22} {seconds * 1e3:8.2f} ms a call  {rate:6.2f} G multiply-adds/s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "out"} | {"threads": torch.get_num_threads()}
        (args.out / "results.json").write_text(json.dumps({"settings": settings, "records": records}, indent=1))


if __name__ == "__main__":
    main()
