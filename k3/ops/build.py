"""Build the optional native CPU kernels of every op family: ``python -m k3.ops.build``.

Compiles each :class:`~k3.ops.extension.NativeExtension` in place (``k3/ops/<op>/_native.<abi>.so``,
git-ignored; intermediate objects in ``build/native/<op>``), one process per extension so that they
compile side by side. Without them k3 runs its pure-torch paths.
"""

from __future__ import annotations

import argparse
import contextlib
from concurrent.futures import ProcessPoolExecutor

from k3.ops.extension import REPO_ROOT, NativeExtension
from k3.ops.kda.native import KDA_EXTENSION
from k3.ops.mxfp4.native import MXFP4_EXTENSION

EXTENSIONS = (MXFP4_EXTENSION, KDA_EXTENSION)


def build_one(extension: NativeExtension, verbose: bool = False) -> None:
    """Compile one extension into the source tree; raises if it did not appear."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension

    build_temp = REPO_ROOT / "build" / "native" / extension.source.parent.name
    build_temp.mkdir(parents=True, exist_ok=True)
    # run from the temp folder so that setuptools does not read the project's pyproject.toml
    with contextlib.chdir(build_temp):
        setup(
            name=f"k3-native-{extension.source.parent.name}",
            ext_modules=[extension.setup_extension()],
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
    if not list(extension.source.parent.glob("_native*.so")):
        raise RuntimeError(f"build finished but {extension.name} did not appear in {extension.source.parent}")


def build(extensions: tuple[NativeExtension, ...] = EXTENSIONS, verbose: bool = False) -> None:
    """Compile the extensions, each in its own process."""
    with ProcessPoolExecutor(max_workers=len(extensions)) as pool:
        for done in [pool.submit(build_one, ext, verbose) for ext in extensions]:
            done.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show compiler command lines")
    args = parser.parse_args()
    build(verbose=args.verbose)
    for ext in EXTENSIONS:
        print(f"built {ext.name} ({'usable' if ext.load() is not None else 'NOT usable on this CPU'})")


if __name__ == "__main__":
    main()
