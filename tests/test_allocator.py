"""The allocator tuning: body-sized buffers freed in bursts stay in the heap instead
of going back to the kernel and faulting in again on the next read."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from traceproxy.allocator import tune_allocator

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")
# The idle trim reads how much of the heap is free with mallinfo2 (glibc 2.33 and later).
mallinfo2_only = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or tuple(int(p) for p in platform.libc_ver()[1].split(".")[:2]) < (2, 33),
    reason="the idle trim needs glibc 2.33 or later")

# A few uploads in flight: four read-sized buffers live together, then all are freed.
BURSTS = """
import resource, sys
from traceproxy.allocator import tune_allocator
if sys.argv[1] == "tune":
    print(tune_allocator(dict(arg.split("=", 1) for arg in sys.argv[2:])))
else:
    print("glibc defaults")
def bursts(n):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        buffers = [bytes(256 * 1024) for _ in range(4)]
        del buffers
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
bursts(5)
print(bursts(200))
"""


def _page_faults(*, tuned: bool, environ: tuple[str, ...] = ()) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", BURSTS, "tune" if tuned else "plain", *environ],
                         capture_output=True, text=True, timeout=60, check=True)
    said, faults = out.stdout.splitlines()
    return said, int(faults)


@glibc_only
def test_freed_read_buffers_are_reused_without_page_faults():
    _, untuned = _page_faults(tuned=False)
    said, tuned = _page_faults(tuned=True)
    assert said.startswith("allocator: heap buffers up to 1 MiB")
    # glibc's adaptive default trims the heap after each burst: tens of faults per burst.
    assert untuned > 2000, untuned
    assert tuned < 50, tuned


@glibc_only
def test_the_operators_own_glibc_settings_are_kept():
    said, faults = _page_faults(tuned=True, environ=("MALLOC_TRIM_THRESHOLD_=131072",))
    assert said == "allocator left as configured by MALLOC_TRIM_THRESHOLD_"
    assert faults > 2000, "the thresholds were changed although the operator set their own"
    assert tune_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}).endswith("GLIBC_TUNABLES")


# A burst's buffers freed but for the last one, which pins the heap's top: glibc's own
# trim (only the top, only past the threshold) can give none of it back.
FRAGMENTED = """
import sys
from traceproxy.allocator import IdleHeapTrim, tune_allocator
tune_allocator({})
def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
trim = IdleHeapTrim.for_this_process()
trim.check(0, busy=False)  # the process starts
buffers = [bytearray(64 * 1024) for _ in range(160)]  # 10 MiB, touched
pin = buffers[-1]
del buffers[-1]
del buffers
kept = rss_kib()
trim.check(1, busy=False)  # work was done since the last check: not quiet yet
after_work = rss_kib()
trim.check(1, busy=False)  # a check later, nothing new: quiet
print(kept - after_work, kept - rss_kib(), trim.trimmed)
"""


@mallinfo2_only
def test_a_quiet_process_gives_a_bursts_freed_heap_back():
    out = subprocess.run([sys.executable, "-c", FRAGMENTED], capture_output=True, text=True, timeout=60, check=True)
    before_quiet, once_quiet, trims = (int(word) for word in out.stdout.split())
    assert before_quiet < 1024, "trimmed before the process was quiet"
    assert once_quiet > 8 * 1024, f"only {once_quiet} KiB of the 10 MiB freed went back to the kernel"
    assert trims == 1


def test_the_heap_is_trimmed_once_per_quiet_spell_and_never_while_busy():
    from traceproxy.allocator import IdleHeapTrim

    trims, free = [], [64 << 20]
    trim = IdleHeapTrim(lambda: trims.append(1), lambda: free[0])
    said = [trim.check(work, busy) for work, busy in [
        (0, False), (0, False),  # started, nothing done yet: nothing of the work's to give back
        (5, True), (5, True),  # requests in flight: never
        (5, False),  # the first check with nothing in flight and nothing new: quiet
        (5, False), (5, False),  # still quiet, nothing done since the trim: not again
        (9, False),  # work done since the last check: not quiet yet
        (9, False),  # quiet again after new work: once more
    ]]
    assert said == [False, False, False, False, True, False, False, False, True]
    assert trim.trimmed == len(trims) == 2


def test_light_traffic_is_not_trimmed_after_every_request():
    from traceproxy.allocator import IdleHeapTrim

    trims, free = [], [200 << 10]  # a request's few freed KiB
    trim = IdleHeapTrim(lambda: trims.append(1), lambda: free[0])
    for request in range(1, 6):  # one request, then two quiet seconds, five times
        trim.check(request, busy=False)
        trim.check(request, busy=False)
    assert trims == []
    free[0] = 8 << 20  # a burst's buffers freed
    trim.check(6, busy=False)
    assert trim.check(6, busy=False) and trims == [1]


@mallinfo2_only
def test_the_operators_own_glibc_settings_mean_no_idle_trim():
    from traceproxy.allocator import IdleHeapTrim

    assert IdleHeapTrim.for_this_process({"MALLOC_TRIM_THRESHOLD_": "131072"}) is None
    assert IdleHeapTrim.for_this_process({}) is not None
