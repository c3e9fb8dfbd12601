"""``kvfold bench --cachefile`` end to end on a tiny local model: file size, answers from the file, chat memory."""

from __future__ import annotations

import json

from kvfold.cli.main import main


def test_bench_cachefile_mode_reports_file_size_speed_and_chat_memory(tiny_dir, tmp_path, capsys):
    args = [
        "bench", "--cachefile", "--model", str(tiny_dir), "--methods", "snapkv", "--budgets", "0.25",
        "--length", "128", "--new-tokens", "4", "--turns", "6", "--chat-budget", "24", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| snapkv | 0.25 |" in out and "RSS growth" in out
    records = [json.loads(line) for line in (tmp_path / "cachefile.jsonl").read_text().splitlines()]
    files = [r for r in records if r["kind"] == "file"]
    chats = [r for r in records if r["kind"] == "chat"]
    assert len(files) == 1 and len(chats) == 1
    record = files[0]
    assert 0.2 < record["file_ratio"] < 0.3 and record["same_answer"] is True
    assert record["scratch_s"] > 0 and record["from_file_s"] > 0 and record["speedup"] > 0
    chat = chats[0]
    assert len(chat["per_turn"]) == 6 and chat["final"]["compactions"] >= 1
    assert chat["max_entries"] < chat["final"]["logical_tokens"] / 2
