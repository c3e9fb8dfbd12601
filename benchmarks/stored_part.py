"""The stored rows' part of a decode step, this tree's against an older tree's, interleaved in one process.

Usage::

    git worktree add /tmp/kvfold-before ea8b4d0       # any older kvfold
    python benchmarks/stored_part.py --baseline /tmp/kvfold-before/src --length 4096 --method kvzip
        [--memory 0.0625] [--reps 30]

Prefills and compresses ``--length`` tokens of the bench's prose with SmolLM2 (this tree's code), then
reads every layer's stored rows with random queries (a decode step's shape: the GQA group's heads, one
token) by this tree's :func:`kvfold.runtime.quantized_attention.stored_part` path and by the older tree's
(its ``rows.float_part`` and ``quantized_attention._stored_part_torch``, loaded from ``--baseline``),
alternating, and prints the median time of a step's worth (every layer) of each, their operators per
layer and each one's largest error against the older path in float64. Quantized rows are read by the
PyTorch path (what a GPU runs), not the CPU's compiled kernel.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from kvfold.evaluate.bench.process import context_ids
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime import quantized_attention
from kvfold.runtime.models import load_model
from kvfold.runtime.quantize import QuantizedRows

VIEWS = {"view", "as_strided", "slice", "select", "expand", "transpose", "t", "unsqueeze", "reshape", "_unsafe_view",
         "alias", "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "to", "detach"}  # fmt: skip
"""Operators that launch no kernel (not counted)."""


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _operators(fn, pairs) -> float:
    with torch.profiler.profile() as prof:
        for q, s in pairs:
            fn(q, s)
    counted = [e.count for e in prof.key_averages() if e.key.startswith("aten::") and e.key[6:] not in VIEWS]
    return sum(counted) / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, required=True, help="the src/ directory of an older kvfold")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--memory", type=float, default=None, help="a memory budget (quantized rows)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    old_rows = _load("baseline_rows", args.baseline / "kvfold/runtime/rows.py")
    old_quantized = _load("baseline_quantized_attention", args.baseline / "kvfold/runtime/quantized_attention.py")

    def new(q, s):
        if isinstance(s, QuantizedRows):
            return quantized_attention._stored_part_torch(q, s, 0.125)  # noqa: SLF001 - the GPU's path, timed
        return quantized_attention.stored_part(q, s, 0.125)

    def old(q, s):
        if isinstance(s, QuantizedRows):
            return old_quantized._stored_part_torch(q, s, 0.125)  # noqa: SLF001
        return old_rows.float_part(q, s, 0.125)

    model, tokenizer = load_model("smollm2-135m")
    config = model.config
    with torch.inference_mode():
        source = prefill_ids(model, tokenizer, context_ids(tokenizer, args.length, 1), methods=[args.method])
        compressed = source.compress(args.method, None if args.memory else 0.1, memory=args.memory)
    layers = [layer.stored for _, layer in compressed.cache.folded_layers if layer.stored is not None]
    if not layers:
        raise SystemExit("no layer holds stored rows (equal rows are stored dense): nothing to compare")
    groups = config.num_attention_heads // config.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(s.num_rows, groups, s.head_dim, generator=g), s) for s in layers]
    entries = sum(int(s.lengths.sum()) for s in layers)
    slots = sum(s.width * s.num_rows for s in layers)
    errors = {"this tree": 0.0, "baseline": 0.0}
    with torch.inference_mode():
        for q, s in pairs:
            top, den, num = old(q.double(), s)
            exact = num / den[..., None]
            for name, fn in (("this tree", new), ("baseline", old)):
                t, d, n = fn(q, s)
                errors[name] = max(errors[name], float(((n / d[..., None]).double() - exact).abs().max()))
        times: dict[str, list[float]] = {"this tree": [], "baseline": []}
        for rep in range(args.reps):
            order = (("this tree", new), ("baseline", old)) if rep % 2 else (("baseline", old), ("this tree", new))
            for name, fn in order:
                start = time.perf_counter()
                for q, s in pairs:
                    fn(q, s)
                times[name].append(time.perf_counter() - start)
        ops = {"this tree": _operators(new, pairs), "baseline": _operators(old, pairs)}
    median = {name: statistics.median(t) * 1000 for name, t in times.items()}
    kind = f"memory {args.memory} ({compressed.cache.quant.describe()})" if args.memory else "0.1"
    threads = torch.get_num_threads()
    print(f"{args.method} at {kind}, {args.length} tokens: {len(layers)} layers with stored rows, {entries} entries, "
          f"padded to the longest row {slots} slots ({slots / entries:.2f}×); {threads} threads")  # fmt: skip
    for name in ("baseline", "this tree"):
        print(f"  {name:9s}: {median[name]:7.2f} ms a step (every layer), {ops[name]:5.1f} operators a layer, "
              f"largest error against float64 {errors[name]:.1e}")  # fmt: skip
    print(f"  this tree / baseline: {median['this tree'] / median['baseline']:.3f}")


if __name__ == "__main__":
    main()
