"""The admin listener's own HTTP server: routes, methods, keep-alive, pipelining and its
bounds, over real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest

from traceproxy import admin_http
from traceproxy.admin_http import AdminHttpServer

from .support import started_for_the_test, wait_until


async def _hello(accept: str) -> tuple[int, str, bytes]:
    return 200, "text/plain; charset=utf-8", f"hello, accept={accept or '-'}\n".encode()


async def _slow(accept: str) -> tuple[int, str, bytes]:
    await asyncio.sleep(0.2)
    return 200, "text/plain; charset=utf-8", b"slow\n"


async def _broken(accept: str) -> tuple[int, str, bytes]:
    raise RuntimeError("a route's own fault")


async def _big(accept: str) -> tuple[int, str, bytes]:
    return 200, "application/octet-stream", b"b" * (1 << 20)


ROUTES = {b"/hello": _hello, b"/slow": _slow, b"/broken": _broken, b"/big": _big}


class _Listener:
    def __init__(self) -> None:
        self.server = AdminHttpServer(ROUTES)
        self.port = 0

    async def start(self) -> None:
        self.port = await self.server.start("127.0.0.1", 0)

    async def stop(self) -> None:
        await self.server.stop()


@pytest.fixture
def listener(loop_thread):
    making = started_for_the_test(loop_thread, _Listener)
    yield next(making)()
    next(making, None)  # stops it


def _exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Sends ``data``, then reads until the server closes (or ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        received = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            received += chunk
        return received


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes; the socket's timeout bounds each wait."""
    received = b""
    while chunk := sock.recv(1 << 16):
        received += chunk
    return received


def _statuses(answers: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answers)]


def test_a_route_answers_get_and_head_and_ignores_the_query(listener):
    answers = _exchange(listener.port, b"GET /hello?x=1 HTTP/1.1\r\nHost: a\r\nAccept: text/x\r\n\r\n"
                                       b"HEAD /hello HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    first, second = answers.split(b"HTTP/1.1 ")[1:]
    assert first.startswith(b"200 OK\r\n") and first.endswith(b"\r\n\r\nhello, accept=text/x\n")
    assert b"Content-Length: 16\r\n" in second and second.endswith(b"Connection: close\r\n\r\n")  # no body


def test_a_percent_encoded_path_is_its_route(listener):
    answers = _exchange(listener.port, b"GET /%68ello HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert _statuses(answers) == [200] and answers.endswith(b"hello, accept=-\n")


def test_another_path_is_404_and_another_method_405_with_allow(listener):
    answers = _exchange(listener.port, b"GET /nope HTTP/1.1\r\nHost: a\r\n\r\n"
                                       b"POST /hello HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab"
                                       b"GET /hello HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert _statuses(answers) == [404, 405, 200]
    assert b"Allow: GET, HEAD\r\n" in answers


def test_pipelined_requests_are_answered_in_order_though_the_first_is_slow(listener):
    answers = _exchange(listener.port, b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
                                       b"GET /hello HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert _statuses(answers) == [200, 200]
    assert answers.index(b"slow\n") < answers.index(b"hello")


def test_an_http_1_0_request_is_answered_and_the_connection_closed(listener):
    answers = _exchange(listener.port, b"GET /hello HTTP/1.0\r\n\r\n")
    assert _statuses(answers) == [200] and b"Connection: close\r\n" in answers


def test_a_route_that_raises_is_500_and_the_connection_goes_on(listener):
    answers = _exchange(listener.port, b"GET /broken HTTP/1.1\r\nHost: a\r\n\r\n"
                                       b"GET /hello HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    assert _statuses(answers) == [500, 200]


def test_bad_bytes_are_400_after_the_answers_before_them_and_the_connection_closes(listener):
    answers = _exchange(listener.port, b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\nGET /hello HTTP/1.1 junk\r\n\r\n")
    assert _statuses(answers) == [200, 400]
    assert answers.endswith(b"400: malformed request\n")


def test_a_head_over_the_bound_is_431_and_a_body_over_it_413(listener):
    huge_header = b"X-Pad: " + b"a" * (admin_http.MAX_HEAD_BYTES + 1) + b"\r\n"
    assert _statuses(_exchange(listener.port, b"GET /hello HTTP/1.1\r\nHost: a\r\n" + huge_header + b"\r\n")) == [431]
    body = b"b" * (admin_http.MAX_BODY_BYTES + 1)
    answers = _exchange(listener.port, b"GET /hello HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % len(body)
                        + body)
    assert _statuses(answers) == [413]
    assert answers.startswith(b"HTTP/1.1 413 Content Too Large\r\n")  # RFC 9110's words, as the proxy's own


def test_an_upgrade_request_is_answered_without_upgrading_and_the_connection_closed(listener):
    answers = _exchange(listener.port, b"GET /hello HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\n"
                                       b"Upgrade: websocket\r\n\r\nGET /hello HTTP/1.1\r\n\r\n")
    assert _statuses(answers) == [200] and b"Connection: close\r\n" in answers  # _exchange read to the close


def test_connect_in_origin_form_is_400_too(listener):
    assert _statuses(_exchange(listener.port, b"CONNECT /hello HTTP/1.1\r\nHost: a\r\n\r\n")) == [400]


def test_connect_is_400_after_the_answers_before_it(listener):
    answers = _exchange(listener.port, b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\n"
                                       b"CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n")
    assert _statuses(answers) == [200, 400]


def test_a_connection_that_asks_nothing_is_closed_after_the_idle_timeout(listener, monkeypatch):
    monkeypatch.setattr(admin_http, "IDLE_TIMEOUT_S", 0.3)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\nGET /hel")  # a second head that never ends
        started = time.monotonic()
        received = _read_to_close(sock)  # ends when the server closes; the socket's timeout bounds it
        assert _statuses(received) == [200]
        assert time.monotonic() - started < 4.0


def test_thousands_of_pipelined_requests_split_mid_head_are_all_answered(listener):
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: a\r\n\r\n" * 3000 + b"GET /hel")
        time.sleep(0.3)
        sock.sendall(b"lo HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        received = _read_to_close(sock)  # to the server's close; the socket's timeout bounds each wait
    assert _statuses(received) == [200] * 3001


def test_a_head_under_the_bound_sent_in_small_pieces_is_answered(listener):
    head = b"GET /hello HTTP/1.1\r\nHost: a\r\nX-Big: " + b"v" * 40_000 + b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        for start in range(0, len(head), 1024):
            sock.sendall(head[start:start + 1024])
        received = _read_to_close(sock)
    assert _statuses(received) == [200]


def test_a_client_that_half_closes_still_gets_its_answers(listener):
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\nGET /hello HTTP/1.1\r\nHost: a\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        received = _read_to_close(sock)
    assert _statuses(received) == [200, 200] and received.endswith(b"hello, accept=-\n")


def test_an_endless_trailer_is_413(listener):
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-Trailer: ")
        received = b""
        for _ in range(200):  # at most 200 KiB of trailer: the bound is well below
            try:
                sock.sendall(b"a" * 1024)
            except OSError:
                break
            sock.settimeout(0.01)
            try:
                received += sock.recv(1 << 16)
            except socket.timeout:
                continue
            finally:
                sock.settimeout(10)
            if received:
                break
        received += _read_to_close(sock)
    assert _statuses(received) == [413]


def test_a_large_upload_gets_its_413_rather_than_a_reset(listener):
    body = b"u" * (10 << 20)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=10) as sock:
        # Sent whole, without a reset: past the answer the server reads on and throws it away.
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        received = _read_to_close(sock)
    assert _statuses(received) == [413]


def test_expect_100_continue_gets_the_final_answer_at_once(listener):
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.sendall(b"POST /hello HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        received = _read_to_close(sock)  # the body is never sent: the answer must not wait for it
    assert _statuses(received) == [405]


def test_an_http_1_0_client_asking_for_keep_alive_is_told_it_is_kept(listener):
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.sendall(b"GET /hello HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        answer = sock.recv(1 << 16)
        sock.sendall(b"GET /hello HTTP/1.0\r\n\r\n")  # the same connection carries a second request
        answer += _read_to_close(sock)
    assert _statuses(answer) == [200, 200]
    first, second = answer.split(b"HTTP/1.1 ")[1:]
    assert b"Connection: keep-alive\r\n" in first and b"Connection: close\r\n" in second


def _buffered(loop_thread, listener) -> list[int]:
    return loop_thread.call(lambda: [c.transport.get_write_buffer_size() for c in listener.server.connections])


def test_a_client_that_never_reads_its_answers_holds_a_bounded_buffer_and_is_aborted(listener, loop_thread,
                                                                                    monkeypatch):
    # The abort comes well after the look at the buffer, also on a slow moment.
    monkeypatch.setattr(admin_http, "IDLE_TIMEOUT_S", 3.0)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"GET /big HTTP/1.1\r\nHost: a\r\n\r\n" * 200)  # 200 MiB of answers asked, none read
        time.sleep(0.5)
        assert max(_buffered(loop_thread, listener)) < 4 << 20  # one or two answers held, not 200
        assert wait_until(lambda: not loop_thread.call(lambda: len(listener.server.connections)), timeout=10)
