"""Diagnostic: per-layer damage of storing the compacted entries in 2/3/4 bits, relative to the same
compacted entries at full precision, on the fit's own reference queries (after a 16-bit fit)."""
import sys, json
import torch
from kvfold import load_model
from kvfold.evaluate import load_dataset_spec
from kvfold.pipeline.context import prefill
from kvfold.methods.compaction.attention_matching.method import AMFit
from kvfold.methods.core.model import layer_scaling
from kvfold.runtime.quantize import QuantConfig, QuantizedRows

damage = {}
orig = AMFit.fold
def fold(self, layer_idx, layer, keep, lengths, scores, ctx):
    orig(self, layer_idx, layer, keep, lengths, scores, ctx)
    k, v, lm, ln = layer.padded()
    q = ctx.memo["am_fit_queries"][layer_idx]
    b, h, n, d = k.shape
    Q = q.queries[..., :1024, :].float(); QV = q.valid[..., :1024]
    s = layer_scaling(ctx, layer_idx, layer)
    def out(keys, vals):
        logits = torch.einsum("bhqd,bhnd->bhqn", Q, keys.float()) * s + lm[:, :, None, :]
        return torch.softmax(logits, -1) @ vals.float()
    ref = out(k, v)
    row = {}
    for bits in (2, 3, 4):
        rows = QuantizedRows.from_padded(k.reshape(b*h, n, d), v.reshape(b*h, n, -1), lm.reshape(b*h, n), ln.reshape(-1), QuantConfig(format=f"int{bits}"))
        kq, vq, _ = rows.to_padded(); w = kq.shape[1]
        kq = kq.view(b, h, w, d); vq = vq.view(b, h, w, -1)
        kk = k.clone(); vv = v.clone(); kk[:, :, :w] = kq; vv[:, :, :w] = vq
        for name, (a, c) in {"kv": (kk, vv), "k": (kk, v), "v": (k, vv)}.items():
            dev = ((out(a, c) - ref) * QV[..., None]).norm() / (ref * QV[..., None]).norm()
            row[f"{name}{bits}"] = round(float(dev), 4)
    row["entries"] = int(ln.sum())
    damage[layer_idx] = row
AMFit.fold = fold

model, tok = load_model()
task, idx = sys.argv[1], int(sys.argv[2])
s = [x for x in load_dataset_spec(f"ruler:{task}", tok, 2048, idx + 1) if x.task == task][idx]
ctx = prefill(model, tok, s.context)
ctx.compress("kvzip+am_fit@16", 0.06)
for l, r in damage.items():
    print(l, r)
json.dump(damage, open(sys.argv[3], "w"))
