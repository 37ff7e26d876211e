"""Every third-party package k3 imports is declared in pyproject.toml: k3/ in [project].dependencies, the
tests and benchmarks in those or the dev extra. Nothing may arrive only as someone else's dependency."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# helper modules of the test folders, imported by their basename
LOCAL = {p.stem for p in (ROOT / "tests").rglob("*.py")} | {
    p.stem for p in (ROOT / "benchmarks").glob("*.py")
}


# Tools installed by hand for one benchmark, never in CI (so possibly absent here): module -> (extra, name)
OPTIONAL_TOOLS = {"llama_cpp": ("llamacpp", "llama-cpp-python")}  # benchmarks/llamacpp.py
# Test-only oracles the Makefile installs with --no-deps (their own requirements would pull a CUDA stack):
# module -> the exact pip argument the Makefile must carry
NO_DEPS_ORACLES = {"nemo_automodel": "--no-deps nemo-automodel==0.7.0"}
MAKEFILE = (ROOT / "Makefile").read_text()


def declared(requirements: list[str]) -> set[str]:
    """Normalised distribution names of requirement strings (`torch==2.13.0` -> `torch`)."""
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def imported_top_level(folder: str) -> set[str]:
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "k3" and n not in LOCAL}


@cache
def installed() -> dict[str, list[str]]:
    return packages_distributions()  # {top-level module: [distributions providing it]}


def distributions_of(module: str) -> set[str]:
    return {d.lower().replace("_", "-") for d in installed().get(module, [])}


def optional_tool_declared(module: str) -> bool:
    extra, name = OPTIONAL_TOOLS.get(module, ("", ""))
    return bool(extra) and name in declared(PROJECT["optional-dependencies"].get(extra, []))


def no_deps_oracle_installed_by_make(module: str) -> bool:
    return module in NO_DEPS_ORACLES and NO_DEPS_ORACLES[module] in MAKEFILE


@pytest.mark.parametrize(
    "folder, allowed",
    [
        ("k3", declared(PROJECT["dependencies"])),
        ("tests", declared(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"])),
        ("benchmarks", declared(PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"])),
    ],
)
def test_every_import_is_declared(folder, allowed):
    missing = {
        m: sorted(distributions_of(m))
        for m in imported_top_level(folder)
        if not distributions_of(m) & allowed
        and not optional_tool_declared(m)
        and not (folder != "k3" and no_deps_oracle_installed_by_make(m))
    }
    assert not missing, f"{folder}/ imports packages pyproject.toml does not declare: {missing}"


def test_the_check_sees_what_k3_imports():
    """Planted: modules k3 is known to import, under names that differ from their distribution's."""
    assert {"torch", "PIL", "regex", "pydantic", "yaml"} - imported_top_level("k3") == {"yaml"}
    assert distributions_of("PIL") == {"pillow"}
