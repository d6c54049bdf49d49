"""Growing the descriptor table ahead of time: the table grows, nothing open is touched."""

from __future__ import annotations

import os
import re
import sys

import pytest

from traceproxy.proxy.context import reserve_descriptor_table

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def _fd_table_size() -> int:
    with open("/proc/self/status") as status:
        return int(re.search(r"FDSize:\s+(\d+)", status.read()).group(1))


def test_the_table_grows_once_and_open_descriptors_stay_open():
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 2048:
        pytest.skip("the soft descriptor limit is below 2048: nothing to reserve")
    read_end, write_end = os.pipe()
    before = set(os.listdir("/proc/self/fd"))
    reserved = reserve_descriptor_table(2048)
    assert reserved == 2048 and _fd_table_size() >= 2048
    assert set(os.listdir("/proc/self/fd")) == before  # the probe descriptor is closed again
    os.write(write_end, b"x")
    assert os.read(read_end, 1) == b"x"
    os.close(read_end)
    os.close(write_end)


def test_small_requests_do_nothing():
    assert reserve_descriptor_table(10) == 0
