"""The room order ARCHITECTURE.md states, checked on every import under ``headrace/`` (issue 23).

Every ``import`` and ``from ... import`` is read with ``ast``, wherever it stands: at the top of
a module, inside a function (a lazy import still ties the two files: one cannot be understood,
moved or tested without the other) and under ``if TYPE_CHECKING:``, which counts too: a type
named from a room above is a dependency on that room's design, and a cycle through annotations
is a cycle a reader follows all the same (the rules of ``/work/shared/tools/import_cycles.py``).
A string naming a module (a registry's ``"module:attr"`` builtins, the CLI's command table) is
not an import: it is how a lower room names a higher one without depending on it.

``ALLOWED`` is the order, as data: each room and the rooms it may import. ARCHITECTURE.md's arrow
block must state exactly this table, and every arrow in it must be one the code takes, so the
document is read off the code rather than written beside it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "headrace"

# room -> the rooms it may import (besides itself). A backend package is a room of its own.
ALLOWED: dict[str, set[str]] = {
    "headrace": {"app", "run", "plugins", "envs", "core"},  # the package's names, `python -m headrace`
    "serve": {"app", "run", "renderers", "net", "core"},
    "posttrain": {"app", "run", "plugins", "renderers", "models", "core"},  # sft, dpo: the run's parts, its own loop
    "agents": {"envs", "renderers", "net", "core"},  # agents as envs: the endpoint, the bridge, the datasets
    "ecosystem": {"agents", "tasks", "envs", "plugins", "renderers", "core"},
    "app": {"run", "plugins", "core"},
    "bench": {"run", "plugins", "envs", "core"},
    "run": {"schedulers", "plugins", "envs", "models", "viewer", "core"},
    "tinker_emulator": {"backends/torch", "models", "tokenizers", "net", "core"},
    "backends/ray": {"plugins", "net", "core"},
    "backends/vllm": {"backends/torch", "tokenizers", "core"},
    "backends/tinker": {"models", "tokenizers", "net", "core"},
    "backends/torch": {"models", "tokenizers", "core"},
    "backends/sim": {"tokenizers", "core"},
    "backends": set(),
    "tasks": {"envs", "plugins", "renderers", "core"},
    "envs": {"plugins", "renderers", "core"},
    "schedulers": {"core"},
    "plugins": {"core"},
    "renderers": {"models", "core"},
    "models": {"core"},
    "viewer": {"core"},
    "tokenizers": set(),
    "net": {"core"},  # its logs, the wire formats' sampling types
    "core": set(),
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "headrace"
    if parts[1] == "backends" and len(parts) > 2:
        return f"backends/{parts[2]}"
    return parts[1]


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules ``node`` imports: ``from a import b`` imports ``a``, and ``a.b`` too
    where ``b`` is a module."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".")
            base = base if MODULES[module].name == "__init__.py" else base[:-1]
            base = base[: len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module or ""
        names = [prefix, *(f"{prefix}.{alias.name}" for alias in node.names)]
    return [name for name in names if name in MODULES and name != module]


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {module it imports: the line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported(module, node):
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


GRAPH = import_graph()


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def room_graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in GRAPH.items():
        rooms[room(module)] |= {room(t) for t in targets if room(t) != room(module)}
    return dict(rooms)


def stated_order() -> dict[str, set[str]]:
    """ARCHITECTURE.md's arrow block: ``room, room -> room, room  (a note)``, one line each."""
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = re.search(r"```\n((?:[^`\n]+→[^\n]*\n)+)```", text)
    assert block, "ARCHITECTURE.md has no block of 'room → rooms' lines"
    order: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        left, _, right = line.partition("→")
        right = right.split("(")[0]
        targets = {r.strip() for r in right.split(",") if r.strip() and r.strip() != "nothing"}
        for name in (r.strip() for r in left.split(",")):
            order[name] = targets
    return order


def test_the_files_import_each_other_in_no_cycle():
    found = cycles({m: set(t) for m, t in GRAPH.items()})
    assert not found, "import cycles (each a set of files that import one another):\n" + "\n".join(
        f"  {len(c)}: " + ", ".join(c) for c in found
    )


def test_no_file_imports_against_the_room_order():
    unplaced = sorted({room(m) for m in MODULES} - set(ALLOWED))
    assert not unplaced, f"rooms the order does not place (add them to ALLOWED and ARCHITECTURE.md): {unplaced}"
    upward = [
        f"  {MODULES[m].relative_to(ROOT)}:{line} imports {t} ({room(m)} → {room(t)}; {room(m)} may import "
        f"{', '.join(sorted(ALLOWED[room(m)])) or 'nothing'})"
        for m, targets in sorted(GRAPH.items())
        for t, line in sorted(targets.items())
        if room(t) != room(m) and room(t) not in ALLOWED[room(m)]
    ]
    assert not upward, "imports against the room order:\n" + "\n".join(upward)


def test_the_room_order_is_an_order():
    assert not cycles({r: set(targets) for r, targets in ALLOWED.items()})


def test_architecture_md_states_the_order_and_every_arrow_is_taken():
    assert stated_order() == ALLOWED, "ARCHITECTURE.md's arrows and ALLOWED differ"
    taken = room_graph()
    unused = sorted(f"{r} → {t}" for r, targets in ALLOWED.items() for t in targets if t not in taken.get(r, set()))
    assert not unused, f"arrows no import takes (remove them from ALLOWED and ARCHITECTURE.md): {unused}"


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("import headrace.core.types\n", {"headrace.core.types"}),
        ("def f():\n    from headrace.run import config\n", {"headrace.run", "headrace.run.config"}),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from headrace.run.config import RunConfig\n",
         {"headrace.run.config"}),
        ("from ..core.protocols import Backend\n", {"headrace.core.protocols"}),
    ],
)  # fmt: skip
def test_the_reader_sees_lazy_relative_and_type_checking_imports(source, found):
    seen = {t for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for t in imported("headrace.schedulers.base", node)}  # fmt: skip
    assert seen == found
