"""Compile every native extension into the user cache now: ``python -m k3.ops.build`` (``make native``).

k3 compiles each extension on first use anyway (see :mod:`k3.ops.extension`); this only does it ahead of
time, all at once (one process each), and says for each whether it is in use.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor

from k3.ops.decode.native import DECODE_EXTENSION
from k3.ops.extension import NativeExtension, native_status
from k3.ops.kda.native import KDA_EXTENSION
from k3.ops.mxfp4.native import MXFP4_EXTENSION

EXTENSIONS = (MXFP4_EXTENSION, KDA_EXTENSION, DECODE_EXTENSION)


def warm(extension: NativeExtension) -> str:
    """Find or build one extension; a line saying where it is or why it is not in use."""
    status = native_status(extension)
    return f"{extension.name}: {'native, ' + str(status.path) if status.in_use else status.reason}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    with ProcessPoolExecutor(max_workers=len(EXTENSIONS)) as pool:
        lines = list(pool.map(warm, EXTENSIONS))
    print("\n".join(lines))
    if any(": native, " not in line for line in lines):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
