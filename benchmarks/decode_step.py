"""Decode-step time of the kvfold attention against stock SDPA on the same full cache.

Usage: python benchmarks/decode_step.py [--length 4096] [--steps 30]
Prints the median per-step time of each and their ratio (kvfold / sdpa), measured alternately
in one process so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

import kvfold


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    model, _ = kvfold.load_model(args.model)
    ids = torch.randint(100, 20000, (1, args.length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        folded = kvfold.FoldedCache(model.config)
        model(ids, past_key_values=folded, logits_to_keep=1)
        model.set_attn_implementation("sdpa")
        stock = DynamicCache(config=model.config)
        model(ids, past_key_values=stock, logits_to_keep=1)
        times = {"kvfold": [], "sdpa": []}
        token = torch.tensor([[42]])
        for step in range(args.steps + 3):
            for name, cache in (("sdpa", stock), ("kvfold", folded)):
                model.set_attn_implementation(name)
                start = time.perf_counter()
                model(token, past_key_values=cache)
                if step >= 3:  # warm-up
                    times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    print(f"context {args.length} tokens, {args.steps} steps, torch threads {torch.get_num_threads()}")
    print(f"sdpa   {med['sdpa']:.2f} ms/step")
    print(f"kvfold {med['kvfold']:.2f} ms/step")
    print(f"ratio  {med['kvfold'] / med['sdpa']:.3f}")


if __name__ == "__main__":
    main()
