# Kept with docs/results/2026-11-29-power-iteration-and-short-modules.md (run with the repository on PYTHONPATH).
"""kvzip+am_fit on the CPU with λ_max estimated by power iteration normalised every step (as before)
and every 5 steps on G / tr G (solvers.top_eigenvalue now): how far apart the compressed caches and
the next-token logits are. Usage: python power_same.py MODEL LENGTH"""
import sys
import torch
from kvfold.evaluate.bench.process import context_ids
from kvfold.methods import build_method
from kvfold.methods.compaction.attention_matching import solvers
from kvfold.pipeline.context import prefill_ids
from kvfold.runtime.budget import Budget
from kvfold.runtime.models import load_model


def every_step(gram, iters=30):
    """The estimate before: normalised every step, on G itself."""
    if gram.shape[-1] <= 64:
        return torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0)
    v = torch.ones(gram.shape[:-1], dtype=gram.dtype, device=gram.device)
    v = v / v.norm(dim=-1, keepdim=True)
    tiny = torch.finfo(gram.dtype).tiny
    for _ in range(iters):
        u = (gram @ v[..., None])[..., 0]
        v = u / u.norm(dim=-1, keepdim=True).clamp_min(tiny)
    rayleigh = (v * (gram @ v[..., None])[..., 0]).sum(-1)
    trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return torch.minimum(1.05 * rayleigh.clamp_min(0), trace)


model_spec, length = sys.argv[1], int(sys.argv[2])
model, tok = load_model(model_spec)
ids = context_ids(tok, length, 1)
now = solvers.top_eigenvalue
widths, ratios = [], []
out = {}
for name, estimate in (("every step", every_step), ("every 5 steps", now)):
    def spy(gram, iters=30, estimate=estimate):
        value = estimate(gram, iters)
        if name == "every 5 steps" and gram.shape[-1] > 64:
            widths.append(gram.shape[-1])
            ratios.append(float((value / every_step(gram, iters).clamp_min(1e-30)).sub(1).abs().max()))
        return value
    solvers.top_eigenvalue = spy
    method = build_method("kvzip+am_fit")
    with torch.inference_mode():
        source = prefill_ids(model, tok, ids, capture_window=64, methods=[method])
        cache = source.cache.copy()
        ctx = source.compression_context(cache, Budget.parse(0.1), shared=source.shared)
        method.apply(ctx)
        probe = torch.tensor([[tok.eos_token_id or 0]])
        logits = model(probe, past_key_values=cache, use_cache=True).logits[0, -1].float()
    out[name] = (cache, logits)
solvers.top_eigenvalue = now
print(f"groups by power iteration {len(widths)}, widest {max(widths)}; max relative change of the estimate {max(ratios):.3g}")
(a, la), (b, lb) = out["every step"], out["every 5 steps"]
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
