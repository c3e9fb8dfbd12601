"""The cache-file fuzzer's child process: mutate good files, load each, answer or refuse, record the outcome.

Run by ``tests/store/test_fuzz.py`` as ``python -m tests.store.fuzz_cases OUT.jsonl SEED CASES``, in a
process of its own so that a crash (a signal), a hang (a timeout) or a runaway allocation (an
address-space limit) shows as what it is. It makes small cache files with a tiny random Llama
(int4, int3 with its token ids, int4 with full-precision outliers, 16-bit dense and paged layers,
and an online method's with its statistics and queries), then mutates
them, seeded: structure (shapes, lengths, dtypes, header fields, dropped, added or renamed tensors)
and bytes (flipped, truncated), recomputing the checksum after each mutation as an attacker would.
Every file must load and answer (up to two tokens) or be refused by a :class:`CacheFileError` of one
line. Each case is written to ``OUT.jsonl`` as it starts and as it ends.
"""

from __future__ import annotations

import json
import random
import resource
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import kvfold
from kvfold.store.format import CacheFileError
from tests.conftest import CharTokenizer, make_tiny_model
from tests.store.crafted import read_raw, write_raw

TEXT = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 2
QUESTION = "What is the vault code?"
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]
VALUES = [float("nan"), float("inf"), float("-inf"), -1, 0, 255, 2**31, 2**62, 1e30, -1e30]
HEADER_VALUES: list[Any] = [None, -1, 0, 1, 2, 3, 2**40, 2**63, 1.5, "x", "int4", "int3", "fp8", "int4[key_group=16]"]
HEADER_VALUES += ["int4[outliers=3]", "int2[value_group=8]", "paged", "dense", "quantized", "sliding", "empty", [], {}]
HEADER_VALUES += [True, "float16", "bfloat16", "cuda", "meta", "snapkv", "h2o", "adakv:snapkv", "0.5", "x\ny", [-5]]
HEADER_VALUES += ["zsmerge", "snapkv+keepkv", "tova", "knorm", "am_highest_fast[online=true]", "streamingllm", "full"]
LAYER_FIELDS = ["kind", "layout", "logical_length", "batch_size", "num_heads", "entries", "kv_format"]
TOP_FIELDS = ["dtype", "device", "layers", "context_tokens", "method", "budget", "extra", "format_version", "model"]
NEW_NAMES = ["layer.0.bogus", "layer.9.keys", "layer.1.q.extra", "context.other", "extra.thing", "layer.0.stat.s"]
NEW_NAMES += ["layer.0.captured_queries", "context.token_ids", "context.last_logits", "extra.turn_queries.0"]
NEW_NAMES += ["layer.01.keys", "layer.1.q.log_mass", "layer.0.log_mass", "layer.1.row_lengths", "layer.0.q.key_zero"]


# ------------------------------------------------------------------------------------ good files
def _paged(compressed) -> None:
    """Give the rows very different lengths, so that every layer is stored paged."""
    for _, layer in compressed.cache.folded_layers:
        k, v, lm, lengths = layer.padded()
        short = lengths.clone()
        short[:, 1:] = 3
        layer.replace(k, v, lm, short)


def good_files(folder: Path) -> list[tuple[str, Path, Any]]:
    """``(name, file, model)``: the files every case starts from, and the model that reads each."""
    model = kvfold.enable(make_tiny_model("llama"))
    half = kvfold.enable(make_tiny_model("llama").to(torch.bfloat16))
    out = []
    for name, which, method, budget in [
        ("int4", model, "snapkv@int4", 0.25),
        ("int3", model, "adakv:snapkv@int3", 0.25),
        ("int4-outliers", model, "snapkv@int4[outliers=2,key_group=8]", 0.25),
        ("bf16-dense", half, "adakv:snapkv", 0.25),
        ("bf16-paged", half, "snapkv", 0.5),
        ("h2o-online", model, "h2o", 0.25),
    ]:
        context = kvfold.prefill(which, CharTokenizer(), TEXT, use_chat_template=False, methods=method.split("@")[0])
        compressed = context.compress(method, budget)
        if name.endswith("paged"):
            _paged(compressed)
        path = folder / f"{name}.kvc"
        kvfold.save_context(compressed, path, source_text=TEXT, resumable=name == "int3")  # int3: token ids too
        out.append((name, path, which))
    return out


# ------------------------------------------------------------------------------------ mutations
def _resize(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 0:
        return t.reshape(1)
    dim = rng.randrange(t.dim())
    size = t.shape[dim]
    new = rng.choice([0, max(size - 1, 0), size + 1, size // 2, size * 2 + 1])
    if new <= size:
        return t.narrow(dim, 0, new)
    extra = list(t.shape)
    extra[dim] = new - size
    return torch.cat([t, torch.zeros(extra, dtype=t.dtype)], dim)


def _reshape(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    choice = rng.randrange(3)
    if choice == 0 or t.dim() < 2:
        return t.reshape(-1) if choice == 0 else t.unsqueeze(0)
    return t.transpose(-1, -2)


def _poke(rng: random.Random, t: torch.Tensor) -> torch.Tensor:
    if not t.numel():
        return t
    t = t.contiguous().clone()
    value = rng.choice(VALUES)
    if not t.dtype.is_floating_point:
        info = torch.iinfo(t.dtype)
        value = int(max(min(value, info.max), info.min)) if value == value and abs(value) != float("inf") else -1
        value = max(min(value, info.max), info.min)
    t.view(-1)[rng.randrange(t.numel())] = value
    return t


def _structure(rng: random.Random, header: dict, tensors: dict[str, torch.Tensor]) -> str:
    """One structural mutation, in place; what it did."""
    names = sorted(tensors)
    name = rng.choice(names)
    kind = rng.choice(["shape", "reshape", "dtype", "value", "value", "drop", "add", "rename", "header", "layer"])
    if kind == "shape":
        tensors[name] = _resize(rng, tensors[name])
    elif kind == "reshape":
        tensors[name] = _reshape(rng, tensors[name])
    elif kind == "dtype":
        tensors[name] = tensors[name].to(rng.choice(DTYPES))
    elif kind == "value":
        tensors[name] = _poke(rng, tensors[name])
    elif kind == "drop":
        del tensors[name]
    elif kind == "add":
        new = rng.choice(NEW_NAMES)
        tensors[new] = tensors[name].clone()
        return f"add {new} as a copy of {name}"
    elif kind == "rename":
        other = rng.choice(names)
        tensors[name], tensors[other] = tensors[other], tensors[name]
        return f"swap {name} and {other}"
    elif kind == "header" or not isinstance(header.get("layers"), list) or not header["layers"]:
        field = rng.choice(TOP_FIELDS)
        header[field] = rng.choice(HEADER_VALUES)
        return f"header {field} = {header[field]!r}"
    else:
        index = rng.randrange(len(header["layers"]))
        if not isinstance(header["layers"][index], dict):
            header["layers"][index] = {}
        field = rng.choice(LAYER_FIELDS)
        old = header["layers"][index].get(field)
        value = rng.choice([*HEADER_VALUES, old + 1 if type(old) is int else 7, old - 1 if type(old) is int else -7])
        header["layers"][index][field] = value
        return f"layer {index} {field} = {value!r}"
    return f"{kind} {name}"


def mutate(rng: random.Random, good: Path, target: Path) -> str:
    """Write a mutated copy of ``good`` to ``target``; what was done."""
    kind = rng.choices(["structure", "combo", "bytes", "raw", "truncate"], weights=[10, 3, 3, 1, 1])[0]
    raw = good.read_bytes()
    if kind == "truncate":
        cut = rng.randrange(len(raw))
        target.write_bytes(raw[:cut])
        return f"truncate at {cut} of {len(raw)}"
    if kind in ("bytes", "raw"):
        data = bytearray(raw)
        start = 8 + int.from_bytes(raw[:8], "little") if kind == "bytes" else 0
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(start, len(data))] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        if kind == "bytes":  # tensors' bytes changed: recompute the checksum, as an attacker would
            header, tensors = read_raw(target)
            write_raw(target, header, tensors)
        return f"{kind} flips"
    header, tensors = read_raw(good)
    steps = [_structure(rng, header, tensors) for _ in range(rng.randint(2, 3) if kind == "combo" else 1)]
    write_raw(target, header, tensors)
    return "; ".join(steps)


# ------------------------------------------------------------------------------------ the run
def attend_pooled(cache: Any, config: Any) -> str:
    """The loaded file's rows packed as ``kvfold serve`` packs them (:mod:`kvfold.runtime.row_pool`) into an
    engine's blocks, and every layer attended by the pool kernel (the debug build, in the fuzzer) for a
    request of three new tokens: ``"pooled"``, or ``"not served"`` when the server refuses the file.

    Raises:
        RuntimeError: the kernel refused its arguments (an index past a buffer), or an output not finite.
    """
    import math

    from kvfold.integrations.vllm.layout import UnservableCacheError
    from kvfold.integrations.vllm.pool_layout import pool_rows
    from kvfold.runtime.pool_attention import EngineCaches, PoolStep, StepRequest, pooled_file
    from kvfold.runtime.row_pool import FloatRows, PoolError, pack_pool

    try:
        rows = pool_rows(cache)
        dtype = rows[0].dtype if isinstance(rows[0], FloatRows) else torch.float32
        kv_heads, dim, block = int(rows[0].lengths.numel()), rows[0].head_dim, 32
        plan, chunks = pack_pool(rows, kv_heads * block * 2 * dim * torch.empty(0, dtype=dtype).element_size())
    except (UnservableCacheError, PoolError):
        return "not served"
    layers, own = len(rows), 3
    placeholders = math.ceil(plan.num_chunks / layers) * block
    blocks = torch.arange(math.ceil((placeholders + own) / block), dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(len(blocks), kv_heads, block, 2 * dim, generator=g).to(dtype) for _ in range(layers)]
    engine = EngineCaches(caches, int(config.num_attention_heads), dim**-0.5, threads=1)
    for index in range(plan.num_chunks):
        engine.chunk(blocks, index, layers).copy_(chunks[index])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    file = pooled_file(plan, placeholders, 5, inv_freq)
    step = PoolStep(engine, [StepRequest(0, own, placeholders + own, file, blocks)])
    query = torch.randn(own, int(config.num_attention_heads), dim, generator=g).to(dtype)
    for layer in range(layers):
        output = torch.zeros_like(query)
        if step.attend(layer, query, output):
            raise RuntimeError(f"layer {layer}: the pool kernel refused a loaded file's request")
        if not bool(output.float().isfinite().all()):
            raise RuntimeError(f"layer {layer}: the pool kernel's output is not finite")
    return "pooled"


def attempt(path: Path, model: Any) -> tuple[str, str]:
    """``("loaded", answer)``, ``("refused", message)``, or ``("error", what)`` for anything else (an
    exception that is not a one-line :class:`CacheFileError`, an answer of the wrong length, a pool
    kernel that refuses or gives a non-finite output where the file was loaded: :func:`attend_pooled`)."""
    try:
        context = kvfold.load_context(path, model, CharTokenizer())
        answer = context.generate(QUESTION, max_new_tokens=2)[0]
        served = attend_pooled(context.cache, model.config)
    except CacheFileError as err:
        message = str(err)
        if "\n" in message or not message:
            return "error", f"a refusal of more than one line: {message!r}"
        return "refused", message
    except Exception as err:  # noqa: BLE001 - every other exception is what the fuzzer looks for
        return "error", f"{type(err).__name__}: {err}"
    if len(answer.token_ids) > 2:  # fewer when the model answers its end-of-sequence token
        return "error", f"{len(answer.token_ids)} tokens answered, 2 asked"
    return "loaded", f"{answer.token_ids!r}; {served}"


def _limit_memory(extra_bytes: int = 3 << 30) -> None:
    """Cap the address space at what the process holds now plus ``extra_bytes``: a runaway
    allocation fails here instead of swapping the machine."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            now = int(line.split()[1]) * 1024
            resource.setrlimit(resource.RLIMIT_AS, (now + extra_bytes, now + extra_bytes))


def run(out: Path, seed: int, cases: int, emit: Callable[[dict], None]) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        goods = good_files(folder)
        _limit_memory()
        for name, path, model in goods:  # the untouched files answer
            emit({"case": f"good {name}", "start": True})
            outcome, detail = attempt(path, model)
            emit({"case": f"good {name}", "outcome": outcome, "detail": detail})
        rng = random.Random(seed)
        for case in range(cases):
            name, good, model = goods[case % len(goods)]
            target = folder / "case.kvc"
            what = mutate(rng, good, target)
            emit({"case": case, "base": name, "mutation": what, "start": True})
            outcome, detail = attempt(target, model)
            emit({"case": case, "base": name, "mutation": what, "outcome": outcome, "detail": detail[:300]})


def main(argv: list[str]) -> int:
    out, seed, cases = Path(argv[0]), int(argv[1]), int(argv[2])
    with out.open("w") as handle:

        def emit(record: dict) -> None:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

        run(out, seed, cases, emit)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
