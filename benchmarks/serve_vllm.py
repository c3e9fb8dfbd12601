"""Serving benchmark: how many requests on saved files vLLM runs at once, at the files' own bytes.

Run in vLLM's environment (``make install-vllm``)::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_vllm.py \\
        --out runs/serve-vllm [--tokens 5000] [--dtype bfloat16] [--requests 24]

One logbook (``kvfold demo``'s facts, ``--tokens`` long) is compressed once with the recommended
pipeline under each ``--memory`` budget (``kvzip+am_fit``: 4 bits at 1/16 and 1/32) and saved. Then,
in one process:

* **kvfold's engine** (``kvfold.integrations.vllm.engine_settings``, prefix caching off so that every
  request holds its own blocks) in a KV space of exactly ``--fit-full`` full contexts in ``--dtype``
  (``num_gpu_blocks_override``) serves, for each file, ``--requests`` requests at once (the logbook's
  questions in turn), then one alone for the time to the first token; every answer is checked against
  ``kvfold ask`` on the same file, in the same dtype. Then ``--plain`` plain requests (no file) at once.
* **stock vLLM's Llama** (no plugin, no connector), in the same KV space, serves the same plain
  requests, and then kvfold's engine once more: the median tokens/s of each engine's ``--rounds``
  rounds, the plugin's against stock's, and whether their tokens are the same.

It writes ``results.json``, ``results.md`` (tables) and ``serving.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
from pathlib import Path

MEMORY = (1 / 16, 1 / 32)


def _max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = running = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


def _run(llm, prompts, params) -> tuple[dict, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    spans = [(o.metrics.scheduled_ts, o.metrics.last_token_ts) for o in outputs if o.metrics is not None]
    ttft = sorted(o.metrics.first_token_ts - o.metrics.scheduled_ts for o in outputs if o.metrics is not None)
    summary = {
        "requests": len(outputs),
        "seconds": wall,
        "tokens_per_second": tokens / wall,
        "max_running_at_once": _max_overlap(spans) if spans else None,
        "preemptions": sum(o.metrics.num_preemptions for o in outputs if o.metrics is not None),
        "first_token_seconds_median": ttft[len(ttft) // 2] if ttft else None,
        "blocks_per_request": sorted({(o.kv_transfer_params or {}).get("kvfold_blocks") for o in outputs} - {None}),
    }
    return summary, outputs


def _files(args, caches: Path) -> dict:
    """The logbook compressed under each memory budget, saved; kvfold ask's answers from each file in
    ``--dtype`` (token ids), and the full prompt's ids."""
    import torch

    import kvfold
    from kvfold.evaluate.data.logbook import FACTS, build_logbook
    from kvfold.runtime.prompts import build_prompt, encode

    torch.set_num_threads(1)
    model, tokenizer = kvfold.load_model()
    text = build_logbook(tokenizer, args.tokens)
    context = kvfold.prefill(model, tokenizer, text, methods=[args.method])
    made = {"context_tokens": context.context_tokens, "files": {}}
    for memory in MEMORY:
        name = f"mem{round(1 / memory)}"
        small = context.compress(args.method, memory=memory)
        kvfold.save_context(small, caches / f"{name}.kvc", source_text=text)
        made["files"][name] = {"memory": memory, "compress_seconds": small.compress_seconds}
    served, _ = kvfold.load_model(dtype=args.dtype)
    for name in made["files"]:
        loaded = kvfold.load_context(caches / f"{name}.kvc", served, tokenizer, dtype=args.dtype)
        made["files"][name]["answers"] = {
            q: loaded.generate(q, max_new_tokens=args.max_tokens)[0].token_ids for _, q, _ in FACTS
        }
    made["questions"] = [q for _, q, _ in FACTS]
    parts = build_prompt(tokenizer, text, FACTS[0][1])
    made["full_prompt_tokens"] = len(encode(tokenizer, parts.context, special=True)) + len(
        encode(tokenizer, parts.suffix, special=False)
    )
    return made


def _engine(args, blocks: int, *, plugin: bool, caches: Path):
    from vllm import LLM

    from kvfold.integrations.vllm.settings import BLOCK_SIZE, engine_settings
    from kvfold.runtime.models import resolve_spec

    settings = engine_settings(str(caches), prefix_caching=False, dtype=args.dtype)
    if not plugin:  # stock vLLM: its own Llama, no connector
        settings = {k: v for k, v in settings.items() if k not in ("hf_overrides", "kv_transfer_config")}
    return LLM(
        model=resolve_spec("smollm2-135m")[0],
        max_model_len=min(8192, math.ceil((args.tokens + 512) / BLOCK_SIZE) * BLOCK_SIZE),
        enforce_eager=True,
        num_gpu_blocks_override=blocks,
        max_num_seqs=max(args.requests, args.plain, 2),
        disable_log_stats=False,  # per-request timestamps (scheduled, first and last token)
        **settings,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=5000, help="the logbook's length in tokens")
    parser.add_argument("--method", default="kvzip+am_fit")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--fit-full", type=int, default=2, help="the KV space holds this many full contexts")
    parser.add_argument("--requests", type=int, default=24, help="requests on each file, sent at once")
    parser.add_argument("--plain", type=int, default=16, help="plain requests (no file), sent at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the plain requests per engine")
    parser.add_argument("--reuse", action="store_true", help="reuse the files of an earlier run in --out")
    args = parser.parse_args()
    caches = args.out / "caches"
    caches.mkdir(parents=True, exist_ok=True)
    made_file = args.out / "files.json"
    if args.reuse and made_file.is_file():
        made = json.loads(made_file.read_text())
    else:
        made = _files(args, caches)
        made_file.write_text(json.dumps(made))

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the block count is set below
    from vllm import SamplingParams

    from kvfold.integrations.vllm.requests import CacheCatalog
    from kvfold.integrations.vllm.settings import BLOCK_SIZE

    full_blocks = math.ceil((made["context_tokens"] + args.max_tokens) / BLOCK_SIZE)
    blocks = args.fit_full * full_blocks
    catalog = CacheCatalog(caches, "smollm2-135m", args.dtype)
    results = {
        "settings": {**vars(args), "out": str(args.out), "block_size": BLOCK_SIZE, "kv_blocks": blocks},
        "context_tokens": made["context_tokens"],
        "full_context_blocks": full_blocks,
        "files": {},
    }
    llm = _engine(args, blocks, plugin=True, caches=caches)
    questions = made["questions"]
    for name, info in made["files"].items():
        prepared = [catalog.prepare(name, q, max_tokens=args.max_tokens) for q in questions]
        prompts = [{"prompt_token_ids": p.prompt_token_ids, "cache_salt": p.cache_salt} for p in prepared]
        params = [
            SamplingParams(
                temperature=0, max_tokens=args.max_tokens, extra_args={"kv_transfer_params": p.kv_transfer_params}
            )
            for p in prepared
        ]
        _run(llm, prompts[:1], params[:1])  # warm
        order = [i % len(questions) for i in range(args.requests)]
        summary, outputs = _run(llm, [prompts[i] for i in order], [params[i] for i in order])
        expected = [catalog.tokenizer.decode(info["answers"][questions[i]], skip_special_tokens=True) for i in order]
        served = [o.outputs[0].text for o in outputs]
        summary["answers_as_kvfold_ask"] = sum(a.strip() == e.strip() for a, e in zip(served, expected, strict=True))
        summary["answers"] = [{"served": a, "kvfold_ask": e} for a, e in zip(served[:5], expected[:5], strict=True)]
        one = SamplingParams(
            temperature=0, max_tokens=1, extra_args={"kv_transfer_params": prepared[0].kv_transfer_params}
        )
        summary["first_token_alone_seconds"] = _run(llm, prompts[:1], [one])[0]["seconds"]
        params_out = outputs[0].kv_transfer_params or {}
        summary["file_blocks"] = params_out.get("kvfold_slots", 0) // BLOCK_SIZE
        summary["block_bytes"] = params_out.get("kvfold_block_bytes")
        summary["fit_in_kv_space"] = blocks // max(summary["blocks_per_request"] or [1])
        results["files"][name] = {**{k: v for k, v in info.items() if k != "answers"}, **summary}
    # Plain requests: kvfold's engine, stock vLLM's Llama, kvfold's engine again (the median of every
    # round of each, so that an engine's place in the run, or a busy moment, weighs less).
    plain_prompts = [{"prompt": f"Write one sentence about the number {i}."} for i in range(args.plain)]
    plain_params = SamplingParams(temperature=0, max_tokens=4 * args.max_tokens, ignore_eos=True)
    rounds: dict[str, list[dict]] = {"plugin": [], "stock": []}
    answers: dict[str, list] = {}
    engines = [llm, None, None]
    del llm
    for index, kind in enumerate(("plugin", "stock", "plugin")):
        engine = engines[index] or _engine(args, blocks, plugin=kind == "plugin", caches=caches)
        engines[index] = None
        _run(engine, plain_prompts[:2], plain_params)  # warm
        for _ in range(args.rounds):
            summary, outputs = _run(engine, plain_prompts, plain_params)
            rounds[kind].append(summary)
            answers[kind] = [list(o.outputs[0].token_ids) for o in outputs]
        del engine
        gc.collect()
    for kind, runs in rounds.items():
        speeds = sorted(r["tokens_per_second"] for r in runs)
        results[f"plain_{kind}"] = {**runs[0], "tokens_per_second": speeds[len(speeds) // 2], "rounds": speeds}
    results["plain_same_answers"] = sum(a == b for a, b in zip(answers["plugin"], answers["stock"], strict=True))
    results["plain_tokens_per_second_ratio"] = (
        results["plain_plugin"]["tokens_per_second"] / results["plain_stock"]["tokens_per_second"]
    )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    (args.out / "results.md").write_text(_table(results))
    _plot(results, args.out / "serving.png")
    print(_table(results))


def _table(r: dict) -> str:
    s = r["settings"]
    rows = [
        f"KV space: {s['kv_blocks']} blocks of {s['block_size']} tokens ({s['fit_full']} full contexts of "
        f"{r['context_tokens']} tokens, {s['dtype']}).",
        "",
        "| file | blocks for the file | blocks a request holds | fit in the KV space | ran at once (measured) | "
        "preemptions | answers as kvfold ask | tokens / s | first token alone (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in r["files"].values():
        rows.append(
            f"| `{s['method']}`, `--memory 1/{round(1 / f['memory'])}` | {f['file_blocks']} | "
            f"{', '.join(map(str, f['blocks_per_request']))} | {f['fit_in_kv_space']} | {f['max_running_at_once']} | "
            f"{f['preemptions']} | {f['answers_as_kvfold_ask']} of {f['requests']} | {f['tokens_per_second']:.1f} | "
            f"{f['first_token_alone_seconds']:.2f} |"
        )
    full = r["full_context_blocks"]
    rows.append(f"| full context (prefilled) | {full} | {full} | {s['fit_full']} | | | | | |")
    p, q = r["plain_plugin"], r["plain_stock"]
    rows += [
        "",
        "| plain requests (no file) | tokens / s (median) | rounds | same tokens as stock |",
        "|---|---:|---|---:|",
        f"| kvfold's engine | {p['tokens_per_second']:.1f} | {', '.join(f'{x:.0f}' for x in p['rounds'])} | "
        f"{r['plain_same_answers']} of {p['requests']} |",
        f"| stock vLLM Llama | {q['tokens_per_second']:.1f} | {', '.join(f'{x:.0f}' for x in q['rounds'])} | |",
        f"| ratio | {r['plain_tokens_per_second_ratio']:.3f} | | |",
    ]
    return "\n".join(rows) + "\n"


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(r["files"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    labels = [f"1/{round(1 / r['files'][n]['memory'])}" for n in names] + ["full"]
    where = list(range(len(labels)))
    fit = [r["files"][n]["fit_in_kv_space"] for n in names] + [r["settings"]["fit_full"]]
    ran = [r["files"][n]["max_running_at_once"] for n in names] + [0]
    axes[0].bar([x - 0.2 for x in where], fit, width=0.4, color="tab:gray", label="fit in the KV space")
    axes[0].bar([x + 0.2 for x in where], ran, width=0.4, color="tab:green", label="ran at once (all sent)")
    axes[0].set_xticks(where, labels)
    axes[0].legend(fontsize=8)
    axes[0].set_title("requests in the same KV space", fontsize=10)
    axes[1].bar(labels[:-1], [r["files"][n]["tokens_per_second"] for n in names], color="tab:green")
    axes[1].set_title("generated tokens / s", fontsize=10)
    fig.suptitle(f"vLLM CPU ({r['settings']['dtype']}), {r['context_tokens']}-token logbook, {r['settings']['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
