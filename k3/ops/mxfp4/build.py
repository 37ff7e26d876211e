"""Build the optional native MXFP4 kernels: ``python -m k3.ops.mxfp4.build``.

Compiles ``_native.cpp`` offline with the machine's C++ compiler (through torch's cpp_extension and
setuptools) into ``k3/ops/mxfp4/_native.<abi>.so`` (git-ignored); intermediate objects go to ``build/``.
Without it, :func:`k3.ops.mxfp4.mxfp4_matmul` uses the pure-torch path.

The digest of the source is compiled into the module, so a build left over from an older ``_native.cpp``
is detected and ignored (see :mod:`k3.ops.mxfp4.native`).
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from k3.ops.mxfp4.native import SOURCE, source_hash

PACKAGE_DIR = SOURCE.parent
REPO_ROOT = PACKAGE_DIR.parents[2]  # k3/ops/mxfp4 -> the folder holding k3/


def build(verbose: bool = False) -> Path:
    """Compile the extension in place and return the path of the built shared library."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension = CppExtension(
        name="k3.ops.mxfp4._native",
        sources=[str(SOURCE)],
        # AVX2/FMA are enabled per function in the source, so the module loads on any x86-64 CPU.
        extra_compile_args=["-O3", "-fopenmp", f"-DK3_MXFP4_SOURCE_HASH={source_hash()}"],
        extra_link_args=["-fopenmp"],  # resolves to the libgomp torch already loaded
    )
    build_temp = REPO_ROOT / "build" / "mxfp4"
    build_temp.mkdir(parents=True, exist_ok=True)
    # run from the temp folder so that setuptools does not read the project's pyproject.toml
    with contextlib.chdir(build_temp):
        setup(
            name="k3-mxfp4-native",
            ext_modules=[extension],
            cmdclass={"build_ext": BuildExtension},
            script_args=[
                "--verbose" if verbose else "--quiet",
                "build_ext",
                "--build-lib",
                str(REPO_ROOT),
                "--build-temp",
                str(build_temp),
            ],
        )
    built = sorted(PACKAGE_DIR.glob("_native*.so"), key=lambda p: p.stat().st_mtime)
    if not built:
        raise RuntimeError(f"build finished but no _native*.so appeared in {PACKAGE_DIR}")
    return built[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show compiler command lines")
    args = parser.parse_args()
    print(f"built {build(verbose=args.verbose)}")


if __name__ == "__main__":
    main()
