"""The allocator tuning: body-sized buffers freed in bursts stay in the heap instead
of going back to the kernel and faulting in again on the next read."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from traceproxy.allocator import tune_allocator

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")

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


def test_freed_read_buffers_are_reused_without_page_faults():
    _, untuned = _page_faults(tuned=False)
    said, tuned = _page_faults(tuned=True)
    assert said.startswith("allocator: heap buffers up to 1 MiB")
    # glibc's adaptive default trims the heap after each burst: tens of faults per burst.
    assert untuned > 2000, untuned
    assert tuned < 50, tuned


def test_the_operators_own_glibc_settings_are_kept():
    said, faults = _page_faults(tuned=True, environ=("MALLOC_TRIM_THRESHOLD_=131072",))
    assert said == "allocator left as configured by MALLOC_TRIM_THRESHOLD_"
    assert faults > 2000, "the thresholds were changed although the operator set their own"
    assert tune_allocator({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}).endswith("GLIBC_TUNABLES")
