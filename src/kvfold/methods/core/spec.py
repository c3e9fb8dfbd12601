"""The method-spec grammar used everywhere a method is named (CLI, Python, result files).

    spec      := (component ":")* component ("+" component)?
    component := NAME ("[" key "=" value ("," key "=" value)* "]")?

Prefixes before ``:`` are wrappers (``adakv:snapkv``), the part after ``+`` is a folder that
decides what happens to evicted entries (``snapkv+grkv``), and options go in square brackets
after the component they configure (``snapkv[window=64,kernel=7]``, ``zsmerge[residual=0]``).
A list of specs is separated by commas outside brackets: ``full,snapkv[window=64,kernel=7]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvfold.runtime.errors import UserError

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class SpecError(UserError):
    """A method spec that does not parse or names something unknown."""


@dataclass(frozen=True)
class Component:
    """One named part of a spec with its options (values still as text)."""

    name: str
    options: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}[{','.join(f'{k}={v}' for k, v in self.options.items())}]"


@dataclass(frozen=True)
class ParsedSpec:
    """A parsed spec: wrappers (outermost first), the selector, and an optional folder."""

    wrappers: tuple[Component, ...]
    selector: Component
    folder: Component | None
    text: str


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs, ignoring commas inside square brackets."""
    specs, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise SpecError(f"unbalanced ']' in method list {text!r}")
        if char == "," and depth == 0:
            specs.append("".join(current).strip())
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise SpecError(f"unbalanced '[' in method list {text!r}")
    specs.append("".join(current).strip())
    specs = [s for s in specs if s]
    if not specs:
        raise SpecError("no method given")
    return specs


def _split_outside_brackets(text: str, sep: str) -> list[str]:
    parts, depth, current = [], 0, []
    for char in text:
        depth += char == "["
        depth -= char == "]"
        if char == sep and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def parse_component(text: str) -> Component:
    """Parse ``name`` or ``name[key=value,...]``."""
    text = text.strip()
    match = re.fullmatch(r"([^\[\]]+)(?:\[(.*)\])?", text)
    if not match:
        raise SpecError(f"cannot read method component {text!r}; expected NAME or NAME[key=value,...]")
    name = match.group(1).strip().lower()
    if not _NAME.match(name):
        raise SpecError(f"invalid method name {name!r}: use lowercase letters, digits and underscores")
    options: dict[str, str] = {}
    if match.group(2) is not None and match.group(2).strip():
        for item in match.group(2).split(","):
            if "=" not in item:
                raise SpecError(f"option {item.strip()!r} in {text!r} must be written key=value")
            key, value = (s.strip() for s in item.split("=", 1))
            if not key or not value:
                raise SpecError(f"option {item.strip()!r} in {text!r} must be written key=value")
            if key in options:
                raise SpecError(f"option {key!r} given twice in {text!r}")
            options[key] = value
    return Component(name, options)


def parse_spec(text: str) -> ParsedSpec:
    """Parse one method spec (see the module docstring for the grammar)."""
    text = text.strip()
    if not text:
        raise SpecError("empty method spec")
    plus = _split_outside_brackets(text, "+")
    if len(plus) > 2:
        raise SpecError(f"{text!r}: at most one folder after '+' (e.g. snapkv+grkv)")
    chain = _split_outside_brackets(plus[0], ":")
    components = [parse_component(c) for c in chain]
    folder = parse_component(plus[1]) if len(plus) == 2 else None
    return ParsedSpec(wrappers=tuple(components[:-1]), selector=components[-1], folder=folder, text=text)
