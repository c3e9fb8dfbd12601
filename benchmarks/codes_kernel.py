"""Time the library's CPU codes kernel alone, and optionally another version of it beside it.

Usage::

    python benchmarks/codes_kernel.py [--formats int4,int3,int8] [--entries 800] [--layers 30]
        [--queries 3,4,48] [--head-dim 64] [--repeat 15] [--baseline OLD/attend_codes.c] [--out DIR]

Random rows at SmolLM2-135M's layout (3 KV heads a layer, ``--head-dim`` 64), ``--entries`` a KV head
in each of ``--layers`` layers, quantized in each of ``--formats`` (:class:`kvfold.runtime.quantize.
QuantizedRows`, β on every entry), read by ``kvfold_attend_codes`` (``runtime/kernels/attend_codes.c``)
with ``--queries`` queries a row: a decode step's GQA group (3 for SmolLM2, 4 for Llama-3.1-8B) or a
prefill's chunk. A timed pass calls the kernel once a layer, with its arguments prepared beforehand (the
kernel alone, not :func:`kvfold.runtime.quantized_attention.stored_part`'s Python around it); it
prints the median milliseconds a pass and multiply-adds a second.

``--baseline`` builds another version of the kernel's source (for instance
``git show REV:src/kvfold/runtime/kernels/attend_codes.c > OLD/attend_codes.c``, with that revision's
``attend_blocks.h`` beside it: the source includes it from its own folder) and times both in this
process on the same rows, in alternating order: the median ratio of each pair (this kernel ÷ the
baseline) with its 10th and 90th percentiles, and the largest difference between their outputs relative
to the largest output. Versions before 84246ac took a scratch buffer and cannot be compared by this
script. docs/benchmarks.md, "Profiling".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvfold.runtime import native
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.quantize import QuantizedRows

KV_HEADS = 3
"""SmolLM2-135M's KV heads a layer: the kernel's rows a call."""


def _layer_rows(fmt: str, entries: int, head_dim: int, g: torch.Generator) -> QuantizedRows:
    keys = torch.randn(KV_HEADS, entries, head_dim, generator=g)
    values = torch.randn(KV_HEADS, entries, head_dim, generator=g)
    beta = torch.randn(KV_HEADS, entries, generator=g)
    lengths = torch.full((KV_HEADS,), entries)
    return QuantizedRows.from_padded(keys, values, beta, lengths, QuantConfig.parse(fmt))


class Call:
    """One layer's kernel call with its arguments made once (the buffers kept alive with them)."""

    def __init__(self, stored: QuantizedRows, queries: torch.Tensor) -> None:
        f32 = torch.float32
        rows, m, dim = queries.shape
        self.held = [
            stored.lengths.to(torch.int64).contiguous(),
            stored.key_codes.contiguous(),
            stored.key_scale.to(f32).contiguous(),
            stored.key_zero.to(f32).contiguous(),
            stored.value_codes.contiguous(),
            stored.value_scale[:, 0].to(f32).contiguous(),
            stored.value_zero[:, 0].to(f32).contiguous(),
            stored.log_mass.to(f32).contiguous(),
            queries.contiguous(),
        ]
        self.top, self.den = queries.new_empty(rows, m), queries.new_empty(rows, m)
        self.num = queries.new_empty(rows, m, stored.value_dim)
        sizes = [rows, m, dim, stored.value_dim, stored.config.bits, stored.config.key_group]
        sizes += [self.held[1].shape[0], self.held[2].shape[0]]
        outputs = [t.data_ptr() for t in (self.top, self.den, self.num)]
        self.arguments = [*sizes, *(t.data_ptr() for t in self.held), dim**-0.5, *outputs]

    def __call__(self, kernel) -> None:
        code = kernel(*self.arguments)
        if code:
            raise SystemExit(f"the kernel refused its arguments (code {code}: {native.ERRORS.get(code, 'unknown')})")


def pass_times(fmt: str, entries: int, layers: int, m: int, head_dim: int, repeat: int, kernels) -> tuple[list, float]:
    """Seconds of a pass over ``layers`` layers (a call each), ``repeat`` times for each kernel, alternating
    their order; and the largest difference between their weighted values relative to the largest."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(layers):
        calls.append(Call(_layer_rows(fmt, entries, head_dim, g), torch.randn(KV_HEADS, m, head_dim, generator=g)))
    outputs = []
    for kernel in kernels:  # warm, and each kernel's outputs of the first layer
        for call in calls:
            call(kernel)
        outputs.append(calls[0].num.clone())
    if not all(bool(torch.isfinite(o).all()) for o in outputs):
        raise SystemExit("the kernel wrote numbers that are not finite")
    scale = float(outputs[0].abs().max())
    difference = max((float((o - outputs[0]).abs().max()) / scale for o in outputs[1:]), default=0.0)
    times: list[list[float]] = [[] for _ in kernels]
    for r in range(repeat):
        order = range(len(kernels)) if r % 2 == 0 else reversed(range(len(kernels)))
        for which in order:
            began = time.perf_counter()
            for call in calls:
                call(kernels[which])
            times[which].append(time.perf_counter() - began)
    return times, difference


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _baseline_kernel(source: Path):
    if not source.is_file():
        raise SystemExit(f"--baseline {source}: no such file (a version of the codes kernel's C source)")
    function, why = native.build_codes_kernel(source=source)
    if function is None:
        raise SystemExit(f"--baseline {source}: {why}")
    return function


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--formats", default="int4,int3,int8")
    parser.add_argument("--entries", type=int, default=800, help="entries a KV head keeps in each layer")
    parser.add_argument("--layers", type=int, default=30, help="layers, a kernel call each in a timed pass")
    parser.add_argument("--queries", default="3,4,48", help="queries a row: a decode step's GQA group, or more")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--baseline", type=Path, help="another version of the kernel's C source, timed beside it")
    parser.add_argument("--out", type=Path, help="a folder for results.json")
    args = parser.parse_args(argv)
    queries = [int(q) for q in args.queries.split(",")]
    if min(args.entries, args.layers, args.repeat, *queries) < 1:
        raise SystemExit("--entries, --layers, --repeat and --queries take positive numbers")
    kernel = native.attend_codes_kernel()
    if kernel is None:
        raise SystemExit(f"no codes kernel here: {native.status()}")
    kernels = [kernel] if args.baseline is None else [kernel, _baseline_kernel(args.baseline)]
    records = []
    for fmt in args.formats.split(","):
        for m in queries:
            times, difference = pass_times(fmt, args.entries, args.layers, m, args.head_dim, args.repeat, kernels)
            seconds = _median(times[0])
            rate = args.layers * KV_HEADS * args.entries * m * 2 * args.head_dim / seconds / 1e9
            record = {"format": fmt, "queries": m, "ms": seconds * 1e3, "gmac_per_s": rate}
            line = f"{fmt:6} {m:3} queries a row  {seconds * 1e3:8.2f} ms a pass  {rate:6.2f} G multiply-adds/s"
            if len(times) == 2:
                ratios = [mine / theirs for mine, theirs in zip(*times, strict=True)]
                record |= {"baseline_ms": _median(times[1]) * 1e3, "ratio": _median(ratios),
                           "ratio_p10": _percentile(ratios, 0.1), "ratio_p90": _percentile(ratios, 0.9),
                           "max_relative_difference": difference}  # fmt: skip
                line += (
                    f"  baseline {record['baseline_ms']:8.2f} ms  ratio {record['ratio']:.3f} "
                    f"[{record['ratio_p10']:.3f}, {record['ratio_p90']:.3f}]  max relative difference {difference:.1e}"
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
