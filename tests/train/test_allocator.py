"""keep_freed_memory(): large blocks come from the heap (reused after free) instead of fresh mmap()s."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# Each probe runs in a child process (the setting is process-wide), glibc's malloc, free and sbrk at hand.
LIBC = """
import ctypes, ctypes.util, json
from k3.train.allocator import keep_freed_memory

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
"""

# Where glibc places a 64 MiB malloc() before and after keep_freed_memory(): above the heap's end (its own
# mmap) or inside the heap.
HEAP_PROBE = """
def in_heap(size=64 * 2**20):
    block = libc.malloc(size)
    inside = block < libc.sbrk(0)
    libc.free(block)
    return inside

before = in_heap()
kept = keep_freed_memory()
print(json.dumps({"before": before, "kept": kept, "after": in_heap()}))
"""

# A freed block larger than 2 GiB at the heap's top: glibc gives the top back (sbrk shrinks) unless trimming
# is off. mallopt's M_TRIM_THRESHOLD is an int, so the largest threshold it takes (2^31 - 1) still trims here:
# only -1 turns trimming off. The block is never touched, so it costs address space, not memory.
TRIM_PROBE = """
kept = keep_freed_memory()
block = libc.malloc(3 * 2**30)
end_with_block = libc.sbrk(0)
libc.free(block)
end_kept = libc.sbrk(0) == end_with_block
print(json.dumps({"kept": kept, "in_heap": block < end_with_block, "end_kept": end_kept}))
"""


def probe(code: str) -> dict:
    """What a probe prints, run after LIBC in a fresh Python."""
    done = subprocess.run([sys.executable, "-c", LIBC + code], capture_output=True, check=True)
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt() settings are glibc's")
def test_large_blocks_come_from_the_heap_after_keep_freed_memory():
    assert probe(HEAP_PROBE) == {"before": False, "kept": True, "after": True}


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt() settings are glibc's")
def test_a_freed_block_above_2_gib_stays_in_the_heap():
    assert probe(TRIM_PROBE) == {"kept": True, "in_heap": True, "end_kept": True}
