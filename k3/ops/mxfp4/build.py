"""Build the optional native MXFP4 kernels: ``python -m k3.ops.mxfp4.build``.

Compiles ``_native.cpp`` offline with the machine's C++ compiler (through torch's cpp_extension and
setuptools) into ``k3/ops/mxfp4/_native.<abi>.so`` (git-ignored); intermediate objects go to ``build/``.
Without it, :func:`k3.ops.mxfp4.mxfp4_matmul` uses the pure-torch path.

The digest of the source is compiled into the module, so a build left over from an older ``_native.cpp``
is detected and ignored (see :mod:`k3.ops.mxfp4.native`).
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE = PACKAGE_DIR / "_native.cpp"
REPO_ROOT = PACKAGE_DIR.parents[2]  # k3/ops/mxfp4 -> repository root (the folder holding k3/)


def source_hash() -> str:
    """First 16 hex digits of the SHA-256 of ``_native.cpp``."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


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
    setup(
        name="k3-mxfp4-native",
        ext_modules=[extension],
        cmdclass={"build_ext": BuildExtension},
        script_args=[
            "--quiet" if not verbose else "--verbose",
            "build_ext",
            "--build-lib",
            str(REPO_ROOT),
            "--build-temp",
            str(REPO_ROOT / "build" / "mxfp4"),
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
