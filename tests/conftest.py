from __future__ import annotations

import pytest

from traceproxy.app import ProxyServer
from traceproxy.config import default_settings
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.sim.fast import FastUpstream

from .support import LoopThread, ScriptedUpstream, refused_port, started_for_the_test


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture
def start_proxy(loop_thread):
    """``start_proxy(upstream_url, **{"dotted.key": value})`` -> a running ProxyServer."""

    def make(upstream_url: str, observers=(), **overrides) -> ProxyServer:
        settings = default_settings().replace(
            **{"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream_url,
               "tracing.exporter": "off", "access_log.path": "", **overrides}
        )
        return ProxyServer(settings, Fanout(list(observers)))

    yield from started_for_the_test(loop_thread, make, stop=lambda server: server.shutdown(grace=0))


@pytest.fixture
def fast_upstream(loop_thread):
    """``fast_upstream(**options)`` -> a running FastUpstream, stopped at the test's end."""
    yield from started_for_the_test(loop_thread, FastUpstream)


@pytest.fixture
def scripted_upstream(loop_thread):
    """``scripted_upstream(handler)`` -> a running ScriptedUpstream, stopped at the test's end."""
    yield from started_for_the_test(loop_thread, ScriptedUpstream)


@pytest.fixture(scope="session")
def dead_upstream() -> str:
    """``http://127.0.0.1:PORT`` where every connection is refused: the port is held (bound,
    never listening) for the whole session, past every proxy pointed at it, so a test file
    running beside this one cannot take it and answer, as it could a port found free and
    let go."""
    with refused_port() as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
