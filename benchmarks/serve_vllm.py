"""Serving benchmark: vLLM (CPU) answering N compressed contexts against the same N full contexts.

Run in vLLM's environment (``make install-vllm``)::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_vllm.py \\
        --out runs/serve-vllm [--contexts 10] [--tokens 3000] [--method 'kvzip[layerwise=true]+am_fit']

One logbook (``kvfold demo``'s, ``--tokens`` long) is compressed once at keep ``--budget`` and saved;
one vLLM engine (``kvfold.integrations.vllm.engine_settings``, prefix caching off so that every
request holds its own blocks) then serves, in a KV space of exactly ``--fit-full`` full requests
(``num_gpu_blocks_override``):

* N requests on the saved compressed file, all at once;
* the same N requests as plain prompts (the whole context and the question, prefilled), all at once;
* one request alone of each, for the time to the first token: from the saved file (loaded by the
  connector, no prefill of the context) against a fresh prefill.

It writes ``results.json``, ``results.md`` (a table) and ``serving.png`` (a plot) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = running = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


def _run(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    spans = [(o.metrics.scheduled_ts, o.metrics.last_token_ts) for o in outputs if o.metrics is not None]
    ttft = [o.metrics.first_token_ts - o.metrics.scheduled_ts for o in outputs if o.metrics is not None]
    return {
        "requests": len(outputs),
        "seconds": wall,
        "requests_per_second": len(outputs) / wall,
        "tokens_per_second": tokens / wall,
        "max_running_at_once": _max_overlap(spans) if spans else None,
        "preemptions": sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None),
        "first_token_seconds_median": sorted(ttft)[len(ttft) // 2] if ttft else None,
        "answers": [o.outputs[0].text for o in outputs[:3]],
    }


def _compress(args, caches: Path) -> dict:
    import torch

    import kvfold
    from kvfold.evaluate.data.logbook import FACTS, build_logbook
    from kvfold.runtime.prompts import build_prompt, encode

    torch.set_num_threads(1)
    model, tokenizer = kvfold.load_model()
    text = build_logbook(tokenizer, args.tokens)
    start = time.perf_counter()
    context = kvfold.prefill(model, tokenizer, text, methods=[args.method])
    prefill = time.perf_counter() - start
    small = context.compress(args.method, budget=args.budget)
    kvfold.save_context(small, caches / "doc.kvc", source_text=text)
    question = FACTS[0][1]
    parts = build_prompt(tokenizer, text, question)
    full_ids = encode(tokenizer, parts.context, special=True) + encode(tokenizer, parts.suffix, special=False)
    return {
        "context_tokens": context.context_tokens,
        "prefill_seconds_kvfold": prefill,
        "compress_seconds": small.compress_seconds,
        "question": question,
        "full_prompt_ids": full_ids,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--method", default="kvzip[layerwise=true]+am_fit")
    parser.add_argument("--budget", type=float, default=0.1)
    parser.add_argument("--fit-full", type=int, default=2, help="the KV space holds this many full requests")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--reuse", action="store_true", help="reuse the compressed file of an earlier run in --out")
    args = parser.parse_args()
    caches = args.out / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    made_file = args.out / "compressed.json"
    if args.reuse and made_file.is_file() and (caches / "doc.kvc").is_file():
        made = json.loads(made_file.read_text())
    else:
        made = _compress(args, caches)
        made_file.write_text(json.dumps(made))

    # without it vLLM reserves 92% of the memory; the block count is set below
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from kvfold.integrations.vllm.requests import CacheCatalog
    from kvfold.integrations.vllm.settings import BLOCK_SIZE, engine_settings
    from kvfold.runtime.models import resolve_spec

    catalog = CacheCatalog(caches, "smollm2-135m")
    prepared = catalog.prepare("doc", made["question"], max_tokens=args.max_tokens)
    full_ids = made["full_prompt_ids"]
    per_full = math.ceil((len(full_ids) + args.max_tokens) / BLOCK_SIZE)
    per_small = math.ceil((len(prepared.prompt_token_ids) + args.max_tokens) / BLOCK_SIZE)
    blocks = args.fit_full * per_full
    llm = LLM(
        model=resolve_spec("smollm2-135m")[0],
        max_model_len=per_full * BLOCK_SIZE,
        enforce_eager=True,
        num_gpu_blocks_override=blocks,
        max_num_seqs=max(args.contexts, 2),
        disable_log_stats=False,  # per-request timestamps (scheduled, first and last token)
        **engine_settings(str(caches), prefix_caching=False),
    )
    small_params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, extra_args={"kv_transfer_params": prepared.kv_transfer_params}
    )
    plain_params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    small_prompt = {"prompt_token_ids": prepared.prompt_token_ids, "cache_salt": prepared.cache_salt}
    full_prompt = {"prompt_token_ids": full_ids}
    one_token_small = SamplingParams(temperature=0, max_tokens=1, **_extra(prepared))
    _run(llm, [small_prompt], small_params)  # warm both paths once
    _run(llm, [full_prompt], plain_params)
    results = {
        "settings": {**vars(args), "out": str(args.out), "block_size": BLOCK_SIZE, "kv_blocks": blocks},
        "context_tokens": made["context_tokens"],
        "slots": prepared.cache.slots,
        "compress_seconds": made["compress_seconds"],
        "blocks_per_request": {"compressed": per_small, "full": per_full},
        "fit_in_kv_space": {"compressed": blocks // per_small, "full": blocks // per_full},
        "compressed": _run(llm, [small_prompt] * args.contexts, small_params),
        "full": _run(llm, [full_prompt] * args.contexts, plain_params),
        "first_token_alone": {
            "from_saved_file": _run(llm, [small_prompt], one_token_small)["seconds"],
            "fresh_prefill": _run(llm, [full_prompt], SamplingParams(temperature=0, max_tokens=1))["seconds"],
        },
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(_table(results))
    _plot(results, args.out / "serving.png")
    print(_table(results))


def _extra(prepared) -> dict:
    return {"extra_args": {"kv_transfer_params": prepared.kv_transfer_params}}


def _table(r: dict) -> str:
    c, f = r["compressed"], r["full"]
    rows = [
        "| | compressed (saved file) | full (prefilled) |",
        "|---|---:|---:|",
        f"| entries a request holds (context {r['context_tokens']} tokens) | {r['slots']} | {r['context_tokens']} |",
        f"| KV blocks a request holds | {r['blocks_per_request']['compressed']} | {r['blocks_per_request']['full']} |",
        f"| requests that fit in the KV space ({r['settings']['kv_blocks']} blocks) | "
        f"{r['fit_in_kv_space']['compressed']} | {r['fit_in_kv_space']['full']} |",
        f"| requests running at once (measured) | {c['max_running_at_once']} | {f['max_running_at_once']} |",
        f"| {c['requests']} requests: seconds | {c['seconds']:.1f} | {f['seconds']:.1f} |",
        f"| requests / s | {c['requests_per_second']:.2f} | {f['requests_per_second']:.2f} |",
        f"| generated tokens / s | {c['tokens_per_second']:.1f} | {f['tokens_per_second']:.1f} |",
        f"| preemptions | {c['preemptions']} | {f['preemptions']} |",
        f"| one request alone, time to first token (s) | {r['first_token_alone']['from_saved_file']:.2f} | "
        f"{r['first_token_alone']['fresh_prefill']:.2f} |",
    ]
    return "\n".join(rows) + "\n"


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    labels = ["compressed", "full"]
    panels = [
        ("requests at once", [r["compressed"]["max_running_at_once"], r["full"]["max_running_at_once"]]),
        ("generated tokens / s", [r["compressed"]["tokens_per_second"], r["full"]["tokens_per_second"]]),
        (
            "first token, alone (s)",
            [r["first_token_alone"]["from_saved_file"], r["first_token_alone"]["fresh_prefill"]],
        ),
    ]
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(labels, values, color=["tab:green", "tab:gray"])
        ax.set_title(title, fontsize=10)
    fig.suptitle(
        f"vLLM CPU, {r['context_tokens']}-token context, {r['settings']['method']} @ {r['settings']['budget']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
