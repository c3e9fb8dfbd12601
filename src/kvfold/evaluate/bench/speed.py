"""``kvfold bench``: prefill, compression and decode speed and memory, as ratios against ``full``.

Each configuration (method, budget, length, batch) runs in its own process so that its peak
resident memory is its own. ``full`` runs in the same invocation at every length, which gives two
ratios per configuration:

* ``speedup`` = decode tokens/s of the method / decode tokens/s of ``full`` at the same length;
* ``limit_speedup`` = decode tokens/s of ``full`` on a context as long as the compressed cache
  (⌈budget × length⌉ tokens) / decode tokens/s of ``full`` at ``length`` — a compressed cache
  cannot decode faster than an uncompressed one of its size, so this is the practical ceiling.

The ``full`` cache of the compressed size (the *reference*) is prefilled in the method's own
process, after its peak memory is read, and its decode steps alternate with the method's: on a
shared machine the speed of one process drifts by 20–30% from one run to the next, and
``speedup / limit_speedup`` = method / reference is then a paired measurement. Decode speed is
the batch over the median step time of the measured steps (warm-up steps excluded).

The configurations are measured by :class:`BenchItem` s, one per (length, batch): ``full`` first,
then every method at that length, each in a process of its own. Serially the items run one after
the other here; with ``kvfold bench --ray`` (:func:`kvfold.evaluate.running.distributed.run_on_ray`) each
item runs on one Ray worker, so every ``speedup`` divides by a ``full`` measured on the same worker
(see the README, "Sweeps on a Ray cluster", for what such timings mean).

Compression time is reported against two references measured in the method's own process:

* ``compress_over_prefill`` = compression seconds / prefill seconds of the same context;
* ``compress_over_repeat`` = compression seconds / seconds of the repeat pass alone
  (:func:`kvfold.methods.core.repeat.repeat_pass` with nothing recorded: the forward pass
  "Repeat the previous context" over a copy of the cache that KVzip, Kim et al. 2025 §3, and
  Attention Matching's repeat-prefill queries, Zweiger et al. 2026 §3.1, cannot avoid). The pass
  is timed once per configuration, before compression, only for a method that runs it
  (``method.uses_repeat_pass``) and without ``--prefill-chunk``; otherwise ``repeat_s`` and the
  ratio are None.

Memory of the compression (without ``--prefill-chunk``): ``compress_peak_mb`` is its peak over what
the prefilled process held when it began (:class:`~kvfold.evaluate.bench.process.PeakOver`: the
resident set's high-water mark reset after the prefill on Linux, torch's allocator peak on CUDA),
and ``compress_peak_over_cache`` that peak over the full cache's bytes: the working memory a
method needs beyond the cache it compresses. ``scaling.png`` plots it and ``compress_over_prefill``
against the length.

This module runs the measurements. What a configuration and its record are, and the records file a
run resumes from: :mod:`kvfold.evaluate.bench.records`; the files a finished bench writes
(``bench.json``, ``bench.md``, the plots): :mod:`kvfold.evaluate.bench.report`.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfold.evaluate.bench.process import (
    DECODE_MMAP_THRESHOLD,
    MEASURED_MMAP_THRESHOLD,
    PeakOver,
    context_ids,
    peak_rss_mb,
    release_freed_memory,
    set_mmap_threshold,
    spawn_worker,
    worker_main,
)
from kvfold.evaluate.bench.records import (
    RECORDS_FILE,
    STOCK,
    BenchConfig,
    compression_ratios,
    config_key,
    load_finished_records,
)
from kvfold.evaluate.bench.report import write_bench_report
from kvfold.methods import build_method
from kvfold.methods.core.repeat import SCORE_FIELDS
from kvfold.pipeline.memory import plan_memory
from kvfold.runtime.attention import log_sum_exp_path
from kvfold.runtime.errors import UserError
from kvfold.runtime.exact_products import products_path
from kvfold.runtime.files import DirectoryLock
from kvfold.runtime.key_scores import scores_path
from kvfold.runtime.models import load_model
from kvfold.runtime.timing import device_clock

WARMUP_STEPS = 4


def run_config(config: BenchConfig) -> dict:
    """Measure one configuration in this process (called in a child process by :func:`bench`).

    After prefill and compression the peak memory is read; then, for a compressing method, the
    reference (``full`` on ⌈budget × length⌉ tokens) is prefilled and decoded step for step
    alongside the method (:func:`_decode_interleaved`).
    """
    import torch

    from kvfold.pipeline.chunked import prefill_chunked
    from kvfold.pipeline.context import check_length, prefill_ids
    from kvfold.runtime.budget import Budget

    if config.method in STOCK:
        return run_stock(config)
    model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    if config.positions is not None:
        extend_positions(model, config.positions)
    check_length(model, config.length)  # the context must fit; timed decode steps may run past it (speed only)
    base_rss = peak_rss_mb()
    if config.bounded_memory:  # what a chunked sweep measures: see set_mmap_threshold
        set_mmap_threshold(MEASURED_MMAP_THRESHOLD)
    ids = context_ids(tokenizer, config.length, config.batch).to(model.device)
    method = build_method(config.method)
    budget = 1.0 if method.is_identity else config.budget
    repeat_s = compress_peak_mb = None
    if config.memory is not None and config.prefill_chunk:
        raise UserError("--memory applies to one-shot compression; leave out --prefill-chunk")
    with torch.inference_mode():
        if config.prefill_chunk:
            compressed = prefill_chunked(model, tokenizer, ids, method, budget, config.prefill_chunk)
            prefill_s = compressed.source.prefill_seconds
        else:
            source = prefill_ids(model, tokenizer, ids, capture_window=64, methods=[method])
            prefill_s = source.prefill_seconds
            if config.memory is not None and not method.is_identity:
                spent = plan_memory(config.memory, method, source.cache, config.length)
                method = dataclasses.replace(method, quant=spent.quant, precision_fixed=True)
                budget = spent.tokens
            if method.uses_repeat_pass and not method.is_identity:
                repeat_s = time_repeat_pass(source)
            peak = PeakOver(model.device).start()
            compressed = _compress_in_place(source, method, budget)
            compress_peak_mb = peak.stop()
        memory_fields = compressed.memory_record()
        memory_fields["memory"] = config.memory
        kv_bytes_full = compressed.cache.full_nbytes()
        peak_rss = peak_rss_mb()  # the process's peak (ru_maxrss): prefill and compression, not the reference
        if config.bounded_memory:
            set_mmap_threshold(DECODE_MMAP_THRESHOLD)
        release_freed_memory()
        runs = [compressed]
        reference_length = None
        if not method.is_identity:
            reference_length = Budget.parse(budget).count(config.length)
            reference_ids = context_ids(tokenizer, reference_length, config.batch).to(model.device)
            runs.append(prefill_ids(model, tokenizer, reference_ids, capture_window=0))
        speeds = _decode_interleaved(model, runs, config.new_tokens, config.compiled)
    return {
        **asdict(config),
        "budget": config.budget if not method.is_identity else 1.0,
        "prefill_s": prefill_s,
        "compress_s": compressed.compress_seconds,
        "repeat_s": repeat_s,
        "decode_tokens_per_s": speeds[0],
        "reference_length": reference_length or config.length,
        "reference_tokens_per_s": speeds[1] if reference_length else speeds[0],
        "peak_rss_mb": peak_rss,
        "base_rss_mb": base_rss,
        "compress_peak_mb": compress_peak_mb,
        "compress_peak_over_cache": None if compress_peak_mb is None else compress_peak_mb * 2**20 / kv_bytes_full,
        **memory_fields,
        "kv_bytes_reserved": compressed.kv_bytes_reserved,
        "physical_tokens": max(layer.physical_length for _, layer in compressed.cache.folded_layers),
        "quantized_attention": quantized_attention_path(compressed.cache, model.device, config.compiled),
        "stored_attention": stored_attention_path(compressed.cache, model.device, config.compiled),
        "repeat_attention": None if repeat_s is None else log_sum_exp_path(model.device, model.dtype),
        "repeat_scores": scores_path(model.device, model.dtype) if repeat_pass_scores(method, repeat_s) else None,
        "fit_products": products_path(model.device, model.dtype) if method.fits_by_attention_matching else None,
    }


def repeat_pass_scores(method, repeat_s: float | None) -> bool:
    """Whether the method's repeat pass scored the context's entries (KVzip's scores, any variant)."""
    return repeat_s is not None and bool(method.repeat_records().intersection(SCORE_FIELDS))


def quantized_attention_path(cache, device, compiled: bool = False) -> str | None:
    """How a decode step read the quantized entries: ``native`` (the CPU's compiled kernel,
    :mod:`kvfold.runtime.native`), ``triton`` (the GPU's kernel, :mod:`kvfold.runtime.triton_attention`)
    or ``torch (why)``; None for a cache held unquantized. ``compiled``: a compiled decode
    (``--compiled``), which on the CPU reads codes by the PyTorch path that the compiler fuses."""
    if cache.quant is None:
        return None
    if getattr(device, "type", str(device)) != "cpu":
        stored = [layer.stored for _, layer in cache.folded_layers if layer.stored is not None]
        return _triton_or_why(stored, str(cache.quant))
    if compiled:
        return "torch (compiled: the C kernel is outside any graph)"
    from kvfold.runtime.native import status

    return status()


def stored_attention_path(cache, device, compiled: bool = False) -> str | None:
    """How a decode step read the stored rows, whatever their format: on a GPU ``triton (N programs a
    layer, at most K pages each)`` (the median layer's splits, :class:`kvfold.runtime.pages.PageSplits`)
    or ``torch (why)``; on the CPU as :func:`quantized_attention_path` says for quantized rows, ``torch``
    for rows at full precision; None where no layer holds stored rows (the full cache, or rows of lengths
    close enough to be held padded in the dense tail)."""
    stored = [layer.stored for _, layer in cache.folded_layers if layer.stored is not None]
    if not stored:
        return None
    if cache.quant is not None:
        path = quantized_attention_path(cache, device, compiled)
    elif getattr(device, "type", str(device)) == "cpu":
        return "torch"
    else:
        path = _triton_or_why(stored, "these rows")
    splits = [rows.pages.splits for rows in stored if rows.pages.count]  # built as a decode builds them
    if path != "triton" or not splits:
        return path
    programs = statistics.median_low(split.count for split in splits)
    return f"triton ({programs} programs a layer, at most {max(s.per_split for s in splits)} pages each)"


def _triton_or_why(stored: list, what: str) -> str:
    """``triton`` where the Triton kernel reads every one of ``stored`` on a GPU, else ``torch (why)``."""
    from kvfold.runtime.triton_attention import available, reads_rows

    if not available():
        return "torch (Triton is not installed)"
    return "triton" if all(map(reads_rows, stored)) else f"torch (the Triton kernel does not read {what})"


def extend_positions(model, positions: int) -> None:
    """Let ``model`` take contexts of up to ``positions`` tokens (its config's
    ``max_position_embeddings``): for measuring cost beyond the trained window (``--positions``).

    Raises:
        ValueError: fewer positions than the model has, or a model without rotary positions.
    """
    config = model.config.get_text_config(decoder=True)
    own = getattr(config, "max_position_embeddings", None)
    if own is None or positions < own:
        raise UserError(f"--positions must be at least the model's {own} positions; got {positions}")
    if not any("rotary" in name for name, _ in model.named_modules()):
        raise UserError("--positions needs a model with rotary positions (RoPE); this one has none")
    config.max_position_embeddings = positions


def time_repeat_pass(source) -> float:
    """Seconds of the repeat pass alone over ``source``'s prefilled cache (copies of it; nothing
    recorded, the default chunk): the one model pass a repeat-pass method cannot avoid."""
    import torch

    from kvfold.methods.core.repeat import repeat_pass
    from kvfold.runtime.budget import Budget

    ctx = source.compression_context(source.cache, Budget.parse(1.0))
    start = device_clock(source.model.device)
    with torch.inference_mode():
        repeat_pass(ctx, scores=False, queries=False)
    return device_clock(source.model.device) - start


def _compress_in_place(source, method, budget):
    """Like :meth:`PrefilledContext.compress` but without copying the full cache first."""
    import torch

    from kvfold.pipeline.context import CompressedContext
    from kvfold.runtime.budget import Budget

    parsed = Budget.parse(budget)
    ctx = source.compression_context(source.cache, parsed, shared=source.shared)  # the prefill's plan: what to record
    start = device_clock(source.model.device)
    with torch.inference_mode():
        policy = method.apply(ctx)  # compression, then the storage the method names (quantized or not)
    return CompressedContext(
        source=source,
        method=method,
        budget=parsed,
        cache=source.cache,
        policy=policy,
        compress_seconds=device_clock(source.model.device) - start,
        report=ctx.report,
    )


def _decode_interleaved(model, contexts: list, new_tokens: int, compiled: bool = False) -> list[float]:
    """Greedy decode of every context, one step of each in turn; steady-state tokens/s of each.

    Each context is a :class:`~kvfold.pipeline.context.CompressedContext` (its cache decodes under its
    online policy) or a :class:`~kvfold.pipeline.context.PrefilledContext` (a full cache) (see
    :func:`time_interleaved`); with ``compiled``, through :func:`_compiled_step` (no online policy)."""
    steppers = []
    for context in contexts:
        cache = context.cache
        cache.policy = getattr(context, "policy", None)
        source = getattr(context, "source", context)
        step = _compiled_step(model, cache, new_tokens) if compiled else _cache_step(model, cache)
        steppers.append(Stepper(source.last_logits.argmax(-1), step))
    return time_interleaved(steppers, new_tokens)


@dataclass
class Stepper:
    """One greedy decode: its last tokens ``(B,)`` and ``step(tokens) -> logits (B, vocab)`` (one forward
    of one new token a row over its own cache), with ``prepare()`` run before each step, untimed."""

    tokens: Any
    step: Callable[[Any], Any]
    prepare: Callable[[], None] = lambda: None


def _cache_step(model, cache) -> Callable[[Any], Any]:
    """A decode step over a cache that counts its own positions (kvfold's, transformers' dynamic one)."""
    import torch

    def step(tokens):
        position = torch.full((tokens.shape[0], 1), cache.get_seq_length(), device=tokens.device)
        return model(input_ids=tokens[:, None], position_ids=position, past_key_values=cache).logits[:, -1]

    return step


def _compiled_step(model, cache, new_tokens: int) -> Callable[[Any], Any]:
    """A decode step over kvfold's cache with fixed tails, compiled once (:class:`CompiledDecode`; its
    first steps, which compile, are among the untimed warm-up steps)."""
    from kvfold.pipeline.compiled_decode import CompiledDecode

    return CompiledDecode(model, cache, WARMUP_STEPS + new_tokens).step


def time_interleaved(steppers: list[Stepper], new_tokens: int) -> list[float]:
    """Run every decode one step at a time in turn, the order alternating from step to step; the
    steady-state tokens/s of each: the batch over the median time of the ``new_tokens`` steps after
    :data:`WARMUP_STEPS` warm-up steps, summed over the batch."""
    times: list[list[float]] = [[] for _ in steppers]
    for step in range(WARMUP_STEPS + new_tokens):
        order = range(len(steppers)) if step % 2 == 0 else reversed(range(len(steppers)))
        for index in order:
            stepper = steppers[index]
            stepper.prepare()
            device = stepper.tokens.device
            start = device_clock(device)
            stepper.tokens = stepper.step(stepper.tokens).argmax(-1)
            if step >= WARMUP_STEPS:
                times[index].append(device_clock(device) - start)
    return [s.tokens.shape[0] / statistics.median(steps) for s, steps in zip(steppers, times, strict=True)]


def run_stock(config: BenchConfig) -> dict:
    """Measure stock transformers (:data:`STOCK`) at ``config``'s length, decoded step for step with
    kvfold's full cache of the same context in the same process (the reference), so
    ``speedup_over_limit`` is stock over kvfold's full cache, paired: kvfold's own overhead as a ratio."""
    import torch
    from transformers import DynamicCache, StaticCache

    from kvfold.pipeline.context import check_length, prefill_ids

    model, tokenizer = load_model(config.model, dtype=config.dtype, device=config.device)
    if config.positions is not None:
        extend_positions(model, config.positions)
    check_length(model, config.length)
    base_rss = peak_rss_mb()
    ids = context_ids(tokenizer, config.length, config.batch).to(model.device)
    with torch.inference_mode():
        reference = _compress_in_place(prefill_ids(model, tokenizer, ids, capture_window=0), build_method("full"), 1.0)
        memory = reference.memory_record()  # before decoding grows it
        model.set_attn_implementation("sdpa")
        start = device_clock(model.device)
        if config.method == "stock":
            cache = DynamicCache(config=model.config)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            step = _cache_step(model, cache)
        else:
            room = config.length + WARMUP_STEPS + config.new_tokens + 1
            cache = StaticCache(config=model.config, max_cache_len=room)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            step = _static_step(model, cache, config.length)
        prefill_s = device_clock(model.device) - start
        peak_rss = peak_rss_mb()
        release_freed_memory()
        kvfold_step = (
            _compiled_step(model, reference.cache, config.new_tokens)
            if config.compiled
            else _cache_step(model, reference.cache)
        )

        def attention(name: str) -> Callable[[], None]:
            return lambda: model.set_attn_implementation(name)

        speeds = time_interleaved(
            [
                Stepper(logits.argmax(-1), step, attention("sdpa")),
                Stepper(reference.source.last_logits.argmax(-1), kvfold_step, attention("kvfold")),
            ],
            config.new_tokens,
        )
    return {
        **asdict(config),
        "budget": 1.0,
        "prefill_s": prefill_s,
        "compress_s": 0.0,
        "repeat_s": None,
        "decode_tokens_per_s": speeds[0],
        "reference_length": config.length,
        "reference_tokens_per_s": speeds[1],
        "peak_rss_mb": peak_rss,
        "base_rss_mb": base_rss,
        "compress_peak_mb": None,
        "compress_peak_over_cache": None,
        **memory,
        "kv_bytes_reserved": 0,
        "physical_tokens": config.length,
        "quantized_attention": None,
        "stored_attention": None,
        "stock": STOCK[config.method],
    }


def _static_step(model, cache, length: int) -> Callable[[Any], Any]:
    """A decode step over transformers' static cache through the compiled forward (``reduce-overhead``
    on CUDA: CUDA graphs; the default mode elsewhere), positions counted here (``length`` filled)."""
    import torch

    mode = "reduce-overhead" if next(model.parameters()).device.type == "cuda" else None
    forward = torch.compile(model.forward, mode=mode, dynamic=False)  # a graph break slows it, fails nothing
    filled = [length]

    def step(tokens):
        position = torch.full((1,), filled[0], dtype=torch.long, device=tokens.device)
        filled[0] += 1
        out = forward(
            input_ids=tokens[:, None],
            past_key_values=cache,
            cache_position=position,
            position_ids=position[None].expand(tokens.shape[0], 1),
            use_cache=True,
        )
        return out.logits[:, -1].clone()  # CUDA graphs reuse their output buffers

    return step


WORKER_ERRORS = ("UserError", "NotImplementedError", "ModelLoadError", "SpecError", "QuantSpecError")
"""What a measuring process fails on when the input is wrong (said plainly, not as a crash)."""


def _spawn(config: BenchConfig, timeout: float | None = None, threads: int | None = None) -> dict:
    """Run one configuration in a fresh Python process and return its record (:func:`spawn_worker`).

    ``threads`` sets the child's ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` (a Ray worker's CPU
    share); None leaves the environment as it is (torch's default: every core).
    """
    where = f"{config.method} @ {config.length} tokens x {config.batch}"
    options = {"what": "bench worker", "user_errors": WORKER_ERRORS, "timeout": timeout, "threads": threads}
    return spawn_worker("kvfold.evaluate.bench.speed", "config", asdict(config), where=where, **options)


def plan(
    model: str,
    methods: list[str],
    budgets: list[float | int],
    lengths: list[int],
    batches: list[int],
    new_tokens: int,
    prefill_chunk: int | None,
    dtype: str = "auto",
    device: str = "auto",
    positions: int | None = None,
    memory: bool = False,
    compiled: bool = False,
) -> tuple[list[BenchConfig], list[BenchConfig]]:
    """The method configurations and the ``full`` runs at every length and batch.

    (``full`` at each compressed size is measured inside the method's own process.) With
    ``memory`` the budgets are memory budgets (``--memory``); with ``compiled`` kvfold's decode steps
    are compiled (:attr:`BenchConfig.compiled`).
    """
    runs, refs = [], {}
    bounded = prefill_chunk is not None
    for length in lengths:
        for batch in batches:
            refs[(length, batch)] = BenchConfig(
                model, "full", 1.0, length, batch, new_tokens, None, dtype, device, bounded, positions
            )
            for method in methods:
                if method == "full":
                    continue
                if method in STOCK:  # no budget: the full cache, as transformers holds it
                    runs.append(
                        BenchConfig(
                            model, method, 1.0, length, batch, new_tokens, None, dtype, device, bounded, positions
                        )
                    )
                    continue
                for budget in budgets:
                    runs.append(
                        BenchConfig(
                            model,
                            method,
                            budget,
                            length,
                            batch,
                            new_tokens,
                            prefill_chunk,
                            dtype,
                            device,
                            bounded,
                            positions,
                            budget if memory else None,
                        )
                    )
    if compiled:
        runs = [dataclasses.replace(c, compiled=True) for c in runs]
        refs = {key: dataclasses.replace(c, compiled=True) for key, c in refs.items()}
    return runs, list(refs.values())


@dataclass(frozen=True)
class BenchItem:
    """One (length, batch) of a bench sweep: ``full`` and every method configuration at it.

    The unit of work of ``kvfold bench`` (a :class:`~kvfold.evaluate.running.runner.SweepItem`): its
    configurations are measured one after the other, each in a child process of its own, on one
    machine, so each method's ``speedup`` divides by a ``full`` measured there.

    Attributes:
        index: position of the item in the sweep.
        configs: ``full`` first, then the method configurations, in the serial order.
        skip: configuration keys already measured (earlier runs, or an earlier attempt).
        threads: threads of each child process (``OMP_NUM_THREADS``); None: torch's default.
    """

    index: int
    configs: tuple[BenchConfig, ...]
    skip: frozenset[str] = frozenset()
    threads: int | None = None

    @property
    def label(self) -> str:
        """What this item is, for messages."""
        return f"length {self.configs[0].length} x batch {self.configs[0].batch}"

    def unit_keys(self) -> list[str]:
        """The keys of the records this item produces, in the order it produces them."""
        return [key for key in map(config_key, self.configs) if key not in self.skip]

    @staticmethod
    def row_key(row: Mapping[str, Any]) -> str:
        """The key of a record (:func:`config_key`)."""
        return config_key(dict(row))

    def run(
        self, model: Any = None, tokenizer: Any = None, status: Callable[[str], None] | None = None
    ) -> Iterator[dict]:
        """Measure the configurations not in ``skip`` (the model is loaded by each child, not here)."""
        for config in self.configs:
            if config_key(config) in self.skip:
                continue
            if status is not None:
                status(f"{config.method} @ {config.budget}, {config.length} tokens x {config.batch}")
            yield _spawn(config, threads=self.threads) if self.threads else _spawn(config)


def plan_items(
    runs: list[BenchConfig], refs: list[BenchConfig], done: Mapping[str, Any] = {}, threads: int | None = None
) -> list[BenchItem]:
    """One :class:`BenchItem` per (length, batch) that has a configuration not in ``done``."""
    items: list[BenchItem] = []
    for ref in refs:
        configs = (ref, *(c for c in runs if (c.length, c.batch) == (ref.length, ref.batch)))
        keys = [config_key(c) for c in configs]
        if any(key not in done for key in keys):
            items.append(BenchItem(len(items), configs, frozenset(k for k in keys if k in done), threads))
    return items


def bench(
    model: str = "smollm2-135m",
    methods: list[str] | None = None,
    budgets: list[float | int] | None = None,
    lengths: list[int] | None = None,
    batches: list[int] | None = None,
    new_tokens: int = 64,
    prefill_chunk: int | None = None,
    out_dir: str | Path | None = None,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    runner: Any = None,
    threads: int | None = None,
    positions: int | None = None,
    memory: bool = False,
    compiled: bool = False,
) -> dict:
    """Run the benchmark and write ``bench.json``, ``bench.md`` and ``bench.png`` into ``out_dir``.

    Every finished configuration is appended to ``out_dir/records.jsonl`` at once; a run started
    again on the same directory reuses the configurations found there and measures only the rest.

    ``runner`` measures the :class:`BenchItem` s (an :data:`~kvfold.evaluate.running.runner.ItemRunner`:
    by default one after the other here; :class:`kvfold.evaluate.running.distributed.RayRunner` on Ray
    workers, which adds ``ray_workers`` to the result: who measured what). ``threads`` sets each
    measuring process's threads (None: torch's default). ``positions`` raises the model's positions
    for lengths past its window (:func:`extend_positions`; cost only). With ``memory`` the budgets
    are memory budgets (fractions of the 16-bit full cache's bytes, ``--memory``); ``compiled``: ``--compiled``.

    Returns:
        ``{"records": [...]}``: per configuration ``prefill_s``, ``compress_s``,
        ``decode_tokens_per_s``, ``peak_rss_mb``, ``kv_bytes``, ``kv_bytes_full``, ``speedup``,
        ``limit_speedup``, ``speedup_over_limit``, the reference's ``reference_length`` and
        ``reference_tokens_per_s``, ``repeat_s``, ``compress_over_prefill`` and
        ``compress_over_repeat`` (module docstring).
    """
    from kvfold.evaluate.running.runner import collect_rows, local_runner
    from kvfold.evaluate.running.sweep import keep_on_interrupt

    runs, refs = plan(
        model,
        methods or ["streamingllm"],
        budgets or [0.1],
        lengths or [2048],
        batches or [1],
        new_tokens,
        prefill_chunk,
        dtype,
        device,
        positions,
        memory,
        compiled,
    )
    folder = Path(out_dir) if out_dir is not None else None
    with DirectoryLock(folder) if folder is not None else nullcontext():
        done = load_finished_records(folder) if folder is not None else {}
        done = {key: r for key, r in done.items() if "reference_tokens_per_s" in r}  # older kvfold: measure again
        items = plan_items(runs, refs, done, threads)
        path = folder / RECORDS_FILE if folder is not None else None
        with keep_on_interrupt(path, "configuration"):
            collect_rows(
                runner or local_runner(None, None),
                items,
                done,
                path=path,
                total=len(runs) + len(refs),
                progress=progress,
                desc="kvfold bench",
                unit="configuration",
            )
        result: dict[str, Any] = {"model": model, "records": _with_ratios(runs, refs, done)}
        worker_of = getattr(runner, "worker_of", None)
        if worker_of is not None:  # on Ray: the worker (host:pid) that measured each configuration of this run
            result["ray_workers"] = {
                _describe(c): worker_of[config_key(c)] for c in [*refs, *runs] if config_key(c) in worker_of
            }
        if folder is not None:
            write_bench_report(result, folder)
    return result


def _with_ratios(runs: list[BenchConfig], refs: list[BenchConfig], done: Mapping[str, dict]) -> list[dict]:
    """The records of a sweep, ``full`` first, with their ratios to ``full`` at the same length and
    batch (``speedup``, ``limit_speedup``, ``speedup_over_limit``) and :func:`compression_ratios`."""
    measured = {(c.length, c.batch): done[config_key(c)] for c in refs}
    records = [done[config_key(c)] for c in runs]
    full_records = [measured[(c.length, c.batch)] for c in refs]
    for record in records:
        full = measured[(record["length"], record["batch"])]
        record["speedup"] = record["decode_tokens_per_s"] / full["decode_tokens_per_s"]
        record["limit_speedup"] = record["reference_tokens_per_s"] / full["decode_tokens_per_s"]
        record["speedup_over_limit"] = record["decode_tokens_per_s"] / record["reference_tokens_per_s"]
    for record in full_records:
        record.update(speedup=1.0, limit_speedup=1.0, speedup_over_limit=1.0)
    for record in [*full_records, *records]:
        record.update(compression_ratios(record))
    return [*full_records, *records]


def _describe(config: BenchConfig) -> str:
    """``"streamingllm @ 0.1, 2048 tokens x 1"``."""
    return f"{config.method} @ {config.budget}, {config.length} tokens x {config.batch}"


WORKERS = {"config": lambda raw: run_config(BenchConfig(**raw))}
"""The measurement a worker process runs (:func:`_spawn`)."""

if __name__ == "__main__":
    raise SystemExit(worker_main("kvfold.evaluate.bench.speed", WORKERS))
