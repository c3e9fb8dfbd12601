"""The layout a cache file is served in, checked through kvfold's own attention (no vLLM needed).

A cache rebuilt from the layout (narrow keys, β read back from the widened channel, logical length
= slots) must answer as the file does; and each thing the layout does must matter: without the key
rotation (positions from C instead of T), without β, or with the padding attended, some of the
five answers change. vLLM runs this same layout (``test_server`` checks its answers).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvfold.evaluate.data.logbook import FACTS
from kvfold.integrations.vllm.layout import (
    PAD_BETA,
    ServedLayout,
    UnservableCacheError,
    build_layout,
    read_cache_file,
    rope_inverse_frequencies,
    rotate_keys,
    wide_head_size,
)
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.prompts import build_prompt, encode


def _as_cache(layout: ServedLayout, config) -> FoldedCache:
    """A FoldedCache that holds what vLLM holds: ``slots`` entries a row at positions 0…slots−1."""
    cache = FoldedCache(config)
    dim = config.head_dim
    for index, layer in enumerate(cache.layers):
        keys, values = layout.keys[index][None], layout.values[index][None]
        beta = keys[..., dim].float() * dim**-0.5
        narrow_k, narrow_v = keys[..., :dim].contiguous(), values[..., :dim].contiguous()
        layer.update(narrow_k, narrow_v)
        layer.logical_length = layout.slots
        layer.replace(narrow_k, narrow_v, beta)
    return cache


@torch.inference_mode()
def _answers_agree(model, tokenizer, cache: FoldedCache, answers: dict[str, list[int]]) -> list[bool]:
    """Per question, whether greedy decoding from ``cache`` gives ``answers[question]`` (kvfold ask's).

    Teacher-forced in one forward: greedy decoding reproduces the answer exactly when every step's
    argmax is the answer's next token (up to the first step that differs, the two read the same prefix).
    """
    agree = []
    for _, question, _ in FACTS:
        suffix = encode(tokenizer, build_prompt(tokenizer, "", question).suffix, special=False)
        ids = torch.tensor([suffix + answers[question]])
        work = cache.copy()
        start = work.get_seq_length()
        positions = torch.arange(start, start + ids.shape[1])[None]
        logits = model(ids, past_key_values=work, position_ids=positions).logits[0, len(suffix) - 1 : -1]
        agree.append(logits.argmax(-1).tolist() == answers[question])
    return agree


def test_a_wider_head_has_room_for_beta():
    assert wide_head_size(64) == 80
    assert wide_head_size(128) == 160
    with pytest.raises(UnservableCacheError):
        wide_head_size(512)


def test_rotating_keys_moves_their_rope_position(model_and_tokenizer):
    model, _ = model_and_tokenizer
    inv_freq = rope_inverse_frequencies(model.config)
    rotary = model.model.rotary_emb
    raw = torch.randn(1, 3, 5, 64)
    positions = torch.arange(100, 105)[None]
    cos, sin = rotary(raw, positions)
    at_100, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    cos, sin = rotary(raw, positions - 37)
    at_63, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    assert torch.allclose(rotate_keys(at_100, -37, inv_freq), at_63, atol=1e-4)
    assert torch.allclose(rotate_keys(rotate_keys(at_100, -37, inv_freq), 37, inv_freq), at_100, atol=1e-5)


@pytest.mark.parametrize("name", ["am_fit", "adakv"])
def test_the_layout_answers_as_the_file(saved, references, model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    cache, _ = read_cache_file(saved[name], model.config)
    layout = build_layout(cache, model.config)
    assert layout.slots < layout.logical_length
    assert all(_answers_agree(model, tokenizer, cache, references[name]))
    assert all(_answers_agree(model, tokenizer, _as_cache(layout, model.config), references[name]))


def test_positions_from_c_instead_of_t_change_the_answers(saved, references, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache, _ = read_cache_file(saved["uniform"], model.config)
    unturned = build_layout(cache, model.config, keep_positions=False)
    assert unturned.logical_length - unturned.slots > 1000
    assert not all(_answers_agree(model, tokenizer, _as_cache(unturned, model.config), references["uniform"]))


def test_dropping_beta_changes_the_answers(saved, references, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache, _ = read_cache_file(saved["am_fit"], model.config)
    layout = build_layout(cache, model.config)
    dim = model.config.head_dim
    for keys in layout.keys:
        real = keys[..., dim] > PAD_BETA / dim**-0.5 / 2  # entries, not padding
        keys[..., dim] = torch.where(real, torch.zeros_like(keys[..., dim]), keys[..., dim])
    assert not all(_answers_agree(model, tokenizer, _as_cache(layout, model.config), references["am_fit"]))


def test_attending_the_padding_changes_the_answers(saved, references, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    cache, _ = read_cache_file(saved["adakv"], model.config)
    layout = build_layout(cache, model.config)
    dim = model.config.head_dim
    padded = sum(int((keys[..., dim] < 0.5 * PAD_BETA / dim**-0.5).sum()) for keys in layout.keys)
    total = sum(keys[..., dim].numel() for keys in layout.keys)
    assert 0.1 < padded / total < 0.9  # per-head budgets: rows of different lengths
    for keys in layout.keys:
        keys[..., dim] = keys[..., dim].clamp(min=0.0)
    assert not all(_answers_agree(model, tokenizer, _as_cache(layout, model.config), references["adakv"]))


def test_unservable_files_are_refused_in_one_line(saved, model_and_tokenizer, tmp_path, logbook):
    import kvfold

    model, tokenizer = model_and_tokenizer
    text = logbook[:300]
    path = tmp_path / "aware.kvc"
    aware = kvfold.prefill(model, tokenizer, text, question=FACTS[0][1], query_aware=True).compress("full", budget=1.0)
    kvfold.save_context(aware, path, source_text=text)
    with pytest.raises(UnservableCacheError, match="query-aware"):
        read_cache_file(path, model.config)
    cache, header = read_cache_file(saved["kvzip"], model.config)
    from kvfold.integrations.vllm.layout import check_servable
    from kvfold.runtime.quantize import QuantConfig

    cache.quantize(QuantConfig(format="int4"))  # as a file of kvfold compress --kv-bits 4 loads
    with pytest.raises(UnservableCacheError, match="layer 0 is stored quantized") as err:
        check_servable(cache, header)
    assert "\n" not in str(err.value)
