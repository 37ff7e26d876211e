"""No code of the project unpickles: loading a pickle can run whatever it holds, so tensors travel as
safetensors, the rest as JSON (the brief's rule; k3.checkpoint refuses pickle checkpoints at run time).

Reads every tracked Python file of k3/, benchmarks/ and tests/ as a syntax tree and fails on each call
that can unpickle: `torch.load` (whose `weights_only` still unpickles a restricted set), `pickle`'s,
`dill`'s, `joblib`'s and `cloudpickle`'s loads, `numpy.load` with `allow_pickle` set and
`pandas.read_pickle`.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

UNPICKLING_MODULES = {"pickle", "cPickle", "dill", "joblib", "cloudpickle", "_pickle"}
UNPICKLING_NAMES = {"load", "loads", "Unpickler"}


def dotted(node: ast.AST) -> str:
    """`a.b.c` for an attribute chain on a name, "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def unpickling_calls(source: str, filename: str) -> list[str]:
    """Each call in `source` that can unpickle, as "file:line: call"."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        module, _, last = name.rpartition(".")
        keywords = {k.arg for k in node.keywords}
        if (
            name == "torch.load"
            or (module in UNPICKLING_MODULES and last in UNPICKLING_NAMES)
            or (name in {"np.load", "numpy.load"} and "allow_pickle" in keywords)
            or name.endswith("read_pickle")
        ):
            found.append(f"{filename}:{node.lineno}: {name}(...)")
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module in UNPICKLING_MODULES | {"torch"}:
            for alias in node.names:
                if alias.name in UNPICKLING_NAMES and (node.module != "torch" or alias.name == "load"):
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def tracked_python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "k3", "benchmarks", "tests"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if name.endswith(".py")]


def test_the_scan_sees_every_way_of_unpickling():
    planted = "\n".join(
        [
            "import torch, pickle, numpy as np",
            "from pickle import loads",
            "a = torch.load('x.pt')",
            "b = torch.load('x.pt', weights_only=True)",
            "c = pickle.loads(b'')",
            "d = np.load('x.npy', allow_pickle=True)",
            "e = df.read_pickle('x')",
            "f = torch.save(a, 'x.pt')",  # writing is not reading
            "g = np.load('x.npy')",  # numpy refuses pickles by default
            "h = json.loads('{}')",
        ]
    )
    found = unpickling_calls(planted, "planted.py")
    assert [line.split(": ", 1)[0] for line in found] == [
        "planted.py:3",
        "planted.py:4",
        "planted.py:5",
        "planted.py:6",
        "planted.py:7",
        "planted.py:2",
    ]


def test_no_tracked_python_file_unpickles():
    files = tracked_python_files()
    assert len(files) > 300 and ROOT / "benchmarks" / "vision.py" in files
    found = [hit for path in files for hit in unpickling_calls(path.read_text(), str(path.relative_to(ROOT)))]
    advice = "these can unpickle (use safetensors for tensors, JSON for the rest):"
    assert not found, "\n".join([advice, *found])
