"""AVX-512 instructions only in the AVX-512 kernels: what an AVX2-only CPU runs must not contain any.

Every native kernel that has a 16-lane variant picks it at run time (`variant` / `wide`), so the code on the
way to it, the dispatchers and every AVX2 kernel, runs on AVX2-only CPUs too. A function compiled with an
AVX-512 target may use EVEX-encoded instructions anywhere in it (a zmm register, xmm16-31, a mask), which
fault there. This test disassembles the three built extensions and lists the functions that use any: each
must be one of the AVX-512 kernels named below, which only a `wide` branch calls.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from k3.ops.decode.native import load_native as load_decode
from k3.ops.kda.native import load_native as load_kda
from k3.ops.mxfp4.native import load_native as load_mxfp4

# The AVX-512 kernels, by name: the 16-lane KDA products and transpose, the decode step's pair tiles and MLA
# block, the MXFP4 GEMVs of _native_rows512.h (two weight rows per register, and their pair step), the
# bf16-compute MXFP4 rows (avx512_bf16), the int8 rows' VNNI kernel (a group of 16 blocks a register) and the
# paired BF16 rows (bf16 products, reached only from a matrix paired where the CPU has avx512_bf16), each by
# name: their namespaces also hold code every CPU runs.
AVX512_KERNELS = re.compile(
    r"wide_block|run_wide|wide_dot_block|transpose_wide|tile_pairs|dense_rows_pairs|tiled_block|weighted_block32"
    r"|mxfp4_rows512::(gemv_rows_pairs|gemv_row_twice|two_rows_pair)\b|mxfp4_bf16::gemv_rows\b"
    r"|mxfp4_int8::(vnni_rows|group_codes|sixteen_half_scales)\b"
    r"|decode_paired::(paired_rows|blocks_times_vectors|round_vectors)\b"
)
EVEX = re.compile(r"zmm|[xy]mm(1[6-9]|2\d|3[01])\b|\{%?k[1-7]\}")
FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def functions_using_evex(library: str) -> set[str]:
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True, check=True
    ).stdout
    found, current = set(), None
    for line in listing.splitlines():
        start = FUNCTION.match(line)
        if start:
            current = start.group(1)
        elif current is not None and EVEX.search(line):
            found.add(current)
    return found


@pytest.mark.parametrize("load", [load_kda, load_decode, load_mxfp4], ids=["kda", "decode", "mxfp4"])
def test_only_the_avx512_kernels_hold_avx512_instructions(load):
    assert shutil.which("objdump"), "objdump (binutils, installed with the compiler) is needed"
    module = load()
    assert module is not None, "native kernels not built: python -m k3.ops.build"
    using = functions_using_evex(module.__file__)
    assert using, "no AVX-512 code found at all: the disassembly was not read"
    strays = sorted(f for f in using if not AVX512_KERNELS.search(f))
    assert not strays, f"AVX-512 instructions outside the AVX-512 kernels: {strays}"
