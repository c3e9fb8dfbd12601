"""The merged-entries diagnostic on a tiny model: where the answer sits, and what a folder changes."""

from __future__ import annotations

import kvfold
from kvfold.evaluate.diagnostics.merged_entries import (
    GROUPS,
    answer_positions,
    entry_changes,
    group_of,
    merged_entries,
)
from tests.conftest import make_tiny_model
from tests.evaluate.conftest import CharTokenizer

TEXT = "The code of the vault is 4721, and the weather was mild all week long. " * 3


def test_answer_positions_and_groups() -> None:
    tokenizer = CharTokenizer()
    ids = tokenizer("the code is 4721", add_special_tokens=False).input_ids
    assert answer_positions(tokenizer, ids, ["4721"]) == {12, 13, 14, 15}  # one token a character
    assert answer_positions(tokenizer, ids, ["absent"]) == set()
    needle = {12, 13}
    assert [group_of(p, 40, needle) for p in (0, 12, 20, 35)] == ["sink", "needle", "other", "tail"]


def test_the_plain_selection_changes_nothing_and_a_folder_changes_its_entries() -> None:
    model = kvfold.enable(make_tiny_model("llama", initializer_range=0.2))
    tokenizer = CharTokenizer()
    context = kvfold.prefill(model, tokenizer, TEXT, use_chat_template=False, methods=["snapkv", "snapkv+cam"])
    length = context.input_ids.shape[1]
    needle = answer_positions(tokenizer, context.input_ids[0].tolist(), ["4721"])
    plain = entry_changes(context, "snapkv", 0.3, needle, length)
    folded = entry_changes(context, "snapkv+cam", 0.3, needle, length)
    assert list(plain) == list(GROUPS) and sum(g.entries for g in plain.values()) > 0
    assert all(g.value_change == 0 and g.beta_change == 0 for g in plain.values())
    assert [g.entries for g in folded.values()] == [g.entries for g in plain.values()]  # CaM keeps SnapKV's entries
    assert sum(g.value_change for g in folded.values()) > 0


def test_the_report_has_a_line_per_group_and_the_answers() -> None:
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=2048))
    lines = list(merged_entries(model, CharTokenizer(), "vt", 0, 0.3, "snapkv", ["snapkv+cam"], length=700))
    assert lines[0].startswith("vt #0: ") and "answer tokens of" in lines[0]
    assert lines[1].startswith("snapkv: answers ")
    assert [line.split()[:2] for line in lines[2:6]] == [["snapkv+cam", group] for group in GROUPS]
    assert "entries" in lines[2] and "mean |dv|/|v|" in lines[2] and "mean |dβ|" in lines[2]
    assert lines[6].startswith("  snapkv+cam: answers ") and len(lines) == 7
