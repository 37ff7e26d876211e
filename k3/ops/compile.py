"""Compile one C++ source into a torch extension module in a folder (setuptools + torch's cpp_extension).

Run as a child process by :meth:`k3.ops.extension.NativeExtension.compile_into`, which captures its output
into build.log; not meant to be called by hand (``python -m k3.ops.build`` builds every extension).

    python k3/ops/compile.py --name k3.ops.kda._native --source k3/ops/kda/_native.cpp \\
        --include k3/ops --out DIR --define K3_NATIVE_SOURCE_HASH=... --cflag=-O3 --ldflag=-fopenmp
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the module's dotted name")
    parser.add_argument("--source", required=True, type=Path)
    parser.add_argument("--include", action="append", default=[], help="an include folder")
    parser.add_argument("--out", required=True, type=Path, help="the folder the module is written to")
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE")
    parser.add_argument("--cflag", action="append", default=[])
    parser.add_argument("--ldflag", action="append", default=[])
    args = parser.parse_args()

    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension = CppExtension(
        name=args.name.rsplit(".", 1)[-1],  # built flat into --out, imported by path under its full name
        sources=[str(args.source)],
        include_dirs=args.include,
        extra_compile_args=[*args.cflag, *(f"-D{d}" for d in args.define)],
        extra_link_args=args.ldflag,
    )
    temp = args.out / "objects"
    temp.mkdir(parents=True, exist_ok=True)
    # run from the output folder so that setuptools reads no project's pyproject.toml or setup.cfg
    with contextlib.chdir(args.out):
        setup(
            name=f"k3-native-{args.source.parent.name}",
            ext_modules=[extension],
            cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
            script_args=["--quiet", "build_ext", "--build-lib", str(args.out), "--build-temp", str(temp)],
        )


if __name__ == "__main__":
    main()
