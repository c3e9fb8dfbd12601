"""The method-spec grammar and composition into runnable methods."""

from __future__ import annotations

import pytest

from kvfold.methods import SpecError, build_method, parse_spec, split_specs


def test_split_specs_ignores_commas_inside_brackets():
    assert split_specs("full, snapkv[window=64,kernel=7],adakv:snapkv+grkv") == [
        "full",
        "snapkv[window=64,kernel=7]",
        "adakv:snapkv+grkv",
    ]


def test_parse_wrappers_selector_folder_and_options():
    parsed = parse_spec("adakv[alpha=0.3]:criticalkv:snapkv[window=16]+grkv[lam=0.1]")
    assert [w.name for w in parsed.wrappers] == ["adakv", "criticalkv"]
    assert parsed.wrappers[0].options == {"alpha": "0.3"}
    assert parsed.selector.name == "snapkv" and parsed.selector.options == {"window": "16"}
    assert parsed.folder.name == "grkv" and parsed.folder.options == {"lam": "0.1"}


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "empty method spec"),
        ("a+b+c", "at most one folder"),
        ("snap kv", "invalid method name"),
        ("streamingllm[sinks]", "must be written key=value"),
        ("streamingllm[sinks=1,sinks=2]", "given twice"),
        ("full,snapkv[window=3", "unbalanced"),
    ],
)
def test_malformed_specs_are_clear_errors(text, message):
    with pytest.raises(SpecError, match=message):
        split_specs(text) if text.startswith("full,") else parse_spec(text)


def test_unknown_method_lists_valid_names():
    with pytest.raises(SpecError, match=r"unknown method 'nosuch'; valid: .*streamingllm"):
        build_method("nosuch")


def test_unknown_option_lists_valid_options():
    with pytest.raises(SpecError, match=r"unknown option\(s\) sink; valid options: sinks, online"):
        build_method("streamingllm[sink=2]")


def test_option_values_are_typed():
    method = build_method("streamingllm[sinks=8,online=false]")
    assert method.selector.sinks == 8 and method.selector.online is False
    with pytest.raises(SpecError, match="must be a int"):
        build_method("streamingllm[sinks=two]")


def test_standalone_takes_no_wrapper_or_folder():
    with pytest.raises(SpecError, match="complete method"):
        build_method("full+streamingllm")


def test_a_selector_is_not_a_folder():
    with pytest.raises(SpecError, match="unknown folder 'random' \\('random' is a selector\\)"):
        build_method("streamingllm+random")
