"""Keep glibc's allocator from returning body buffers to the kernel after every read.

Why
---
Each socket read hands the proxy a new ``bytes`` of up to 256,000 bytes (uvloop's read
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

The cost: up to ``TRIM_THRESHOLD`` of free space at the heap's top stays resident
while work goes on, beside the free pages inside the heap that glibc never returns on
its own. ``IdleHeapTrim`` gives both back (``malloc_trim``) once a process has gone
quiet after work, a second with nothing in flight and nothing new done, when at least
1 MiB of the heap is free. The trim never runs while a request is in flight, so it
cannot cost one; the next burst pays the page faults once. An operator who set glibc's own knobs (``MALLOC_*_`` variables or
``GLIBC_TUNABLES``) keeps them: this module then changes nothing. Other C libraries
(musl, macOS) are left alone as well.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable, Mapping

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 1 << 20  # 1 MiB: above any single read, well below a large body
TRIM_THRESHOLD = 16 << 20  # 16 MiB of freed heap may stay resident

OPERATOR_KNOBS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def _glibc(environ: Mapping[str, str]) -> "tuple[ctypes.CDLL | None, str]":
    """The C library when it is glibc and the operator left its knobs alone; else None
    and why, in words for the log."""
    chosen = [name for name in OPERATOR_KNOBS if name in environ]
    if chosen:
        return None, f"allocator left as configured by {', '.join(chosen)}"
    return _loaded_glibc()


@functools.cache
def _loaded_glibc() -> "tuple[ctypes.CDLL | None, str]":
    """Once per process: libc_ver() reads the interpreter's binary, and the tuning and the
    idle trim both ask."""
    if platform.libc_ver()[0] != "glibc":
        return None, "allocator left alone (not glibc)"
    try:
        return ctypes.CDLL("libc.so.6"), ""
    except OSError:
        return None, "allocator left alone (no libc.so.6)"


def tune_allocator(environ: Mapping[str, str] = os.environ) -> str:
    """Set the thresholds above; return what was done, in words for the log."""
    libc, why_not = _glibc(environ)
    if libc is None:
        return why_not
    try:
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except AttributeError:
        ok = False
    if not ok:
        return "allocator left alone (mallopt refused)"
    return f"allocator: heap buffers up to {MMAP_THRESHOLD >> 20} MiB, trim beyond {TRIM_THRESHOLD >> 20} MiB"


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33 and later): the allocator's totals, all arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class IdleHeapTrim:
    """Gives freed heap back to the kernel once a process has gone quiet after work.

    ``check`` is called about once a second (by a timer, or a thread's tick) with how
    much work the process has done so far (any count that grows with it) and whether
    any is under way now. A quiet spell is a check that finds nothing under way and the
    count unchanged since the check before: a second of quiet. On the first check of a
    quiet spell after new work, the heap is trimmed if at least ``WORTH_TRIMMING`` of
    it is free (``free_bytes``); never while work goes on (a trim walks the heap and
    holds the allocator's lock, milliseconds for tens of MiB), never before any work,
    and not after every request of light traffic, whose few freed KiB are not worth the
    trim and the page faults that follow it. ``trimmed`` counts the trims."""

    WORTH_TRIMMING = 1 << 20

    def __init__(self, trim: Callable[[], object], free_bytes: Callable[[], int]) -> None:
        self._trim, self._free_bytes = trim, free_bytes
        self._seen: int | None = None  # the work count at the last check
        self._judged_at: int | None = None  # the work count when a quiet spell was last judged
        self.trimmed = 0

    @classmethod
    def for_this_process(cls, environ: Mapping[str, str] = os.environ) -> "IdleHeapTrim | None":
        """One that calls glibc's ``malloc_trim`` (2.33 and later, for ``mallinfo2``); None on
        another C library or when the operator set glibc's knobs (the trim is theirs then)."""
        libc, _ = _glibc(environ)
        if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallinfo2"):
            return None
        libc.mallinfo2.restype = _MallInfo2
        return cls(lambda: libc.malloc_trim(0), lambda: libc.mallinfo2().fordblks)

    def check(self, work_done: int, busy: bool) -> bool:
        """True when this check trimmed."""
        first = self._seen is None
        quiet = not busy and work_done == self._seen
        self._seen = work_done
        if first:
            self._judged_at = work_done  # what was done before the first check is not this spell's
        if not quiet or work_done == self._judged_at:
            return False
        self._judged_at = work_done
        if self._free_bytes() < self.WORTH_TRIMMING:
            return False
        self._trim()
        self.trimmed += 1
        return True
