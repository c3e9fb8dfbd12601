"""The shape of the package: a short top level, imports that point downward only, no
private names across modules, and functions a reader takes in at once.

These read the source as text (``ast``); they run nothing of kvfold.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvfold"

LAYERS = ("runtime", "methods", "pipeline", "store", "evaluate", "integrations", "cli")
"""The top-level packages, lowest first: a module may import its own package and those before it."""

MAX_FUNCTION_LINES = 80
LONG_FUNCTION_MARK = "one function on purpose"
"""A paper algorithm longer than :data:`MAX_FUNCTION_LINES` says this in its docstring, with why."""


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """Every ``kvfold`` import of a module, also those inside functions: ``(module, names, line)``."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    is_package = MODULES[name].name == "__init__.py"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name.split(".")[0] == "kvfold"]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] == "kvfold":
                found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def _target(module: str, names: list[str]) -> list[str]:
    """The modules an import loads: ``from kvfold.a import b`` loads ``kvfold.a.b`` when that is a module."""
    targets = [module]
    targets += [f"{module}.{name}" for name in names if f"{module}.{name}" in MODULES]
    return targets


def _layer(module: str) -> int:
    parts = module.split(".")
    return len(LAYERS) if len(parts) == 1 else LAYERS.index(parts[1])


def test_the_top_level_has_at_most_seven_entries_beside_the_package_file():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in {"__init__.py", "__pycache__"})
    assert len(entries) <= 7, entries
    assert set(entries) == set(LAYERS), entries


def test_imports_point_downward_only_also_inside_functions():
    upward = []
    for name in MODULES:
        for module, names, line in _imports(name):
            for target in _target(module, names):
                if target == name:
                    continue
                if name.startswith(target + ".") or _layer(target) > _layer(name):
                    upward.append(f"{name}:{line} imports {target}")
    assert not upward, "\n".join(upward)


def test_methods_core_imports_no_method_family():
    inside = [
        f"{name}:{line} imports {module}"
        for name in MODULES
        if name.startswith("kvfold.methods.core")
        for module, _, line in _imports(name)
        if module.startswith("kvfold.methods.") and not module.startswith("kvfold.methods.core")
    ]
    assert not inside, "\n".join(inside)


def test_no_import_circle():
    graph = {
        name: {t for module, names, _ in _imports(name) for t in _target(module, names) if t in MODULES and t != name}
        for name in MODULES
    }
    # a package imports its children to re-export them; the children never import it (test above)
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, "\n".join(circles)


def test_no_private_name_is_imported_across_modules():
    private = []
    for name in MODULES:
        aliases = {}
        tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
        for module, names, line in _imports(name):
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__"):
                    private.append(f"{name}:{line} imports {imported} from {module}")
                elif f"{module}.{imported}" in MODULES:
                    aliases[imported] = f"{module}.{imported}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in MODULES})
            elif isinstance(node, ast.ImportFrom):
                aliases.update({a.asname: "" for a in node.names if a.asname and f"{node.module}.{a.name}" in MODULES})
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(f"{name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not private, "\n".join(private)


def _functions():
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                yield name, node


def test_functions_fit_on_a_screen_or_say_why_not():
    long = [
        f"{name}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, node in _functions()
        if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
        and LONG_FUNCTION_MARK not in " ".join((ast.get_docstring(node) or "").lower().split())
    ]
    assert not long, "\n".join(long)


@pytest.mark.parametrize("dead", ["Timings", "_join_keys"])
def test_dead_code_is_gone(dead):
    assert not [name for name, node in _functions() if node.name == dead]
    assert not [
        name
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name == dead
    ]
