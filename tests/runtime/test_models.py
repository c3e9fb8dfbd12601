"""Model loading: local directories, unsupported families, missing models, the bundled GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3TextConfig, GPT2Config, GPT2LMHeadModel

from kvfold.runtime.errors import UserError
from kvfold.runtime.models import (
    ModelLoadError,
    check_rotary,
    check_supported,
    load_model,
    load_tokenizer,
    prepare_model,
    resolve_dtype,
)
from tests.conftest import TINY, make_tiny_model


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


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        (
            {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
            "RoPE type 'longrope' is not supported",
        ),
    ],
)
def test_rope_kvfold_cannot_undo_is_refused_in_one_line_before_any_method_runs(tmp_path, rope, message):
    # Phi-4-mini turns 3/4 of each head; Phi-3-mini-128k and Phi-3.5 switch tables past 4K positions.
    model = make_tiny_model(
        "phi3", rope_parameters={"rope_theta": 10000.0, **rope}, original_max_position_embeddings=64
    )
    model.save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    with pytest.raises(UserError, match=message) as err:
        load_model(str(tmp_path))
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=message):
        prepare_model(model)


def test_rope_over_whole_heads_is_taken_in_every_family_and_per_layer_type(tiny_family):
    check_supported(make_tiny_model(tiny_family).config)
    config = Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"]},
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
        },
    )
    with pytest.raises(UserError, match="partial_rotary_factor 0.25"):  # one layer type is enough
        check_rotary(config)


def test_missing_paths_and_unreachable_hub_say_how_to_provide_a_model(tmp_path, monkeypatch):
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "missing.gguf"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no 20 s network time-out
    with pytest.raises(ModelLoadError, match="Pass a local directory") as err:
        load_model("nobody-here/no-such-model")
    message = str(err.value)  # the real cause, in the one line: the class and the first line of its message
    assert "\n" not in message and f"{type(err.value.__cause__).__name__}: " in message
    first_line = str(err.value.__cause__).strip().splitlines()[0].strip()
    assert first_line[:60] in message


def test_load_model_passes_revision_token_device_map_and_more_to_transformers(tmp_path, monkeypatch):
    """``revision`` and ``token`` reach the config, the weights and the tokenizer; ``device_map`` and
    other keywords reach the weights; with a ``device_map`` the model stays where transformers put it."""
    import transformers

    make_tiny_model("llama").save_pretrained(tmp_path)
    _write_tokenizer(tmp_path)
    seen: dict[str, dict] = {}
    for cls in (transformers.AutoConfig, transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def spy(klass, *args, _original=original, _name=cls.__name__, **kwargs):
            seen.setdefault(_name, dict(kwargs))  # the first call: kvfold's (transformers calls again inside)
            kwargs.pop("device_map", None)
            kwargs.pop("low_cpu_mem_usage", None)
            return _original(klass, *args, **{k: v for k, v in kwargs.items() if k not in ("revision", "token")})

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    model, _ = load_model(str(tmp_path), revision="v1", token="hf_x", device_map="cpu", low_cpu_mem_usage=True)
    assert model.config._attn_implementation == "kvfold"
    for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"):
        assert seen[name]["revision"] == "v1" and seen[name]["token"] == "hf_x", name
    assert seen["AutoModelForCausalLM"]["device_map"] == "cpu" and seen["AutoModelForCausalLM"]["low_cpu_mem_usage"]
    assert "device_map" not in seen["AutoTokenizer"] and not moved  # transformers placed it: not moved again
    seen.clear()
    load_model(str(tmp_path))
    assert "revision" not in seen["AutoConfig"] and moved  # nothing given: nothing passed, the model moved


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


def test_random_spec_builds_the_architecture_with_seeded_random_weights(tmp_path):
    """``random:DIR`` (cost benches at a model's shape): DIR's config and tokenizer, no weights
    read, the same seeded weights at every load, in the dtype asked for; a bare directory is a
    one-line error that says what to put there."""
    model = make_tiny_model("llama")
    model.config.save_pretrained(tmp_path)  # config only: no weights in the directory
    _write_tokenizer(tmp_path)
    first, tokenizer = load_model(f"random:{tmp_path}")
    second, _ = load_model(f"random:{tmp_path}", dtype="bfloat16")
    assert first.config._attn_implementation == "kvfold" and tokenizer("w3").input_ids == [3]
    assert first.config.num_hidden_layers == model.config.num_hidden_layers
    assert second.dtype == torch.bfloat16 and first.dtype == torch.float32
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters(), strict=True):
        torch.testing.assert_close(a.to(torch.bfloat16), b, msg=name)
    # the weights are the seeded stream's, matrix after matrix, whatever transformers draws itself
    generator, std = torch.Generator().manual_seed(0), model.config.initializer_range
    matrices = [p for p in first.parameters() if p.dim() >= 2]
    for parameter in matrices[:2]:
        torch.testing.assert_close(parameter, torch.randn(parameter.shape, generator=generator) * std)
    assert not list(tmp_path.glob("*.safetensors")) and not list(tmp_path.glob("*.bin"))
    (tmp_path / "bare").mkdir()
    with pytest.raises(ModelLoadError, match="random:DIR needs a directory with config.json"):
        load_model(f"random:{tmp_path / 'bare'}")


COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_model(cache, monkeypatch, repo: str = "org/tiny", shards: int = 2) -> Path:
    """``repo`` in a Hugging Face cache of its own (offline), as a download leaves it: a tiny Qwen3 in
    ``shards`` safetensors shards named by an index, plus a second copy of the weights the index does not
    name (as Mistral's repositories hold ``consolidated.safetensors``). Returns the snapshot folder."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / COMMIT
    make_tiny_model("qwen3", head_dim=32).save_pretrained(snapshot, max_shard_size="20KB" if shards > 1 else "1GB")
    _write_tokenizer(snapshot)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_hub_model_in_the_cache_is_found_with_what_a_server_reads(tmp_path, monkeypatch):
    from kvfold.runtime.models import hub_snapshot

    snapshot = fake_hub_model(tmp_path / "hub", monkeypatch)
    assert len(list(snapshot.glob("model-*.safetensors"))) >= 2
    assert hub_snapshot("org/tiny") == str(snapshot)
    model, _ = load_model(hub_snapshot("org/tiny"))
    assert model.config.model_type == "qwen3"


def test_a_hub_shard_missing_from_the_cache_is_one_line(tmp_path, monkeypatch):
    from kvfold.runtime.models import hub_snapshot

    snapshot = fake_hub_model(tmp_path / "hub", monkeypatch)
    next(iter(sorted(snapshot.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ModelLoadError, match="could not fetch 'org/tiny' from the Hugging Face hub") as err:
        hub_snapshot("org/tiny")
    assert "\n" not in str(err.value)


def test_a_hub_repository_without_weights_or_not_there_is_one_line(tmp_path, monkeypatch):
    from kvfold.runtime.models import hub_snapshot

    snapshot = fake_hub_model(tmp_path / "hub", monkeypatch, shards=1)
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="found no weights transformers reads"):
        hub_snapshot("org/tiny")
    with pytest.raises(ModelLoadError, match="could not fetch 'nobody/nothing'"):
        hub_snapshot("nobody/nothing")


def test_a_hub_model_is_fetched_as_transformers_fetches_it_not_every_weight_file(tmp_path, monkeypatch):
    """What is asked of the hub: the config, the weight index and the shards it names (not the second copy
    of the weights beside them), the tokenizer and the generation config."""
    import transformers.utils
    import transformers.utils.hub

    from kvfold.runtime import models

    snapshot = fake_hub_model(tmp_path / "hub", monkeypatch)
    (snapshot / "consolidated.safetensors").write_bytes(b"not asked for")
    asked: list[str] = []
    real_file, real_shards = transformers.utils.cached_file, transformers.utils.hub.get_checkpoint_shard_files

    def cached_file(spec, name, **kwargs):
        asked.append(name)
        return real_file(spec, name, **kwargs)

    def shards(spec, index, **kwargs):
        found, _ = real_shards(spec, index, **kwargs)
        asked.extend(Path(path).name for path in found)
        return found, _

    monkeypatch.setattr(transformers.utils, "cached_file", cached_file)
    monkeypatch.setattr(transformers.utils.hub, "get_checkpoint_shard_files", shards)
    tokenizers = []
    real_tokenizer = models.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        models.AutoTokenizer, "from_pretrained", lambda spec, **k: tokenizers.append(spec) or real_tokenizer(spec, **k)
    )
    assert models.hub_snapshot("org/tiny") == str(snapshot)
    weights = sorted(path.name for path in snapshot.glob("model-*.safetensors"))
    assert asked[:2] == ["config.json", "model.safetensors.index.json"]
    assert sorted(asked[2:-1]) == weights and asked[-1] == "generation_config.json"
    assert tokenizers == ["org/tiny"]
