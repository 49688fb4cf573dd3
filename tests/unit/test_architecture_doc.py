"""docs/architecture.md's walk of one version matches the code, and the README's step table
follows it (issue 34).

The walk is the numbered list under the heading ``## One version's walk``. Each step names
exactly one module by its path in backticks (``sender/publisher.py``), no module twice, at most
:data:`MAX_STEPS` steps. Everything else a step puts in backticks is a name the test looks up,
so it cannot drift from the code:

- ``pb.Name``: a message or RPC of the control-plane API (``proto/weightsync/v1/*.proto``);
- ``Name``, ``name()``: a class, function or constant defined (not imported) in the step's
  module, or a member of one of its classes;
- ``Class.member``: a method, attribute or nested name of that class of the step's module.

The README table under "One version, step by step" has a row per step, each naming the same
one module, in the same order. Modules are parsed, never imported (the engines are optional).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
PROTOS = sorted((ROOT / "proto").rglob("*.proto"))
MAX_STEPS = 15
WALK_HEADING = "## One version's walk"
README_TABLE = "One version, step by step, and the module that does each step"

MODULE = re.compile(r"`((?:[\w-]+/)+\w+\.py)`")
"""A module's path from the repository root, in backticks."""
CODE = re.compile(r"`([^`]+)`")
NAME = re.compile(r"(?:pb\.)?[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?(?:\(\))?")


@dataclass(frozen=True)
class Step:
    number: int
    text: str

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(MODULE.findall(self.text)))

    @property
    def names(self) -> list[str]:
        """What the step puts in backticks besides its module's path."""
        return [c for c in CODE.findall(self.text) if not MODULE.fullmatch(f"`{c}`")]


def walk_steps(markdown: str) -> list[Step]:
    """The numbered steps of the walk section: a step starts at ``N. `` in the first column
    and goes on over its indented (or blank) lines."""
    lines = markdown.splitlines()
    try:
        start = lines.index(WALK_HEADING)
    except ValueError:
        raise AssertionError(f"docs/architecture.md has no {WALK_HEADING!r} heading") from None
    steps: list[tuple[int, list[str]]] = []
    for line in lines[start + 1 :]:
        if line.startswith("## "):
            break
        numbered = re.match(r"(\d+)\.\s", line)
        if numbered:
            steps.append((int(numbered.group(1)), [line]))
        elif steps and (not line.strip() or line.startswith(" ")):
            steps[-1][1].append(line)
        elif line.strip() and steps:
            break  # the walk's list ended
    return [Step(n, " ".join(s.strip() for s in text)) for n, text in steps]


def readme_step_modules(markdown: str) -> list[tuple[str, list[str]]]:
    """Each row of the README's step table: its step cell and the module paths of its
    module cell."""
    lines = markdown.splitlines()
    at = next((i for i, line in enumerate(lines) if README_TABLE in line), None)
    assert at is not None, f"README.md has no line {README_TABLE!r}"
    rows = []
    table = False
    for line in lines[at + 1 :]:
        if not line.startswith("|"):
            if table or line.startswith("#"):
                break
            continue  # the sentence that introduces the table
        table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if set(cells[0]) <= {"-", " "} or cells[0] == "step":
            continue
        rows.append((cells[0], MODULE.findall(cells[-1])))
    return rows


@functools.cache
def definitions(path: str) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """The names ``path`` defines at its top level, and each class's members (its body's
    definitions and assignments, and ``self.x`` assigned in its methods)."""
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    top: set[str] = set()
    members: dict[str, frozenset[str]] = {}
    for node in tree.body:
        top |= _defined(node)
        if isinstance(node, ast.ClassDef):
            inside: set[str] = set()
            for child in node.body:
                inside |= _defined(child)
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.ctx, ast.Store)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    inside.add(sub.attr)
            members[node.name] = frozenset(inside)
    return frozenset(top), members


def _defined(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


@functools.cache
def proto_names() -> frozenset[str]:
    text = "\n".join(p.read_text() for p in PROTOS)
    return frozenset(re.findall(r"^\s*(?:message|rpc|enum|service)\s+(\w+)", text, re.M))


def missing_name(module: str, name: str) -> str | None:
    """Why ``name`` (as written in a step) is not in ``module``; None when it is."""
    if not NAME.fullmatch(name):
        return (
            f"`{name}` is neither a name of {module} nor `pb.Message` "
            "(write other code spans outside the walk)"
        )
    bare = name.removesuffix("()")
    if bare.startswith("pb."):
        if bare[3:] not in proto_names():
            return f"`{name}`: no message or RPC {bare[3:]!r} in the .proto files"
        return None
    top, members = definitions(module)
    owner, _, member = bare.rpartition(".")
    if owner:
        if owner not in members:
            return f"`{name}`: {module} defines no class {owner!r}"
        if member not in members[owner]:
            return f"`{name}`: class {owner} in {module} has no {member!r}"
        return None
    if bare in top or any(bare in m for m in members.values()):
        return None
    return f"`{name}`: {module} defines no {bare!r}"


def check_walk(doc: str, readme: str) -> list[str]:
    """Every way the walk and the README's table break the rules above."""
    steps = walk_steps(doc)
    problems = []
    if not steps:
        problems.append("the walk has no numbered steps")
    if len(steps) > MAX_STEPS:
        problems.append(f"the walk has {len(steps)} steps, at most {MAX_STEPS}")
    numbers = [s.number for s in steps]
    if numbers != list(range(1, len(steps) + 1)):
        problems.append(f"steps are numbered {numbers}, not 1..{len(steps)}")
    walk: list[str] = []
    for step in steps:
        if len(step.modules) != 1:
            problems.append(f"step {step.number} names {step.modules or 'no module'}, not one")
            continue
        (module,) = step.modules
        if not (ROOT / module).is_file():
            problems.append(f"step {step.number}: {module} does not exist")
            continue
        if module in walk:
            problems.append(f"step {step.number}: {module} is step {walk.index(module) + 1} too")
        walk.append(module)
        for name in step.names:
            why = missing_name(module, name)
            if why is not None:
                problems.append(f"step {step.number}: {why}")
    rows = readme_step_modules(readme)
    table = []
    for i, (cell, modules) in enumerate(rows, 1):
        if not cell.startswith(f"{i}."):
            problems.append(f"README step row {i} starts {cell[:20]!r}, not '{i}.'")
        if len(modules) != 1:
            problems.append(f"README step row {i} names {modules or 'no module'}, not one")
        table.append(modules[0] if modules else None)
    if table != walk:
        problems.append(
            "the README's step table does not follow the walk:\n"
            f"  walk:   {walk}\n  README: {table}"
        )
    return problems


def test_walk_matches_the_code_and_the_readme() -> None:
    problems = check_walk(DOC.read_text(), README.read_text())
    assert not problems, "\n".join(problems)


def test_layout_table_names_modules_that_exist() -> None:
    """Every ``name.py`` the README's layout table lists in a folder's row is in that folder."""
    text = README.read_text()
    layout = text[text.index("\n## Layout") :]
    missing = []
    for line in layout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 2 or not cells[0].startswith("`"):
            continue
        folder = ROOT / cells[0].split("`")[1].rstrip("/")
        if not folder.is_dir():
            continue
        for named in re.findall(r"`([\w/]+\.py)`", cells[1]):
            if not any(p.as_posix().endswith("/" + named) for p in folder.rglob(Path(named).name)):
                missing.append(f"{cells[0].split('`')[1]}: {named}")
    assert not missing, f"the README's layout table lists modules that do not exist: {missing}"


# The checker itself: each rule fails on a walk that breaks it.

_README = f"""{README_TABLE}:

| step | module |
| --- | --- |
| 1. publish | `sender/publisher.py` |
| 2. serve | `sender/service.py` |
"""

_DOC = f"""{WALK_HEADING}

1. `sender/publisher.py`: `Publisher.publish` sends a `pb.BeginVersion`.
2. `sender/service.py`: `WeightSyncServicer` moves it on.

## Next
"""


def test_checker_passes_a_good_walk() -> None:
    assert check_walk(_DOC, _README) == []


@pytest.mark.parametrize(
    ("doc", "readme", "complaint"),
    [
        (_DOC.replace("Publisher.publish", "Publisher.publish_all"), _README, "has no"),
        (_DOC.replace("`WeightSyncServicer`", "`Servicer`"), _README, "defines no"),
        (_DOC.replace("pb.BeginVersion", "pb.BeginVersions"), _README, "no message"),
        (_DOC.replace("sender/service.py", "sender/publisher.py"), _README, "is step 1 too"),
        (_DOC.replace("sender/service.py", "sender/nowhere.py"), _README, "does not exist"),
        (_DOC.replace("moves it on", "and `sender/coordinator.py`"), _README, "not one"),
        (_DOC.replace("2. ", "3. "), _README, "numbered"),
        (_DOC, _README.replace("sender/service.py", "sender/coordinator.py"), "follow the walk"),
        (_DOC, _README.replace("| 2. serve", "| 3. serve"), "not '2.'"),
        (
            _DOC.replace("\n\n## Next", "".join(f"\n{i}. x" for i in range(3, 17)) + "\n## Next"),
            _README,
            "at most 15",
        ),
    ],
)
def test_checker_fails_a_broken_walk(doc: str, readme: str, complaint: str) -> None:
    assert any(complaint in p for p in check_walk(doc, readme)), check_walk(doc, readme)
