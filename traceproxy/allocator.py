"""Keep glibc's allocator from returning body buffers to the kernel after every read.

Why
---
Each socket read hands the proxy a new ``bytes`` of up to 256 KiB (uvloop's read
buffer), which lives until it is written on and is then freed. glibc's default
allocator adapts its thresholds to such sizes: it serves them from the heap, and
as soon as the free space at the top of the heap exceeds twice the largest
buffer it gives that space back to the kernel (``brk``). With a few uploads in
flight that happens after nearly every request, and the next read pays for it
again: a ``brk`` and a page fault plus zeroing per 4 KiB page. Measured on a
1 MiB upload benchmark with 16 connections: three or more ``brk`` calls per
request, and about 25 % of upload throughput. Small requests are unaffected.

What
----
Fixed thresholds, set once per worker process before it serves:

* buffers below ``MMAP_THRESHOLD`` come from the heap (never a fresh mapping);
* free heap space is returned to the kernel only beyond ``TRIM_THRESHOLD``.

The cost is at most ``TRIM_THRESHOLD`` of freed memory kept resident after a burst.
An operator who set glibc's own knobs (``MALLOC_*_`` variables or
``GLIBC_TUNABLES``) keeps them: this module then changes nothing. Other C
libraries (musl, macOS) are left alone as well.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 20  # 1 MiB: above any single read, well below a large body
TRIM_THRESHOLD = 16 << 20  # 16 MiB of freed heap may stay resident

OPERATOR_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def tune_allocator(environ: Mapping[str, str] = os.environ) -> str:
    """Set the thresholds above; return what was done, in words for the log."""
    chosen = [name for name in OPERATOR_KNOBS if name in environ]
    if chosen:
        return f"allocator left as configured by {', '.join(chosen)}"
    if platform.libc_ver()[0] != "glibc":
        return "allocator left alone (not glibc)"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        return "allocator left alone (mallopt refused)"
    return f"allocator: heap buffers up to {MMAP_THRESHOLD >> 20} MiB, trim beyond {TRIM_THRESHOLD >> 20} MiB"
