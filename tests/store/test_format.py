"""Saved caches (kvfold.store: format, save, load): exact round trips, live entries only, and every bad-file error."""

from __future__ import annotations

import importlib.metadata
import json
import struct

import pytest
import torch

import kvfold
from kvfold.pipeline.context import greedy_decode
from kvfold.store.format import (
    FORMAT_VERSION,
    CacheFileError,
    CacheFileVersionError,
    CorruptCacheFileError,
    DtypeDeviceError,
    ModelMismatchError,
    checksum,
    kvfold_version,
    read_info,
)
from kvfold.store.load import load_cache, load_context
from kvfold.store.save import save_cache, save_context
from tests.conftest import CharTokenizer, make_tiny_model

TEXT = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 3
QUESTION = "What is the vault code?"
METHODS = [
    "snapkv",
    "snapkv+keepkv",
    "zsmerge",
    "am_highest_fast",
    "am_highest_fast[online=true]",
    "adakv:snapkv",
    "h2o",
    "snapkv@int4",
    "adakv:snapkv@int3",
    "snapkv+keepkv@fp8[outliers=1]",
    "kvzip@int3[wide=16,key_group=16]",
    "kvzip+am_fit@int3[clip=1,rotate=1]",
]


def _model(family: str = "llama", seed: int = 0):
    return kvfold.enable(make_tiny_model(family, seed=seed))


def _compressed(model, method: str = "snapkv", budget: float | int = 0.25):
    context = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False, methods=method)
    return context.compress(method, budget)


def _physical(cache: kvfold.FoldedCache) -> list:
    out = []
    for _, layer in cache.folded_layers:
        k, v, lm, lengths = layer.padded()
        out.append((k, v, lm, lengths, layer.logical_length, layer.stored is not None))
    return out


def _rewrite_header(path, edit) -> None:
    """Rewrite the kvfold header of a file in place (offsets unchanged), as a tamperer would."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    index = json.loads(raw[8 : 8 + length])
    meta = json.loads(index["__metadata__"]["kvfold"])
    edit(meta)
    index["__metadata__"]["kvfold"] = json.dumps(meta, sort_keys=True)
    body = json.dumps(index).encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + length :])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("method", METHODS)
def test_save_load_generate_equals_the_original_token_for_token(tmp_path, family, method):
    model = _model(family)
    compressed = _compressed(model, method)
    path = tmp_path / "doc.kvc"
    save_context(compressed, path, source_text=TEXT)
    original = compressed.generate(QUESTION, max_new_tokens=12)[0]

    loaded = load_context(path, model, CharTokenizer())
    again = loaded.generate(QUESTION, max_new_tokens=12)[0]
    assert again.token_ids == original.token_ids
    assert len(original.token_ids) == 12
    for (k, v, lm, n, logical, paged), (k2, v2, lm2, n2, logical2, paged2) in zip(
        _physical(compressed.cache), _physical(loaded.cache), strict=True
    ):
        assert torch.equal(k, k2) and torch.equal(v, v2) and torch.equal(lm, lm2) and torch.equal(n, n2)
        assert (logical, paged) == (logical2, paged2)
    # decoding under the method's policy leaves both caches in the same state (online methods evict/refit)
    first, second = compressed.decode_cache(), loaded.decode_cache()
    assert (first.policy is None) == (second.policy is None)
    for cache in (first, second):
        greedy_decode(model, CharTokenizer(), cache, [5, 6, 7, 8] * 6, 8, stop_at_eos=False)
    for before, after in zip(_physical(first), _physical(second), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(before[:4], after[:4], strict=True))
    # kvfold's own greedy decode on the plain loaded cache, and plain transformers' generate
    prompt = [5, 6, 7, 8]
    ours = greedy_decode(model, CharTokenizer(), compressed.cache.copy(), prompt, 8, stop_at_eos=False)
    theirs = greedy_decode(model, CharTokenizer(), load_cache(path, model), prompt, 8, stop_at_eos=False)
    assert ours.token_ids == theirs.token_ids
    logical = compressed.cache.get_seq_length()
    ids = torch.tensor([[3] * logical + prompt])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    reference = model.generate(ids, past_key_values=compressed.cache.copy(), **kwargs)
    from_file = model.generate(ids, past_key_values=load_cache(path, model), **kwargs)
    assert torch.equal(reference, from_file)


def test_online_policy_continues_from_the_saved_state(tmp_path):
    """An online method decoded past its budget, saved, loaded and decoded on equals one long decode."""
    model = _model()
    compressed = _compressed(model, "h2o", 24)
    cache = compressed.decode_cache()
    first = greedy_decode(model, CharTokenizer(), cache, [5, 6, 7], 10, stop_at_eos=False)
    cache.policy.export_state(cache)
    policy = cache.policy
    cache.policy = None
    tokens = compressed.source.context_tokens
    save_cache(cache, tmp_path / "mid.kvc", model, method="h2o", budget=24, context_tokens=tokens)
    cache.policy = policy
    rest = greedy_decode(model, CharTokenizer(), cache, [first.token_ids[-1]], 10, stop_at_eos=False)

    loaded = load_context(tmp_path / "mid.kvc", model, CharTokenizer())
    resumed = loaded.decode_cache()
    assert resumed.policy is not None
    again = greedy_decode(model, CharTokenizer(), resumed, [first.token_ids[-1]], 10, stop_at_eos=False)
    assert again.token_ids == rest.token_ids
    assert max(layer.physical_length for _, layer in resumed.folded_layers) == 24


def test_file_holds_only_the_live_entries(tmp_path):
    model = _model()
    compressed = _compressed(model, "snapkv", 0.25)
    path = tmp_path / "doc.kvc"
    size = save_context(compressed, path)
    info = read_info(path)
    live = 0
    for _, layer in compressed.cache.folded_layers:
        n = int(layer.row_lengths().sum())
        live += n * (layer.head_dim * 2 * layer.keys.element_size())
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert size == path.stat().st_size
    assert abs(size - header - live) <= 0.01 * live
    assert info.header["live_bytes"] == size - header
    full = compressed.cache.full_nbytes()
    assert info.header["kv_bytes_full"] == full
    assert live <= 0.26 * full
    # after decoding, the dense buffers have spare capacity (geometric growth): not saved
    cache = compressed.decode_cache()
    greedy_decode(model, CharTokenizer(), cache, [5, 6, 7], 4, stop_at_eos=False)
    assert cache.nbytes() > 1.05 * sum(
        int(layer.row_lengths().sum()) * layer.head_dim * 2 * 4 for _, layer in cache.folded_layers
    )
    decoded_size = save_cache(cache, tmp_path / "decoded.kvc", model)
    decoded_live = sum(int(layer.row_lengths().sum()) * layer.head_dim * 2 * 4 for _, layer in cache.folded_layers)
    decoded_header = 8 + struct.unpack("<Q", (tmp_path / "decoded.kvc").read_bytes()[:8])[0]
    assert abs(decoded_size - decoded_header - decoded_live) <= 0.01 * decoded_live
    # per-head budgets: the paged layout is stored as Σ row lengths, not rows × the longest row
    paged = _paged_context(model)
    paged_size = save_context(paged, tmp_path / "paged.kvc")
    paged_live = sum(
        int(layer.row_lengths().sum()) * (layer.head_dim * 2 * 4 + 4) + layer.batch_size * layer.num_heads * 8
        for _, layer in paged.cache.folded_layers
    )
    paged_header = 8 + struct.unpack("<Q", (tmp_path / "paged.kvc").read_bytes()[:8])[0]
    assert abs(paged_size - paged_header - paged_live) <= 0.01 * paged_live


def _paged_context(model):
    """A compressed context whose layers hold rows of very different lengths (the paged layout)."""
    compressed = _compressed(model, "snapkv", 0.5)
    for _, layer in compressed.cache.folded_layers:
        k, v, lm, lengths = layer.padded()
        short = lengths.clone()
        short[:, 1:] = 3
        layer.replace(k, v, lm, short)
        assert layer.stored is not None
    return compressed


def test_paged_layers_round_trip(tmp_path):
    model = _model()
    compressed = _paged_context(model)
    save_context(compressed, tmp_path / "paged.kvc")
    loaded = load_context(tmp_path / "paged.kvc", model, CharTokenizer())
    for before, after in zip(_physical(compressed.cache), _physical(loaded.cache), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(before[:4], after[:4], strict=True)) and after[5]
    assert (
        loaded.generate(QUESTION, max_new_tokens=8)[0].token_ids
        == compressed.generate(QUESTION, max_new_tokens=8)[0].token_ids
    )


def test_header_records_the_model_method_budget_and_source(tmp_path):
    model = _model()
    compressed = _compressed(model, "snapkv", 0.25)
    save_context(compressed, tmp_path / "doc.kvc", source_text=TEXT)
    header = read_info(tmp_path / "doc.kvc").header
    assert header["format"] == "kvfold-cache" and header["format_version"] == FORMAT_VERSION
    assert header["kvfold_version"] == kvfold_version() == importlib.metadata.version("kvfold")
    assert header["method"] == "snapkv" and header["budget"] == 0.25
    assert header["context_tokens"] == [compressed.source.context_tokens]
    assert len(header["source_sha256"]) == 64 and len(header["tokens_sha256"]) == 64
    assert header["model"]["architecture"] == "LlamaForCausalLM"
    assert header["dtype"] == "float32" and header["device"] == "cpu"


def test_a_mismatched_model_is_refused(tmp_path):
    model = _model()
    save_context(_compressed(model), tmp_path / "doc.kvc")
    with pytest.raises(ModelMismatchError, match="differs in: weights.*Load the model the cache was made with"):
        load_cache(tmp_path / "doc.kvc", _model(seed=1))
    with pytest.raises(ModelMismatchError, match="architecture .*config"):
        load_cache(tmp_path / "doc.kvc", _model("qwen2"))
    with pytest.raises(ModelMismatchError, match="config"):
        load_cache(tmp_path / "doc.kvc", kvfold.enable(make_tiny_model("llama", num_hidden_layers=3)))


def test_a_truncated_file_is_refused(tmp_path):
    model = _model()
    path = tmp_path / "doc.kvc"
    save_context(_compressed(model), path)
    raw = path.read_bytes()
    for cut in (len(raw) - 1, len(raw) // 2, 100, 4):
        path.write_bytes(raw[:cut])
        with pytest.raises(CorruptCacheFileError, match=r"\.kvc is truncated\b.*re-create it"):
            load_cache(path, model)
    path.write_bytes(b"not a cache file at all, just text")
    with pytest.raises(CorruptCacheFileError):
        load_cache(path, model)
    with pytest.raises(CorruptCacheFileError, match="not found"):
        load_cache(tmp_path / "missing.kvc", model)


def test_a_tampered_file_fails_its_checksum(tmp_path):
    model = _model()
    path = tmp_path / "doc.kvc"
    save_context(_compressed(model), path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01  # one bit of the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCacheFileError, match="checksum"):
        load_cache(path, model)
    save_context(_compressed(model), path)
    _rewrite_header(path, lambda meta: meta["layers"][0].update(logical_length=300))  # positions moved
    with pytest.raises(CorruptCacheFileError, match="checksum"):
        load_cache(path, model)
    assert load_cache(path, model, verify=False).layers[0].logical_length == 300  # the check is what caught it


def test_an_unknown_format_version_is_refused(tmp_path):
    model = _model()
    path = tmp_path / "doc.kvc"
    save_context(_compressed(model), path)
    _rewrite_header(path, lambda meta: meta.update(format_version=FORMAT_VERSION + 1, kvfold_version="9.0"))
    with pytest.raises(CacheFileVersionError, match=f"format version {FORMAT_VERSION + 1}.*upgrade kvfold"):
        load_cache(path, model)


def test_a_dtype_or_device_change_needs_an_explicit_conversion(tmp_path):
    model = _model()
    path = tmp_path / "doc.kvc"
    compressed = _compressed(model)
    save_context(compressed, path)
    model64 = kvfold.enable(make_tiny_model("llama").to(torch.float64))
    with pytest.raises(DtypeDeviceError, match="float32 keys and values but the model runs in float64.*dtype="):
        load_cache(path, model64)
    converted = load_cache(path, model64, dtype=torch.float64)
    assert all(layer.dtype == torch.float64 for _, layer in converted.folded_layers)
    with pytest.raises(DtypeDeviceError, match="the model's dtype"):
        load_cache(path, model, dtype=torch.float64)

    # a file saved on a GPU: written with the device it names, checksum and all
    _rewrite_header(path, lambda meta: meta.update(device="cuda:0"))
    meta = read_info(path).header
    _rewrite_header(path, lambda m: m["checksum"].update(value=checksum(meta, _tensors(path).items())))
    with pytest.raises(DtypeDeviceError, match="saved on cuda:0 but the model is on cpu.*device='cpu'"):
        load_cache(path, model)
    moved = load_cache(path, model, device="cpu")
    assert all(layer.device.type == "cpu" for _, layer in moved.folded_layers)


def test_quantized_rows_are_checked_once_and_again_when_converted(tmp_path, monkeypatch):
    """The loader checks each layer's quantized rows before it builds any (``validate_tensors``) and
    builds them without a second check; rows it converts to the model's dtype on the way are checked
    again: a float32 outlier past float16's range is infinite there, and the file is refused."""
    import kvfold.runtime.quantize as quantize
    from tests.store.crafted import craft, poke

    model = _model()
    path = tmp_path / "doc.kvc"
    save_context(_compressed(model, "snapkv@int4[outliers=2,key_group=8]"), path)
    calls = []
    real = quantize.check_quantized_tensors
    monkeypatch.setattr(quantize, "check_quantized_tensors", lambda *a, **k: calls.append(1) or real(*a, **k))
    load_cache(path, model)
    assert calls == []  # the rows were checked by validate_tensors, which this does not count

    big = craft(path, tmp_path / "big.kvc", tensors=poke("layer.0.q.outlier_keys", 1e6))
    assert load_cache(big, model).get_seq_length() > 0  # finite in float32: a valid file
    half = kvfold.enable(make_tiny_model("llama").to(torch.float16))
    with pytest.raises(CacheFileError, match="outlier_keys.*NaN or infinite"):
        load_cache(big, half, dtype=torch.float16)
    assert len(calls) == 1  # checked again once converted


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_errors_are_value_errors_and_nothing_is_half_loaded(tmp_path):
    assert issubclass(CacheFileError, ValueError)
    model = _model()
    path = tmp_path / "doc.kvc"
    save_context(_compressed(model), path)
    _rewrite_header(path, lambda meta: meta["layers"][1].update(layout="sideways"))
    with pytest.raises(CacheFileError):
        load_cache(path, model, verify=False)


def test_a_model_without_the_kvfold_attention_is_refused(tmp_path):
    model = _model()
    save_context(_compressed(model), tmp_path / "doc.kvc")
    with pytest.raises(CacheFileError, match="kvfold.enable"):
        load_cache(tmp_path / "doc.kvc", make_tiny_model("llama"))


def test_the_package_root_saves_and_loads_with_the_store_functions():
    assert kvfold.save_context is save_context and kvfold.save_cache is save_cache
    assert kvfold.load_context is load_context and kvfold.load_cache is load_cache


def test_an_empty_cache_is_not_saved(tmp_path):
    model = _model()
    with pytest.raises(CacheFileError, match="empty"):
        save_cache(kvfold.FoldedCache(model.config), tmp_path / "x.kvc", model)


def test_the_weight_sample_stays_inside_large_parameters():
    """float32 cannot index past 2**24 exactly: the sample indices are integer arithmetic."""
    from kvfold.store.format import WEIGHT_SAMPLES, _weight_sample

    big = torch.nn.Module()
    big.weight = torch.nn.Parameter(torch.arange(28_311_552, dtype=torch.float32), requires_grad=False)
    sample = _weight_sample(big)
    assert len(sample) == 3 * WEIGHT_SAMPLES and sample[WEIGHT_SAMPLES - 1] == float(big.weight[-1])


def test_a_batch_a_query_aware_context_and_sliding_window_layers_round_trip(tmp_path):
    model = _model()
    texts = [TEXT, "A shorter context about harbour lights and dawn. " * 3]
    batch = kvfold.prefill(model, CharTokenizer(), texts, use_chat_template=False).compress("snapkv", 0.25)
    save_context(batch, tmp_path / "batch.kvc")
    loaded = load_context(tmp_path / "batch.kvc", model, CharTokenizer())
    assert [a.token_ids for a in loaded.generate(QUESTION, max_new_tokens=6)] == [
        a.token_ids for a in batch.generate(QUESTION, max_new_tokens=6)
    ]

    aware = kvfold.prefill(
        model, CharTokenizer(), TEXT, question=QUESTION, query_aware=True, use_chat_template=False
    ).compress("snapkv", 0.25)
    save_context(aware, tmp_path / "aware.kvc")
    again = load_context(tmp_path / "aware.kvc", model, CharTokenizer())
    assert again.generate(max_new_tokens=6)[0].token_ids == aware.generate(max_new_tokens=6)[0].token_ids

    gemma = _model("gemma3")
    compressed = kvfold.prefill(gemma, CharTokenizer(), TEXT[:60], use_chat_template=False).compress("snapkv", 0.5)
    save_context(compressed, tmp_path / "gemma.kvc")
    from_file = load_context(tmp_path / "gemma.kvc", gemma, CharTokenizer())
    assert from_file.generate(QUESTION[:6], max_new_tokens=4)[0].token_ids == (
        compressed.generate(QUESTION[:6], max_new_tokens=4)[0].token_ids
    )


def test_a_quantized_file_holds_its_codes_and_is_within_5_percent_of_the_counted_bytes(tmp_path):
    model = kvfold.enable(make_tiny_model("llama", head_dim=64, num_hidden_layers=8, max_position_embeddings=1024))
    text = (TEXT * 4)[:900]
    context = kvfold.prefill(model, CharTokenizer(), text, use_chat_template=False, methods="snapkv")
    compressed = context.compress("full@int4")
    path = tmp_path / "doc.kvc"
    size = save_context(compressed, path, source_text=text)
    counted = compressed.kv_bytes
    assert abs(size - counted) / counted <= 0.05
    loaded = load_context(path, model, CharTokenizer())
    assert loaded.cache.quant == compressed.cache.quant
    for (_, a), (_, b) in zip(compressed.cache.folded_layers, loaded.cache.folded_layers, strict=True):
        for name, tensor in a.stored.tensors().items():
            assert torch.equal(tensor, b.stored.tensors()[name]), name
    info = read_info(path)
    assert info.header["kv_format"] == "int4" and info.header["format_version"] == FORMAT_VERSION
    assert info.header["kv_bytes"] == counted
    assert (
        loaded.generate(QUESTION, max_new_tokens=6)[0].token_ids
        == compressed.generate(QUESTION, max_new_tokens=6)[0].token_ids
    )


class _Vocabulary:
    """A tokenizer's vocabulary part: ``get_vocab`` counted, tokens added as a tokenizer adds them."""

    def __init__(self, size: int) -> None:
        self.vocab = {f"t{i}": i for i in range(size)}
        self.reads = 0

    def get_vocab(self) -> dict[str, int]:
        self.reads += 1
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_the_vocabulary_hash_is_kept_per_tokenizer_until_tokens_are_added():
    import hashlib

    from kvfold.store.format import model_fingerprint

    def recorded(vocab: dict[str, int]) -> str:  # what a file records: the sorted items' JSON, hashed
        return hashlib.sha256(json.dumps(sorted(vocab.items()), sort_keys=True).encode()).hexdigest()

    model, tokenizer = _model(), _Vocabulary(50)
    first = model_fingerprint(model, tokenizer)["vocab_sha256"]
    assert first == recorded(tokenizer.vocab)
    assert model_fingerprint(model, tokenizer)["vocab_sha256"] == first and tokenizer.reads == 1  # kept
    assert model_fingerprint(model, _Vocabulary(50))["vocab_sha256"] == first  # another object, same vocabulary
    tokenizer.vocab["added"] = 50
    changed = model_fingerprint(model, tokenizer)["vocab_sha256"]
    assert changed == recorded(tokenizer.vocab) != first and tokenizer.reads == 2  # computed again
