"""The upstream pool: reuse, idle expiry, stale connections never surfacing as client
errors, the single resend on a fresh connection, and waiting for a free slot."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest
import uvloop

from .support import SMALL_OK, RawClient, admin_metric, answers_then_drops_next_request, wait_until



def test_request_that_hits_a_stale_reused_connection_is_resent_once(scripted_upstream, start_proxy):
    up = scripted_upstream(answers_then_drops_next_request(1))
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    assert client.roundtrip("POST", "/v1/chat/completions", body=b'{"turn": 1}').body == b"ok"
    resp = client.roundtrip("POST", "/v1/chat/completions", body=b'{"turn": 2}')
    assert resp.status == 200 and resp.body == b"ok"
    assert proxy.ctx.pool.stats["stale_retried"] == 1
    assert up.connections == 2
    # The resent request arrived whole on the fresh connection.
    assert bytes(up.received[1]).endswith(b'{"turn": 2}')


def test_stale_connection_and_request_too_big_to_resend_is_explicit_502(scripted_upstream, start_proxy):
    up = scripted_upstream(answers_then_drops_next_request(1))
    proxy = start_proxy(up.url, **{"pool.retry_buffer_bytes": 1024})
    client = RawClient(proxy.port)
    client.roundtrip("POST", "/", body=b"small")
    resp = client.roundtrip("POST", "/", body=b"x" * 4096)
    assert resp.status == 502
    error = json.loads(resp.body)["error"]
    assert error["code"] == "SRC"
    assert "retry_buffer_bytes" in error["message"] and "reused connection" in error["message"]
    assert up.connections == 1
    # The race the client saw is counted, though nothing was resent.
    assert admin_metric(proxy, "traceproxy_upstream_stale_connections_total") == 1
    assert admin_metric(proxy, "traceproxy_upstream_retries_total") == 0


def test_with_retry_buffer_zero_nothing_is_resent_not_even_a_request_without_body(scripted_upstream, start_proxy):
    up = scripted_upstream(answers_then_drops_next_request(1))
    proxy = start_proxy(up.url, **{"pool.retry_buffer_bytes": 0})
    client = RawClient(proxy.port)
    client.roundtrip("GET", "/")
    resp = client.roundtrip("GET", "/")
    assert resp.status == 502
    error = json.loads(resp.body)["error"]
    assert error["code"] == "SRC" and "resending is off" in error["message"]
    assert up.connections == 1 and proxy.ctx.pool.stats["stale_retried"] == 0


def test_a_resend_behind_a_full_pool_still_goes_out_on_a_new_connection(scripted_upstream, start_proxy):
    # One connection allowed, and every connection carries exactly one request: a
    # resend handed the connection another request just used would fail again.
    up = scripted_upstream(answers_then_drops_next_request(1))
    proxy = start_proxy(up.url, **{"pool.max_connections": 1, "pool.keep_warm": 0})
    first, second = RawClient(proxy.port), RawClient(proxy.port)
    assert first.roundtrip("GET", "/warm").status == 200  # the pool now holds one used connection
    first.send(b"GET /a HTTP/1.1\r\nHost: a\r\n\r\n")
    second.send(b"GET /b HTTP/1.1\r\nHost: a\r\n\r\n")
    statuses = sorted([first.response().status, second.response().status])
    assert statuses == [200, 200]
    # /a's resend goes first, on a new connection; /b then reuses that one, which
    # this upstream drops in turn, and /b is resent on a third.
    assert proxy.ctx.pool.stats["stale_retried"] == 2
    assert up.connections == 3


def test_a_resend_at_the_cap_keeps_its_place_in_the_queue(scripted_upstream, start_proxy):
    # One connection allowed. A holds it; B and C queue in that order. B is handed the
    # pooled connection, which the upstream closes as B's request arrives: B's resend
    # takes the slot its dead connection frees, ahead of C.
    served: list[bytes] = []

    async def handler(reader, writer, upstream):
        first_connection = upstream.connections == 1
        while True:
            head, _ = await reader.read_request()
            path = head.split(b" ")[1]
            if first_connection and path == b"/b":
                writer.transport.abort()  # the keep-alive race, on B's turn
                return
            if path == b"/a":
                await asyncio.sleep(0.3)  # B and C queue meanwhile
            served.append(path)
            writer.write(SMALL_OK)
            await writer.drain()

    proxy = start_proxy(scripted_upstream(handler).url, **{"pool.max_connections": 1, "pool.keep_warm": 0})
    clients = {name: RawClient(proxy.port) for name in ("warm", "a", "b", "c")}
    assert clients["warm"].roundtrip("GET", "/warm").status == 200
    for name in ("a", "b", "c"):
        clients[name].send(b"GET /%s HTTP/1.1\r\nHost: x\r\n\r\n" % name.encode())
        assert wait_until(lambda: len(proxy.ctx.in_flight) == "abc".index(name) + 1)
    assert all(clients[name].response().status == 200 for name in ("a", "b", "c"))
    assert served == [b"/warm", b"/a", b"/b", b"/c"]
    assert proxy.ctx.pool.stats["stale_retried"] == 1


def test_a_resend_after_the_upload_filled_the_dead_connection_finishes_the_upload(scripted_upstream, start_proxy):
    # The dead connection stopped reading the body, so the proxy had paused reading
    # the client; the resend must resume it, or the upload waits for a timeout.
    body = bytes(range(256)) * (12 * 1024)  # 3 MiB

    async def handler(reader, writer, upstream):
        if upstream.connections == 1:
            upstream.set_receive_buffer(1 << 20)  # the resend's connection takes what was sent at once
            await reader.read_request()
            writer.write(SMALL_OK)
            await writer.drain()
            await reader.read_head()  # the upload: its head only, then the connection dies
            await asyncio.sleep(0.5)
            writer.transport.abort()
            return
        _, received = await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n" + (b"same" if received == body else b"diff"))
        await writer.drain()

    up = scripted_upstream(handler)
    up.set_receive_buffer(2048)  # the first connection backs up after a few kilobytes
    proxy = start_proxy(up.url, **{"pool.retry_buffer_bytes": 64 * 1024 * 1024, "timeouts.upstream_headers": 10})
    client = RawClient(proxy.port, timeout=15)
    assert client.roundtrip("GET", "/warm").status == 200
    resp = client.roundtrip("POST", "/upload", body=body)
    assert resp.status == 200 and resp.body == b"same"
    assert proxy.ctx.pool.stats["stale_retried"] == 1


def test_resend_that_fails_again_is_urx(scripted_upstream, start_proxy):
    state = {"conn": 0}

    async def handler(reader, writer, upstream):
        state["conn"] += 1
        if state["conn"] == 1:
            await reader.read_request()
            writer.write(SMALL_OK)
            await writer.drain()
        await reader.read_request()
        writer.transport.abort()

    proxy = start_proxy(scripted_upstream(handler).url)
    client = RawClient(proxy.port)
    client.roundtrip("GET", "/")
    resp = client.roundtrip("GET", "/")
    assert resp.status == 502 and json.loads(resp.body)["error"]["code"] == "URX"


def test_a_resend_never_goes_to_another_pooled_connection(scripted_upstream, start_proxy):
    """Two pooled connections went stale together (an upstream restart, or its idle
    timeout closing both): the resend must open a new one, not try the other."""
    async def slow_first_then_drops_the_next(reader, writer, upstream):
        await reader.read_request()
        await asyncio.sleep(0.3)  # slow enough that the two warm-up requests need two connections
        writer.write(SMALL_OK)
        await writer.drain()
        await reader.read_request()
        writer.transport.abort()

    up = scripted_upstream(slow_first_then_drops_the_next)
    proxy = start_proxy(up.url, **{"pool.keep_warm": 0})
    first, second = RawClient(proxy.port), RawClient(proxy.port)
    first.request("GET", "/warm-1")
    second.request("GET", "/warm-2")
    assert first.response().body == b"ok" and second.response().body == b"ok"
    assert wait_until(lambda: len(proxy.ctx.pool.idle) == 2)
    resp = RawClient(proxy.port).roundtrip("GET", "/after")
    assert resp.status == 200 and resp.body == b"ok"
    assert proxy.ctx.pool.stats["stale_retried"] == 1 and up.connections == 3


def test_idle_connection_closed_by_upstream_is_dropped_before_use(fast_upstream, start_proxy):
    up = fast_upstream(idle_close_after=0.1)
    proxy = start_proxy(up.url)
    client = RawClient(proxy.port)
    for _ in range(3):
        assert client.roundtrip("GET", "/health").status == 200
        assert wait_until(lambda: up.idle_closes >= 1 and not proxy.ctx.pool.idle, timeout=2)
        up.idle_closes = 0
    # Detected while idle, so never retried and never an error.
    assert proxy.ctx.pool.stats["stale_retried"] == 0
    assert proxy.ctx.pool.stats["opened"] == 3


def test_pool_idle_timeout_closes_connections_before_the_engine_would(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"pool.idle_timeout": 0.2, "pool.keep_warm": 0})
    RawClient(proxy.port).roundtrip("GET", "/health")
    assert len(proxy.ctx.pool.idle) == 1
    assert wait_until(lambda: not proxy.ctx.pool.idle and not up.connections, timeout=3)


def test_requests_wait_for_a_free_upstream_connection_at_the_cap(scripted_upstream, start_proxy, loop_thread):
    release = asyncio.Event()

    async def held(reader, writer, upstream):
        while True:
            await reader.read_request()
            await release.wait()
            writer.write(SMALL_OK)
            await writer.drain()

    up = scripted_upstream(held)
    proxy = start_proxy(up.url, **{"pool.max_connections": 1})
    first, second = RawClient(proxy.port), RawClient(proxy.port)
    first.request("GET", "/1")
    assert wait_until(lambda: up.connections == 1)
    second.request("GET", "/2")
    assert wait_until(lambda: len(proxy.ctx.pool.waiters) == 1)
    loop_thread.call(release.set)
    assert first.response().body == b"ok"
    assert second.response().body == b"ok"
    assert up.connections == 1  # the waiter got the released connection


def test_connections_the_pool_expires_are_not_counted_as_closed_by_the_upstream(fast_upstream, start_proxy):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"pool.idle_timeout": 0.2, "pool.keep_warm": 0})
    RawClient(proxy.port).roundtrip("GET", "/health")
    assert wait_until(lambda: proxy.ctx.pool.open_count == 0, timeout=3)
    assert proxy.ctx.pool.stats["closed_by_upstream_while_idle"] == 0


class _User:
    """The two calls the pool makes on whoever waits for a connection it opens (sides.ConnectionWaiter)."""

    def __init__(self):
        self.ready, self.failed = [], []

    def connection_ready(self, conn, reused):
        self.ready.append((conn, reused, conn.transport is not None))

    def connection_failed(self, error):
        self.failed.append(error)


def _pool(port: int, connect_timeout: float = 5.0, idle_timeout: float = 4.0, keep_warm: float = 0.0,
          max_connections: int = 0):
    from traceproxy.proxy.upstream import UpstreamPool

    return UpstreamPool("127.0.0.1", port, idle_timeout=idle_timeout, max_connections=max_connections,
                        connect_timeout=connect_timeout, keep_warm=keep_warm)


@contextlib.asynccontextmanager
async def _pool_on_server(on_connect=lambda reader, writer: None, **pool_options):
    """A pool against a loopback server running ``on_connect``; both are shut at the end."""
    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    pool = _pool(server.sockets[0].getsockname()[1], **pool_options)
    try:
        yield pool
    finally:
        pool.close_all()
        server.close()


def _usable(pool) -> int:
    now = time.monotonic_ns()
    return sum(1 for c in pool.idle if not c.closed and c.record.idle_age_ns(now) < pool.idle_timeout_ns)


async def _sample(seconds: float, measure) -> list:
    """``measure()`` every 5 ms for ``seconds``."""
    values, loop = [], asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        values.append(measure())
        await asyncio.sleep(0.005)
    return values


async def _until(condition, timeout: float = 3.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def _burst(pool, count: int) -> list:
    """``count`` requests at once; each gets its connection, then all are released."""
    users = [_User() for _ in range(count)]
    for user in users:
        pool.acquire(user)
    assert await _until(lambda: all(user.ready for user in users))
    for user in users:
        pool.release(user.ready[0][0])
    return users


def test_a_connection_idle_past_the_timeout_is_never_handed_out_even_between_sweeps():
    async def main():
        async with _pool_on_server(idle_timeout=0.4) as pool:
            # No sweep comes during the test (a window between two sweeps a few ms wide
            # failed on a slow moment): only the hand-out's own age check stands between.
            pool.sweep_interval_ns = 60 * 10**9
            first, second = _User(), _User()
            pool.acquire(first)
            pool.acquire(second)
            assert await _until(lambda: first.ready and second.ready)
            pool.release(first.ready[0][0])
            pool.release(second.ready[0][0])
            released = time.monotonic()
            await asyncio.sleep(0.45 - (time.monotonic() - released))  # past 0.4 s idle, long before a sweep
            assert len(pool.idle) == 2  # still pooled: no sweep took them
            late = _User()
            pool.acquire(late)
            assert await _until(lambda: late.ready)
            _, reused, _ = late.ready[0]
            assert not reused, "both pooled connections were idle past pool.idle_timeout (0.4 s)"

    asyncio.run(main())


def test_keep_warm_renews_idle_connections_so_a_burst_after_a_pause_finds_them_ready():
    async def main():
        accepted = []
        async with _pool_on_server(lambda r, w: accepted.append(w), idle_timeout=0.4, keep_warm=30) as pool:
            await _burst(pool, 5)
            first = set(pool.idle)
            await asyncio.sleep(1.2)  # three idle timeouts: without renewing, the pool would be empty
            assert await _until(lambda: len(pool.idle) == 5)
            assert not first & set(pool.idle), "every connection was replaced"
            now = time.monotonic_ns()
            assert all(conn.record.idle_age_ns(now) < pool.idle_timeout_ns for conn in pool.idle)
            assert pool.stats["opened_ahead"] >= 5 and len(accepted) >= 10
            opened = pool.stats["opened"]
            users = await _burst(pool, 5)
            assert all(reused for (_, reused, _) in (user.ready[0] for user in users))
            assert pool.stats["opened"] == opened, "the burst opened nothing on demand"

    asyncio.run(main())


def test_keep_warm_renews_before_the_idle_timeout_even_for_connections_released_just_after_a_sweep():
    async def main():
        # 1.6 s: a renewal has 0.4 s to spare (at 0.8 s it had 0.2, which one slow moment took).
        async with _pool_on_server(idle_timeout=1.6, keep_warm=30) as pool:
            await _burst(pool, 5)  # starts the sweeper
            sweeps = len(pool.recent_peaks)
            assert await _until(lambda: len(pool.recent_peaks) > sweeps)
            await _burst(pool, 5)  # released early in a sweep period: the hardest phase to renew in time
            usable = await _sample(3.2, lambda: _usable(pool))  # two idle timeouts
            assert min(usable) == 5, "a warm connection lapsed before its replacement was ready"
            assert pool.stats["opened_ahead"] >= 10

    asyncio.run(main())


def test_keep_warm_renewing_never_opens_past_max_connections(monkeypatch):
    async def main():
        loop = asyncio.get_running_loop()
        connect = loop.create_connection

        async def slow_connect(*args, **kwargs):  # make-before-break holds old and new longer
            await asyncio.sleep(0.08)
            return await connect(*args, **kwargs)

        monkeypatch.setattr(loop, "create_connection", slow_connect)
        async with _pool_on_server(idle_timeout=0.4, keep_warm=30, max_connections=4) as pool:
            await _burst(pool, 4)
            open_counts = await _sample(1.5, lambda: pool.open_count)
            assert max(open_counts) <= 4 and pool.stats["opened_ahead"] >= 4

    asyncio.run(main())


def test_requests_taking_slots_while_a_renewal_opens_do_not_push_the_pool_past_max_connections():
    # The upstream restarts and drops the warm pool; the sweep then schedules its
    # replacements, a few per tick. A burst landing meanwhile takes slots up to the
    # cap, and the ticks left must not open past it.
    class User(_User):
        def connection_queued(self):
            pass

        def connection_opening(self):
            pass

    async def main():
        accepted = []
        async with _pool_on_server(lambda reader, writer: accepted.append(writer), idle_timeout=4.0,
                                   keep_warm=60, max_connections=8) as pool:
            await _burst(pool, 8)
            for writer in accepted:
                writer.transport.abort()
            assert await _until(lambda: pool.open_count == 0)
            assert await _until(lambda: pool.spares_to_open > 0, timeout=5), "no renewal was scheduled"
            users = [User() for _ in range(8)]
            for user in users:
                pool.acquire(user)
            open_counts = await _sample(1.5, lambda: pool.open_count)
            assert max(open_counts) <= 8, f"{max(open_counts)} upstream connections open at a cap of 8"
            assert all(user.ready for user in users)

    asyncio.run(main())


def test_keep_warm_learns_an_upstream_that_closes_fresh_idle_connections_early_and_stops_renewing():
    # The upstream closes every connection left idle for 0.3 s, including ones opened
    # ahead that never carried a request: that is an idle timeout, not a failed connect.
    async def main():
        async def on_connect(reader, writer):
            await asyncio.sleep(0.3)
            writer.close()

        async with _pool_on_server(on_connect, idle_timeout=2.0, keep_warm=30) as pool:
            await _burst(pool, 2)
            assert await _until(lambda: pool.keepalive.misaligned, timeout=5)
            assert pool.stats["connect_failed"] == 0
            assert 0.25 <= pool.keepalive.learned <= 0.6  # 0.3 s, seen late on a slow moment; far under 2 s
            opened_ahead = pool.stats["opened_ahead"]
            await asyncio.sleep(1.5)  # three sweeps: nothing more is opened ahead to be closed the same way
            assert pool.stats["opened_ahead"] == opened_ahead

    asyncio.run(main())


def test_keep_warm_backs_off_from_an_upstream_that_accepts_and_closes_and_learns_nothing_from_it():
    async def main():
        closing = False
        accepts = []

        def on_connect(reader, writer):
            accepts.append(writer)
            if closing:
                writer.close()  # a load balancer with no healthy backend

        async with _pool_on_server(on_connect, idle_timeout=0.4, keep_warm=30) as pool:
            await _burst(pool, 8)
            closing = True
            before = len(accepts)
            await asyncio.sleep(1.0)  # ten sweeps
            assert pool.spares_failing and len(accepts) - before <= 8 + 12, "a connect storm"
            assert pool.keepalive.learned is None and not pool.keepalive.misaligned
            closing = False  # the upstream recovers: keeping warm resumes in full
            assert await _until(lambda: len(pool.idle) == 8, timeout=3)

    asyncio.run(main())


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_shutdown_with_connects_ahead_in_flight_leaves_nothing_open(run):
    async def main():
        ends = []

        async def watch(reader, writer):
            ends.append(asyncio.ensure_future(reader.read()))  # b"" once the proxy side closes

        async with _pool_on_server(watch, idle_timeout=0.4, keep_warm=30) as pool:
            await _burst(pool, 6)
            pool.stop_keeping_warm()  # what shutdown does first: idle ones now just expire
            assert not pool.warm_target and not pool.spares_to_open
            opened_ahead = pool.stats["opened_ahead"]
            assert await _until(lambda: not pool.idle, timeout=3), "idle connections outlived keep_warm's end"
            assert pool.stats["opened_ahead"] == opened_ahead
            await _burst(pool, 6)
            pool.keep_warm_ns = int(30e9)  # warm again, then shut while renewing
            assert await _until(lambda: pool.spares_connecting > 0 or pool.spares_to_open > 0, timeout=3)
            pool.close_all()
            assert await _until(lambda: pool.open_count == 0 and not pool.idle and not pool.connecting, timeout=3)
            assert await _until(lambda: all(end.done() for end in ends), timeout=3)

    run(main())


def test_keep_warm_lets_the_pool_drain_after_the_window_and_never_opens_after_shutdown():
    async def main():
        accepted = []
        async with _pool_on_server(lambda r, w: accepted.append(w), idle_timeout=0.2, keep_warm=0.5) as pool:
            await _burst(pool, 3)
            assert await _until(lambda: pool.open_count == 0, timeout=3)  # no demand for keep_warm: drained

            await _burst(pool, 3)
            pool.close_all()
            count = len(accepted)
            await asyncio.sleep(0.5)  # the window in which a late connect would arrive
            assert pool.open_count == 0 and len(accepted) == count

    asyncio.run(main())


def test_keep_warm_probes_a_down_upstream_with_one_connect_a_sweep():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = _pool(port, idle_timeout=0.4, keep_warm=30)
        await _burst(pool, 8)
        server.close()
        await server.wait_closed()
        for conn in list(pool.idle):
            pool.discard(conn, "test: the upstream went away")
        assert await _until(lambda: pool.spares_failing)  # the first of the top-up were refused
        failed = pool.stats["connect_failed"]
        assert failed <= 8
        started = time.monotonic()
        assert await _until(lambda: pool.stats["connect_failed"] >= failed + 2, timeout=3), "the probes stopped"
        sweeps = (time.monotonic() - started) / (pool.sweep_interval_ns / 1e9)
        assert pool.stats["connect_failed"] <= failed + sweeps + 2, "more than one probe a sweep"
        assert pool.open_count <= 1
        pool.close_all()

    asyncio.run(main())


def test_keep_warm_does_not_renew_for_an_upstream_that_closes_idle_connections_first():
    async def main():
        async with _pool_on_server(idle_timeout=0.4, keep_warm=30) as pool:
            pool.keepalive.saw_header(b"timeout=0.2")  # below our idle timeout: misaligned
            await _burst(pool, 3)
            assert await _until(lambda: pool.open_count == 0, timeout=3)
            assert pool.stats["opened_ahead"] == 0

    asyncio.run(main())


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_new_connection_is_handed_over_as_soon_as_it_is_connected(run):
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        pool, user = _pool(server.sockets[0].getsockname()[1]), _User()
        task = pool.acquire(user)
        # Handed over from connection_made, before the connect coroutine has returned.
        for _ in range(100):
            if user.ready:
                break
            await asyncio.sleep(0)
        assert user.ready and not task.done()
        conn, reused, connected = user.ready[0]
        assert not reused and connected and pool.stats["opened"] == 1 and pool.open_count == 1
        await task
        assert not pool.connecting and user.failed == []
        pool.release(conn)
        assert pool.idle == [conn]
        pool.close_all()
        server.close()

    run(main())


def test_connect_timeout_and_refusal_reach_the_request_once_and_free_the_slot(monkeypatch):
    async def main():
        loop = asyncio.get_running_loop()

        async def never_connects(*args, **kwargs):
            await asyncio.sleep(3600)

        monkeypatch.setattr(loop, "create_connection", never_connects)
        pool, user = _pool(9, connect_timeout=0.05), _User()
        pool.acquire(user)
        await asyncio.sleep(0.2)
        assert user.failed == ["connect timed out after 0.05 s"] and user.ready == []
        assert pool.open_count == 0 and not pool.connecting and pool.stats["connect_failed"] == 1

        monkeypatch.undo()
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))  # bound, never listening: connecting is refused
        pool, user = _pool(probe.getsockname()[1]), _User()
        await asyncio.wait([pool.acquire(user)])
        probe.close()
        assert len(user.failed) == 1 and user.failed[0].startswith("connect failed")
        assert pool.open_count == 0 and not pool.connecting

    asyncio.run(main())


def test_a_connect_the_request_gave_up_on_is_not_reported():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        pool, user = _pool(server.sockets[0].getsockname()[1]), _User()
        task = pool.acquire(user)
        task.cancel()
        await asyncio.sleep(0.05)
        assert user.ready == [] and user.failed == []
        assert pool.open_count == 0 and not pool.connecting and pool.stats["connect_failed"] == 0
        server.close()

    asyncio.run(main())


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_connect_given_up_on_as_it_completes_is_never_handed_over_or_pooled(run):
    # The client left in the same loop pass as the connect completed: the cancel comes
    # after connection_made was scheduled, before it ran. Handed over, the connection
    # reached the finished request and was pooled, while the cancelled connect closed
    # its transport underneath: the next request was given a dead connection.
    from traceproxy.proxy.upstream import UpstreamConnection

    async def main():
        async with _pool_on_server() as pool:
            user = _User()
            task = pool.acquire(user)
            (conn,) = pool.connecting.values()

            def cancelled_first(transport):
                pool.cancel_connect(task)
                UpstreamConnection.connection_made(conn, transport)

            conn.connection_made = cancelled_first
            await asyncio.wait([task])
            await asyncio.sleep(0.05)
            assert user.ready == [] and user.failed == []
            assert pool.idle == [] and pool.open_count == 0 and not pool.connecting
            assert conn.transport is None or conn.transport.is_closing()

    run(main())


def test_a_request_that_never_got_a_connection_under_the_cap_is_the_proxys_504(scripted_upstream, start_proxy):
    # The header timeout ran out while the request waited for pool.max_connections:
    # the proxy's own limit, so the outcome is PWS (blame proxy), not the engine's UT.
    async def slow(reader, writer, upstream):
        await reader.read_request()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n")  # the head at once: no UT for it
        await writer.drain()
        await asyncio.sleep(2)
        writer.write(b"ok")
        await writer.drain()

    proxy = start_proxy(scripted_upstream(slow).url,
                        **{"pool.max_connections": 1, "pool.keep_warm": 0, "timeouts.upstream_headers": 0.5})
    holder, waiter = RawClient(proxy.port), RawClient(proxy.port)
    holder.send(b"GET /holds HTTP/1.1\r\nHost: a\r\n\r\n")
    assert wait_until(lambda: proxy.ctx.pool.open_count == 1)
    resp = waiter.roundtrip("GET", "/waits")
    assert resp.status == 504 and resp.headers["x-traceproxy-outcome"] == "PWS"
    error = json.loads(resp.body)["error"]
    assert "pool.max_connections (1)" in error["message"]


# -- a connection ahead for each client connection that sent a request ----------------
STREAM_AFTER_300_MS = json.dumps({"model": "m", "stream": True, "max_tokens": 2,
                                  "messages": [{"role": "user", "content": "hi"}]}).encode()
SLOW_STREAM_HEADERS = [("Content-Type", "application/json"), ("x-fake-ttft-ms", "300")]


def _one_turn_each(port: int, count: int, headers=()) -> list[RawClient]:
    """``count`` client connections, one after another, each with one request answered."""
    clients = []
    for _ in range(count):
        client = RawClient(port)
        assert client.roundtrip("GET", "/health", headers=list(headers)).status == 200
        clients.append(client)
    return clients


def _open_count(proxy, loop_thread) -> int:
    return loop_thread.call(lambda: proxy.ctx.pool.open_count)  # connecting ones included


def test_clients_that_each_sent_a_request_find_a_connection_ready_for_each_when_they_then_burst(
        fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    pool = proxy.ctx.pool
    # One at a time: at most one upstream connection was ever in use at once.
    clients = _one_turn_each(proxy.port, 8)
    assert wait_until(lambda: loop_thread.call(lambda: len(pool.idle)) == 8, timeout=3)
    opened = pool.stats["opened"]
    assert opened == 8 and pool.stats["opened_ahead"] == 7
    # Then all at once, each request held upstream long enough to overlap the others.
    for client in clients:
        client.conn.start_next_cycle()
        client.request("POST", "/v1/chat/completions", body=STREAM_AFTER_300_MS, headers=SLOW_STREAM_HEADERS)
    for client in clients:
        response = client.response()
        assert response.status == 200 and response.complete and b"[DONE]" in response.body
    assert pool.stats["opened"] == opened, "the burst waited on connects"
    assert pool.stats["reused"] >= 8


def test_connections_opened_ahead_for_clients_expire_unless_demand_uses_them(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"pool.idle_timeout": 0.4})
    clients = _one_turn_each(proxy.port, 8)
    assert wait_until(lambda: proxy.ctx.pool.stats["opened_ahead"] == 7, timeout=3)
    # The clients stay connected and silent: only the peak in use (one) is kept.
    assert wait_until(lambda: _open_count(proxy, loop_thread) <= 1, timeout=5)
    assert len(proxy.ctx.connections) == len(clients) and proxy.ctx.pool.warm_target == 1


def test_clients_that_leave_after_one_request_are_not_kept_a_connection(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    for _ in range(8):
        client = RawClient(proxy.port)
        assert client.roundtrip("GET", "/health").status == 200
        client.close()
        assert wait_until(lambda: not loop_thread.call(lambda: proxy.ctx.connections), timeout=3)
        assert _open_count(proxy, loop_thread) == 1
    assert proxy.ctx.pool.stats["opened_ahead"] == 0


def test_requests_that_send_connection_close_do_not_count_their_client(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    clients = [RawClient(proxy.port) for _ in range(4)]
    for client in clients:
        client.request("POST", "/v1/chat/completions", body=STREAM_AFTER_300_MS,
                       headers=SLOW_STREAM_HEADERS + [("Connection", "close")])
    assert wait_until(lambda: loop_thread.call(lambda: len(proxy.ctx.in_flight)) == 4, timeout=3)
    assert loop_thread.call(lambda: len(proxy.ctx.sending_clients)) == 0
    for client in clients:
        assert client.response().status == 200
    assert proxy.ctx.pool.stats["opened_ahead"] == 0


def test_connections_opened_ahead_for_clients_stop_at_max_connections(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"pool.max_connections": 3})
    clients = _one_turn_each(proxy.port, 8)
    assert _open_count(proxy, loop_thread) == 3 and proxy.ctx.pool.stats["opened"] <= 3
    assert all(client.roundtrip("GET", "/health").status == 200 for client in clients)


def test_with_keep_warm_off_no_connection_is_opened_ahead_for_clients(fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url, **{"pool.keep_warm": 0})
    _one_turn_each(proxy.port, 8)
    assert _open_count(proxy, loop_thread) == 1 and proxy.ctx.pool.stats["opened_ahead"] == 0


def test_a_down_upstream_gets_at_most_one_connect_ahead_from_arriving_clients(start_proxy, loop_thread):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens here once this is closed
    proxy = start_proxy(f"http://127.0.0.1:{port}")
    clients = []
    for _ in range(8):  # they stay connected: each counts
        clients.append(RawClient(proxy.port))
        assert clients[-1].roundtrip("GET", "/health").status == 502
    # One connect per request, plus at most one ahead: it failed, and no more followed.
    assert wait_until(lambda: loop_thread.call(lambda: proxy.ctx.pool.open_count) == 0, timeout=3)
    assert proxy.ctx.pool.stats["connect_failed"] <= 9 and proxy.ctx.pool.spares_failing


def test_after_connects_ahead_failed_a_reusable_request_connection_lets_clients_have_them_again(
        fast_upstream, start_proxy, loop_thread):
    up = fast_upstream()
    proxy = start_proxy(up.url)
    pool = proxy.ctx.pool
    loop_thread.call(lambda: setattr(pool, "spares_failing", True))  # as after a router restart
    clients = _one_turn_each(proxy.port, 3)  # no pause: no sweep has anything to probe
    assert not pool.spares_failing
    assert wait_until(lambda: pool.stats["opened_ahead"] == 2, timeout=3)
    assert len(clients) == 3


def test_a_connection_opened_ahead_for_a_client_does_not_retire_a_due_idle_one():
    async def main():
        async with _pool_on_server(keep_warm=30) as pool:
            (user,) = await _burst(pool, 1)
            (due,) = pool.idle
            due.record.idle_since_ns -= pool.due_age_ns  # idle long enough to be renewed
            pool.warm_for_clients(2)
            assert await _until(lambda: pool.stats["opened_ahead"] == 1)
            assert due in pool.idle and not due.closed, "a renewal retires a due one; this was not one"
            assert len(pool.idle) == 2

    asyncio.run(main())


@pytest.mark.parametrize("state", ["shut down", "upstream closes idle connections first", "keep_warm off"])
def test_no_connection_is_opened_ahead_for_clients_when(state):
    async def main():
        async with _pool_on_server(keep_warm=0 if state == "keep_warm off" else 30) as pool:
            if state == "shut down":
                pool.close_all()
            elif state == "upstream closes idle connections first":
                pool.keepalive.misaligned = True
            pool.warm_for_clients(4)
            assert pool.open_count == 0 and not pool.connecting

    asyncio.run(main())
