"""No import runs back up: every `import k3.<room>` in k3/, at the top of a module or inside a function,
goes to a room at the same level or below (the dependency order of the README).

`python tests/test_import_direction.py` prints the room graph (which room imports which, and from where).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "k3"

# The dependency order, lowest first: a room may import rooms of its own level and below, never above.
# Rooms that other issues are about to add are listed already, so that they land in the right place.
LEVELS: tuple[tuple[str, ...], ...] = (
    ("ops",),
    ("config",),
    ("layout",),
    ("checkpoint",),
    ("model", "census"),
    ("tokenizer", "chat", "engine"),
    ("train", "atlas", "stream", "dist", "sandbox", "rl", "export"),
    ("cli", "__main__"),
)
# Base utilities every room may use; they import no room themselves.
BASE = ("errors", "terminal", "lazy", "__init__")
LEVEL = {room: level for level, rooms in enumerate(LEVELS) for room in rooms}


def room_of(path: Path) -> str:
    """`k3/model/mla.py` -> "model", `k3/config.py` -> "config"."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Every absolute module name an import statement anywhere in the file names, with its line number
    (`from k3 import config` counts as `k3.config`; relative imports are resolved against the file)."""
    package = ["k3", *path.relative_to(PACKAGE).parts[:-1]]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join([*base_parts, *([node.module] if node.module else [])])
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def room_graph() -> dict[str, dict[str, list[str]]]:
    """{room: {imported room: ["k3/<file>:<line>", ...]}} over every file of k3/ (a room's own left out)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(PACKAGE.rglob("*.py")):
        room = room_of(path)
        for module, line in imported_modules(path):
            parts = module.split(".")
            if parts[0] != "k3" or len(parts) < 2 or parts[1] == room:
                continue
            where = f"k3/{path.relative_to(PACKAGE)}:{line}"
            if where not in graph[room][parts[1]]:
                graph[room][parts[1]].append(where)
    return {room: dict(targets) for room, targets in sorted(graph.items())}


def describe(graph: dict[str, dict[str, list[str]]]) -> str:
    return "\n".join(f"{room} -> {', '.join(sorted(targets))}" for room, targets in graph.items())


def upward_imports(graph: dict[str, dict[str, list[str]]]) -> list[str]:
    """One line per import that the order forbids."""
    bad = []
    for room, targets in graph.items():
        for target, places in sorted(targets.items()):
            if target in BASE:
                continue
            if room in BASE:
                bad.append(f"base utility k3.{room} imports the room k3.{target} ({', '.join(places)})")
            elif LEVEL[target] > LEVEL[room]:
                bad.append(
                    f"k3.{room} (level {LEVEL[room]}) imports k3.{target} (level {LEVEL[target]}) "
                    f"at {', '.join(places)}"
                )
    return bad


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Import cycles between rooms (each found once, as the path that closes it)."""
    found, state = [], {}

    def visit(room: str, path: list[str]) -> None:
        state[room] = "open"
        for target in sorted(graph.get(room, {})):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[room] = "done"

    for room in graph:
        if room not in state:
            visit(room, [room])
    return found


def test_every_room_has_a_level():
    rooms = {room_of(p) for p in PACKAGE.rglob("*.py")}
    unknown = sorted(rooms - set(LEVEL) - set(BASE))
    assert not unknown, f"rooms without a level in LEVELS (add each where it belongs): {unknown}"


def test_no_import_runs_back_up():
    graph = room_graph()
    print("\n" + describe(graph))
    bad = upward_imports(graph)
    assert not bad, "imports against the dependency order:\n" + "\n".join(bad)


def test_no_cycles_between_rooms():
    graph = room_graph()
    loops = cycles(graph)
    assert not loops, "import cycles between rooms: " + "; ".join(" -> ".join(c) for c in loops)


def test_the_checks_see_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The walk must catch an upward import hidden inside a function and a relative one."""
    fake = tmp_path / "k3"
    (fake / "checkpoint").mkdir(parents=True)
    (fake / "census.py").write_text("from k3.checkpoint import reader\n")
    (fake / "checkpoint" / "commands.py").write_text("def f():\n    from k3.census import census_of\n")
    (fake / "checkpoint" / "relative.py").write_text("from ..model import loading\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    graph = room_graph()
    assert graph["checkpoint"] == {
        "census": ["k3/checkpoint/commands.py:2"],
        "model": ["k3/checkpoint/relative.py:1"],
    }
    assert len(upward_imports(graph)) == 2
    assert cycles(graph) == [["census", "checkpoint", "census"]]


if __name__ == "__main__":
    for room, targets in room_graph().items():
        print(f"{room} -> {', '.join(sorted(targets))}")
        for target, places in sorted(targets.items()):
            print(f"    {target}: {', '.join(places)}")
