"""What attention reads from a compressed cache, for comparing two compressions of one context (float32
against float64 on the CPU, CUDA against the CPU): the next-token logits after a probe, and each row's
attention output and mass (log-sum-exp) over its compressed entries on the probe's own queries.

Attention Matching (Zweiger et al. 2026 §2) fits β and the values so that these match the full cache's;
the fit solves near-singular normal equations, so β itself may move a lot between precisions or devices
in directions the attention barely reads. Comparing what is read tells such a difference from a bug.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvfold
from kvfold.runtime.attention import attention_scalings
from tests.conftest import CharTokenizer, make_tiny_model

TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 6
PROBE = [5, 7, 9]
"""Token ids of the probe read after the compressed context."""


@dataclass
class Reads:
    """What attention reads from one compressed cache (float64, on the CPU).

    Attributes:
        logits: ``(len(PROBE), vocab)`` next-token logits of the probe's tokens.
        outputs: per layer, ``(B, H_kv, G·q, Dv)`` each row's attention output over its compressed
            entries alone (β included) for the probe's queries (the G query heads of a KV head folded).
        masses: per layer, ``(B, H_kv, G·q)`` the log-sum-exp of those logits (the attention mass).
        lengths: per layer, ``(B, H_kv)`` the rows' lengths.
        betas: per layer, ``(B, H_kv, N)`` float32 β of the padded entries (−inf past a row's end).
        keys, values: per layer, the padded entries.
    """

    logits: torch.Tensor
    outputs: list[torch.Tensor]
    masses: list[torch.Tensor]
    lengths: list[torch.Tensor]
    betas: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def compress(method: str, device: str = "cpu", dtype: torch.dtype = torch.float32, budget: float = 0.25):
    """The tiny Qwen2 model (seed 0) on ``device`` in ``dtype``, and :data:`TEXT` compressed by ``method``."""
    model = kvfold.enable(make_tiny_model("qwen2").to(device=device, dtype=dtype))
    prefilled = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False)
    return model, prefilled.compress(method, budget)


def reads(model, compressed) -> Reads:
    """:class:`Reads` of a compressed context: the probe decoded on a copy of its cache, its queries
    captured at every layer; the rows' outputs and masses computed in float64 on the CPU, so two caches
    compare by their entries only."""
    cache = compressed.cache.copy()
    n = cache.get_seq_length()
    ids = torch.tensor([PROBE], device=model.device)
    positions = torch.arange(n, n + len(PROBE), device=model.device)[None]
    for _, layer in cache.folded_layers:
        layer.captured_queries = None
    cache.capture_window = len(PROBE)
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, position_ids=positions).logits[0]
    scalings = attention_scalings(model)
    out = Reads(logits.double().cpu(), [], [], [], [], [], [])
    for (index, probed), (_, layer) in zip(cache.folded_layers, compressed.cache.folded_layers, strict=True):
        keys, values, beta, lengths = (t.cpu() for t in layer.padded())
        query = probed.captured_queries.double().cpu()  # (B, H_q, q, D)
        b, h_kv = lengths.shape
        folded = query.reshape(b, h_kv, -1, query.shape[-1])
        scaling = scalings.get(index) or query.shape[-1] ** -0.5
        logit = folded @ keys.double().transpose(-1, -2) * scaling + beta.double()[:, :, None, :]
        out.masses.append(torch.logsumexp(logit, -1))
        out.outputs.append(torch.softmax(logit, -1) @ values.double())
        out.lengths.append(lengths)
        out.betas.append(beta)
        out.keys.append(keys)
        out.values.append(values)
    return out


def largest_difference(a: Reads, b: Reads) -> dict[str, float]:
    """The largest absolute difference of each read (``logits``, ``outputs``, ``masses``) and of β where
    both are finite (``beta``)."""
    both = [(x - y).nan_to_num(0.0, 0.0, 0.0) for x, y in zip(a.betas, b.betas, strict=True)]  # −inf − −inf: nan
    beta = max(float(d.abs().max()) if d.numel() else 0.0 for d in both)
    return {
        "logits": float((a.logits - b.logits).abs().max()),
        "outputs": max(float((x - y).abs().max()) for x, y in zip(a.outputs, b.outputs, strict=True)),
        "masses": max(float((x - y).abs().max()) for x, y in zip(a.masses, b.masses, strict=True)),
        "beta": beta,
    }


def assert_same_selection(a: Reads, b: Reads, *, values: bool = True) -> None:
    """The same entries kept in every row: equal lengths, keys within float32 rounding, the same slots
    empty; with ``values`` the values too (a method that fits nothing keeps them as they are)."""
    for i, (la, lb) in enumerate(zip(a.lengths, b.lengths, strict=True)):
        assert torch.equal(la, lb), f"layer {i}: row lengths differ"
        torch.testing.assert_close(a.keys[i].double(), b.keys[i].double(), rtol=1e-3, atol=1e-3)
        assert torch.equal(torch.isfinite(a.betas[i]), torch.isfinite(b.betas[i])), f"layer {i}: empty slots differ"
        if values:
            torch.testing.assert_close(a.values[i].double(), b.values[i].double(), rtol=1e-3, atol=1e-3)
