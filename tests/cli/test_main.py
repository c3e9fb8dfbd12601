"""The ``kvfold`` command line: listing methods, generate on the embedded model, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvfold
import kvfold.runtime.models
from kvfold.cli.main import main
from kvfold.evaluate.data.logbook import build_logbook
from kvfold.runtime.budget import Budget


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_methods_json_lists_registered_methods(capsys):
    code, out, _ = run(capsys, "methods", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert {"full", "streamingllm", "random"} <= set(rows)
    assert all(r["description"] and r["paper"] for r in rows.values())


def test_a_closed_stdout_ends_the_command_quietly():
    """``kvfold methods | head``: the reader leaves before the output is written; no traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfold.cli", "methods"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # nobody reads: writing to the pipe fails with EPIPE
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=300) == 141 and err == ""


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "nosuch"], "unknown method 'nosuch'; valid:"),
        (["--method", "streamingllm[sink=3]"], "unknown option(s) sink; valid options: sinks, online"),
        (["--budget", "1.5"], "budget must be a fraction in (0, 1] or a positive token count; got '1.5'"),
        (["--budget", "0"], "budget must be a fraction in (0, 1] or a positive token count"),
        (["--context", "   "], "the context is empty"),
        (["--model", "/nonexistent/model-dir"], "model path not found"),
        (["--model", "tests"], "without config.json"),
        (["--new-tokens", "0"], "--new-tokens must be ≥ 1; got 0"),
        (["--device", "gpu0"], "unknown device 'gpu0'; use auto, cpu, cuda or cuda:N"),
        (["--dtype", "int7"], "unknown dtype 'int7'; choose one of: auto,"),
        (["--context-file", "/nonexistent/doc.txt"], "context file not found: /nonexistent/doc.txt"),
    ],
)
def test_generate_bad_input_is_one_clear_line(capsys, argv, message):
    base = {"--context": "Some context.", "--question": "Q?"}
    args = ["generate"]
    for key, value in base.items():
        if key not in argv:
            args += [key, value]
    if "--context-file" in argv:
        args.remove("--context")
        args.remove("Some context.")
    code, _, err = run(capsys, *args, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    last = err.rstrip("\n").splitlines()[-1]  # progress lines may come first
    assert last.startswith("kvfold generate: error: ") and message in last


def test_a_context_file_that_is_not_text_is_bad_input(capsys, tmp_path):
    """A binary file's UnicodeDecodeError is a ValueError that kvfold did not raise: it is still the
    input's fault, said with the file's name."""
    path = tmp_path / "doc.bin"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    code, _, err = run(capsys, "generate", "--context-file", str(path), "--question", "Q?")
    assert code == 2 and err.splitlines()[-1] == (
        f"kvfold generate: error: context file {path} is not UTF-8 text (invalid start byte at byte 0); "
        "give a text file"
    )


@pytest.mark.parametrize("fault", [ValueError("slot 7 is past the layer's 6 entries"), KeyError("attention_modules")])
def test_an_internal_error_is_not_reported_as_bad_input(capsys, monkeypatch, fault):
    """A ValueError or KeyError raised by kvfold's own code (here inside ``kvfold methods``) is a fault
    of kvfold, not of the input: exit 1, one line that says so and names --debug, no traceback."""
    import kvfold.methods

    def broken():
        raise fault

    monkeypatch.delenv("KVFOLD_DEBUG", raising=False)
    monkeypatch.setattr(kvfold.methods, "available_methods", broken)
    code, out, err = run(capsys, "methods")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvfold methods: internal error: ")
    assert type(fault).__name__ in err and "--debug" in err and "KVFOLD_DEBUG=1" in err
    assert "error: slot" not in err and "Traceback" not in err


@pytest.mark.parametrize("how", ["before", "after", "environment"])
def test_debug_raises_an_internal_error_with_its_traceback(capsys, monkeypatch, how):
    import kvfold.methods

    def broken():
        raise KeyError("attention_modules")

    monkeypatch.setattr(kvfold.methods, "available_methods", broken)
    monkeypatch.delenv("KVFOLD_DEBUG", raising=False)
    argv = {"before": ["--debug", "methods"], "after": ["methods", "--debug"], "environment": ["methods"]}[how]
    if how == "environment":
        monkeypatch.setenv("KVFOLD_DEBUG", "1")
    with pytest.raises(KeyError, match="attention_modules"):
        main(argv)


def test_debug_shows_the_traceback_of_an_internal_error_on_stderr():
    """In a fresh interpreter, as a user runs it: the traceback and Python's exit status 1."""
    code = (
        "import sys, kvfold.methods as m\n"
        "def broken():\n    raise KeyError('attention_modules')\n"
        "m.available_methods = broken\n"
        "from kvfold.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    plain = subprocess.run([sys.executable, "-c", code, "methods"], capture_output=True, text=True, timeout=300)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and "internal error" in plain.stderr
    debug = subprocess.run(
        [sys.executable, "-c", code, "--debug", "methods"], capture_output=True, text=True, timeout=300
    )
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
    assert debug.stderr.rstrip().endswith("KeyError: 'attention_modules'")


def test_a_user_error_stays_one_line_exit_2_whatever_raises_it(capsys, monkeypatch):
    """Bad input found deep inside a command (a UserError) is still the input's fault: one line, 2."""
    import kvfold.methods
    from kvfold.runtime.errors import UserError

    def refuses():
        raise UserError("the registry file names no method; give at least one")

    monkeypatch.delenv("KVFOLD_DEBUG", raising=False)
    monkeypatch.setattr(kvfold.methods, "available_methods", refuses)
    code, _, err = run(capsys, "methods")
    assert code == 2 and err == "kvfold methods: error: the registry file names no method; give at least one\n"


@pytest.mark.model
def test_generate_over_long_context_is_refused(capsys, smollm2):
    code, _, err = run(capsys, "generate", "--context", "word " * 9000, "--question", "Q?")
    assert code == 2
    assert "supports 8192 positions" in err


@pytest.mark.model
def test_generate_streamingllm_json_reports_memory(capsys, smollm2, tmp_path):
    _, tokenizer = smollm2
    path = tmp_path / "context.txt"
    path.write_text(build_logbook(tokenizer, target_tokens=1200))
    code, out, _ = run(
        capsys,
        "generate",
        "--method",
        "streamingllm",
        "--budget",
        "0.1",
        "--context-file",
        str(path),
        "--question",
        "What is the special magic number for the cabin?",
        "--new-tokens",
        "4",
        "--json",
    )
    assert code == 0
    record = json.loads(out)
    for key in (
        "answer",
        "method",
        "budget",
        "context_tokens",
        "kv_bytes",
        "kv_bytes_full",
        "prefill_seconds",
        "compress_seconds",
    ):
        assert key in record
    assert record["context_tokens"] > 1000
    assert record["kv_bytes"] <= 0.11 * record["kv_bytes_full"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--budget", "0.1", "--memory", "0.05"], "give --budget or --memory, not both"),
        (["--memory", "2"], "a memory budget is a fraction in (0, 1]"),
        (["--kv-bits", "5"], "unknown KV format 'int5'"),
        (["--method", "snapkv@int9"], "unknown KV format 'int9'"),
    ],
)
def test_generate_memory_flags_bad_input_is_one_clear_line(capsys, argv, message):
    code, _, err = run(capsys, "generate", "--context", "Some context.", "--question", "Q?", *argv)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.model
def test_generate_under_a_memory_budget_reports_bytes(capsys, smollm2, tmp_path):
    _, tokenizer = smollm2
    path = tmp_path / "context.txt"
    path.write_text(build_logbook(tokenizer, target_tokens=1200))
    code, out, _ = run(
        capsys,
        *("generate", "--method", "kvzip", "--memory", "0.0625", "--context-file", str(path)),
        *("--question", "What is the special magic number for the cabin?", "--max-new-tokens", "16", "--json"),
    )
    assert code == 0
    record = json.loads(out)
    assert record["memory"] == 0.0625 and record["memory_ratio"] <= 0.0625 and record["kv_format"] == "int4"
    assert record["method"] == "kvzip@int4" and 0.1 < record["token_budget"] < 0.25
    # the answer is the one the library gives from the cache the memory plan asked for, built another
    # way: the same method and storage at the token budget the plan chose, no memory planning
    model, _ = smollm2
    question = "What is the special magic number for the cabin?"
    prefilled = kvfold.prefill(model, tokenizer, path.read_text(), methods=["kvzip@int4"])
    reference = prefilled.compress("kvzip@int4", Budget(fraction=record["token_budget"]))
    assert record["kv_bytes"] == reference.kv_bytes
    assert record["answer"] == reference.generate(question, max_new_tokens=16)[0].text
    assert record["answer"].startswith("The special magic number for the cabin is")


@pytest.mark.model
def test_generate_full_under_a_memory_budget_holds_it_or_refuses_it(capsys, smollm2, tmp_path):
    """``full`` keeps every token: under --memory it is quantized to the widest storage that fits, and
    a budget no storage of every token reaches (1/20: 0.8 bits an element) is refused in one line."""
    _, tokenizer = smollm2
    path = tmp_path / "context.txt"
    path.write_text(build_logbook(tokenizer, target_tokens=600))
    base = ("generate", "--method", "full", "--context-file", str(path), "--question", "Q?", "--new-tokens", "2")
    code, out, err = run(capsys, *base, "--memory", "0.05", "--quiet")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("kvfold generate: error: 'full' keeps every token and can only quantize them: in 3 bits")
    assert "so memory 0.05 is out of its reach" in err and "--method kvzip+am_fit" in err
    code, out, _ = run(capsys, *base, "--memory", "0.4", "--json")
    record = json.loads(out)
    assert code == 0 and record["method"] == "full@int4" and record["token_budget"] == 1.0
    assert record["memory"] == 0.4 and record["memory_ratio"] <= 0.4
    assert record["memory_ratio"] == record["kv_bytes"] / record["kv_bytes_full_16"]


@pytest.mark.parametrize("command", [["generate", "--question", "Q?"], ["compress", "--out", "unwritten.kvf"]])
def test_an_empty_context_is_refused_before_a_model_is_loaded(capsys, monkeypatch, command):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(kvfold.runtime.models, "load_model", load)
    code, _, err = run(capsys, *command, "--context", " \n ")
    assert code == 2
    last = err.rstrip("\n").splitlines()[-1]
    assert last == f"kvfold {command[0]}: error: the context is empty; give a text to compress"
