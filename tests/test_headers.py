"""Pure header rules, table-driven."""

from __future__ import annotations

import pytest

from traceproxy.proxy import headers as H

CTX = H.ForwardingContext(client_ip="192.0.2.7", scheme="http", upstream_authority=b"10.0.0.9:30000",
                          preserve_host=True, x_forwarded=True)

FRAMING = [
    ("no-body", [], H.RequestFraming(False, 0)),
    ("length", [(b"Content-Length", b"12")], H.RequestFraming(False, 12)),
    ("same-length-twice", [(b"Content-Length", b"12"), (b"content-length", b"12")], H.RequestFraming(False, 12)),
    ("length-list-same", [(b"Content-Length", b"12, 12")], H.RequestFraming(False, 12)),
    ("chunked", [(b"Transfer-Encoding", b"Chunked")], H.RequestFraming(True, None)),
]


@pytest.mark.parametrize("headers,expected", [(h, e) for _, h, e in FRAMING], ids=[i for i, _, _ in FRAMING])
def test_request_framing(headers, expected):
    assert H.parse_request_headers([(b"Host", b"a")] + headers).framing == expected


def test_connection_listed_names_are_hop_by_hop_both_ways():
    headers = [(b"Host", b"a"), (b"Connection", b"close, X-Foo"), (b"X-Foo", b"1"), (b"X-Bar", b"2"),
               (b"Keep-Alive", b"x")]
    assert H.parse_request_headers(headers).end_to_end == [(b"Host", b"a"), (b"X-Bar", b"2")]
    assert H.parse_response_headers(headers[1:]).end_to_end == [(b"X-Bar", b"2")]


def test_expect_and_forwarded_headers_are_set_aside():
    parts = H.parse_request_headers([(b"Host", b"a"), (b"Expect", b"100-continue"),
                                     (b"X-Forwarded-For", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2")])
    assert parts.expect == b"100-continue" and parts.end_to_end == [(b"Host", b"a")]
    assert parts.forwarded == [(b"X-Forwarded-For", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2")]
    head = H.upstream_request_head("GET", b"/", parts, CTX)
    assert b"X-Forwarded-For: 1.1.1.1, 2.2.2.2, 192.0.2.7\r\n" in head


def test_each_forwarded_header_the_client_sent_is_appended_to_not_replaced():
    parts = H.parse_request_headers([(b"Host", b"inner.example"), (b"X-Forwarded-Proto", b"https"),
                                     (b"X-Forwarded-Host", b"outer.example")])
    lines = H.upstream_request_head("GET", b"/", parts, CTX).split(b"\r\n")
    assert b"X-Forwarded-Proto: https, http" in lines
    assert b"X-Forwarded-Host: outer.example, inner.example" in lines
    assert b"X-Forwarded-For: 192.0.2.7" in lines  # none of its own: ours alone


def test_upstream_head_is_http11_with_recomputed_framing():
    parts = H.parse_request_headers([(b"Host", b"api"), (b"Content-Length", b"3")])
    head = H.upstream_request_head("POST", b"/v1/x?y=1", parts, CTX)
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/x?y=1 HTTP/1.1"
    assert b"Content-Length: 3" in lines and b"Host: api" in lines
    assert b"X-Forwarded-For: 192.0.2.7" in lines and b"X-Forwarded-Host: api" in lines
    assert head.endswith(b"\r\n\r\n")


def test_chunked_request_is_forwarded_chunked():
    parts = H.parse_request_headers([(b"Host", b"a"), (b"Transfer-Encoding", b"chunked")])
    head = H.upstream_request_head("POST", b"/", parts, CTX)
    assert head.count(b"Transfer-Encoding: chunked") == 1 and b"Content-Length" not in head


def test_forwarded_headers_off_leaves_them_untouched():
    ctx = H.ForwardingContext("192.0.2.7", "http", b"u:1", preserve_host=False, x_forwarded=False)
    parts = H.parse_request_headers([(b"Host", b"a"), (b"X-Forwarded-For", b"1.1.1.1")])
    head = H.upstream_request_head("GET", b"/", parts, ctx)
    assert b"X-Forwarded-For: 1.1.1.1\r\n" in head and b"Host: u:1\r\n" in head and b"Host: a" not in head


CL5, CL9, TE = (b"Content-Length", b"5"), (b"Content-Length", b"9"), (b"Transfer-Encoding", b"chunked")
RESPONSE_FRAMING = [
    ("length", 200, "GET", [CL5], True, (H.ResponseFraming.LENGTH, b"5")),
    ("chunked-to-11", 200, "GET", [TE], True, (H.ResponseFraming.CHUNKED, None)),
    ("close-delimited-to-11", 200, "GET", [], True, (H.ResponseFraming.CHUNKED, None)),
    ("chunked-to-10", 200, "GET", [TE], False, (H.ResponseFraming.CLOSE, None)),
    ("head-keeps-length", 200, "HEAD", [CL9], True, (H.ResponseFraming.NONE, b"9")),
    ("no-content", 204, "GET", [], True, (H.ResponseFraming.NONE, None)),
    ("not-modified", 304, "GET", [CL9], True, (H.ResponseFraming.NONE, b"9")),
]


@pytest.mark.parametrize("status,method,headers,http11,expected",
                         [r[1:] for r in RESPONSE_FRAMING], ids=[r[0] for r in RESPONSE_FRAMING])
def test_response_framing_is_always_unambiguous_for_the_client(status, method, headers, http11, expected):
    parts = H.parse_response_headers(headers)
    assert H.response_framing(status, method, parts, http11) == expected


def test_chunk_encoding():
    assert H.chunk(b"hello world") == b"b\r\nhello world\r\n"
    assert b"".join(H.chunk_pieces(b"hello world")) == H.chunk(b"hello world")


def test_status_lines_llhttp_accepts_but_the_proxy_refuses():
    for status, reason in ((100, b""), (200, b"OK"), (599, b"Tab\tand obs-text \xe9")):
        H.check_status_line(status, reason)
    for status, reason in ((0, b"OK"), (99, b"OK"), (600, b"OK"), (200, b"O\x00K"), (200, b"O\x7fK")):
        with pytest.raises(H.BadResponse):
            H.check_status_line(status, reason)


def test_host_values_are_host_and_port():
    for good in (b"a", b"example.com:8080", b"127.0.0.1:30000", b"[::1]:8000", b"",
                 b"router-1.svc.cluster.local", b"xn--bcher-kva.example"):
        H.check_host(good)
    for bad in (b"a b", b"a/b", b"user@a", b"a:80/x", b"[::1", b"a\tb", b"a?b"):
        with pytest.raises(H.BadRequest):
            H.check_host(bad)


def test_absolute_form_targets_split_into_authority_and_path():
    assert H.split_absolute_form(b"http://a:1/x?y=1#frag") == (b"a:1", b"/x?y=1")
    assert H.split_absolute_form(b"HTTP://a") == (b"a", b"/")
    assert H.split_absolute_form(b"http://a?q") == (b"a", b"/?q")
    assert H.split_absolute_form(b"/x") is None and H.split_absolute_form(b"*") is None
    assert H.split_absolute_form(b"ftp://a/x") is None


def test_a_target_is_shown_without_user_information():
    # Refused targets are still logged and traced: never with a password in them.
    assert H.shown_target(b"/v1/models?a=1") == "/v1/models?a=1"
    assert H.shown_target(b"http://alice:s3cret@example.com/v1/models") == "http://example.com/v1/models"
    assert H.shown_target(b"http://a@b@c:80?q=@x") == "http://c:80?q=@x"
    assert H.shown_target(b"user:pw@host:443") == "host:443"  # authority-form (CONNECT)
    assert H.shown_target(b"*") == "*"
