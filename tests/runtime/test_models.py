"""Model loading: local directories, unsupported families, missing models, the bundled GGUF."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from kvfold.runtime.models import ModelLoadError, load_model, load_tokenizer, resolve_dtype
from tests.conftest import make_tiny_model


def test_load_local_directory_enables_kvfold(tmp_path):
    model = make_tiny_model("qwen3")
    model.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    loaded, tokenizer = load_model(str(tmp_path))
    assert loaded.config._attn_implementation == "kvfold"
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert tokenizer is not None


def test_load_tokenizer_reads_the_tokenizer_alone(tmp_path):
    _write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a model directory; no weights are read
    tokenizer = load_tokenizer(str(tmp_path))
    assert tokenizer("w3 w5 nope").input_ids == [3, 5, 0]
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_tokenizer(str(tmp_path / "tokenizer_only"))
    (tmp_path / "tokenizer_only").mkdir()
    with pytest.raises(ModelLoadError, match="directory without config.json"):
        load_tokenizer(str(tmp_path / "tokenizer_only"))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; kvfold supports: llama, mistral"):
        load_model(str(tmp_path))


def test_missing_paths_and_unreachable_hub_say_how_to_provide_a_model(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no 20 s network time-out
    with pytest.raises(ModelLoadError, match="pass a local directory"):
        load_model("nobody-here/no-such-model")


def test_dtype_names():
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8", torch.device("cpu"))


@pytest.mark.model
def test_bundled_model_is_smollm2(smollm2):
    model, tokenizer = smollm2
    assert model.config.model_type == "llama"
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert tokenizer.chat_template


def _write_tokenizer(path):
    """A minimal word-level tokenizer saved next to the model (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(1, 97)}
    vocab["[UNK]"] = 0
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]").save_pretrained(path)
