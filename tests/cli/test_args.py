"""The command line explains itself: ``--help`` fast and without torch, every flag with help and its
default, ``--version``, one name per idea with the old names as deprecated aliases (kvfold.cli.args)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvfold
from kvfold.cli.args import ALIASES_REMOVED_IN
from kvfold.cli.main import _load_extra_commands, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    _load_extra_commands()
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_help_imports_no_torch_and_answers_in_under_a_second():
    """``kvfold --help`` and ``kvfold SUB --help`` for every subcommand, in a fresh interpreter."""
    script = """
import contextlib, io, json, sys, time
start = time.perf_counter()
from kvfold.cli.main import _load_extra_commands, build_parser, main
seconds, loaded = {}, {}
for argv in [["--help"], ["--version"]] + [[name, "--help"] for name in SUBCOMMANDS]:
    begin = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    seconds[" ".join(argv)] = time.perf_counter() - begin
seconds["import"] = time.perf_counter() - start - sum(seconds.values())
print(json.dumps({"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules, "s": seconds}))
"""
    names = sorted(_subparsers())
    code = f"SUBCOMMANDS = {names!r}\n{script}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(proc.stdout)
    assert result["torch"] is False and result["transformers"] is False
    assert len(result["s"]) == len(names) + 3
    assert result["s"]["import"] + result["s"]["--help"] < 1.0
    assert all(seconds < 1.0 for seconds in result["s"].values()), result["s"]


def test_version_is_written_once_and_printed(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvfold {kvfold.__version__}\n"
    pyproject = (ROOT / "pyproject.toml").read_text()
    project = pyproject.split("[project]\n", 1)[1].split("\n[", 1)[0]
    assert not re.search(r"^version\s*=", project, flags=re.M) and 'dynamic = ["version"]' in project
    assert 'version = { attr = "kvfold.runtime.version.__version__" }' in pyproject
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{kvfold.__version__}]" in changelog  # the version moved on with a CHANGELOG section


def test_every_flag_has_help_and_shows_its_default():
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
                continue
            assert action.help and action.help.strip(), f"kvfold {name} {action.option_strings}: no help"
        text = parser.format_help()
        for action in parser._actions:
            shown = action.help != argparse.SUPPRESS and action.option_strings and action.default != argparse.SUPPRESS
            plain = isinstance(action.default, (int, float, str)) and not isinstance(action.default, bool)
            if shown and plain and action.default != "":
                assert f"(default: {action.default}" in " ".join(text.split()), f"kvfold {name} {action.dest}"


def test_generate_help_names_the_recommended_default(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: kvzip+am_fit; with --cache: the file's)" in text and "(default: 0.1;" in text


@pytest.mark.parametrize(
    "argv,dest,value",
    [
        (["generate", "--context", "c", "--question", "q", "--max-new-tokens", "5"], "new_tokens", 5),
        (["ask", "--cache", "x.kvc", "--max-new-tokens", "5"], "new_tokens", 5),
        (["chat", "--max-new-tokens", "5"], "new_tokens", 5),
        (["bench", "--out", "o", "--lengths", "64,128"], "length", "64,128"),
        (["demo", "--context-tokens", "900"], "length", 900),
        (["fidelity", "--dataset", "ruler", "--methods", "full", "--out", "o", "--next-tokens", "5"], "new_tokens", 5),
        (["head-schedule", "--out", "s.json", "--continuation", "5"], "new_tokens", 5),
    ],
)
def test_old_flag_names_still_work_for_one_version_with_a_note(capsys, argv, dest, value):
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    old = next(a for a in argv if a in ("--max-new-tokens", "--lengths", "--context-tokens", "--next-tokens",
                                        "--continuation"))  # fmt: skip
    new = "--" + dest.replace("_", "-")
    err = capsys.readouterr().err
    assert f"{old} is deprecated; use {new} (the old name goes in kvfold {ALIASES_REMOVED_IN})" in err


def test_one_name_for_lengths_and_new_tokens():
    """No subcommand shows another name for context tokens or for tokens after the context."""
    retired = {"--lengths", "--context-tokens", "--max-new-tokens", "--next-tokens"}
    for name, parser in _subparsers().items():
        shown = {s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings}
        assert not shown & retired, name
        continuation = parser._option_string_actions.get("--continuation")
        assert continuation is None or continuation.help == argparse.SUPPRESS or continuation.choices, name


def test_every_subcommand_takes_quiet():
    assert all("--quiet" in parser._option_string_actions for parser in _subparsers().values())


def test_out_says_whether_it_is_a_file_or_a_directory():
    """``--out`` is a file for commands that write one, a directory for sweeps; the help says which
    (and "folder" is kept for the method role)."""
    for name, parser in _subparsers().items():
        out = parser._option_string_actions.get("--out")
        if out is not None:
            assert ("directory" in out.help) != ("file" in out.help.split("(")[0]), name


def test_head_schedule_ratios_are_the_methods():
    from kvfold.cli.schedule import DEFAULT_RATIOS
    from kvfold.methods.compaction.attention_matching import schedule

    assert DEFAULT_RATIOS == schedule.DEFAULT_RATIOS


def test_an_ignored_flag_is_the_same_error_in_generate_and_chat(capsys, tmp_path):
    cache = tmp_path / "doc.kvc"
    cache.write_bytes(b"")
    for argv in (
        ["generate", "--cache", str(cache), "--question", "q", "--method", "snapkv"],
        ["chat", "--cache", str(cache), "--budget", "64"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "do not apply with --cache: the file was compressed already" in err and err.count("\n") == 1


def test_errors_name_no_flag_of_another_command():
    """The context-length error is raised by the pipeline for every command: it names no flag."""
    from kvfold.pipeline.context import check_length

    class Model:
        class config:  # noqa: N801 - a stand-in for a model config
            max_position_embeddings = 8

            @staticmethod
            def get_text_config(decoder=True):
                return Model.config

    with pytest.raises(ValueError) as err:
        check_length(Model, 9)
    assert "--" not in str(err.value)


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--question", "Q?", "--context-file"],
        ["compress", "--out", "unwritten.kvf", "--context-file"],
        ["chat", "--context-file"],
        ["mergemap", "--methods", "snapkv", "--out", "unwritten", "--context-file"],
        ["head-schedule", "--out", "unwritten.json", "--text-file"],
    ],
)
def test_an_empty_document_is_refused_before_a_model_is_loaded(capsys, monkeypatch, tmp_path, command):
    """Every command that reads a document into the model (``read_document``) refuses one of only white
    space in one line that names it, and loads no model first."""
    import kvfold.runtime.models

    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    monkeypatch.chdir(tmp_path)
    document = tmp_path / "empty.txt"
    document.write_text(" \n\t\n", encoding="utf-8")
    code = main([*command, str(document)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    what = "text file" if command[0] == "head-schedule" else "context file"
    assert err.endswith(f"error: {what} {document} is empty; give a file with the text\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]
