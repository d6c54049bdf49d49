"""The trailer section of a chunked body, sized from the reads (proxy/trailers.py).

The size must be the same however the reads cut the body: each message below is fed
as the proxy sees it (llhttp says which reads carried body data and where the message
ended), in one read, in two at every offset, a byte per read and in a few random
cuts, and compared with the size of the trailer lines it was built with.
"""

from __future__ import annotations

import itertools
import random

import httptools
import pytest

from traceproxy.proxy.trailers import TrailerWatch, field_size, section_at_end

HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(("line", "size"), [
    (b"X-A: 1", 8),
    (b"X-A:1", 8),  # as llhttp hands it over: name, value
    (b"X-A:   spaced  ", 15),  # the whitespace before a value is dropped, after it kept
    (b"X-Pa", 8),  # a name still coming
])
def test_a_field_line_counts_as_llhttp_reads_it(line, size):
    assert field_size(line) == size


@pytest.mark.parametrize(("last_read", "since_body", "carried_body", "size"), [
    (HEAD + b"5\r\nhello\r\n0\r\n\r\n", b"", True, 0),
    (HEAD + b"5\r\nhello\r\n0;ext=" + b"e" * 3000 + b"\r\n\r\n", b"", True, 0),  # extensions never count
    (HEAD + b"5\r\nhello\r\n000\r\nX-A: 1\r\nB:2\r\n\r\n", b"", True, 8 + 6),
    (b"0\r\n\r\n", b"5\r\nhello\r\n", False, 0),  # the usual last read of its own
    (b"0\r\n\r\n", b"5\r\nhello\r\n0\r\nX-A: 1", False, 9),  # ... which here ends a trailer line
    (b"\r\n", b"5\r\nhello\r\n0\r\nX-A: 1\r\n", False, 8),
    (b"\r\n\r\n\r\n", b"5\r\nhello\r\n0\r\nX-A: 1\r\n", False, 8),  # CRLFs after the message: not its
    # Body data shaped like a last chunk and trailers is data.
    (HEAD + b"10\r\n\r\n0\r\nX-Fake: 1\r\n\r\n0\r\n\r\n", b"", True, 0),
])
def test_the_section_is_sized_from_the_end_of_the_body(last_read, since_body, carried_body, size):
    assert section_at_end(last_read, since_body, carried_body) == size


class _Parse:
    """llhttp's view of a response: whether a read carried body data, and its end."""

    def __init__(self) -> None:
        self.head_done = self.body = self.done = False

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body = True

    def on_message_complete(self) -> None:
        self.done = True


def sized(reads: list[bytes], limit: int) -> tuple[bool, int]:
    """As the proxy sizes the section of ``reads``: (refused before the end, size)."""
    parse = _Parse()
    parser = httptools.HttpResponseParser(parse)
    since: bytes | TrailerWatch = b""
    for data in reads:
        awaiting_head, parse.body = not parse.head_done, False
        parser.feed_data(data)
        if parse.done:
            return False, section_at_end(data, since, parse.body or awaiting_head)
        if parse.body or awaiting_head:
            since = data
        else:
            if since.__class__ is bytes:
                since = TrailerWatch(since)
            size = since.read(data)
            if size > limit:
                return True, size
    raise AssertionError("the message did not end")


# Body data, some of it shaped like the end of a body: a last chunk, trailer lines
# (longer than the limits below), a line that a trailer line would go on with.
DATA = [b"hello", b"X: y\r\n0\r\n", b"0", b"\r\n0\r\nA: b\r\n", b"data: [DONE]\n\n", b"ab\ncd:e",
        b"\r\n0\r\nPad: " + b"p" * 80 + b"\r\nX-Short: 1", b"\r\n0\r\nPad: " + b"p" * 80 + b"\r\n00"]
TRAILERS = [[], [b"X-A: 1"], [b"Big: " + b"w" * 30], [b"X-A:   spaced  ", b"B:c"], [b"0abc: 1", b"Q: " + b"v" * 20]]
LAST_CHUNKS = [b"0", b"000", b"0;ext=1", b'0;q="a:b"']


def messages():
    for data, trailers, last in itertools.product(DATA, TRAILERS, LAST_CHUNKS):
        section = b"".join(line + b"\r\n" for line in trailers)
        yield HEAD + b"%x;e=1\r\n%s\r\n" % (len(data), data) + last + b"\r\n" + section + b"\r\n", trailers
        if last == b"0" and data == b"hello":  # chunk sizes padded with zeros
            yield (HEAD + b"0005\r\n%s\r\n0000000000000000000000000000003\r\nabc\r\n" % data + b"0" * 40 + b"\r\n"
                   + section + b"\r\n", trailers)
    for trailers in TRAILERS:  # no body data at all
        yield HEAD + b"0\r\n" + b"".join(line + b"\r\n" for line in trailers) + b"\r\n", trailers


def read_plans(message: bytes):
    yield [message]
    for at in range(1, len(message)):
        yield [message[:at], message[at:]]
        yield [message[:at], message[at:at + 1], message[at + 1:]]  # a CR alone after body data, among others
    yield [message[i:i + 1] for i in range(len(message))]
    rnd = random.Random(len(message))
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(message)), 4))
        yield [message[a:b] for a, b in zip([0, *cuts], [*cuts, len(message)])]


@pytest.mark.parametrize(("message", "trailers"), list(messages()))
def test_the_size_is_the_same_however_the_reads_cut_the_body(message, trailers):
    size = sum(field_size(line) for line in trailers)
    for limit in {size + 20, size, size - 1} - set(range(16)):  # limits this small: see the next test
        for reads in read_plans(message):
            refused_early, counted = sized(reads, limit)
            cuts = [len(read) for read in reads]
            if refused_early:
                assert size > limit, (cuts, limit, counted)
            else:
                assert counted == size, (cuts, limit)


def test_a_line_of_hex_digits_after_a_last_chunk_line_is_held_to_the_limit_as_a_field_name():
    # A trailer name that is all hex digits cannot be told from a chunk size while it
    # comes, when the line before it may be body data ("hello\r\n0" may be): as a
    # name, httptools would gather it without bound, so past the limit it is refused.
    message = HEAD + b"5\r\nhello\r\n0\r\n" + b"0" * 100
    refused, size = sized([message[:-100], *(b"0" for _ in range(100))], 60)
    assert refused and size == 61


def test_a_chunk_size_padded_with_zeros_after_plain_body_data_never_counts():
    # After body data whose last line cannot precede a trailer line, digits are a chunk size.
    message = HEAD + b"5\r\nhello\r\n" + b"0" * 100 + b"5\r\nworld\r\n0\r\n\r\n"
    start = message.index(b"000")
    assert sized([message[:start], *(message[i:i + 1] for i in range(start, len(message)))], 60) == (False, 0)
