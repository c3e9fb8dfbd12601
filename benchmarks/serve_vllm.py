"""Serving benchmark: kvfold's files served by vLLM against stock vLLM, in one run, every number a ratio.

Run in vLLM's environment (``make install-vllm``)::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_vllm.py \\
        --out runs/serve-vllm [--documents 24,64] [--sweep 1,2,4,8,16] [--dtype bfloat16]

The files are made first (``benchmarks/serve_files.py``: the recommended pipeline under ``--memory`` 1/16
and 1/32, its compression time reported apart), or reused from ``--out``. Every request then generates
``--max-tokens`` tokens (``ignore_eos``, so that every engine generates the same number); answers are
compared up to the first end-of-sequence token. The KV space is two full contexts of ``--tokens`` tokens
unless said otherwise. Four engines, one after another, in this process:

1. **kvfold's engine** (the plugin, prefix caching on, salted per file):
   * *overhead*: ``--needles`` requests on 1/16 files of ``--needle-tokens``-token needle contexts
     against as many plain requests with 60-token prompts, in ``--rounds`` alternating rounds (medians);
   * *the logbook*: 24 requests on its 1/16 file (its five questions in turn), after one to warm;
   * *documents*: N distinct documents, one question each, all sent at once, from their 1/16 files and
     from their 1/32 files, for each N of ``--documents`` and ``--sweep`` (1/16 only);
   * *plain*: ``--plain`` plain requests, in rounds.
2. **stock vLLM** (its own Llama, no plugin, no connector), the same KV space: the logbook's 24 questions
   on the full logbook as plain prompts (prefix cache on, after one to warm: the logbook is computed
   once); the documents from their text (prefill and decode); the plain rounds.
3. **stock vLLM with room for all** (a KV space of every document's full context): the documents from
   their text, all at once: what a request on a file saves in time, not only in bytes.
4. **kvfold's engine** again: the plain rounds (each engine's median over its rounds, so that an
   engine's place in the run weighs less).

Per run it reports: the time until all answers are in, generated tokens per second over that time,
decode tokens per second (tokens after each request's first, over the time any request was decoding),
the median and 90th percentile time to first token (from arrival), the most requests running at once,
preemptions, KV blocks a request held, answers equal to ``kvfold ask``'s (files) and needles found.

It writes ``results.json``, ``results.md`` (tables, the issue's ratios) and ``serving.png`` (tokens/s
against requests at once, kvfold against stock; time until all answers are in) under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_files import make_files  # noqa: E402 - the benchmarks folder is not a package

PLAIN_PROMPT = "Write one sentence about the number {}, and say why it matters in a story about the sea: {}."


# ------------------------------------------------------------------------------------------ measuring
def _max_overlap(spans: list[tuple[float, float]]) -> int:
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    best = running = 0
    for _, step in events:
        running += step
        best = max(best, running)
    return best


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _until_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[: ids.index(eos)] if eos is not None and eos in ids else ids


def run(llm, prompts: list, params: list) -> tuple[dict, list]:
    """Send every prompt at once; what the run measured, and the outputs."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    metrics = [o.metrics for o in outputs if o.metrics is not None]
    tokens = [len(o.outputs[0].token_ids) for o in outputs]
    ttft = sorted(m.first_token_latency for m in metrics)
    decoding = [(m.first_token_ts, m.last_token_ts) for m in metrics if m.last_token_ts > m.first_token_ts]
    decode_seconds = _union(decoding)
    summary = {
        "requests": len(outputs),
        "seconds": wall,
        "tokens": sum(tokens),
        "tokens_per_second": sum(tokens) / wall,
        "decode_tokens_per_second": (sum(tokens) - len(outputs)) / decode_seconds if decode_seconds else None,
        "first_token_seconds_median": ttft[len(ttft) // 2] if ttft else None,
        "first_token_seconds_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))] if ttft else None,
        "max_running_at_once": _max_overlap([(m.scheduled_ts, m.last_token_ts) for m in metrics]) if metrics else None,
        "preemptions": sum(m.num_preemptions for m in metrics),
        "blocks_per_request": sorted({(o.kv_transfer_params or {}).get("kvfold_blocks") for o in outputs} - {None}),
    }
    return summary, outputs


def _engine(args, blocks: int, *, plugin: bool, caches: Path, max_seqs: int):
    from vllm import LLM

    from kvfold.integrations.vllm.settings import BLOCK_SIZE, engine_settings
    from kvfold.runtime.models import resolve_spec

    settings = engine_settings(str(caches), dtype=args.dtype)
    if not plugin:  # stock vLLM: its own Llama, no connector
        settings = {k: v for k, v in settings.items() if k not in ("hf_overrides", "kv_transfer_config")}
    return LLM(
        model=resolve_spec("smollm2-135m")[0],
        max_model_len=min(8192, math.ceil((args.tokens + 512) / BLOCK_SIZE) * BLOCK_SIZE),
        enforce_eager=True,
        num_gpu_blocks_override=blocks,
        max_num_seqs=max_seqs,
        disable_log_stats=False,  # per-request timestamps (scheduled, first and last token)
        **settings,
    )


# ------------------------------------------------------------------------------------------ requests
class Requests:
    """Prompts and parameters for every kind of request of the run."""

    def __init__(self, args, made: dict, caches: Path) -> None:
        from vllm import SamplingParams

        from kvfold.integrations.vllm.requests import CacheCatalog

        self.args, self.made = args, made
        self.catalog = CacheCatalog(caches, "smollm2-135m", args.dtype)
        self.eos = made.get("eos_token_id")
        self.SamplingParams = SamplingParams

    def params(self, extra: dict | None = None):
        extra_args = {"kv_transfer_params": extra} if extra else None
        return self.SamplingParams(
            temperature=0, max_tokens=self.args.max_tokens, ignore_eos=True, extra_args=extra_args
        )

    def on_file(self, name: str, question_index: int = 0) -> tuple[dict, object, list[int]]:
        """A request on file ``name``: prompt, parameters and ``kvfold ask``'s answer."""
        info = self.made["files"][name]
        question, prefix = info["questions"][question_index]
        prepared = self.catalog.prepare(name, question, answer_prefix=prefix, max_tokens=self.args.max_tokens)
        prompt = {"prompt_token_ids": prepared.prompt_token_ids, "cache_salt": prepared.cache_salt}
        return prompt, self.params(prepared.kv_transfer_params), info["kvfold_ask"][question_index]

    def plain(self, ids: list[int]) -> tuple[dict, object]:
        return {"prompt_token_ids": ids}, self.params()

    def short(self, count: int) -> tuple[list, list]:
        """``count`` plain requests with prompts of about 60 tokens."""
        words = ["salt", "wind", "harbour", "rope", "lantern", "gull", "tide", "keel", "anchor", "compass"]
        prompts = [{"prompt": PLAIN_PROMPT.format(i, " ".join(words * 3 + words[:5]))} for i in range(count)]
        return prompts, [self.params() for _ in prompts]

    def same_as_ask(self, outputs: list, expected: list[list[int]]) -> int:
        return sum(
            _until_eos(list(o.outputs[0].token_ids), self.eos) == _until_eos(list(e), self.eos)
            for o, e in zip(outputs, expected, strict=True)
        )

    def needles_found(self, outputs: list, documents: list[dict]) -> int:
        tokenizer = self.catalog.tokenizer
        found = 0
        for output, doc in zip(outputs, documents, strict=True):
            text = tokenizer.decode(_until_eos(list(output.outputs[0].token_ids), self.eos), skip_special_tokens=True)
            found += all(needle in text for needle in doc["needles"])
        return found


def _on_files(req: Requests, names: list[str]) -> tuple[dict, list]:
    prompts, params, expected = zip(*(req.on_file(n) for n in names), strict=True)
    summary, outputs = run(req.llm, list(prompts), list(params))
    summary["answers_as_kvfold_ask"] = req.same_as_ask(outputs, list(expected))
    return summary, outputs


def _documents_from_files(req: Requests, count: int, budget: str) -> dict:
    summary, outputs = _on_files(req, [f"doc{i}-{budget}" for i in range(count)])
    summary["needles_found"] = req.needles_found(outputs, req.made["documents"][:count])
    return summary


def _documents_from_text(req: Requests, count: int) -> dict:
    docs = req.made["documents"][:count]
    prompts, params = zip(*(req.plain(d["prompt_ids"]) for d in docs), strict=True)
    summary, outputs = run(req.llm, list(prompts), list(params))
    summary["needles_found"] = req.needles_found(outputs, docs)
    return summary


def _rounds(req: Requests, results: dict, key: str) -> None:
    prompts, params = req.short(req.args.plain)
    run(req.llm, prompts[:2], params[:2])  # warm
    for _ in range(req.args.rounds):
        summary, outputs = run(req.llm, prompts, params)
        results.setdefault(key, []).append(summary)
        results.setdefault(f"{key}_tokens", [list(o.outputs[0].token_ids) for o in outputs])


# ------------------------------------------------------------------------------------------ the run
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=5000, help="the logbook's and each document's length in tokens")
    parser.add_argument("--needle-tokens", type=int, default=1792, help="the needle contexts' length (overhead)")
    parser.add_argument("--needles", type=int, default=6, help="requests on needle files in the overhead runs")
    parser.add_argument("--documents", default="24,64", help="counts of distinct documents sent at once")
    parser.add_argument("--sweep", default="1,2,4,8,16", help="more counts of documents (1/16 files and text)")
    parser.add_argument("--method", default="kvzip+am_fit")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--fit-full", type=int, default=2, help="the KV space holds this many full contexts")
    parser.add_argument("--plain", type=int, default=16, help="plain requests (no file) in the plain rounds")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only-files", action="store_true", help="make the files, then stop")
    args = parser.parse_args()
    counts = sorted({int(n) for n in args.documents.split(",")})
    sweep = sorted({int(n) for n in args.sweep.split(",") if n} - set(counts))
    args.documents = max(counts + sweep)
    args.out.mkdir(parents=True, exist_ok=True)
    made = make_files(args.out, args)
    if args.only_files:
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the block count is set below
    from kvfold.integrations.vllm.settings import BLOCK_SIZE

    caches = args.out / "caches"
    doc_tokens = max(len(d["prompt_ids"]) for d in made["documents"])
    full_blocks = math.ceil((doc_tokens + args.max_tokens) / BLOCK_SIZE)
    blocks = args.fit_full * full_blocks
    roomy = (max(counts) + 1) * full_blocks
    most = max(counts + [24, args.needles, args.plain])
    results: dict = {
        "settings": {
            **vars(args),
            "out": str(args.out),
            "counts": counts,
            "sweep": sweep,
            "block_size": BLOCK_SIZE,
            "kv_blocks": blocks,
            "roomy_kv_blocks": roomy,
        },  # fmt: skip
        "document_tokens": doc_tokens,
        "full_context_blocks": full_blocks,
        "compression": _compression(made),
    }
    req = Requests(args, made, caches)

    print("kvfold's engine", flush=True)
    req.llm = _engine(args, blocks, plugin=True, caches=caches, max_seqs=most)
    kv = results["kvfold"] = {}
    needles = [f"needle{i}-mem16" for i in range(args.needles)]
    short_prompts, short_params = req.short(args.needles)
    _on_files(req, needles)  # warm both kinds
    run(req.llm, short_prompts, short_params)
    for _ in range(args.rounds):  # the overhead: files and plain requests in alternating rounds
        kv.setdefault("overhead_files", []).append(_on_files(req, needles)[0])
        kv.setdefault("overhead_plain", []).append(run(req.llm, short_prompts, short_params)[0])
    logbook = [req.on_file("logbook-mem16", i % 5) for i in range(25)]
    run(req.llm, [logbook[0][0]], [logbook[0][1]])  # warm: the file's blocks, as the prefix cache keeps them
    prompts, params, expected = zip(*logbook[1:], strict=True)
    kv["logbook"], outputs = run(req.llm, list(prompts), list(params))
    kv["logbook"]["answers_as_kvfold_ask"] = req.same_as_ask(outputs, list(expected))
    for count in counts:
        for budget in ("mem16", "mem32"):
            print(f"  {count} documents from their {budget} files", flush=True)
            kv[f"documents_{count}_{budget}"] = _documents_from_files(req, count, budget)
    for count in sweep:
        kv[f"documents_{count}_mem16"] = _documents_from_files(req, count, "mem16")
    _rounds(req, kv, "plain")
    del req.llm
    gc.collect()

    print("stock vLLM", flush=True)
    req.llm = _engine(args, blocks, plugin=False, caches=caches, max_seqs=most)
    st = results["stock"] = {}
    full = [req.plain(made["logbook_prompt_ids"][i % 5]) for i in range(25)]
    run(req.llm, [full[0][0]], [full[0][1]])  # warm: the logbook computed once, kept by the prefix cache
    prompts, params = zip(*full[1:], strict=True)
    st["logbook"] = run(req.llm, list(prompts), list(params))[0]
    for count in counts + sweep:
        print(f"  {count} documents from their text", flush=True)
        st[f"documents_{count}"] = _documents_from_text(req, count)
    _rounds(req, st, "plain")
    del req.llm
    gc.collect()

    print("stock vLLM with room for every document", flush=True)
    req.llm = _engine(args, roomy, plugin=False, caches=caches, max_seqs=most)
    roomy_results = results["stock_roomy"] = {}
    for count in counts:
        print(f"  {count} documents from their text", flush=True)
        roomy_results[f"documents_{count}"] = _documents_from_text(req, count)
    del req.llm
    gc.collect()

    print("kvfold's engine, again", flush=True)
    req.llm = _engine(args, blocks, plugin=True, caches=caches, max_seqs=most)
    _rounds(req, kv, "plain_again")
    del req.llm
    gc.collect()

    results["ratios"] = _ratios(results)
    (args.out / "results.json").write_text(json.dumps(_without_tokens(results), indent=2))
    (args.out / "plain_tokens.json").write_text(json.dumps(_plain_tokens(results)))
    (args.out / "results.md").write_text(_table(results))
    _plot(results, args.out / "serving.png")
    print(_table(results))


def _compression(made: dict) -> dict:
    """Seconds the files took to make (prefill, and compression apart), medians per workload and budget."""
    out: dict = {}
    for name, info in made["files"].items():
        kind = "".join(c for c in name.split("-")[0] if not c.isdigit()) + "-" + name.split("-")[1]
        out.setdefault(kind, {"prefill": [], "compress": [], "context_tokens": []})
        out[kind]["prefill"].append(info["prefill_seconds"])
        out[kind]["compress"].append(info["compress_seconds"])
        out[kind]["context_tokens"].append(info["context_tokens"])
    return {
        kind: {
            "files": len(v["compress"]),
            "context_tokens_median": sorted(v["context_tokens"])[len(v["context_tokens"]) // 2],
            "prefill_seconds_median": sorted(v["prefill"])[len(v["prefill"]) // 2],
            "compress_seconds_median": sorted(v["compress"])[len(v["compress"]) // 2],
            "compress_seconds_total": sum(v["compress"]),
        }
        for kind, v in out.items()
    }


def _median(runs: list[dict], key: str) -> float:
    values = sorted(r[key] for r in runs)
    return values[len(values) // 2]


def _ratios(r: dict) -> dict:
    kv, st, roomy = r["kvfold"], r["stock"], r["stock_roomy"]
    out = {
        "overhead_tokens_per_second": _median(kv["overhead_files"], "tokens_per_second")
        / _median(kv["overhead_plain"], "tokens_per_second"),
        "logbook_tokens_per_second": kv["logbook"]["tokens_per_second"] / st["logbook"]["tokens_per_second"],
        "logbook_decode_tokens_per_second": kv["logbook"]["decode_tokens_per_second"]
        / st["logbook"]["decode_tokens_per_second"],
        "plain_tokens_per_second": _median(kv["plain"] + kv["plain_again"], "tokens_per_second")
        / _median(st["plain"], "tokens_per_second"),
        "plain_same_tokens": sum(a == b for a, b in zip(kv["plain_tokens"], st["plain_tokens"], strict=True)),
        "plain_again_same_tokens": sum(
            a == b for a, b in zip(kv["plain_again_tokens"], st["plain_tokens"], strict=True)
        ),
    }
    for count in r["settings"]["counts"]:
        for budget in ("mem16", "mem32"):
            files = kv[f"documents_{count}_{budget}"]
            for name, text in (("stock", st[f"documents_{count}"]), ("roomy", roomy[f"documents_{count}"])):
                key = f"documents_{count}_{budget}_vs_{name}"
                out[f"{key}_sooner"] = text["seconds"] / files["seconds"]
                out[f"{key}_tokens_per_second"] = files["tokens_per_second"] / text["tokens_per_second"]
                out[f"{key}_decode_tokens_per_second"] = (
                    files["decode_tokens_per_second"] / text["decode_tokens_per_second"]
                )
    return out


def _plain_tokens(r: dict) -> dict:
    """The plain requests' greedy tokens of each engine (the first round), to compare by eye."""
    return {name: {k: v for k, v in part.items() if k.endswith("_tokens")} for name, part in r.items()
            if name in ("kvfold", "stock")}  # fmt: skip


def _without_tokens(r: dict) -> dict:
    return {k: (_without_tokens(v) if isinstance(v, dict) else v) for k, v in r.items() if not k.endswith("_tokens")}


# ------------------------------------------------------------------------------------------ reporting
def _row(label: str, s: dict, extra: str = "") -> str:
    blocks = ", ".join(map(str, s["blocks_per_request"])) or "—"
    return (
        f"| {label} | {s['requests']} | {s['seconds']:.1f} | {s['tokens_per_second']:.1f} | "
        f"{s['decode_tokens_per_second']:.1f} | {s['first_token_seconds_median']:.2f} / "
        f"{s['first_token_seconds_p90']:.2f} | {s['max_running_at_once']} | {s['preemptions']} | {blocks} | {extra} |"
    )


HEADER = [
    "| run | requests | until all answers (s) | tokens / s | decode tokens / s | first token (s), median / p90 | "
    "most at once | preemptions | blocks a request held (file) | answers |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
]


def _table(r: dict) -> str:
    s, kv, st, roomy, q = r["settings"], r["kvfold"], r["stock"], r["stock_roomy"], r["ratios"]
    lines = [
        f"vLLM CPU ({s['dtype']}), SmolLM2-135M, `{s['method']}` files; KV space {s['kv_blocks']} blocks of "
        f"{s['block_size']} tokens (two full contexts of {r['document_tokens']} tokens); {s['max_tokens']} tokens a "
        "request (`ignore_eos`). Every number below comes from one run.",
        "",
        "**Ratios** (kvfold ÷ the comparison):",
        "",
        "| comparison | ratio |",
        "|---|---:|",
        f"| overhead: {s['needles']} requests on 1/16 needle files ÷ {s['needles']} plain requests (tokens/s, "
        f"medians of {s['rounds']} rounds) | {q['overhead_tokens_per_second']:.2f} |",
        f"| the logbook: 24 requests on its 1/16 file ÷ the same 24 questions on the full logbook, stock, prefix "
        f"cache on (tokens/s; decode tokens/s) | {q['logbook_tokens_per_second']:.2f}; "
        f"{q['logbook_decode_tokens_per_second']:.2f} |",
    ]
    for count in s["counts"]:
        for budget in ("mem16", "mem32"):
            for name, label in (("stock", "stock, two full contexts"), ("roomy", "stock, room for all")):
                key = f"documents_{count}_{budget}_vs_{name}"
                lines.append(
                    f"| {count} documents from 1/{budget[3:]} files ÷ from their text ({label}): all answers in "
                    f"sooner; tokens/s; decode tokens/s | {q[key + '_sooner']:.2f}×; "
                    f"{q[key + '_tokens_per_second']:.2f}; {q[key + '_decode_tokens_per_second']:.2f} |"
                )
    lines += [
        f"| plain requests, kvfold's engine ÷ stock (tokens/s, medians; same tokens as stock: "
        f"{q['plain_same_tokens']} of {s['plain']} after the files, {q['plain_again_same_tokens']} on a fresh "
        f"engine) | {q['plain_tokens_per_second']:.3f} |",
        "",
        "**Runs**:",
        "",
        *HEADER,
    ]
    for i, run_ in enumerate(kv["overhead_files"]):
        lines.append(_row(f"kvfold: 1/16 needle files, round {i + 1}", run_,
                          f"{run_['answers_as_kvfold_ask']} as `kvfold ask`"))  # fmt: skip
    for i, run_ in enumerate(kv["overhead_plain"]):
        lines.append(_row(f"kvfold's engine: plain, 60-token prompts, round {i + 1}", run_))
    lines.append(_row("kvfold: the logbook's 1/16 file", kv["logbook"],
                      f"{kv['logbook']['answers_as_kvfold_ask']} as `kvfold ask`"))  # fmt: skip
    lines.append(_row("stock: the full logbook, prefix cached", st["logbook"]))
    for count in s["counts"] + s["sweep"]:
        for budget in ("mem16", "mem32"):
            key = f"documents_{count}_{budget}"
            if key in kv:
                run_ = kv[key]
                said = f"{run_['answers_as_kvfold_ask']} as `kvfold ask`; {run_['needles_found']} needles"
                lines.append(_row(f"kvfold: {count} documents, 1/{budget[3:]} files", run_, said))
        lines.append(_row(f"stock: {count} documents from text", st[f"documents_{count}"],
                          f"{st[f'documents_{count}']['needles_found']} needles"))  # fmt: skip
        if f"documents_{count}" in roomy:
            run_ = roomy[f"documents_{count}"]
            lines.append(_row(f"stock, room for all: {count} documents from text", run_,
                              f"{run_['needles_found']} needles"))  # fmt: skip
    for key, label in (("plain", "kvfold's engine"), ("plain_again", "kvfold's engine, again")):
        for i, run_ in enumerate(kv[key]):
            lines.append(_row(f"{label}: {s['plain']} plain, round {i + 1}", run_))
    for i, run_ in enumerate(st["plain"]):
        lines.append(_row(f"stock: {s['plain']} plain, round {i + 1}", run_))
    lines += ["", "**Making the files** (medians; compression apart from the prefill):", "",
              "| files | count | context tokens | prefill (s) | compression (s) | compression, all files (s) |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for kind, c in r["compression"].items():
        lines.append(
            f"| {kind} | {c['files']} | {c['context_tokens_median']} | {c['prefill_seconds_median']:.2f} | "
            f"{c['compress_seconds_median']:.2f} | {c['compress_seconds_total']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, kv, st, roomy = r["settings"], r["kvfold"], r["stock"], r["stock_roomy"]
    counts = sorted(s["counts"] + s["sweep"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    series = [
        ("kvfold, 1/16 files", [kv.get(f"documents_{n}_mem16") for n in counts], "tab:green"),
        ("kvfold, 1/32 files", [kv.get(f"documents_{n}_mem32") for n in counts], "tab:olive"),
        ("stock, from text (two full contexts)", [st.get(f"documents_{n}") for n in counts], "tab:gray"),
        ("stock, from text (room for all)", [roomy.get(f"documents_{n}") for n in counts], "tab:blue"),
    ]
    for label, runs, color in series:
        points = [(x["max_running_at_once"], x["tokens_per_second"]) for x in runs if x]
        if points:
            axes[0].plot(*zip(*points, strict=True), marker="o", label=label, color=color)
    axes[0].set_xlabel("requests running at once (measured)")
    axes[0].set_ylabel("generated tokens / s")
    axes[0].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    axes[0].set_title("throughput: distinct ~5K-token documents", fontsize=10)
    width = 0.2
    for k, (label, runs, color) in enumerate(series):
        points = [(i + (k - 1.5) * width, x["seconds"]) for i, x in enumerate(runs) if x]
        if points:
            axes[1].bar(*zip(*points, strict=True), width=width, color=color, label=label)
    axes[1].set_xticks(range(len(counts)), [str(n) for n in counts])
    axes[1].set_xlabel("documents sent at once")
    axes[1].set_ylabel("seconds until all answers are in")
    axes[1].set_yscale("log")
    axes[1].set_title("time to all answers", fontsize=10)
    fig.suptitle(f"vLLM CPU ({s['dtype']}), SmolLM2-135M, {s['method']} files, the same KV space", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
