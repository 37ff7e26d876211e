"""Process memory: what the progress line shows, and an allocator setting that keeps RSS honest.

glibc's malloc serves large blocks with mmap only above a threshold that it raises each time such a block is
freed (up to 32 MB), after which freed stage buffers stay in the heap: RSS then holds several stages that
are long gone. `return_freed_memory()` pins the threshold at 64 kB, so every stage buffer is its own mapping
and goes back to the kernel when freed. A process-wide allocator setting, and a costly one (every
activation above 64 kB is then a fresh mapping, faulted in page by page: a 256-token pass of `k3-slice`
took 103 s pinned, 69 s not): `k3 stream` calls it for URLs only, whose stages arrive in buffers of its
own; a local checkpoint's stages are used in place from its memory map.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
_THRESHOLD = 64 * 1024


def return_freed_memory() -> bool:
    """Pin glibc's mmap threshold (see above); False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """Resident set size of this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
