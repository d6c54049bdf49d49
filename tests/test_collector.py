"""Closed connections are freed by reference counting, not by the cycle collector.

The proxy runs the cycle collector rarely (``app.YOUNG_COLLECTION_THRESHOLD``) so that
bursts of new streams are not paused by it. That is only sound while what a closed
connection leaves behind is not held in reference cycles: otherwise every closed
connection would wait for the next collection, and make it long.
"""

from __future__ import annotations

import gc
import json
import weakref

from traceproxy.app import YOUNG_COLLECTION_THRESHOLD

from .support import RawClient, wait_until

STREAM = json.dumps({"model": "m", "stream": True, "max_tokens": 3,
                     "messages": [{"role": "user", "content": "hi"}]}).encode()


def _streamed_turns(port: int, turns: int) -> RawClient:
    client = RawClient(port)
    for _ in range(turns):
        response = client.roundtrip("POST", "/v1/chat/completions",
                                    headers=[("Content-Type", "application/json")], body=STREAM)
        assert response.status == 200 and response.complete and b"[DONE]" in response.body
    return client


def test_a_running_proxy_collects_cycles_rarely(fast_upstream, start_proxy):
    start_proxy(fast_upstream().url)
    assert gc.get_threshold()[0] == YOUNG_COLLECTION_THRESHOLD


def test_closed_client_and_upstream_connections_are_freed_without_the_cycle_collector(
        fast_upstream, start_proxy, loop_thread):
    # The upstream closes idle connections, so the pooled ones close too.
    upstream = fast_upstream(idle_close_after=0.3)
    proxy = start_proxy(upstream.url)
    gc.collect()
    gc.disable()
    try:
        # Two streamed turns per connection: the second response's head repeats the
        # first, so the pooled connection's parser for repeated heads is made too.
        clients = [_streamed_turns(proxy.port, turns=2) for _ in range(3)]
        client_side = loop_thread.call(lambda: [weakref.ref(c) for c in proxy.ctx.connections])
        upstream_side = loop_thread.call(lambda: [weakref.ref(c) for c in proxy.ctx.pool.idle])
        assert len(client_side) == 3 and upstream_side
        for client in clients:
            client.close()
        assert wait_until(lambda: loop_thread.call(lambda: not proxy.ctx.connections and not proxy.ctx.pool.idle))
        still_held = [ref() for ref in client_side + upstream_side if ref() is not None]
        assert still_held == []
    finally:
        gc.enable()
