"""How a compressed cache's stored rows fall to the Triton kernel's programs: one program a row (before)
against splits of a few pages (after, ``RowPages.splits``), a layer at a time.

    OMP_NUM_THREADS=2 python docs/results/data/split-k-2026-11-29/chains.py --model MODEL --length L \
        [--memory 0.0625] [--batch B]

Prefills ``--length`` tokens of the bench's prose, compresses with ``kvzip`` at 0.1 (or under a memory
budget: quantized rows, pages of a key group), and prints, over the layers with stored rows, the pages
a layer holds, the programs a step launches for it and the pages the busiest program walks one after
another, before and after. Nothing is timed: the pages the busiest program walks bound a layer's time
on a GPU whose other multiprocessors are idle.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from kvfold.evaluate.bench.process import context_ids
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.models import load_model
from kvfold.runtime.pages import SPLIT_PROGRAMS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--method", default="kvzip")
    parser.add_argument("--memory", type=float, default=None)
    parser.add_argument("--batch", type=int, default=1, help="rows of a layer repeated this many times")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    with torch.inference_mode():
        source = prefill_ids(model, tokenizer, context_ids(tokenizer, args.length, 1), methods=[args.method])
        compressed = source.compress(args.method, None if args.memory else 0.1, memory=args.memory)
    layers, page_entries = [], 0
    for _, layer in compressed.cache.folded_layers:
        stored = layer.stored
        if stored is None:
            continue
        pages = stored.pages
        page_entries = pages.size
        per_row = (pages.first_page[1:] - pages.first_page[:-1]).long()
        rows = int(per_row.numel()) * args.batch
        count = pages.count * args.batch
        per_split = max(1, -(-count // SPLIT_PROGRAMS))
        splits = sum(-(-int(p) // per_split) for p in per_row.tolist()) * args.batch
        lengths = stored.lengths.long()
        layers.append(
            {
                "rows": rows,
                "entries": int(lengths.sum()) * args.batch,
                "longest_row_entries": int(lengths.max()),
                "pages": count,
                "before_programs": rows,
                "before_longest_chain": int(per_row.max()),
                "after_programs": splits,
                "after_longest_chain": min(per_split, int(per_row.max())),
            }
        )
    if not layers:
        raise SystemExit("no layer holds stored rows: nothing to count")
    context = compressed.cache.get_seq_length()
    summary = {
        "model": args.model,
        "length": args.length,
        "method": args.method,
        "budget": f"memory {args.memory}" if args.memory else "0.1",
        "batch": args.batch,
        "layers": len(compressed.cache.folded_layers),
        "layers_with_stored_rows": len(layers),
        "page_entries": page_entries,
    }
    for key in layers[0]:
        values = [layer[key] for layer in layers]
        summary[key] = {"median": statistics.median(values), "max": max(values)}
    summary["longest_row_of_the_context"] = max(layer["longest_row_entries"] for layer in layers) / args.length
    ratio = [layer["before_longest_chain"] / layer["after_longest_chain"] for layer in layers]
    summary["chain_before_over_after"] = {"median": statistics.median(ratio), "min": min(ratio)}
    summary["cache_tokens"] = int(context)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
