"""Profile a few decode steps of a compressed (or full) cache with ``torch.profiler``.

Usage::

    python benchmarks/profile_decode.py --length 4096 --method kvzip --budget 0.1 [--memory 1/16]
        [--model smollm2-135m] [--device cpu] [--steps 4] [--top 25] [--compiled]

Prefills ``--length`` tokens of the bench's prose (:func:`kvfold.evaluate.bench.process.context_ids`),
compresses with ``--method`` at ``--budget`` (or the memory budget ``--memory``), decodes a few
warm-up steps, then profiles ``--steps`` greedy steps and prints the operators with the most self
time (CPU, and CUDA on a GPU), with their call counts per step. It also counts, per step, the
operations that make a CUDA host wait for the device (``.item()``, ``.tolist()``, ``bool()`` or
``int()`` of a tensor, ``nonzero``, boolean-mask indexing; :mod:`kvfold.runtime.host_syncs`), those
made inside kvfold's own code and in the rest of the step apart, and the operator calls and (on CUDA)
the kernel or graph launches a step. ``--compiled`` decodes through
:class:`kvfold.pipeline.compiled_decode.CompiledDecode`. docs/benchmarks.md, "Profiling".
"""

from __future__ import annotations

import argparse
import time

import torch

from kvfold.evaluate.bench.process import context_ids
from kvfold.pipeline.compiled_decode import CompiledDecode
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.host_syncs import HostSyncCounter
from kvfold.runtime.models import load_model


def _memory(text: str | None) -> float | None:
    if text is None:
        return None
    if "/" in text:
        top, bottom = text.split("/")
        return float(top) / float(bottom)
    return float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--budget", default="0.1")
    parser.add_argument("--memory", default=None, help="a memory budget (e.g. 1/16) in place of --budget")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    parser.add_argument(
        "--compiled", action="store_true", help="decode through torch.compile over fixed tails (CompiledDecode)"
    )
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    ids = context_ids(tokenizer, args.length, 1).to(model.device)
    with torch.inference_mode():
        source = prefill_ids(model, tokenizer, ids, capture_window=64, methods=[args.method])
        if args.method == "full":
            cache, policy = source.cache, None
        else:
            start = time.perf_counter()
            memory = _memory(args.memory)
            budget = None if memory is not None else float(args.budget) if "." in args.budget else int(args.budget)
            compressed = source.compress(args.method, budget, memory=memory)
            print(f"compressed in {time.perf_counter() - start:.2f} s: {compressed.kv_bytes / 2**20:.2f} MB")
            cache, policy = compressed.cache, compressed.policy
        cache.policy = policy
        token = source.last_logits.argmax(-1)[:, None]
        compiled = CompiledDecode(model, cache, args.warmup + 1 + 2 * args.steps) if args.compiled else None

        def step() -> None:
            nonlocal token
            if compiled is not None:
                token = compiled.step(token[:, 0]).argmax(-1)[:, None]
                return
            position = torch.full((1, 1), cache.get_seq_length(), device=token.device)
            logits = model(input_ids=token, position_ids=position, past_key_values=cache).logits[:, -1]
            token = logits.argmax(-1)[:, None]

        for _ in range(args.warmup):
            step()
        counter = HostSyncCounter()
        with counter:
            step()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if model.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.steps):
                step()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        per_step = (time.perf_counter() - start) / args.steps
    layers = len(cache.folded_layers)
    how = " compiled" if args.compiled else ""
    print(f"{args.method} at {args.memory or args.budget}{how}, {args.length} tokens, {layers} layers, "
          f"{per_step * 1000:.1f} ms a step unprofiled ({torch.get_num_threads()} threads)")  # fmt: skip
    print(f"host synchronisations in one step: {counter.summary()}")
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or "GraphLaunch" in e.key) / args.steps
    operators = sum(e.count for e in events if e.key.startswith("aten::")) / args.steps
    print(f"a step: {operators:.0f} aten operator calls, {launches:.0f} kernel or graph launches (CUDA)")
    sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if model.device.type == "cuda" else [])
    for sort in sorts:  # on a GPU, the host's time (launches, Python) and the device's apart
        print(f"by {sort}, {args.steps} steps:")
        print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
