"""A client that half-closes (shutdown(SHUT_WR), ``nc -N``, some health checkers) after
its request: ``limits.client_half_close``. By default ("abort") the FIN is a disconnect,
so that a client that left frees the engine; with "answer" a complete request is still
answered, then the connection closed. A FIN before the request is complete is a
disconnect either way."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import socket
import struct

import pytest

from traceproxy.config import ConfigError, add_flags, load_settings
from traceproxy.lifecycle.flags import Flag

from .support import answers_done_then_waits, header_value, recv_until, wait_until

ANSWER = {"limits.client_half_close": "answer"}
GET = b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n"
POST = b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
CHUNKED = b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 12\r\n\r\n{"ok": true}'


class Recorder:
    def __init__(self) -> None:
        self.done: list = []

    def on_done(self, record) -> None:
        self.done.append(record)


class HeldUpstream:
    """An upstream that reads each request and answers it with OK only once released,
    so that the client's FIN surely reaches the proxy before any response does."""

    def __init__(self, loop_thread, scripted_upstream) -> None:
        self._loop_thread = loop_thread
        self._release = asyncio.Event()
        self.up = scripted_upstream(self._serve)

    async def _serve(self, reader, writer, upstream) -> None:
        while True:
            await reader.read_request()
            released = asyncio.ensure_future(self._release.wait())
            closed = asyncio.ensure_future(reader.read(1))  # the proxy letting go of it
            await asyncio.wait((released, closed), return_when=asyncio.FIRST_COMPLETED)
            if closed.done():
                released.cancel()
                return
            closed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await closed  # gone before the next read begins
            writer.write(OK)
            await writer.drain()

    def release(self) -> None:
        self._loop_thread.call(self._release.set)


@pytest.fixture
def held(loop_thread, scripted_upstream):
    return HeldUpstream(loop_thread, scripted_upstream)


def _half_closed(proxy) -> bool:
    return any(conn.half_closed for conn in proxy.ctx.connections)


def _read_to_the_end(sock: socket.socket) -> tuple[bytes, str]:
    """What the proxy sends until it ends the connection, and how: "eof" or "reset"."""
    received = b""
    for _ in range(1000):  # bounded: a few short responses
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received, "reset"
        if not chunk:
            return received, "eof"
        received += chunk
    raise AssertionError(f"never ended: {received[-300:]!r}")


# ---------------------------------------------------------------------------------
# The setting
# ---------------------------------------------------------------------------------
def load(tmp_path, argv=(), env=None, toml=None):
    env = dict(env or {})
    if toml is not None:
        path = tmp_path / "traceproxy.toml"
        path.write_text(toml)
        env["TRACEPROXY_CONFIG"] = str(path)
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return load_settings(parser.parse_args(list(argv)), environ=env)


def test_client_half_close_is_declared_like_every_other_key(tmp_path):
    assert load(tmp_path).limits.client_half_close == "abort"
    assert load(tmp_path, toml='[limits]\nclient_half_close = "answer"\n').limits.client_half_close == "answer"
    assert load(tmp_path, env={"TRACEPROXY_LIMITS_CLIENT_HALF_CLOSE": "answer"}).limits.client_half_close == "answer"
    assert load(tmp_path, argv=["--limits-client-half-close", "answer"],
                env={"TRACEPROXY_LIMITS_CLIENT_HALF_CLOSE": "abort"}).limits.client_half_close == "answer"
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, env={"TRACEPROXY_LIMITS_CLIENT_HALF_CLOSE": "keep"})
    message = str(caught.value)
    assert "limits.client_half_close" in message and "TRACEPROXY_LIMITS_CLIENT_HALF_CLOSE" in message
    assert "'abort', 'answer'" in message


# ---------------------------------------------------------------------------------
# abort (the default): the FIN is a disconnect
# ---------------------------------------------------------------------------------
def test_by_default_a_half_close_after_a_whole_request_is_a_disconnect_the_access_log_names(
        held, start_proxy, tmp_path):
    log = tmp_path / "access.log"
    proxy = start_proxy(held.up.url, **{"access_log.path": str(log)})
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(GET)
        assert wait_until(lambda: held.up.connections == 1)  # the request went upstream whole
        sock.shutdown(socket.SHUT_WR)
        received, _ = _read_to_the_end(sock)
        assert held.up.closed.wait(5)  # the engine is let go
    assert received == b""  # no response: the client is taken to have left
    assert wait_until(lambda: log.exists() and log.read_text().strip(), timeout=5)
    line = json.loads(log.read_text().splitlines()[0])
    assert (line["outcome"], line["blame"], line["status"]) == ("DC", "client", None)
    # The line says what happened and which key would have answered it.
    assert line["error"] == ("client closed the connection, or its sending side (FIN), after its whole request, "
                             "before the response was complete: taken as leaving (limits.client_half_close = abort)")


def test_a_plain_close_after_a_whole_request_is_not_called_a_half_close(held, start_proxy):
    # A close and a half-close are the same FIN to the proxy: the error must be true of both.
    rec = Recorder()
    proxy = start_proxy(held.up.url, observers=[rec])
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(GET)
        assert wait_until(lambda: held.up.connections == 1)
    assert held.up.closed.wait(5)
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.DC
    assert rec.done[0].error.startswith("client closed the connection, or its sending side (FIN), after its whole "
                                        "request"), rec.done[0].error
    assert "half-closed" not in rec.done[0].error


# ---------------------------------------------------------------------------------
# answer
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("request_bytes", [GET, POST, CHUNKED], ids=["no-body", "content-length", "chunked"])
def test_answer_sends_the_response_to_a_whole_request_then_closes(held, start_proxy, request_bytes):
    rec = Recorder()
    proxy = start_proxy(held.up.url, observers=[rec], **ANSWER)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(request_bytes)
        sock.shutdown(socket.SHUT_WR)
        assert wait_until(lambda: _half_closed(proxy))
        held.release()
        received, ended = _read_to_the_end(sock)
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and body == b'{"ok": true}', received
    assert header_value(head, b"connection") == b"close"  # it says the connection ends
    assert ended == "eof"
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.OK
    assert wait_until(lambda: not proxy.ctx.connections)


def test_answer_answers_every_pipelined_request_before_the_fin(held, start_proxy):
    # The second request waits its turn with the proxy's reading paused, so the FIN is
    # found under it by the hang-up check: it must wait for the bytes before it too.
    rec = Recorder()
    proxy = start_proxy(held.up.url, observers=[rec], **ANSWER)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(GET + POST)
        sock.shutdown(socket.SHUT_WR)
        assert wait_until(lambda: len(proxy.ctx.in_flight) == 2)
        assert not wait_until(lambda: held.up.closed.is_set() or rec.done, timeout=0.6)  # past two checks
        held.release()
        received, ended = _read_to_the_end(sock)
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", received) == [b"200", b"200"], received
    first, _, last = received.rpartition(b"HTTP/1.1 ")
    assert header_value(first.partition(b"\r\n\r\n")[0], b"connection") is None  # the first keeps it open
    assert header_value(last.partition(b"\r\n\r\n")[0], b"connection") == b"close" and ended == "eof"
    assert wait_until(lambda: len(rec.done) == 2) and {r.outcome for r in rec.done} == {Flag.OK}


@pytest.mark.parametrize("partial", [
    b"GET /v1/models HTTP/1.1\r\nHost: a\r\n",  # its head unfinished
    b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nhello",  # its body unfinished
], ids=["head", "body"])
def test_answer_still_takes_a_fin_before_the_request_is_complete_as_a_disconnect(held, start_proxy, partial):
    rec = Recorder()
    proxy = start_proxy(held.up.url, observers=[rec], **ANSWER)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(partial)
        assert wait_until(lambda: proxy.ctx.in_flight)
        sock.shutdown(socket.SHUT_WR)
        received, _ = _read_to_the_end(sock)
    assert received == b""
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.DC
    assert "after its whole request" not in rec.done[0].error  # it left mid-request, nothing to answer


def test_answer_lets_the_engine_go_when_the_half_closed_client_then_resets(held, start_proxy):
    # A client killed after its FIN: nothing is being read from it any more, so only
    # the hang-up check can see the reset before a response is written.
    rec = Recorder()
    proxy = start_proxy(held.up.url, observers=[rec], **ANSWER)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(GET)
    sock.shutdown(socket.SHUT_WR)
    assert wait_until(lambda: _half_closed(proxy))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST
    assert held.up.closed.wait(5)
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.DC


def test_answer_still_ends_ok_for_a_client_that_leaves_at_done(scripted_upstream, start_proxy):
    # The openai SDK closes at data: [DONE]; its FIN then means it had the whole stream,
    # in either mode, not a request still to be answered.
    rec = Recorder()
    up = scripted_upstream(answers_done_then_waits)
    proxy = start_proxy(up.url, observers=[rec], **ANSWER)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
        recv_until(sock, b"[DONE]")
    assert up.closed.wait(5)
    assert wait_until(lambda: len(rec.done) == 1) and rec.done[0].outcome is Flag.OK
