# Kept with docs/results/2026-11-29-fewer-fit-groups-and-the-oldest-versions.md (run with the repository on PYTHONPATH).
"""kvzip+am_fit on the CPU with the CPU's groups and with a GPU's padded groups (pad_products): how far
apart the compressed caches and the next-token logits are. Usage: python grouping_same.py MODEL LENGTH"""
import sys, time
import torch
from kvfold.evaluate.bench.process import context_ids
from kvfold.methods import build_method
from kvfold.methods.compaction.attention_matching import solve
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.budget import Budget
from kvfold.runtime.models import load_model

model_spec, length = sys.argv[1], int(sys.argv[2])
model, tok = load_model(model_spec)
ids = context_ids(tok, length, 1)
groups = []
real = solve._fit_group
solve._fit_group = lambda group, *a, **k: groups.append(group.keys.shape[0]) or real(group, *a, **k)
out = {}
for name, pad in (("cpu groups", 0), ("gpu padding", solve.GROUP_LAUNCH_PRODUCTS)):
    solve.CPU_FIT_SIZES = solve.FitSizes(*[getattr(solve.CPU_FIT_SIZES, f) for f in ("group_bytes", "query_block", "statistics_rows", "statistics_bytes")], pad)
    method = build_method("kvzip+am_fit")
    groups.clear()
    with torch.inference_mode():
        source = prefill_ids(model, tok, ids, capture_window=64, methods=[method])
        cache = source.cache.copy()
        ctx = source.compression_context(cache, Budget.parse(0.1), shared=source.shared)
        start = time.perf_counter()
        method.apply(ctx)
        seconds = time.perf_counter() - start
        probe = torch.tensor([[tok.eos_token_id or 0]])
        logits = model(probe, past_key_values=cache, use_cache=True).logits[0, -1].float()
    out[name] = (cache, logits)
    print(f"{name}: {len(groups)} groups, widest group {max(groups)} problems, compression {seconds:.2f} s")
(a, la), (b, lb) = out["cpu groups"], out["gpu padding"]
beta = values = 0.0
for (i, x), (_, y) in zip(a.folded_layers, b.folded_layers):
    kx, vx, bx, _ = x.padded(); ky, vy, by, _ = y.padded()
    fin = torch.isfinite(bx)
    assert torch.equal(fin, torch.isfinite(by)), i
    beta = max(beta, float((bx[fin] - by[fin]).abs().max()))
    values = max(values, float((vx - vy).abs().max()))
p, q = la.softmax(-1), lb.softmax(-1)
print(f"max |beta diff| {beta:.3g}, max |value diff| {values:.3g}, max |logit diff| {float((la - lb).abs().max()):.3g}, "
      f"total variation {0.5 * float((p - q).abs().sum()):.3g}, same next token {int(la.argmax()) == int(lb.argmax())}")
