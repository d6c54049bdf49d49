from __future__ import annotations

import pytest

from traceproxy.app import ProxyServer
from traceproxy.config import default_settings
from traceproxy.lifecycle.hooks import Fanout
from traceproxy.sim.fast import FastUpstream

from .support import LoopThread, ScriptedUpstream


@pytest.fixture(scope="session")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture
def start_proxy(loop_thread):
    """``start_proxy(upstream_url, **{"dotted.key": value})`` -> a running ProxyServer."""
    started: list[ProxyServer] = []

    def factory(upstream_url: str, observers=(), **overrides) -> ProxyServer:
        settings = default_settings().replace(
            **{"listen": "127.0.0.1:0", "admin": "127.0.0.1:0", "upstream": upstream_url,
               "tracing.exporter": "off", "access_log.path": "", **overrides}
        )
        server = ProxyServer(settings, Fanout(list(observers)))
        loop_thread.run(server.start())
        started.append(server)
        return server

    yield factory
    for server in started:
        loop_thread.run(server.shutdown(grace=0))


@pytest.fixture
def fast_upstream(loop_thread):
    started: list[FastUpstream] = []

    def factory(**kwargs) -> FastUpstream:
        up = loop_thread.run(FastUpstream(**kwargs).start())
        started.append(up)
        return up

    yield factory
    for up in started:
        loop_thread.run(up.stop())


@pytest.fixture
def scripted_upstream(loop_thread):
    started: list[ScriptedUpstream] = []

    def factory(handler) -> ScriptedUpstream:
        up = loop_thread.run(ScriptedUpstream(handler).start())
        started.append(up)
        return up

    yield factory
    for up in started:
        loop_thread.run(up.stop())
