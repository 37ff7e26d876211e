"""keep_freed_memory(): large blocks come from the heap (reused after free) instead of fresh mmap()s."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# In a child process (the setting is process-wide): where glibc places a 64 MiB malloc() before and
# after keep_freed_memory(): above the heap's end (its own mmap) or inside the heap.
PROBE = """
import ctypes, ctypes.util, json
from k3.train.allocator import keep_freed_memory

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]

def in_heap(size=64 * 2**20):
    block = libc.malloc(size)
    inside = block < libc.sbrk(0)
    libc.free(block)
    return inside

before = in_heap()
kept = keep_freed_memory()
print(json.dumps({"before": before, "kept": kept, "after": in_heap()}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt() settings are glibc's")
def test_large_blocks_come_from_the_heap_after_keep_freed_memory():
    result = json.loads(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, check=True).stdout)
    assert result == {"before": False, "kept": True, "after": True}
