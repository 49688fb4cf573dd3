"""The import layers: the core imports nothing above it, sender and receiver not each other.

    weightsync.app, weightsync.drivers,     entry points, RL-driver clients, RL-framework
    weightsync.integrations                 adapters (may import all)
    weightsync.sender | weightsync.receiver the two sides (each imports only the core)
    weightsync (the rest)                   the core

Every module is parsed (never imported), so an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Folder -> the package it is installed as (pyproject's package-dir).
PACKAGES = {
    "weightsync": "weightsync",
    "sender": "weightsync.sender",
    "receiver": "weightsync.receiver",
}
TOP = ("weightsync.app", "weightsync.drivers", "weightsync.integrations")
SIDES = ("weightsync.sender", "weightsync.receiver")
GENERATED = "weightsync.v1"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def forbidden_for(module: str) -> tuple[str, ...]:
    """The packages ``module`` must not import."""
    if any(_within(module, top) for top in TOP):
        return ()
    for side in SIDES:
        if _within(module, side):
            return tuple(p for p in TOP + SIDES if p != side)
    return TOP + SIDES


def modules() -> dict[str, Path]:
    """Every module of the three folders by its installed name."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if not _within(name, GENERATED):
                found[name] = path
    return found


def imports(source: str, module: str, is_package: bool) -> list[tuple[str, set[str]]]:
    """Every import statement of ``source`` (as written, with its line) and the modules it may
    import (``from a import b`` may import ``a.b``)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = ", ".join(alias.name for alias in node.names)
            out.append((f"line {node.lineno}: import {names}", {a.name for a in node.names}))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    parent = parent.rpartition(".")[0]
                base = f"{parent}.{base}" if base else parent
            names = ", ".join(alias.name for alias in node.names)
            written = "." * node.level + (node.module or "")
            targets = {base} | {f"{base}.{alias.name}" for alias in node.names}
            out.append((f"line {node.lineno}: from {written} import {names}", targets))
    return out


def violations(module: str, statements: list[tuple[str, set[str]]]) -> list[str]:
    banned = forbidden_for(module)
    return [
        f"{module} ({statement})"
        for statement, targets in statements
        if any(_within(t, package) for t in targets for package in banned)
    ]


def test_no_module_imports_a_layer_above_it_or_the_other_side():
    found = modules()
    assert "weightsync.buckets" in found and "weightsync.sender.publisher" in found
    bad = []
    for module, path in found.items():
        source = path.read_text()
        bad += violations(module, imports(source, module, path.name == "__init__.py"))
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_the_check_sees_upward_and_sideways_imports():
    core = imports("def f():\n    from weightsync import sender\n", "weightsync.demo", False)
    assert violations("weightsync.demo", core) == [
        "weightsync.demo (line 2: from weightsync import sender)"
    ]
    side = imports("from ...receiver import core\n", "weightsync.sender.megatron", True)
    assert violations("weightsync.sender.megatron", side) == [
        "weightsync.sender.megatron (line 1: from ...receiver import core)"
    ]
    top = imports("import weightsync.sender, weightsync.receiver\n", "weightsync.app.cli", False)
    assert violations("weightsync.app.cli", top) == []


MAX_LINES = 400
"""One responsibility per module (issue 34): past this, split it."""


def test_no_module_grows_past_400_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for folder in PACKAGES
        for path in (ROOT / folder).rglob("*.py")
        if GENERATED.replace(".", "/") not in str(path.relative_to(ROOT))
    }
    too_long = {m: n for m, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"over {MAX_LINES} lines (split them): {too_long}"
