"""The import contract of docs/architecture.md, checked on the source: which part of the package may import which,
no import cycles, and no private name taken from another module."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_swarm"

# The rooms of the package, from the top down: a room may import the rooms below it, never one above or beside it.
# Rooms on one line are independent of each other.
PACKAGE_LAYERS = [
    ["lightning_swarm", "lightning_swarm.cli"],
    ["lightning_swarm.strategy"],
    ["lightning_swarm.swarm", "lightning_swarm.layers"],
    ["lightning_swarm.torch_archive", "lightning_swarm.children"],
]
ENGINE = "lightning_swarm.swarm"
ENGINE_LAYERS = [
    ["peer"],
    ["client", "server"],
    ["training"],
    ["dht"],
    ["settings"],
    ["wire"],
]
# The engine's foundation: modules every room may use; they import each other (no cycles) and nothing above them.
ENGINE_BASE = ["allocator", "boundary", "footprint", "lifetime", "logs", "loop", "states", "throughput"]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> Iterator[tuple[str, list[str], int]]:
    """``(imported module, imported names, line)`` of every project import of module ``name``, lazy ones too."""
    path = MODULES[name]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, (
                f"{path}:{node.lineno}: a relative import (the contract reads absolute ones)"
            )
            if node.module and node.module.split(".")[0] == "lightning_swarm":
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    yield (
                        (sub, [], node.lineno) if sub in MODULES else (node.module, [alias.name], node.lineno)
                    )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightning_swarm":
                    yield alias.name, [], node.lineno


def _room(name: str) -> tuple[str, int, int] | None:
    """``(room, level, layer)`` of a module: level 0 is the package's rooms, level 1 the engine's."""
    if name == ENGINE or name.startswith(ENGINE + "."):
        part = name[len(ENGINE) + 1 :].split(".")[0] if name != ENGINE else ""
        if part == "":
            return (ENGINE, 0, _layer(PACKAGE_LAYERS, ENGINE))
        if part in ENGINE_BASE:
            return ("base", 1, len(ENGINE_LAYERS))
        return (part, 1, _layer(ENGINE_LAYERS, part))
    for layer, rooms in enumerate(PACKAGE_LAYERS):
        for room in sorted(rooms, key=len, reverse=True):
            if name == room or (room != "lightning_swarm" and name.startswith(room + ".")):
                return (room, 0, layer)
    return None


def _layer(layers: list[list[str]], room: str) -> int:
    for i, rooms in enumerate(layers):
        if room in rooms:
            return i
    raise AssertionError(f"{room} is in no layer of the contract: add it to tests/test_architecture.py")


def test_every_module_is_in_a_room_of_the_contract() -> None:
    for name in MODULES:
        assert _room(name) is not None, name


def test_rooms_import_only_the_rooms_below_them() -> None:
    violations = []
    for name in MODULES:
        mine = _room(name)
        assert mine is not None
        for target, _, line in _imports(name):
            theirs = _room(target)
            assert theirs is not None, f"{name} imports {target}, which is in no room"
            if mine[0] == theirs[0] or (mine[1] != theirs[1] and (mine[1] == 1) == (theirs[1] == 0)):
                # same room; or between a part of the engine and the engine's package (the engine's face)
                if mine[1] != theirs[1] and mine[1] == 1 and target == ENGINE:
                    violations.append(f"{MODULES[name]}:{line}: {name} imports the engine's face {target}")
                continue
            if mine[1] == 0 and theirs[1] == 1:  # from outside the engine into one of its rooms
                continue
            if theirs[2] <= mine[2]:
                violations.append(
                    f"{MODULES[name]}:{line}: {name} ({mine[0]}) imports {target} ({theirs[0]})"
                )
    assert not violations, "imports against the contract of docs/architecture.md:\n" + "\n".join(violations)


def test_no_module_imports_a_private_name_of_another() -> None:
    found = []
    for name in MODULES:
        for target, names, line in _imports(name):
            found += [
                f"{MODULES[name]}:{line}: {target}.{n}" for n in names if n.startswith("_") and target != name
            ]
    assert not found, "a name used by another module is public:\n" + "\n".join(found)


def test_there_are_no_import_cycles() -> None:
    graph = {name: {t for t, _, _ in _imports(name) if t in MODULES and t != name} for name in MODULES}
    order, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        order[v] = low[v] = len(order)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in order:
            visit(v)
    assert not cycles, f"modules that import each other in a circle: {cycles}"


def test_the_engine_has_few_modules_at_its_top_level() -> None:
    top = [p.stem for p in (PACKAGE / "swarm").glob("*.py") if p.stem != "__init__"]
    assert sorted(top) == sorted(ENGINE_BASE + ["settings"]), (
        "the engine's top level holds only its foundation"
    )
    assert len(top) <= 12
