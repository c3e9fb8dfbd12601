"""What ``kvfold bench`` measures and records, below its runner and its report.

A configuration (:class:`BenchConfig`, which may name a stock-transformers method of :data:`STOCK`),
its identity (:func:`config_key`: a resumed run skips the configurations already measured, and a
report merges benches by it), the records file a run appends to (:data:`RECORDS_FILE`,
:func:`load_finished_records`) and the compression ratios derived from a record
(:func:`compression_ratios`). The runner is :mod:`kvfold.evaluate.bench.speed`; the report,
:mod:`kvfold.evaluate.bench.report`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kvfold.runtime.files import read_jsonl


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration."""

    model: str
    method: str
    budget: float | int
    length: int
    batch: int
    new_tokens: int = 64
    prefill_chunk: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    bounded_memory: bool = False
    """Peak RSS with glibc's mmap threshold fixed (every configuration of a ``--prefill-chunk``
    sweep, ``full`` included; see :func:`~kvfold.evaluate.bench.process.set_mmap_threshold`)."""
    positions: int | None = None
    """The model's positions raised to this many (``--positions``; RoPE past the trained window:
    the answers mean nothing, the costs are the model's), or None: the model's own."""
    memory: float | None = None
    """A memory budget (``--memory``: a fraction of the 16-bit full cache's bytes) in place of
    ``budget``, spent on tokens × bits by :func:`kvfold.pipeline.memory.plan_memory`."""
    compiled: bool = False
    """kvfold's decode steps (the method's, and ``full``'s beside it) through ``torch.compile`` over fixed
    tails (``--compiled``; :class:`kvfold.pipeline.compiled_decode.CompiledDecode`; CUDA graphs on a GPU)."""


STOCK = {
    "stock": "transformers' DynamicCache with SDPA, eager",
    "stock-static": "transformers' StaticCache with SDPA, the forward compiled (torch.compile; CUDA graphs on a GPU)",
}
"""Stock transformers measured by ``kvfold bench`` beside kvfold (``--methods full,stock,stock-static``)."""


def compression_ratios(record: dict) -> dict:
    """``compress_over_prefill`` and ``compress_over_repeat`` of a record (None without the
    reference time; records of an older kvfold have no ``repeat_s``)."""
    compress, prefill, repeat = record.get("compress_s"), record.get("prefill_s"), record.get("repeat_s")
    return {
        "compress_over_prefill": compress / prefill if compress is not None and prefill else None,
        "compress_over_repeat": compress / repeat if compress is not None and repeat else None,
    }


RECORDS_FILE = "records.jsonl"
"""Every finished configuration of a bench, one JSON line each, in its ``--out`` folder."""


def config_key(config: BenchConfig | dict) -> str:
    """The identity of a configuration: every :class:`BenchConfig` field, as canonical JSON."""
    fields = asdict(config) if isinstance(config, BenchConfig) else config
    defaults = {name: field.default for name, field in BenchConfig.__dataclass_fields__.items()}
    return json.dumps({name: fields.get(name, defaults[name]) for name in defaults}, sort_keys=True)


def load_finished_records(out_dir: Path) -> dict[str, dict]:
    """Records of configurations already measured into ``out_dir`` (a resumed run skips them).

    A configuration is reused only when every field matches (model, method, budget, length, batch,
    new tokens, prefill chunk, dtype, device); anything else is measured again. A torn last line
    (a run killed in the middle of a write) is dropped from the file and measured again.

    Raises:
        ValueError: a damaged line elsewhere, with its number (the file is not changed).
    """
    done = {}
    for record in read_jsonl(out_dir / RECORDS_FILE, repair=True, check=config_key, what="bench record"):
        done[config_key(record)] = record
    return done
