"""No import runs back up, and no import goes round in a circle.

1. Rooms: every `import k3.<room>` in k3/ goes to a room at the same level or below (the dependency order
   of the README, written once here in LEVELS).
2. Files: the graph of imports between the files of k3/ has no circle (`a.py -> b.py -> a.py`), inside a
   room as well as between rooms.

Every import counts, wherever it stands: at the top of a module, inside a function, under `if
TYPE_CHECKING:`. A function-local import only delays the circle to the first call (the two files still
need each other to be understood, tested or moved), and a type-only one is a dependency of the reader. A
name a package exports lazily (`from k3.model import K3ForCausalLM`, through its `_EXPORTS`) counts as an
import of the file that defines it.

`python tests/test_import_direction.py` prints the room graph (which room imports which, and from where),
then the file circles, if any.
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
    ("vision",),
    ("config",),
    ("layout",),
    ("checkpoint",),
    ("model", "census"),
    ("tokenizer", "chat", "engine"),
    ("train", "atlas", "stream", "dist", "sandbox", "export"),
    ("tasks",),
    ("rl",),
    ("distill",),
    ("conform",),
    ("cli", "__main__"),
)
# Base utilities every room may use; they import no room themselves.
BASE = ("errors", "terminal", "listen", "lazy", "__init__")
LEVEL = {room: level for level, rooms in enumerate(LEVELS) for room in rooms}


def room_of(path: Path) -> str:
    """`k3/model/mla.py` -> "model", `k3/config.py` -> "config"."""
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Every absolute module name an import statement anywhere in the file names, with its line number
    (`from k3 import config` counts as `k3` and `k3.config`; relative imports are resolved against the
    file)."""
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


def cycles(graph: dict[str, dict[str, list[str]]] | dict[str, set[str]]) -> list[list[str]]:
    """Import cycles of a graph {node: targets} (rooms or files), each found once, as the path that closes
    it: a depth-first walk reports every edge back to a node still open."""
    found, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph.get(node, {})):
            if state.get(target) == "open":
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def _module_files() -> dict[str, Path]:
    """{"k3.rl.trainer": k3/rl/trainer.py, "k3.rl": k3/rl/__init__.py, ...}"""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["k3", *path.relative_to(PACKAGE).with_suffix("").parts]
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _lazy_exports(init: Path) -> dict[str, str]:
    """A package's `_EXPORTS = {"Name": "k3.pkg.module", ...}` (k3.lazy), or {}."""
    for node in ast.parse(init.read_text()).body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Dict) and any(getattr(t, "id", "") == "_EXPORTS" for t in targets):
            return {k.value: v.value for k, v in zip(value.keys, value.values, strict=True)}
    return {}


def file_graph() -> dict[str, set[str]]:
    """{"k3/a.py": {"k3/b.py", ...}}: which file of k3/ each file imports (itself left out). `import k3.x.y`
    and `from k3.x import y` go to the file of the longest module name that is one: y's file when y is a
    module, else k3/x/__init__.py, or the module a lazy export of k3.x names."""
    files = _module_files()
    lazy = {name: _lazy_exports(path) for name, path in files.items() if path.name == "__init__.py"}

    def target(module: str) -> str | None:
        parts = module.split(".")
        for n in range(len(parts), 0, -1):
            name = ".".join(parts[:n])
            if name in files:
                if n < len(parts) and parts[n] in lazy.get(name, {}):
                    return lazy[name][parts[n]]
                return name
        return None

    graph: dict[str, set[str]] = {}
    for path in sorted(files.values()):
        here = f"k3/{path.relative_to(PACKAGE)}"
        graph[here] = set()
        for module, _ in imported_modules(path):
            found = target(module) if module.split(".")[0] == "k3" else None
            if found is not None and files[found] != path:
                graph[here].add(f"k3/{files[found].relative_to(PACKAGE)}")
    return graph


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


def test_no_cycles_between_files():
    loops = cycles(file_graph())
    assert not loops, "import cycles between files:\n" + "\n".join(" -> ".join(c) for c in loops)


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


def test_the_file_check_sees_circles_inside_a_room(tmp_path, monkeypatch):
    """Planted: a circle of three files in one room through a function-local, a type-only and a relative
    import, and one through a lazy package export; a plain chain and a package's own export are no circle."""
    fake = tmp_path / "k3"
    (fake / "rl").mkdir(parents=True)
    (fake / "model").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "rl" / "__init__.py").write_text('"""A room."""\n')
    (fake / "rl" / "ptx.py").write_text("def f():\n    from k3.rl.sft import batch\n")
    (fake / "rl" / "sft.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import trainer\n"
    )
    (fake / "rl" / "trainer.py").write_text("from k3.rl import ptx\nimport k3.rl.config\n")
    (fake / "rl" / "config.py").write_text("import numpy\n")
    exports = '_EXPORTS = {"Model": "k3.model.model", "load": "k3.model.loading"}\n'
    (fake / "model" / "__init__.py").write_text(exports)
    (fake / "model" / "model.py").write_text("def f():\n    from k3.model import load\n")
    (fake / "model" / "loading.py").write_text("from k3.model import Model\n")
    (fake / "model" / "init.py").write_text("from k3.model import loading\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", fake)
    graph = file_graph()
    assert graph["k3/rl/trainer.py"] == {"k3/rl/__init__.py", "k3/rl/ptx.py", "k3/rl/config.py"}
    assert graph["k3/model/__init__.py"] == set()
    assert cycles(graph) == [
        ["k3/model/loading.py", "k3/model/model.py", "k3/model/loading.py"],
        ["k3/rl/ptx.py", "k3/rl/sft.py", "k3/rl/trainer.py", "k3/rl/ptx.py"],
    ]


if __name__ == "__main__":
    for room, targets in room_graph().items():
        print(f"{room} -> {', '.join(sorted(targets))}")
        for target, places in sorted(targets.items()):
            print(f"    {target}: {', '.join(places)}")
    loops = cycles(file_graph())
    print(f"\nimport circles between the {len(file_graph())} files of k3/: {len(loops) or 'none'}")
    for loop in loops:
        print("    " + " -> ".join(loop))
