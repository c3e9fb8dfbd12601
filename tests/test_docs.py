"""The documentation follows the code: README.md and every page of docs/.

* every method spec the text names parses, builds and compresses a tiny model;
* the options table of docs/methods.md is the registry's options and defaults;
* the README's quick start and the worked example of docs/contributing.md run as written (the quick
  start on a tiny random model in place of the embedded one);
* every page of docs/ is reachable from the README, every relative link points at a file and a
  heading that exist, and the README stays short.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import kvfold
from kvfold.methods import RECOMMENDED, REGISTRY, SpecError, available_methods, build_method, parse_spec, split_specs
from tests.conftest import CharTokenizer, make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
README_MAX_LINES = 300


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    """The body of a ``## heading`` section, up to the next ``## ``."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


# ----------------------------------------------------------------------------- method specs


def _candidates(text: str) -> set[str]:
    """Inline code spans, ``--method(s) X`` arguments and string literals given to ``compress``."""
    found = set(re.findall(r"`([^`\n]+)`", text))
    found |= set(re.findall(r"--methods? ([^\s`]+)", text))
    found |= set(re.findall(r"compress\(\"([^\"]+)\"", text))
    return {c.strip("\"'") for c in found}


def _is_spec(text: str) -> bool:
    """A full spec: it parses and every component is registered (``+cam`` or ``adakv:`` alone are not).

    A bare wrapper or folder name (``adakv``, ``d2o_merge``) names a component, not a spec, unless it
    builds on its own (``keepkv`` = ``h2o_cosine+keepkv``).
    """
    try:
        parsed = parse_spec(text)
    except SpecError:
        return False
    names = [w.name for w in parsed.wrappers] + [parsed.selector.name]
    names += [parsed.folder.name] if parsed.folder is not None else []
    if not all(name in REGISTRY for name in names):
        return False
    if len(names) == 1 and text == names[0] and REGISTRY[text].role in ("wrapper", "folder"):
        try:
            build_method(text)
        except SpecError:
            return False
    return True


def doc_specs() -> list[str]:
    """Every method spec named in README.md and docs/**/*.md."""
    available_methods()  # every built-in method registered
    specs = set()
    for page in PAGES:
        for candidate in _candidates(_text(page)):
            try:
                pieces = split_specs(candidate)
            except SpecError:
                continue
            specs.update(p for p in pieces if _is_spec(p))
    return sorted(specs)


SPECS = doc_specs()


def test_the_docs_name_the_methods():
    assert len(SPECS) >= 40, SPECS
    for name in ("snapkv", "adakv:snapkv", "snapkv+grkv", "zsmerge", "keepkv", "am_highest_fast", "kvzip", "leverage"):
        assert name in SPECS
    for name in ("compactor", "global:snapkv", "global[minimum=0]:kvzip[layerwise=true]", RECOMMENDED):
        assert name in SPECS


@pytest.fixture(scope="module")
def prefilled() -> kvfold.PrefilledContext:
    """One tiny model and context, prefilled once for every spec (their query windows included)."""
    model = kvfold.enable(make_tiny_model("llama"))
    text = "the documented methods still run, " * 3
    return kvfold.prefill(model, CharTokenizer(), text, use_chat_template=False, methods=SPECS)


@pytest.mark.parametrize("spec", SPECS)
def test_every_documented_spec_builds_and_compresses_a_tiny_model(prefilled, spec):
    method = build_method(spec)
    if "schedule=" in spec:  # names a model's schedule file (tests/methods/eviction/test_kvzip.py runs one)
        return
    small = prefilled.compress(method, 0.5)
    assert small.kv_bytes <= small.kv_bytes_full, spec
    answer = small.generate("?", max_new_tokens=2, use_chat_template=False)[0]
    assert 1 <= answer.new_tokens <= 2, spec


# ----------------------------------------------------------------------------- options table


def _registry_options(cls: type) -> dict[str, str]:
    options = {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = "?"
        options[field.name] = str(default)
    return options


def _documented_options() -> dict[str, dict[str, str]]:
    """The rows of docs/methods.md's options table; ``as `X`, with a=1`` rows extend X's."""
    section = _section(_text(DOCS / "methods.md"), "Options and defaults")
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", section, flags=re.M))
    resolved: dict[str, dict[str, str]] = {}

    def resolve(name: str) -> dict[str, str]:
        if name not in resolved:
            text = rows[name]
            base = re.match(r"as `(\w+)`, with (.*)", text)
            options = dict(resolve(base.group(1))) if base else {}
            options.update(re.findall(r"(\w+)=([^,\s]+)", base.group(2) if base else text))
            resolved[name] = options
        return resolved[name]

    return {name: resolve(name) for name in rows}


def test_the_options_table_is_the_registrys():
    documented = _documented_options()
    for cls in available_methods():
        assert cls.name in documented, f"docs/methods.md: add `{cls.name}` to the options table"
        assert documented[cls.name] == _registry_options(cls), f"docs/methods.md: options of `{cls.name}`"
    assert set(documented) == {cls.name for cls in available_methods()}


# ----------------------------------------------------------------------------- the quick start


class _TensorCharTokenizer(CharTokenizer):
    """The test tokenizer, also answering ``return_tensors="pt"`` as a transformers tokenizer does."""

    def __call__(self, text: str, add_special_tokens: bool = True, return_tensors: str | None = None):
        encoding = super().__call__(text, add_special_tokens=add_special_tokens)
        if return_tensors == "pt":
            encoding.input_ids = torch.tensor([encoding.input_ids])
        return encoding


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


@pytest.mark.parametrize("device", DEVICES)
def test_the_readme_quick_start_runs_on_a_tiny_model(monkeypatch, capsys, device):
    """The quick start as written, with ``kvfold.load_model()`` giving a tiny random Llama on
    ``device`` (as ``device="auto"`` puts it on a GPU) and the demo's logbook cut to its shortest
    (about 2,500 characters, one token each); the tokenizer's tensors stay on the CPU, as a
    transformers tokenizer's do."""
    from kvfold.evaluate.data import logbook

    blocks = _python_blocks(_section(_text(README), "Quick start"))
    assert len(blocks) == 1 and "kvfold.load_model()" in blocks[0]
    model = kvfold.enable(make_tiny_model("llama", max_position_embeddings=4096)).to(device)
    model.generation_config.pad_token_id = 0
    monkeypatch.setattr(kvfold, "load_model", lambda *args, **kwargs: (model, _TensorCharTokenizer()))
    full_length = logbook.build_logbook
    monkeypatch.setattr(logbook, "build_logbook", lambda tokenizer, *args, **kwargs: full_length(tokenizer, 100))
    exec(compile(blocks[0], "README.md: quick start", "exec"), {"__name__": "readme_quick_start"})
    printed = capsys.readouterr().out.rstrip("\n").split("\n")
    assert len(printed) == 2 + len(logbook.FACTS), printed
    assert "MB kept" in printed[0]
    assert all(line.startswith(question) for line, (_, question, _) in zip(printed[1:], logbook.FACTS, strict=False))


# ----------------------------------------------------------------------------- the worked example


def _example_blocks() -> tuple[str, str]:
    blocks = _python_blocks(_section(_text(DOCS / "contributing.md"), "Adding a method"))
    assert len(blocks) == 2, "docs/contributing.md, 'Adding a method': the example method and its test"
    return blocks[0], blocks[1]


METHOD_CODE, TEST_CODE = _example_blocks()
TEST_NAMES = sorted(re.findall(r"^def (test_\w+)\(", TEST_CODE, flags=re.M))


def _module(name: str, code: str, origin: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look the module up
    exec(compile(code, origin, "exec"), module.__dict__)
    return module


@pytest.fixture
def example_tests() -> Iterator[types.ModuleType]:
    """The example method registered for one test, then removed from the registry."""
    method = _module("kvfold_docs_value_norm", METHOD_CODE, "docs/contributing.md: value_norm.py")
    tests = _module("kvfold_docs_test_value_norm", TEST_CODE, "docs/contributing.md: test_value_norm.py")
    try:
        yield tests
    finally:
        for cls in list(vars(method).values()):
            if isinstance(cls, type) and REGISTRY.get(getattr(cls, "name", None)) is cls:
                del REGISTRY[cls.name]
        sys.modules.pop(method.__name__, None)
        sys.modules.pop(tests.__name__, None)


def test_the_example_is_a_short_method_with_its_test():
    assert len(TEST_NAMES) >= 1
    assert 30 <= len(METHOD_CODE.splitlines()) + len(TEST_CODE.splitlines()) <= 90
    assert "@register" in METHOD_CODE
    assert "import kvfold\n" not in METHOD_CODE and "from kvfold.methods import" not in METHOD_CODE  # layers


@pytest.mark.parametrize("name", TEST_NAMES)
def test_the_worked_example(example_tests: types.ModuleType, name: str) -> None:
    getattr(example_tests, name)()


# ----------------------------------------------------------------------------- links and length


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _links(page: Path) -> list[tuple[Path, str]]:
    """Relative Markdown links of a page: ``(target file, anchor)``; web links are left out."""
    found = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(page)):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        found.append(((page.parent / path).resolve() if path else page, anchor))
    return found


def test_every_relative_link_points_at_a_file_and_a_heading():
    for page in PAGES:
        for target, anchor in _links(page):
            assert target.exists(), f"{page.relative_to(ROOT)}: no {target}"
            if anchor:
                anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", _text(target), flags=re.M)}
                assert anchor in anchors, f"{page.relative_to(ROOT)}: no #{anchor} in {target.name}"


def test_every_docs_page_is_reachable_from_the_readme():
    readme_links = {target for target, _ in _links(README)}
    results_index = DOCS / "results" / "README.md"
    assert results_index.resolve() in readme_links
    index_links = {target for target, _ in _links(results_index)}
    for page in sorted(DOCS.rglob("*.md")):
        reachable = page.resolve() in readme_links or (
            page.parent == results_index.parent and page.resolve() in index_links
        )
        assert reachable, f"{page.relative_to(ROOT)} is linked from neither README.md nor docs/results/README.md"


def test_the_readme_is_short():
    lines = len(_text(README).splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


# ----------------------------------------------------------------------------- commands in the docs

RETIRED_FLAGS = {"--lengths", "--context-tokens", "--max-new-tokens", "--next-tokens"}
"""Old names kept as deprecated aliases: the dated results pages ran them; no other page shows them."""


def _command_lines(text: str) -> Iterator[str]:
    """Every ``kvfold SUB ...`` command of a page: in code blocks (continuation lines joined) and in
    inline code spans."""
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"(^|\s)#.*", "", line)  # a shell comment
            for match in re.finditer(r"(?:^|[\s;&|(])kvfold\s+([a-z][\w-]*)((?:\s.*)?)$", line):
                yield f"kvfold {match.group(1)}{match.group(2)}"
    yield from re.findall(r"`(kvfold [a-z][\w-]*(?:\s[^`\n]*)?)`", text)


def _code_blocks(text: str) -> Iterator[str]:
    """The shell code blocks of a page (fences with no language or a shell's)."""
    block: list[str] | None = None
    language = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if block is None:
                block, language = [], line.strip()[3:].strip()
            else:
                if language in ("", "bash", "sh", "shell", "console"):
                    yield "\n".join(block)
                block = None
        elif block is not None:
            block.append(line)


def _flags(command: str) -> tuple[str, list[str]]:
    """The subcommand and the ``--flags`` a command line gives it (up to a comment or a pipe to
    another program)."""
    body = re.split(r"\s#\s|\s[|>]\s|\s<\s|\s&&\s", command)[0]
    sub = body.split()[1]
    return sub, re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", body)


def _parsers():
    import argparse

    from kvfold.cli.main import _load_extra_commands, build_parser

    _load_extra_commands()
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, dict(action.choices)


def test_every_flag_of_every_command_in_the_docs_exists():
    """Every ``kvfold SUB --flag`` in the README and docs/ names a subcommand that exists and flags
    it takes; pages other than the dated results use the current names, not the deprecated ones."""
    parser, subparsers = _parsers()
    checked = 0
    for page in PAGES:
        history = "results" in page.relative_to(ROOT).parts
        for command in _command_lines(_text(page)):
            sub, flags = _flags(command)
            if sub not in subparsers:
                assert command.startswith(("kvfold --", "kvfold -h")), f"{page.name}: {command!r}: no subcommand {sub}"
                continue
            known = subparsers[sub]._option_string_actions
            for flag in flags:
                assert flag in known, f"{page.name}: {command!r}: kvfold {sub} has no {flag}"
                assert history or flag not in RETIRED_FLAGS, f"{page.name}: {command!r}: {flag} is deprecated"
                checked += 1
    assert checked > 100  # the docs show many commands: the parsing found them


def test_the_fast_commands_in_the_docs_run(capsys):
    """The docs' commands that finish in a second run as written: ``kvfold methods`` (and ``--json``),
    ``kvfold --version``, ``kvfold SUB --help``."""
    from kvfold.cli.main import main

    ran = 0
    for page in PAGES:
        for command in _command_lines(_text(page)):
            sub, flags = _flags(command)
            if sub == "methods" or "--help" in flags:
                argv = [sub, *(flag for flag in flags if flag in ("--json", "--help"))]
                try:
                    assert main(argv) == 0, f"{page.name}: {command!r}"
                except SystemExit as done:  # --help
                    assert done.code == 0, f"{page.name}: {command!r}"
                ran += 1
    assert ran >= 2 and "kvzip" in capsys.readouterr().out


# ----------------------------------------------------------------------------- no dead references

DEAD_REFERENCES = re.compile(
    r"(?<![\w.])shared/"  # the developers' notes, not in this repository
    r"|\b(?:[Ii]ssues?|PR|[Pp]ull request)\s*#?\s*\d+"  # a numbered issue: only owner/repo#N is followed
    r"|(?<![\w/.-])#\d{2,}\b"  # a bare #N
)


def _source_and_doc_files() -> list[Path]:
    """Code (the package, its tests, benchmarks and tools) and docs; not this file, whose check has
    examples of what it finds."""
    code = [
        path for folder in ("src", "tests", "benchmarks", "tools") for path in sorted((ROOT / folder).rglob("*.py"))
    ]
    files = code + [README, *sorted(DOCS.rglob("*.md"))]
    return [path for path in files if "__pycache__" not in path.parts and path != Path(__file__).resolve()]


def test_no_file_cites_the_developers_notes_or_issue_numbers():
    """Docstrings, comments and docs (of the package, its tests, benchmarks and tools) cite the papers,
    public projects (``owner/repo#N``) and the project's own docs: no ``shared/`` notes and no numbered
    issues a reader cannot open."""
    found = []
    for path in _source_and_doc_files():
        for number, line in enumerate(_text(path).splitlines(), 1):
            for match in DEAD_REFERENCES.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}")
    assert not found, "\n".join(found)


def test_the_dead_reference_check_finds_what_it_looks_for():
    cited = ["see shared/guide/methods.md", "(issue 35)", "Issue 33's target", "kvpress PR #288", "its #222"]
    fine = ["NVIDIA/kvpress#288", "ctx.shared", "self.shared[key]", "the shared repeat pass", "issue a warning"]
    assert all(DEAD_REFERENCES.search(text) for text in cited)
    assert not any(DEAD_REFERENCES.search(text) for text in fine)
