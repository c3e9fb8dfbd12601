"""Where a compression's time goes: cProfile's functions and torch.profiler's operators.

Usage::

    python benchmarks/profile_compress.py --length 4096 --method kvzip+am_fit [--budget 0.1]
        [--model smollm2-135m] [--device cpu] [--top 25] [--ops] [--count | --peak [--as-accelerator]]
        [--plain [--repeat 2]] [--pad-products N]

Prefills ``--length`` tokens of the bench's prose, then compresses once under cProfile (and, with
``--ops``, a second time under ``torch.profiler``) and prints the prefill and compression seconds,
the functions with the most cumulative time, and the method's own report (``ctx.report``: the repeat
pass, the fits).

``--count`` instead compresses once counting what a GPU would pay for whatever the machine: the
operators dispatched (views apart: they launch nothing), by phase (the repeat pass, Attention
Matching's fits, the rest) and by kvfold function, their matrix products' floating-point operations
(by phase and function: which run at a 16-bit rate on a GPU depends on the function), and the host reads
(:class:`kvfold.runtime.host_syncs.HostSyncCounter`). With ``--as-accelerator`` a CPU takes the
paths and block sizes a GPU in 16 bits would (the repeat pass's forwards and its fused attention with
the log-sum-exp, the CPU's kernel standing in for CUDA's; the fits'
:data:`~kvfold.methods.compaction.attention_matching.solve.ACCELERATOR_FIT_SIZES`, and their logits of
16-bit queries and keys by :func:`kvfold.runtime.exact_products.float32_bmm`, where the count names the
products a GPU runs on tensor cores with float32 sums), so the count is the GPU's.

``--peak`` instead compresses once under :class:`kvfold.runtime.live_bytes.LiveBytes` and prints the
memory the compression's tensors add at their peak, over the full cache's bytes (``kvfold bench``'s
``compress_peak_over_cache``, which a GPU reads from its allocator), and what held it, by phase and by
the kvfold function that made each tensor. With ``--as-accelerator`` the repeat pass's queries are left
out (a GPU holds them in host memory), a fit's layer of them is a copy (brought to the device), and
KVzip's scores hold only their output (the GPU's fused kernel, :func:`scores_by_fused_kernel`).

``--plain`` times the compression without a profiler (one untimed compression first, then
``--repeat`` timed ones, the fastest printed, over a second prefill's time): a launch-bound GPU run
pays cProfile's overhead on every launch. ``--pad-products N`` sets the multiply-adds a group of
Attention Matching's problems may add by padding
(:attr:`~kvfold.methods.compaction.attention_matching.solve.FitConfig.pad_products`; 0 is the CPU's
grouping) on whatever device, to time the two groupings against each other.
docs/benchmarks.md, "Profiling".
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from kvfold.evaluate.bench.process import context_ids
from kvfold.methods import build_method
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.budget import Budget
from kvfold.runtime.host_syncs import HostSyncCounter
from kvfold.runtime.live_bytes import FREED, LiveBytes
from kvfold.runtime.models import load_model
from kvfold.runtime.timing import device_clock


def _compress(source, method, budget: Budget, around=contextlib.nullcontext) -> tuple[float, dict]:
    """Compress a copy of the prefilled cache once, inside ``around()`` (the copy outside it)."""
    cache = source.cache.copy()
    ctx = source.compression_context(cache, budget, shared=source.shared)
    start = device_clock(source.model.device)
    with torch.inference_mode(), around():
        method.apply(ctx)
    return device_clock(source.model.device) - start, ctx.report


VIEWS = frozenset(
    {
        "alias", "as_strided", "chunk", "detach", "diagonal", "expand", "flatten", "mT", "narrow", "permute",
        "reshape", "select", "slice", "split", "squeeze", "t", "transpose", "unbind", "unflatten",
        "unsqueeze", "view", "_unsafe_view",
    }
)  # fmt: skip
"""Operators that make a view of a tensor: no kernel runs."""


CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
"""The CPU's fused attention (standing in for CUDA's flash kernel under ``--as-accelerator``): its products
are counted as torch's counter counts CUDA's (``sdpa_flop_count``: no discount for a causal mask)."""


def matmul_flops(a: torch.Size, b: torch.Size) -> int:
    """Floating-point operations of ``a @ b`` (``torch.matmul``'s broadcasting; a vector is a matrix of one row
    or column): ``2 · batch · m · k · n``. Under inference mode ``matmul`` and ``linear`` reach the counter
    whole, not as the ``bmm`` and ``mm`` that torch's formulas count."""
    a = (1, *a) if len(a) == 1 else tuple(a)
    b = (*b, 1) if len(b) == 1 else tuple(b)
    batch = torch.broadcast_shapes(a[:-2], b[:-2])
    return 2 * batch.numel() * a[-2] * a[-1] * b[-1]


COMPOSITE_FLOPS = {
    torch.ops.aten.matmul: lambda a, b, **_: matmul_flops(a.shape, b.shape),
    torch.ops.aten.linear: lambda x, w, bias=None, **_: matmul_flops(x.shape, w.shape[::-1]),
}
"""Products torch's formulas do not count, by their shapes."""


class OperatorCount(TorchDispatchMode):
    """Counts the operators dispatched inside it (views apart), by phase and by the kvfold function
    that called them, and the multiply-adds of their matrix products (twice: floating-point operations,
    ``torch.utils.flop_counter``'s formulas) by phase and function."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: Counter[str] = Counter()
        self.functions: Counter[str] = Counter()
        self.phase_flops: Counter[str] = Counter()
        self.function_flops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet.__name__ in VIEWS:
            self.views += 1
            return out
        phase, where = _caller_phase()
        self.phases[phase] += 1
        self.functions[where] += 1
        flops = 0
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet in COMPOSITE_FLOPS:
            flops = COMPOSITE_FLOPS[packet](*args, **kwargs)
        elif packet is CPU_FLASH:
            flops = sdpa_flop_count(args[0].shape, args[1].shape, args[2].shape)
        if flops:
            self.phase_flops[phase] += flops
            self.function_flops[where] += flops
        return out


HOST_BUFFERS = (
    ("repeat pass", "methods/core/repeat.py:query_buffer"),
    ("repeat pass", "methods/core/repeat.py:_padded_queries"),
)
"""Where tensors are made that a GPU holds in host memory (the repeat pass's queries, their validity and
chunks, made beside them: :func:`kvfold.methods.core.repeat.queries_on_host`): the ledger leaves them out."""


def _caller_phase() -> tuple[str, str]:
    """The phase of the operator being dispatched (``repeat pass``, ``fits``, ``other``) and the
    innermost kvfold function on the stack."""
    frame, where, phase = sys._getframe(2), "", "other"
    while frame is not None:
        path = frame.f_code.co_filename
        if "/kvfold/" in path and not where and not path.endswith(("host_syncs.py", "live_bytes.py")):
            where = f"{path.split('/kvfold/')[-1]}:{frame.f_code.co_name}"
        if path.endswith("core/repeat.py"):
            return "repeat pass", where
        if "/attention_matching/" in path:
            phase = "fits"
        frame = frame.f_back
    return phase, where


def as_accelerator() -> None:
    """Take, on this CPU, the paths and block sizes a GPU takes in 16 bits (for counting only)."""
    from kvfold.methods.compaction.attention_matching import queries, solve
    from kvfold.methods.core import repeat
    from kvfold.runtime import attention, exact_products

    exact_products.FORCED = True  # the fits' logits of 16-bit queries and keys: exact_products.float32_bmm
    attention._is_cpu = lambda device: False  # noqa: SLF001 - other devices' blocks
    attention._cpu_flash = lambda query: False  # noqa: SLF001 - not the CPU's own path, but
    attention.device_flash = lambda query: attention.FLASH_WITH_LSE  # its kernel standing in for CUDA's flash
    repeat.forward_tokens = lambda device, fresh: repeat.ACCELERATOR_FORWARD_CHUNK if fresh else repeat.FORWARD_CHUNK
    solve.fit_sizes = lambda device: solve.ACCELERATOR_FIT_SIZES
    queries.ReferenceQueries.on = _brought_to_device  # the host's queries copied to the device, one layer a fit
    solve._fused_statistics_apply = lambda *args: False  # noqa: SLF001 - the CPU's fused statistics
    score_rows = repeat.score_block_rows
    repeat.score_block_rows = lambda device, *sizes: score_rows(torch.device("cuda"), *sizes)  # KVzip's blocks


def _brought_to_device(held, device: torch.device):
    """A copy of a layer's reference queries, as :meth:`ReferenceQueries.on
    <kvfold.methods.compaction.attention_matching.queries.ReferenceQueries.on>` makes on a GPU from the
    host's (on the CPU they are already where the fit reads them)."""
    chunk = None if held.chunk is None else held.chunk.clone()
    return type(held)(held.queries.clone(), held.valid.clone(), chunk)


def count(source, method, budget: Budget, top: int) -> None:
    """Compress once counting operators and host reads; print them."""
    ops = OperatorCount()
    with HostSyncCounter() as syncs, ops:
        _compress(source, method, budget)
    total = sum(ops.phases.values())
    phases = ", ".join(f"{phase} {n:,}" for phase, n in ops.phases.most_common())
    print(f"operators {total:,} ({phases}); views {ops.views:,}; host reads {sum(syncs.kvfold.values()):,} in kvfold")
    for where, n in ops.functions.most_common(top):
        print(f"  {n:>8,}  {where}")
    flops = ", ".join(f"{phase} {n / 1e12:.3f}" for phase, n in ops.phase_flops.most_common())
    print(f"matrix products: {sum(ops.phase_flops.values()) / 1e12:.3f} TFLOP ({flops})")
    for where, n in ops.function_flops.most_common(top):
        print(f"  {n / 1e12:>10.4f} TFLOP  {where}")
    for where, n in syncs.kvfold.most_common(top):
        print(f"  {n:>8,}  read: {where}")


def scores_by_fused_kernel() -> None:
    """KVzip's scores as a GPU takes them in 16 bits, for the ledger: the Triton kernel
    (:func:`kvfold.runtime.key_scores.fused_max_logits`) holds only its output. The PyTorch path stands in for
    it, its blocks of logits made outside the ledger and its output copied inside."""
    from kvfold.runtime import key_scores

    blocked = key_scores.blocked_max_logits

    def stand_in(query, keys, shift, scaling, groups, block):
        with _disable_current_modes():
            best = blocked(query, keys, shift, scaling, groups, block)
        return best.clone()

    key_scores.blocked_max_logits = stand_in


def peak(source, method, budget: Budget, top: int, accelerator: bool = False) -> None:
    """Compress once under :class:`LiveBytes`; print the peak over the full cache's bytes (as ``kvfold bench``'s
    ``compress_peak_over_cache``) and what held it; ``accelerator``: what a GPU holds in host memory left out."""
    cache_bytes = source.cache.full_nbytes()
    ledger = LiveBytes(site=_caller_phase, left_out=HOST_BUFFERS if accelerator else ())
    _compress(source, method, budget, around=lambda: ledger)
    print(f"peak {ledger.peak / 2**20:,.1f} MiB over the start = {ledger.peak / cache_bytes:.3f} x the cache "
          f"({cache_bytes / 2**20:,.1f} MiB); held at the peak:")  # fmt: skip
    held = [(nbytes, phase, where) for (phase, where), nbytes in ledger.at_peak.most_common() if nbytes > 0]
    for nbytes, phase, where in held[:top]:
        print(f"  {nbytes / 2**20:>10,.1f} MiB  {phase:<11}  {where}")
    freed = ledger.at_peak.get(FREED, 0)
    print(f"  {freed / 2**20:>10,.1f} MiB  tensors made before the compression and freed by the peak")


def set_pad_products(products: int) -> None:
    """Every fit on this machine's devices pads its groups by ``products`` multiply-adds at most."""
    from dataclasses import replace

    from kvfold.methods.compaction.attention_matching import solve

    chosen = {device: replace(sizes, pad_products=products) for device, sizes in
              (("cpu", solve.CPU_FIT_SIZES), ("accelerator", solve.ACCELERATOR_FIT_SIZES))}  # fmt: skip
    solve.fit_sizes = lambda device: chosen["cpu" if device.type == "cpu" else "accelerator"]


def plain(source, method, budget: Budget, prefill: float, repeat: int, label: str) -> None:
    """One untimed compression, then the fastest of ``repeat`` timed ones, without a profiler."""
    _compress(source, method, budget)
    best = min(_compress(source, method, budget)[0] for _ in range(max(1, repeat)))
    print(f"{label}: prefill {prefill:.3f} s, compression {best:.3f} s ({best / prefill:.2f} prefills), "
          f"fastest of {max(1, repeat)} after one untimed")  # fmt: skip


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
    parser.add_argument("--count", action="store_true", help="count operators and host reads instead of timing")
    parser.add_argument("--peak", action="store_true", help="the peak memory of the tensors made, and their holders")
    parser.add_argument(
        "--as-accelerator", action="store_true", help="with --count or --peak: a GPU's paths and block sizes"
    )
    parser.add_argument("--plain", action="store_true", help="time the compression without a profiler")
    parser.add_argument("--repeat", type=int, default=2, help="with --plain: timed compressions (the fastest)")
    parser.add_argument("--pad-products", type=int, default=None, help="the fits' padding budget (default: by device)")
    args = parser.parse_args()
    if args.as_accelerator:
        as_accelerator()
    if args.pad_products is not None:
        set_pad_products(args.pad_products)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = context_ids(tokenizer, args.length, 1).to(model.device)
    method = build_method(args.method)
    budget = Budget.parse(float(args.budget) if "." in args.budget else int(args.budget))
    with torch.inference_mode():
        start = device_clock(model.device)
        source = prefill_ids(model, tokenizer, ids, capture_window=64, methods=[method])
        prefill = device_clock(model.device) - start  # the first prefill: warm-up included
        if args.plain:  # a warm prefill is the unit
            start = device_clock(model.device)
            source = prefill_ids(model, tokenizer, ids, capture_window=64, methods=[method])
            prefill = device_clock(model.device) - start
    if args.count:
        count(source, method, budget, args.top)
        return
    if args.peak:
        if args.as_accelerator:
            scores_by_fused_kernel()
        peak(source, method, budget, args.top, args.as_accelerator)
        return
    if args.plain:
        padding = "by device" if args.pad_products is None else f"{args.pad_products:,}"
        label = f"{args.method} at {args.budget}, {args.length} tokens, pad_products {padding}"
        plain(source, method, budget, prefill, args.repeat, label)
        return
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
    if args.ops:  # by host time, and on a GPU by device time too
        cuda = model.device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            _compress(source, method, budget)
        for sort in ["self_cpu_time_total"] + (["self_cuda_time_total"] if cuda else []):
            print(prof.key_averages().table(sort_by=sort, row_limit=args.top))


if __name__ == "__main__":
    main()
