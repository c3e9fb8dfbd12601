"""What is served, and how a file is laid into a request's blocks (no vLLM needed).

* The RoPE turn: the backend turns the question's queries by ``T − P`` instead of the keys by
  ``−(T − P)``; both give the same logits, and a question left at the placeholders' positions (no
  turn) answers otherwise.
* A file is held at its own bytes: its chunks fill ``ceil(chunks / layers)`` blocks, within 5% of
  the rows' bytes (plus the last block), in float32 and in bfloat16; the API server's plan equals the
  worker's.
* What cannot be served is refused in one line.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvfold.evaluate.data.logbook import FACTS
from kvfold.integrations.vllm.layout import (
    UnservableCacheError,
    check_servable,
    read_cache_file,
    rope_inverse_frequencies,
    rotate_keys,
)
from kvfold.integrations.vllm.pool_layout import chunk_bytes, pool_rows, served_plan, served_pool
from kvfold.integrations.vllm.settings import BLOCK_SIZE
from kvfold.runtime.cache import FoldedCache
from kvfold.runtime.prompts import build_prompt, encode
from kvfold.runtime.quant_config import QuantConfig
from tests.integrations.vllm.conftest import MEMORY, METHODS


@torch.inference_mode()
def _answers_agree(model, tokenizer, cache: FoldedCache, answers: dict[str, list[int]]) -> list[bool]:
    """Per question, whether greedy decoding from ``cache`` gives ``answers[question]`` (kvfold ask's),
    teacher-forced in one forward (greedy decoding reproduces the answer exactly when every step's
    argmax is the answer's next token)."""
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


def test_turning_the_queries_forward_equals_turning_the_keys_back(model_and_tokenizer):
    inv_freq = rope_inverse_frequencies(model_and_tokenizer[0].config)
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(4, 64, generator=g, dtype=torch.float64), torch.randn(7, 64, generator=g).double()
    turned_queries = rotate_keys(queries, 1507, inv_freq) @ keys.T
    turned_keys = queries @ rotate_keys(keys, -1507, inv_freq).T
    torch.testing.assert_close(turned_queries, turned_keys, rtol=1e-10, atol=1e-10)


def test_a_question_left_at_the_placeholders_positions_answers_otherwise(saved, references, model_and_tokenizer):
    """The mutation the turn guards against: the file's entries seen from position P, not T."""
    model, tokenizer = model_and_tokenizer
    cache, _ = read_cache_file(saved["am_fit"], model.config)
    served = served_plan(cache, model.config, BLOCK_SIZE, torch.float32)
    assert served.logical_length - served.placeholders > 1000
    assert all(_answers_agree(model, tokenizer, cache, references["am_fit"]))
    for layer in cache.layers:
        layer.logical_length = served.placeholders
    assert not all(_answers_agree(model, tokenizer, cache, references["am_fit"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*METHODS, *MEMORY])
def test_a_file_is_held_at_its_own_bytes(saved, model_and_tokenizer, name, dtype):
    model, _ = model_and_tokenizer
    cache, _ = read_cache_file(saved[name], model.config)
    served, chunks = served_pool(cache, model.config, BLOCK_SIZE, dtype)
    planned = served_plan(cache, model.config, BLOCK_SIZE, dtype)  # the API server's, without the bytes
    assert (planned.plan, planned.placeholders, planned.block_bytes) == (
        served.plan,
        served.placeholders,
        served.block_bytes,
    )
    layers = model.config.num_hidden_layers
    assert served.block_bytes == chunk_bytes(model.config, BLOCK_SIZE, dtype) * layers == chunks.shape[1] * layers
    assert served.placeholders == math.ceil(chunks.shape[0] / layers) * BLOCK_SIZE
    rows = pool_rows(cache)
    element = torch.empty(0, dtype=dtype).element_size()
    held = sum(  # the rows' bytes as the engine holds them: codes as stored, full-precision rows in its dtype
        r.nbytes() if hasattr(r, "config") else r.lengths.numel() * 8 + r.keys.numel() * element * 2 + 4 * len(r.keys)
        for r in rows
    )
    blocks = served.placeholders // BLOCK_SIZE
    assert held <= blocks * served.block_bytes <= 1.05 * held + served.block_bytes
    context = cache.layers[0].logical_length
    full_blocks = math.ceil(context / BLOCK_SIZE)
    if name in MEMORY:  # a fraction of the 16-bit cache: of the float32 blocks, half of it
        assert blocks <= math.ceil(full_blocks * MEMORY[name] * (2 if dtype == torch.float32 else 1) * 1.1) + 1
    else:  # keep 0.1: a tenth of the context's blocks, whatever the rows' lengths
        assert blocks <= math.ceil(full_blocks * 0.1 * 1.1) + 1


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
    check_servable(cache, header)
    cache.layers[3].quantize(QuantConfig(format="int4"))
    with pytest.raises(UnservableCacheError, match="some layers are stored quantized") as err:
        served_plan(cache, model.config, BLOCK_SIZE, torch.float32)
    assert "\n" not in str(err.value)
    cache.quantize(QuantConfig(format="int4", outliers=1))
    with pytest.raises(UnservableCacheError, match="outlier") as err:
        served_plan(cache, model.config, BLOCK_SIZE, torch.float32)
    assert "\n" not in str(err.value)
    cache, _ = read_cache_file(saved["kvzip"], model.config)
    for index, layer in enumerate(cache.layers):  # a wide layer (int3[wide=8]) among 3-bit ones
        layer.quantize(QuantConfig(format="int8" if index == 3 else "int3"))
    with pytest.raises(UnservableCacheError, match=r"different formats \(int3, int8\)") as err:
        served_plan(cache, model.config, BLOCK_SIZE, torch.float32)
    assert "\n" not in str(err.value)
