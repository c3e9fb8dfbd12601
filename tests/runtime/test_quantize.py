"""Quantized storage (kvfold.runtime.quantize) and quantized folded layers: error bounds against
float64, β untouched, bytes in closed form, attention over quantized layers, batch edits."""

from __future__ import annotations

import math

import pytest
import torch

import kvfold
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.codes import INT_BITS
from kvfold.runtime.quant_config import QuantConfig, QuantSpecError
from kvfold.runtime.quantize import FP8_MAX, QuantizedRows
from tests.conftest import CharTokenizer, make_tiny_model

R, N, D = 5, 70, 16


def _rows(seed: int = 0, outlier_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    keys = torch.randn(R, N, D)
    if outlier_channel:  # an outlier channel (as RoPE'd keys have) and a sink-like first entry
        keys[:, :, 3] = keys[:, :, 3] * 10 + 40
        keys[:, 0] *= 8
    values = torch.randn(R, N, D)
    log_mass = torch.randn(R, N)
    lengths = torch.tensor([N, 1, 33, 0, 64])
    return keys, values, log_mass, lengths


def _valid(lengths: torch.Tensor, width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < lengths[:, None]


@pytest.mark.parametrize("bits", INT_BITS)
def test_dequantized_entries_are_within_half_a_step_of_a_float64_reference(bits):
    """Keys per channel over groups of entries, values per entry: every valid element within half a
    step of its own group's grid, steps computed in float64 from the data (outlier channel included)."""
    keys, values, log_mass, lengths = _rows()
    config = QuantConfig(format=f"int{bits}", key_group=16)
    k, v, lm = QuantizedRows.from_padded(keys, values, log_mass, lengths, config).to_padded()
    width = int(lengths.max())
    valid = _valid(lengths, width)
    levels = (1 << bits) - 1
    for r in range(R):
        n = int(lengths[r])
        for start in range(0, n, 16):  # key groups: per channel, float64 range
            x = keys[r, start : min(n, start + 16)].double()
            step = (x.amax(0) - x.amin(0)) / levels
            err = (k[r, start : min(n, start + 16)].double() - x).abs()
            assert (err <= step / 2 * (1 + 2e-3) + 1e-3 * x.abs().amax(0) * 2**-9 + 1e-6).all()
        if n:
            x = values[r, :n].double()  # values: per entry
            step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / levels
            err = (v[r, :n].double() - x).abs()
            assert (err <= step / 2 * (1 + 2e-3) + 1e-3 * x.abs().amax(1, keepdim=True) * 2**-9 + 1e-6).all()
    assert (lm[~valid] == float("-inf")).all()


def test_an_outlier_channel_does_not_coarsen_the_other_channels_of_a_key():
    """Per-channel key scales: the other channels' error follows their own range (per-entry scales,
    which KIVI shows fail on keys, would spread the outlier channel's range over every channel)."""
    keys, values, log_mass, lengths = _rows()
    k, _, _ = QuantizedRows.from_padded(keys, values, None, lengths, QuantConfig(format="int4")).to_padded()
    plain = [c for c in range(D) if c != 3]
    n = int(lengths[0])
    err = (k[0, 1:n, plain] - keys[0, 1:n, plain]).abs().max()
    own_range = keys[0, :n, plain].amax(0) - keys[0, :n, plain].amin(0)
    outlier_range = keys[0, :n, 3].amax() - keys[0, :n, 3].amin()
    assert err <= own_range.max() / 15 / 2 * 1.01
    assert err < outlier_range / 15 / 8  # far below what a scale shared with channel 3 would give


def test_fp8_stores_e4m3_with_one_scale_per_row():
    keys, values, log_mass, lengths = _rows()
    rows = QuantizedRows.from_padded(keys, values, log_mass, lengths, QuantConfig(format="fp8"))
    assert rows.key_codes.dtype == torch.uint8 and rows.key_codes.shape == (int(lengths.sum()), D)
    k, v, _ = rows.to_padded()
    valid = _valid(lengths, k.shape[1])
    for source, back in ((keys, k), (values, v)):
        x = source[:, : k.shape[1]][valid].double()
        rel = (back[valid].double() - x).abs() / x.abs().clamp_min(1e-3)
        scale = rows.key_scale if source is keys else rows.value_scale
        tiny = (x.abs() < 2**-6 * FP8_MAX * scale.max()).squeeze()
        assert (rel[~tiny] <= 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits, half-ulp 1/16


@pytest.mark.parametrize("fmt", ["int4", "int2", "fp8"])
def test_log_mass_is_kept_bit_for_bit(fmt):
    keys, values, log_mass, lengths = _rows()
    _, _, lm = QuantizedRows.from_padded(keys, values, log_mass, lengths, QuantConfig(format=fmt)).to_padded()
    valid = _valid(lengths, lm.shape[1])
    assert torch.equal(lm[valid], log_mass[:, : lm.shape[1]][valid])
    assert lm.dtype == torch.float32


def test_a_wide_fitted_value_leaves_its_neighbours_error_unchanged():
    """Values have a scale per entry: one entry with ten times the range (a fitted value) changes no
    other entry's stored value."""
    keys, values, _, lengths = _rows(outlier_channel=False)
    config = QuantConfig(format="int4")
    _, before, _ = QuantizedRows.from_padded(keys, values, None, lengths, config).to_padded()
    wide = values.clone()
    wide[0, 10] *= 10
    _, after, _ = QuantizedRows.from_padded(keys, wide, None, lengths, config).to_padded()
    others = torch.ones(R, before.shape[1], dtype=torch.bool)
    others[0, 10] = False
    assert torch.equal(after[others], before[others])


def test_outlier_entries_are_kept_exactly_and_counted_at_16_bits():
    keys, values, log_mass, lengths = _rows()
    config = QuantConfig(format="int4", outliers=2)
    rows = QuantizedRows.from_padded(keys, values, log_mass, lengths, config)
    k, v, _ = rows.to_padded()
    assert torch.equal(k[0, 0], keys[0, 0]) and torch.equal(v[0, 0], values[0, 0])  # the sink-like entry
    outliers = rows.outlier_keys.shape[0]
    assert outliers == 2 + 1 + 2 + 0 + 2
    assert rows.nbytes() - rows.gpu_nbytes() == outliers * 2 * D * (4 - 2)
    # without the sink in its group, the group's other keys are quantized finer
    plain = QuantizedRows.from_padded(keys, values, log_mass, lengths, QuantConfig(format="int4")).to_padded()[0]
    assert (k[0, 1:32] - keys[0, 1:32]).abs().max() < (plain[0, 1:32] - keys[0, 1:32]).abs().max()


def test_selecting_rows_keeps_their_codes():
    keys, values, log_mass, lengths = _rows()
    rows = QuantizedRows.from_padded(keys, values, log_mass, lengths, QuantConfig(format="int3", outliers=1))
    k, v, lm = rows.to_padded()
    picked = rows.select_rows(torch.tensor([4, 2, 2, 3]))
    k2, v2, lm2 = picked.to_padded()
    for new, old in enumerate([4, 2, 2, 3]):
        n = int(lengths[old])
        assert torch.equal(k2[new, :n], k[old, :n]) and torch.equal(v2[new, :n], v[old, :n])
        assert torch.equal(lm2[new, :n], lm[old, :n])


def _closed_form_bytes(lengths: torch.Tensor, config: QuantConfig, head_dim: int, with_beta: bool) -> int:
    """Codes, scales and zero points, β and the row lengths, summed by hand."""
    entries = int(lengths.sum())
    groups = sum(math.ceil(int(n) / config.key_group) for n in lengths)
    codes = entries * 2 * head_dim * config.bits // 8
    key_params = groups * head_dim * 2 * 2
    value_params = entries * 2 * 2
    beta = entries * 4 if with_beta else 0
    return codes + key_params + value_params + beta + lengths.numel() * 8


@pytest.mark.parametrize("lengths", [[40, 40, 40, 40], [40, 3, 17, 64]], ids=["dense", "paged"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int3", "int2"])
def test_a_quantized_layer_holds_the_closed_form_bytes(lengths, fmt):
    torch.manual_seed(1)
    layer_lengths = torch.tensor(lengths).view(2, 2)
    cache = FoldedCache(num_layers=1)
    layer = cache.layers[0]
    n = max(lengths)
    layer.update(torch.randn(2, 2, n, D), torch.randn(2, 2, n, D))
    beta = torch.randn(2, 2, n)
    layer.replace(*layer.padded()[:2], beta, lengths=layer_lengths)
    assert (layer.stored is not None) == (len(set(lengths)) > 1)
    config = QuantConfig(format=fmt)
    cache.quantize(config)
    expected = _closed_form_bytes(layer_lengths.flatten(), config, D, with_beta=True)
    empty_tail = 0  # the full-precision tail holds nothing yet
    assert layer.content_nbytes() == expected + empty_tail
    assert layer.nbytes() == expected
    assert cache.content_nbytes(sixteen_bit=True) == expected
    assert cache.full_nbytes(sixteen_bit=True) == 2 * 2 * n * D * 2 * 2
    assert cache.memory_ratio() == pytest.approx(expected / (2 * 2 * n * D * 2 * 2))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_searched_ranges_give_keys_and_values_back_closer_than_min_max(bits):
    """``clip=1``: every group's squared error is at most min–max's (1.0 is among the factors), and
    on Gaussian entries with a few tails the total is lower."""
    keys, values, log_mass, lengths = _rows(outlier_channel=False)
    keys[:, 5, 2] += 6.0  # a tail in one key channel and one value
    values[:, 7, 1] -= 6.0
    valid = torch.arange(N)[None, :] < lengths[:, None]
    errors = {}
    for clip in (0, 1):
        config = QuantConfig(format=f"int{bits}", clip=clip)
        k, v, _ = QuantizedRows.from_padded(keys, values, log_mass, lengths, config).to_padded()
        w = k.shape[1]
        key_err = ((k - keys[:, :w]).square().sum(-1) * valid[:, :w]).sum()
        value_err = (v - values[:, :w]).square().sum(-1)[valid[:, :w]]
        errors[clip] = key_err, value_err
    assert errors[1][0] < errors[0][0]
    assert bool((errors[1][1] <= errors[0][1] * (1 + 1e-5) + 1e-7).all())
    assert errors[1][1].sum() < errors[0][1].sum()


def test_wide_layers_of_short_rows_are_stored_wider_or_in_the_models_dtype():
    """``wide``: a layer whose rows hold on average at most one key group is stored in ``wide`` bits
    (16: left in the model's dtype), every other layer in the format itself; the cache keeps the
    format it was given, each layer's stored rows the plain format they are in."""
    config = QuantConfig.parse("int3[wide=8,key_group=16]")
    assert config.layer_format(torch.tensor([[16, 16], [3, 29]])) == QuantConfig("int8", key_group=16)
    assert config.layer_format(torch.tensor([[17, 16], [16, 16]])) == QuantConfig("int3", key_group=16)
    assert QuantConfig("int3", wide=16).layer_format(torch.tensor([[5, 9]])) is None
    assert QuantConfig("int3").layer_format(torch.tensor([[5, 9]])) == QuantConfig("int3")
    for wide, short in ((8, "int8"), (16, None)):
        torch.manual_seed(0)
        cache = FoldedCache(num_layers=2)
        for layer, n in zip(cache.layers, (6, 70), strict=True):
            layer.update(torch.randn(1, 2, n, D), torch.randn(1, 2, n, D))
            layer.replace(*layer.padded()[:2], torch.randn(1, 2, n), lengths=torch.tensor([[n, n - 3]]))
        cache.quantize(QuantConfig("int3", wide=wide))
        assert cache.quant == QuantConfig("int3", wide=wide)
        short_layer, long_layer = cache.layers
        assert long_layer.is_quantized and long_layer.stored.config == QuantConfig("int3")
        if short is None:
            assert not short_layer.is_quantized  # in the model's dtype
            assert short_layer.row_lengths().tolist() == [[6, 3]]
        else:
            assert short_layer.stored.config == QuantConfig(short)
    for bad in ("int3[wide=4]", "int4[wide=4]", "int3[wide=12]", "fp8[wide=16]", "int8[wide=8]"):
        with pytest.raises(QuantSpecError):
            QuantConfig.parse(bad)
    assert QuantConfig.parse("int3[wide=16]").describe() == "int3[wide=16]"


# ---------------------------------------------------------------- quantized layers in a model
TEXT = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 3


def _context(model):
    return kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False, methods="snapkv")


def _next_logits(model, cache: FoldedCache, ids: list[int]) -> torch.Tensor:
    logical = cache.get_seq_length()
    pos = torch.arange(logical, logical + len(ids))[None]
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), past_key_values=cache, position_ids=pos, use_cache=True).logits


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv@int4",
        "adakv:snapkv@int3",
        "snapkv+keepkv@int8",
        "full@int2",
        "adakv:snapkv+keepkv@int4[outliers=2]",
        "snapkv@fp8",
        "snapkv@int4[value_group=8]",
    ],
)
def test_attention_over_a_quantized_layer_equals_attention_over_its_dequantized_entries(spec):
    """The quantized path (dequantized entries with β, then the full-precision tail, causal among
    the new tokens) computes what the plain path computes over the same entries stored unquantized."""
    model = kvfold.enable(make_tiny_model("llama"))
    small = _context(model).compress(spec, 0.3)
    quantized = small.cache.copy()
    plain = small.cache.copy()
    for (_, q_layer), (_, p_layer) in zip(quantized.folded_layers, plain.folded_layers, strict=True):
        assert q_layer.is_quantized
        k, v, lm, lengths = q_layer.padded()
        p_layer.stored = None
        p_layer.replace(k, v, lm, lengths=lengths)
    question = [5, 9, 17, 23, 4]
    a = _next_logits(model, quantized, question)
    b = _next_logits(model, plain, question)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for token in (7, 11):  # decode steps append to the tail
        torch.testing.assert_close(_next_logits(model, quantized, [token]), _next_logits(model, plain, [token]))
    assert all(layer.is_quantized for _, layer in quantized.folded_layers)


def test_no_quantization_leaves_caches_and_answers_bit_identical():
    model = kvfold.enable(make_tiny_model("llama"))
    context = _context(model)
    for spec in ("snapkv", "adakv:snapkv", "full"):
        plain = context.compress(spec, 0.3)
        same = context.compress(spec + "@16", 0.3)
        assert plain.cache.quant is None and same.cache.quant is None
        for (_, a), (_, b) in zip(plain.cache.folded_layers, same.cache.folded_layers, strict=True):
            for x, y in zip(a.padded(), b.padded(), strict=True):
                assert torch.equal(x, y)
        assert plain.answer("What is the vault code?", max_new_tokens=6) == same.answer(
            "What is the vault code?", max_new_tokens=6
        )


def test_batch_edits_of_a_quantized_cache_pick_stored_rows():
    model = kvfold.enable(make_tiny_model("llama"))
    context = kvfold.prefill(model, CharTokenizer(), [TEXT, TEXT[:150]], use_chat_template=False, methods="snapkv")
    small = context.compress("adakv:snapkv@int4", 0.3)
    _, layer = small.cache.folded_layers[0]
    k, v, lm, lengths = layer.padded()
    one = small.cache.copy()
    one.batch_select_indices(torch.tensor([1]))
    k1, v1, lm1, lengths1 = one.folded_layers[0][1].padded()
    assert torch.equal(lengths1[0], lengths[1])
    width = int(lengths[1].max())
    assert torch.equal(k1[0, :, :width], k[1, :, :width]) and torch.equal(lm1[0, :, :width], lm[1, :, :width])
    # answers from a batch equal each row's own
    answers = small.answer("What is the vault code?", max_new_tokens=5)
    alone = kvfold.prefill(model, CharTokenizer(), TEXT[:150], use_chat_template=False, methods="snapkv")
    assert answers[1] == alone.compress("adakv:snapkv@int4", 0.3).answer("What is the vault code?", max_new_tokens=5)


def test_a_quantized_cache_refuses_online_policies_with_one_line():
    model = kvfold.enable(make_tiny_model("llama"))
    context = _context(model)
    with pytest.raises(ValueError, match="quantized cache cannot be compressed while decoding"):
        context.compress("h2o@int4", 0.3)
