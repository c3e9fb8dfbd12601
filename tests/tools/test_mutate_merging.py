"""tools/mutate_merging.py: every mutation still edits the code it names (a refactor that moves a merge
step must move its mutation along, or the mutation run checks nothing)."""

from __future__ import annotations

from pathlib import Path

from tests.tools.scripts import ROOT, load_script

tool = load_script("tools/mutate_merging.py")


def test_every_mutation_names_code_that_occurs_once_and_tests_that_exist():
    assert tool.stale_mutations() == []


def test_a_mutation_of_code_that_is_gone_is_reported(tmp_path):
    """A tree holding every mutated line once, except ``cam``'s: only ``cam`` is reported."""
    held: dict[str, str] = {}
    for name, (edits, tests) in tool.M.items():
        for path, old, _ in edits:
            held[path] = held.get(path, "") + ("\n" + old + "\n" if name != "cam" else "")
        for test in tests:
            held.setdefault(test, "")
    for path, text in held.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    stale = tool.stale_mutations(tmp_path)
    assert stale and all(line.startswith("cam: ") for line in stale)


def test_a_mutation_runs_in_a_scratch_copy_and_leaves_the_working_tree_alone(monkeypatch, capsys):
    """:func:`main` edits a copy of ``src``: the mutated code is what the tests run on, and the
    working tree is byte for byte what it was (it may be committed while the run goes on)."""
    path, old, new = tool.M["cam"][0][0]
    before = (ROOT / path).read_bytes()
    seen = {}

    def fake_run(command, cwd, **kwargs):
        seen["cwd"], seen["text"] = Path(cwd), (Path(cwd) / path).read_text()
        return type("Done", (), {"stdout": "FAILED tests/x.py::test_y - boom\n1 failed in 0.1s\n"})()

    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    tool.main(["cam"])
    assert seen["cwd"] != ROOT and new in seen["text"] and old not in seen["text"]
    assert (ROOT / path).read_bytes() == before and not seen["cwd"].exists()  # the copy is removed
    assert "## cam: 1 failed" in capsys.readouterr().out
