"""kvfold.store.validate: each rule refuses what it should (one line naming the layer and the tensor), and
every layout a legitimate file holds passes (β = −inf marking empty dense and paged slots included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvfold
from kvfold.store.format import CacheFileError, InvalidCacheFileError
from kvfold.store.load import load_context, read_cache
from kvfold.store.validate import Expected, validate_layer
from tests.conftest import CharTokenizer, make_tiny_model
from tests.store.crafted import craft, poke, read_raw, set_tensor

TEXT = "The vault code is 4712. Ships sail at dawn; the harbour keeps its lights on all night. " * 2
NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def model():
    return kvfold.enable(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def files(model, tmp_path_factory) -> dict[str, Path]:
    """Good files of every layout: dense with empty slots (β = −inf), paged, int4 with outliers, fp8,
    an online method's (statistics and queries) with its token ids."""
    folder = tmp_path_factory.mktemp("validate")
    out = {}
    for name, method, budget in [
        ("dense", "adakv:snapkv", 0.25),
        ("paged", "snapkv", 0.5),
        ("outliers", "snapkv@int4[outliers=2,key_group=8]", 0.25),
        ("fp8", "snapkv@fp8[outliers=1]", 0.25),
        ("h2o", "h2o", 0.25),
    ]:
        context = kvfold.prefill(model, CharTokenizer(), TEXT, use_chat_template=False, methods=method.split("@")[0])
        compressed = context.compress(method, budget)
        if name == "paged":
            for _, layer in compressed.cache.folded_layers:
                k, v, lm, lengths = layer.padded()
                short = lengths.clone()
                short[:, 1:] = 3
                layer.replace(k, v, lm, short)
        out[name] = folder / f"{name}.kvc"
        kvfold.save_context(compressed, out[name], source_text=TEXT, resumable=name == "h2o")
    return out


def _refused(path: Path, model) -> str:
    with pytest.raises(InvalidCacheFileError) as caught:
        load_context(path, model, CharTokenizer())
    message = str(caught.value)
    assert "\n" not in message and "damaged or was crafted" in message
    return message


def test_every_good_layout_loads_and_answers(files, model):
    _, tensors = read_raw(files["dense"])
    assert bool((tensors["layer.0.log_mass"] == -INF).any())  # empty slots: a legitimate −inf β
    _, paged = read_raw(files["paged"])
    assert "layer.0.row_lengths" in paged
    for path in files.values():
        assert len(load_context(path, model, CharTokenizer()).generate("code?", max_new_tokens=2)[0].token_ids) == 2


def _swap_layers(content: dict) -> None:
    content["layer.0.keys"], content["layer.0.values"] = content["layer.0.values"], content["layer.0.keys"][:, :1]


CASES = [
    # dense and paged layers: β may be −inf (an empty slot), never NaN or +inf; keys of counted slots finite
    ("dense", poke("layer.0.log_mass", NAN), None, "layer 0 log_mass: holds NaN or +inf"),
    ("dense", poke("layer.1.log_mass", INF, 7), None, "layer 1 log_mass"),
    ("dense", set_tensor("layer.0.log_mass", lambda t: t[..., :-1]), None, "layer 0 log_mass: shape"),
    ("dense", poke("layer.0.keys", NAN, 40), None, "layer 0 keys: holds NaN"),
    ("dense", poke("layer.1.values", -INF), None, "layer 1 values: holds NaN"),
    ("dense", set_tensor("layer.0.keys", lambda t: t.double()), None, "layer 0 keys: dtype float64"),
    ("dense", set_tensor("layer.0.keys", lambda t: t[..., :8]), None, "layer 0 keys: shape"),
    ("dense", _swap_layers, None, "layer 0 values: shape"),
    ("dense", None, lambda h: h["layers"][0].update(entries=h["layers"][0]["entries"] + 1), "layer 0 entries"),
    ("dense", None, lambda h: h.update(context_tokens=[10]) or h["layers"][0].update(logical_length=10), "0 keys"),
    ("paged", poke("layer.0.log_mass", NAN), None, "layer 0 log_mass"),
    ("paged", poke("layer.0.keys", INF), None, "layer 0 keys"),
    ("paged", set_tensor("layer.0.row_lengths", lambda t: t + 1), None, "layer 0 row_lengths"),
    ("paged", poke("layer.1.row_lengths", -2), None, "layer 1 row_lengths: a row length is negative"),
    ("paged", set_tensor("layer.0.row_lengths", lambda t: t.int()), None, "layer 0 row_lengths: dtype int32"),
    ("paged", lambda c: c.pop("layer.1.row_lengths"), None, "layer 1 row_lengths: missing"),
    ("paged", lambda c: c.pop("layer.1.log_mass"), None, "layer 1 log_mass: missing"),
    # quantized layers beyond int4's (tests/store/test_crafted.py): outliers, fp8, the tail, the format
    ("outliers", set_tensor("layer.0.q.outlier_index", lambda t: t.flip(0)), None, "q.outlier_index: indices are"),
    ("outliers", set_tensor("layer.0.q.outlier_index", lambda t: t * 0), None, "q.outlier_index"),
    ("outliers", poke("layer.0.q.outlier_index", -1), None, "layer 0 q.outlier_index: an index is outside"),
    ("outliers", poke("layer.1.q.outlier_keys", NAN), None, "layer 1 q.outlier_keys"),
    ("outliers", set_tensor("layer.1.q.outlier_values", lambda t: t[:-1]), None, "layer 1 q.outlier_values"),
    ("outliers", None, lambda h: h["layers"][0].update(kv_format="int4[key_group=8]"), "q.outlier_index"),
    ("outliers", poke("layer.0.q.key_scale", -1.0), None, "layer 0 q.key_scale: holds scales that are not positive"),
    (
        "outliers",
        None,
        lambda h: h.update(context_tokens=[9]) or h["layers"][1].update(logical_length=9),
        "1 q.lengths",
    ),
    ("fp8", poke("layer.0.q.key_scale", NAN), None, "layer 0 q.key_scale"),
    ("fp8", set_tensor("layer.0.q.value_scale", lambda t: t.half()), None, "layer 0 q.value_scale: dtype"),
    ("fp8", lambda c: c.update({"layer.0.q.key_zero": torch.zeros(2, 16)}), None, "layer 0 q.key_zero"),
    ("fp8", None, lambda h: h["layers"][1].update(kv_format="int9"), "layer 1 kv_format"),
    ("fp8", None, lambda h: h["layers"][1].update(kv_format=None), "layer 1 kv_format"),
    ("fp8", lambda c: c.update({"layer.0.keys": torch.zeros(1, 2, 3, 16)}), None, "layer 0 values: shape"),
    # statistics, queries, token ids, logits, extra tensors
    ("h2o", poke("layer.0.stat.h2o", NAN), None, "layer 0 stat.h2o: holds NaN"),
    ("dense", lambda c: c.update({"layer.0.stat.x": torch.zeros(3)}), None, "layer 0 stat.x: float32 (3,), expected"),
    (
        "dense",
        lambda c: c.update({"layer.1.bogus": torch.zeros(3)}),
        None,
        "layer 1 bogus: not a tensor of a dense layer",
    ),
    ("h2o", set_tensor("layer.0.stat.h2o", lambda t: t[..., 1:]), None, "layer 0 stat.h2o"),
    ("h2o", lambda c: c.pop("layer.1.stat.h2o"), None, "layer 1 stat.h2o: missing"),
    ("h2o", set_tensor("layer.0.captured_queries", lambda t: t[:, :2]), None, "layer 0 captured_queries"),
    ("h2o", poke("layer.1.captured_queries", INF), None, "layer 1 captured_queries"),
    ("h2o", poke("context.token_ids", 97), None, "context.token_ids: a token id outside the vocabulary"),
    ("h2o", poke("context.token_ids", -1), None, "context.token_ids"),
    ("h2o", set_tensor("context.token_ids", lambda t: t.float()), None, "context.token_ids"),
    ("h2o", lambda c: c.update({"context.last_logits": torch.zeros(1, 5)}), None, "context.last_logits"),
    ("h2o", lambda c: c.update({"context.whatever": torch.zeros(1)}), None, "context.whatever: not a tensor"),
    ("h2o", lambda c: c.update({"extra.turn_queries.5": torch.zeros(1)}), None, "extra.turn_queries.5"),
    ("h2o", lambda c: c.update({"layer.00.keys": torch.zeros(1)}), None, "layer.00.keys"),
    ("h2o", None, lambda h: h.update(method="paged+what"), "header method"),
    ("paged", None, lambda h: h.update(method="h2o"), "layer 0 is paged"),
    ("dense", None, lambda h: h.update(method="h2o"), "stat.h2o: missing"),
    # the header
    ("h2o", None, lambda h: h.update(budget="lots"), "header budget"),
    ("h2o", None, lambda h: h.update(kv_format="int5"), "header kv_format"),
    ("h2o", None, lambda h: h.update(kv_format="16"), "header kv_format"),
    ("h2o", None, lambda h: h.update(kv_format=[3]), "header kv_format"),
    ("h2o", None, lambda h: h.update(device="toaster"), "header device"),
    ("h2o", None, lambda h: h.update(dtype=["float32"]), "header dtype"),
    ("h2o", None, lambda h: h.update(context_tokens=[10**6]), "header context_tokens"),
    ("h2o", None, lambda h: h.update(context_tokens=[3, 4]), "header context_tokens"),
    ("h2o", None, lambda h: h.update(extra={"query_aware_suffixes": [1]}), "header extra.query_aware_suffixes"),
    ("h2o", None, lambda h: h["layers"][0].update(kind="wormhole\nline"), "layer 0: kind 'wormhole\\nline'"),
    ("h2o", None, lambda h: h["layers"][0].update(layout="sideways"), "layer 0 layout"),
    ("h2o", None, lambda h: h["layers"][1].update(logical_length=True), "layer 1 logical_length"),
    ("h2o", None, lambda h: h["layers"][1].update(batch_size=2), "layers of different batch sizes"),
    ("h2o", None, lambda h: h["layers"][0].update(kind="empty"), "an empty layer holds no tensors"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}: {c[3][:48]}" for c in CASES])
def test_a_rule_refuses_in_one_line_naming_the_layer_and_tensor(case, files, model, tmp_path):
    base, edit_tensors, edit_header, words = case
    bad = craft(files[base], tmp_path / "bad.kvc", tensors=edit_tensors, header=edit_header)
    message = _refused(bad, model)
    assert words in message, message


def test_a_header_that_claims_more_than_the_file_is_refused_before_any_tensor_is_read(
    files, model, tmp_path, monkeypatch
):
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr("kvfold.store.load.read_tensors", refuse)
    for edit in ({"entries": 2**40}, {"logical_length": 2**40}, {"batch_size": 2**40}):
        bad = craft(files["dense"], tmp_path / "big.kvc", header=lambda h, e=edit: h["layers"][0].update(e))
        assert next(iter(edit)) in _refused(bad, model)

    def every_layer(meta: dict) -> None:  # consistent with itself: only the file's size refutes it
        meta.update(context_tokens=None)
        for spec in meta["layers"]:
            spec.update(batch_size=2**40)

    assert "layer 0 batch_size" in _refused(craft(files["dense"], tmp_path / "rows.kvc", header=every_layer), model)


def test_the_vllm_reader_refuses_the_same_files(files, model, tmp_path):
    bad = craft(files["outliers"], tmp_path / "bad.kvc", tensors=poke("layer.0.q.value_zero", NAN))
    with pytest.raises(InvalidCacheFileError, match="layer 0 q.value_zero"):
        read_cache(bad, model.config)
    cache, _ = read_cache(files["outliers"], model.config)
    assert cache.layers[0].is_quantized


def test_validate_layer_checks_raw_tensors_for_a_serving_backend(files, model):
    header, tensors = read_raw(files["paged"])
    own = {name.split(".", 2)[2]: t for name, t in tensors.items() if name.startswith("layer.1.")}
    expected = Expected.from_config(model.config)
    validate_layer(1, header["layers"][1], own, expected, torch.float32)
    own["row_lengths"] = own["row_lengths"].clone()
    own["row_lengths"][0, 1] += 1
    with pytest.raises(InvalidCacheFileError, match=r"^layer 1 row_lengths: they add up to"):
        validate_layer(1, header["layers"][1], own, expected, torch.float32)
    assert issubclass(InvalidCacheFileError, CacheFileError)


def test_a_sliding_window_layer_holds_at_most_its_window(tmp_path):
    gemma = kvfold.enable(make_tiny_model("gemma3"))
    compressed = kvfold.prefill(gemma, CharTokenizer(), TEXT[:60], use_chat_template=False).compress("snapkv", 0.5)
    good = tmp_path / "gemma.kvc"
    kvfold.save_context(compressed, good)
    assert load_context(good, gemma, CharTokenizer()).generate("code?", max_new_tokens=2)[0].token_ids

    def wider(content: dict) -> None:
        for name in ("layer.0.keys", "layer.0.values"):
            content[name] = torch.cat([content[name]] * 3, 2)

    assert "layer 0 keys: " in _refused(craft(good, tmp_path / "wide.kvc", tensors=wider), gemma)
    bad = craft(good, tmp_path / "nan.kvc", tensors=poke("layer.2.values", NAN))
    assert "layer 2 values: holds NaN" in _refused(bad, gemma)
    bad = craft(good, tmp_path / "extra.kvc", tensors=lambda c: c.update({"layer.0.log_mass": torch.zeros(1)}))
    assert "layer 0 log_mass: not a tensor of a sliding-window layer" in _refused(bad, gemma)
