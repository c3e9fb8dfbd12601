"""The compiled decode (kvfold.pipeline.compiled_decode): fixed tails decode as growing ones, the step
is traced once, and what it refuses."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import kvfold
from kvfold.pipeline.compiled_decode import CompiledDecode
from kvfold.runtime import quantized_attention
from kvfold.runtime.errors import UserError
from kvfold.runtime.quant_config import QuantConfig
from kvfold.runtime.rows import FloatRows
from tests.conftest import CharTokenizer, make_tiny_model

FORMATS = ["full", "rows", "int4", "int3", "fp8", "int4[outliers=1]"]
"""The full cache (no stored rows), ragged rows at full precision, and quantized ragged rows."""

TOKENS = [5, 17, 3, 41, 9]


def _cache(kind: str, family: str = "llama"):
    """A tiny model and a cache of ``kind`` (:data:`FORMATS`), rows of very different lengths with β."""
    model = kvfold.enable(make_tiny_model(family, num_key_value_heads=3, num_attention_heads=6))
    prefilled = kvfold.prefill(
        model, CharTokenizer(), "the quick brown fox jumps over it " * 3, use_chat_template=False
    )
    cache = prefilled.cache
    if kind != "full":
        n = cache.get_seq_length()
        for i, layer in cache.folded_layers:
            keys, values, _, _ = layer.padded()
            beta = torch.randn(1, 3, n, generator=torch.Generator().manual_seed(i))
            layer.replace(keys, values, beta, torch.tensor([[n, 3 + i, n // 3]]))
            assert isinstance(layer.stored, FloatRows)
        if kind != "rows":
            cache.quantize(QuantConfig.parse(kind))
    return model, cache


def _eager_logits(model, cache, tokens: list[int]) -> list[torch.Tensor]:
    """Logits of each step of a growing tail (the reference), positions counted on the host."""
    n = cache.get_seq_length()
    out = []
    with torch.no_grad():
        for step, token in enumerate(tokens):
            position = torch.tensor([[n + step]])
            out.append(
                model(input_ids=torch.tensor([[token]]), position_ids=position, past_key_values=cache).logits[:, -1]
            )
    return out


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch):
    """Quantized rows by the PyTorch path in both decodes (the one a compiled step traces)."""
    monkeypatch.setattr(quantized_attention, "native_applies", lambda *a: False)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_fixed_tail_decodes_as_a_growing_one(kind):
    """Eager steps over fixed tails give the growing tail's logits, and once released the cache holds
    what the growing one holds (lengths, entries, β)."""
    model, cache = _cache(kind)
    reference = cache.copy()
    want = _eager_logits(model, reference, TOKENS)
    n = cache.get_seq_length()
    with torch.no_grad(), CompiledDecode(model, cache, len(TOKENS) + 2, compile=False) as decode:
        assert int(cache.get_seq_length()) == n
        got = [decode.step(torch.tensor([token])) for token in TOKENS]
        assert int(cache.get_seq_length()) == n + len(TOKENS)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert cache.get_seq_length() == reference.get_seq_length() == n + len(TOKENS)
    for (_, layer), (_, ref) in zip(cache.folded_layers, reference.folded_layers, strict=True):
        assert not layer.is_fixed and layer.physical_length == ref.physical_length
        assert torch.equal(layer.row_lengths(), ref.row_lengths())
        for mine, theirs in zip(layer.padded()[:3], ref.padded()[:3], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)  # the same entries and β
    if kind == "full":  # a plain tail is plain again: attention skips the bias
        assert all(layer._log_mass is None for _, layer in cache.folded_layers)  # noqa: SLF001
    more = torch.tensor([[7]])
    with torch.no_grad():  # and it grows again
        position = torch.tensor([[n + len(TOKENS)]])
        a = model(input_ids=more, position_ids=position, past_key_values=cache).logits
        b = model(input_ids=more, position_ids=position, past_key_values=reference).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", FORMATS)
def test_a_compiled_step_is_traced_once(kind):
    """``torch.compile`` traces the first step into one graph (no break) and replays it for every
    later step (no recompile); its logits are the eager decode's."""
    torch._dynamo.reset()
    model, cache = _cache(kind)
    want = _eager_logits(model, cache.copy(), TOKENS)
    counter = CompileCounter()
    with torch.no_grad(), CompiledDecode(model, cache, len(TOKENS), backend=counter) as decode:
        got = [decode.step(torch.tensor([token])) for token in TOKENS]
    assert counter.frame_count == 1, f"{counter.frame_count} graphs for {len(TOKENS)} steps"
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {step}")


def test_quantized_rows_on_the_cpu_are_traced_through_the_pytorch_path(monkeypatch):
    """On the CPU the eager decode reads codes with the C kernel (a ctypes call no graph holds); a
    compiled step reads them by the PyTorch path, still one graph."""
    monkeypatch.undo()
    torch._dynamo.reset()
    model, cache = _cache("int4")
    counter = CompileCounter()
    with torch.no_grad(), CompiledDecode(model, cache, 2, backend=counter) as decode:
        decode.step(torch.tensor([5]))
        decode.step(torch.tensor([6]))
    assert counter.frame_count == 1


@pytest.mark.parametrize("kind", ["full", "int4"])
def test_the_compiled_step_computes_what_the_eager_one_does(kind):
    """Compiled by inductor (fused kernels, as on a GPU without its CUDA graphs)."""
    torch._dynamo.reset()
    model, cache = _cache(kind)
    want = _eager_logits(model, cache.copy(), TOKENS[:3])
    with torch.no_grad(), CompiledDecode(model, cache, 3) as decode:
        got = [decode.step(torch.tensor([token])) for token in TOKENS[:3]]
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_what_a_compiled_decode_refuses():
    model, cache = _cache("int4")
    with torch.no_grad(), CompiledDecode(model, cache, 1, compile=False) as decode:
        decode.step(torch.tensor([5]))
        with pytest.raises(UserError, match="tails are full"):
            decode.step(torch.tensor([6]))
        with pytest.raises(UserError, match="one new token a step"):
            model(input_ids=torch.tensor([[1, 2]]), past_key_values=cache)
        with pytest.raises(ValueError, match="already fixed"):
            cache.layers[0].fix_tail(2)
        with pytest.raises(ValueError, match="release_tail"):
            cache.layers[0].batch_select_indices(torch.tensor([0]))
    gemma, sliding = _cache("full", family="gemma3")
    with pytest.raises(UserError, match="sliding-window"):
        CompiledDecode(gemma, sliding, 2)
    cache.policy = object()
    with pytest.raises(UserError, match="online"):
        CompiledDecode(model, cache, 2)
