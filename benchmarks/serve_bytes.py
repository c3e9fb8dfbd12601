"""The bytes a served request holds against its file's: vLLM's own block count, per cache file.

Run in vLLM's environment (``make install-vllm``)::

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind .venv-vllm/bin/python benchmarks/serve_bytes.py \\
        --caches DIR --question "What is …?" [--expect 4821] [--dtype float32] --out runs/serve-bytes

For every ``.kvc`` file of ``--caches`` one vLLM engine (``kvfold.integrations.vllm.engine_settings``,
prefix caching off) answers the question from the file, greedily, and the request's
``kv_transfer_params`` give vLLM's own count of the blocks it held (``kvfold_blocks``) and the bytes
a block holds over every layer (``kvfold_block_bytes``). Against them: the file's rows as the engine
holds them (codes, scales, zero points, β and row lengths; rows at full precision in ``--dtype``), the
same context's full cache in ``--dtype`` and in 16 bits, and ``kvfold ask``'s answer from the file
(float32). It writes ``results.json`` and ``results.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caches", type=Path, required=True)
    parser.add_argument("--question", required=True)
    parser.add_argument("--expect", default=None, help="text the answer must hold (the needle)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch
    from vllm import LLM, SamplingParams

    import kvfold
    from kvfold.integrations.vllm.pool_layout import pool_rows, served_plan
    from kvfold.integrations.vllm.requests import CacheCatalog
    from kvfold.integrations.vllm.settings import BLOCK_SIZE, engine_settings
    from kvfold.runtime.models import resolve_spec
    from kvfold.store.format import read_info

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = kvfold.load_model()
    catalog = CacheCatalog(args.caches, "smollm2-135m", args.dtype)
    files = sorted(args.caches.glob("*.kvc"))
    rows_out, prompts, params = [], [], []
    for path in files:
        context = kvfold.load_context(path, model, tokenizer)
        served = served_plan(context.cache, model.config, BLOCK_SIZE, dtype)
        element = torch.empty(0, dtype=dtype).element_size()
        held = 0
        layers = pool_rows(context.cache)
        longest = max(int(rows.lengths.max()) for rows in layers)
        busiest = max(int(rows.lengths.sum()) / rows.lengths.numel() for rows in layers)
        for rows in layers:
            if hasattr(rows, "config"):
                held += rows.nbytes()
            else:
                held += rows.lengths.numel() * 8 + (rows.keys.numel() + rows.values.numel()) * element
                held += 0 if rows.log_mass is None else 4 * rows.log_mass.numel()
        tokens = int(read_info(path).context_tokens[0])
        per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * model.config.head_dim
        answer = context.generate(args.question, max_new_tokens=args.max_tokens)[0]
        prepared = catalog.prepare(path.stem, args.question, max_tokens=args.max_tokens)
        prompts.append({"prompt_token_ids": prepared.prompt_token_ids, "cache_salt": prepared.cache_salt})
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=args.max_tokens,
                extra_args={"kv_transfer_params": prepared.kv_transfer_params},
            )
        )
        rows_out.append(
            {
                "file": path.name,
                "method": context.method.spec,
                "budget": context.budget.label(),
                "context_tokens": tokens,
                "rows_bytes": held,
                "full_bytes_dtype": tokens * per_token * element,
                "full_bytes_16bit": tokens * per_token * 2,
                "placeholders": served.placeholders,
                "longest_row": longest,
                "busiest_layer_mean_row": busiest,
                "kvfold_ask": answer.token_ids,
                "kvfold_ask_text": answer.text,
            }
        )
    llm = LLM(
        model=resolve_spec("smollm2-135m")[0],
        enforce_eager=True,
        max_model_len=8192,
        **engine_settings(str(args.caches), prefix_caching=False, dtype=args.dtype),
    )
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for row, output in zip(rows_out, outputs, strict=True):
        kv = output.kv_transfer_params or {}
        blocks, block_bytes = int(kv["kvfold_blocks"]), int(kv["kvfold_block_bytes"])
        file_blocks = int(kv["kvfold_slots"]) // BLOCK_SIZE
        row.update(
            blocks=blocks,
            block_bytes=block_bytes,
            file_blocks=file_blocks,
            question_and_answer_blocks=blocks - file_blocks,
            held_over_rows=file_blocks * block_bytes / row["rows_bytes"],
            served_text=output.outputs[0].text,
            same_as_kvfold_ask=output.outputs[0].text.strip() == row["kvfold_ask_text"].strip(),
            needle_found=None if args.expect is None else args.expect in output.outputs[0].text,
            within_done_when=file_blocks * block_bytes <= 1.05 * row["rows_bytes"] + block_bytes,
        )
    (args.out / "results.json").write_text(json.dumps(rows_out, indent=2))
    (args.out / "results.md").write_text(_table(rows_out, args))
    print(_table(rows_out, args))


def _table(rows: list[dict], args) -> str:
    lines = [
        f"vLLM 0.32 CPU, {args.dtype}; question: {args.question.strip()!r}",
        "",
        "| file | method @ budget | context tokens | longest row ÷ T | busiest layer ÷ T | file's rows (MB) | "
        "held for the file (MB) | held ÷ rows | ÷ full cache in 16 bits | question + answer blocks | "
        "as `kvfold ask` |" + (" needle |" if args.expect else ""),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|" + ("---|" if args.expect else ""),
    ]
    for r in rows:
        held = r["file_blocks"] * r["block_bytes"]
        line = (
            f"| {r['file']} | `{r['method']}` @ {r['budget']} | {r['context_tokens']} | "
            f"{r['longest_row'] / r['context_tokens']:.3f} | {r['busiest_layer_mean_row'] / r['context_tokens']:.3f} | "
            f"{r['rows_bytes'] / 1e6:.2f} | "
            f"{held / 1e6:.2f} | {r['held_over_rows']:.3f} | 1/{r['full_bytes_16bit'] / held:.1f} | "
            f"{r['question_and_answer_blocks']} | {'same' if r['same_as_kvfold_ask'] else 'differs'} |"
        )
        if args.expect:
            line += f" {'found' if r['needle_found'] else 'missed'} |"
        lines.append(line)
    if rows:
        lines += ["", f"A block (32 tokens) holds {rows[0]['block_bytes']:,} bytes over every layer."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
