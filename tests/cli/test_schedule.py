"""``kvfold head-schedule`` on a tiny model: the file it writes is the schedule ``kvzip[schedule=F]`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvfold
import kvfold.runtime.models
from kvfold.cli.main import main
from kvfold.methods.core.head_schedule import HeadSchedule
from tests.conftest import make_tiny_model
from tests.evaluate.conftest import CharTokenizer

TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 3


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch):
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=2048))

    def load(spec: str, **kwargs):
        return model, CharTokenizer()

    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    return model


def test_head_schedule_writes_shares_that_kvzip_reads(capsys, tiny, tmp_path: Path):
    text = tmp_path / "calibration.txt"
    text.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "schedules" / "tiny.json"
    argv = [
        "head-schedule",
        "--text-file",
        str(text),
        "--method",
        "kvzip[layerwise=true]+am_fit",
        "--ratios",
        "0.2,0.5",
        "--r0",
        "0.3",
        "--new-tokens",
        "8",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}: 4 heads" in captured.out and "layer 2/2" in captured.err
    schedule = HeadSchedule.load(out, tiny)
    assert schedule.ratios == [0.2, 0.5] and schedule.r0 == 0.3
    assert sum(sum(row) for row in schedule.shares) == pytest.approx(1.0)
    assert json.loads(out.read_text())["curves"]  # the sensitivity curves are kept with the shares
    pre = kvfold.prefill(tiny, CharTokenizer(), TEXT, use_chat_template=False)
    small = pre.compress(f"kvzip[schedule={out}]+am_fit", 0.3)
    assert small.kv_bytes < pre.compress("full").kv_bytes


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ratios", "0.2,two"], "--ratios takes"),
        (["--ratios", "0,0.5"], "--ratios takes"),
        (["--r0", "1.5"], "--r0 must be"),
        (["--method", "kvzip[scope=sideways]"], "scope must be"),
        (["--text-file", "missing.txt"], "text file not found"),
    ],
)
def test_head_schedule_refuses_bad_input_in_one_line(capsys, tiny, tmp_path: Path, extra, message):
    assert main(["head-schedule", "--out", str(tmp_path / "s.json"), *extra]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "s.json").exists()


def test_the_default_calibration_is_pieces_of_the_shipped_prose():
    from kvfold.cli.schedule import prose_pieces

    pieces = prose_pieces(CharTokenizer(), 3, 100)
    assert len(pieces) == 3 and len(set(pieces)) == 3 and all(len(p) == 100 for p in pieces)  # one id a character
