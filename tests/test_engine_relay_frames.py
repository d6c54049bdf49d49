"""The engine span receiver's process hands the proxy the requests to relay in frames of
several (``engine_receiver_main._ToProxy``): the proxy's loop wakes a few times a second
for them, not once per export request. No process, no network: a transport that records."""

from __future__ import annotations

import asyncio
import marshal

from traceproxy.observe import engine_receiver_main as main
from traceproxy.observe.export_wire import RawSpans


class RecordingTransport:
    def __init__(self, buffered: int = 0) -> None:
        self.written: list[bytes] = []
        self.buffered = buffered

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def messages(self) -> list[tuple]:
        data, out = b"".join(self.written), []
        while data:
            length = main.HEADER.unpack(data[:main.HEADER.size])[0]
            out.append(marshal.loads(data[main.HEADER.size:main.HEADER.size + length]))
            data = data[main.HEADER.size + length:]
        return out


def test_requests_to_relay_go_to_the_proxy_together_each_as_it_came():
    async def scenario():
        transport = RecordingTransport()
        to_proxy = main._ToProxy(transport)
        payloads = [b"\x0a\x02first", b"\x0a\x03second", b""]
        assert all(to_proxy.submit_raw(RawSpans(payload, n + 1)) for n, payload in enumerate(payloads))
        written_at_once = list(transport.written)
        await asyncio.sleep(main.RELAY_EVERY_S * 3)
        return written_at_once, transport.messages()

    written_at_once, messages = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert written_at_once == []
    assert messages == [("raw", [b"\x0a\x02first", b"\x0a\x03second", b""], [1, 2, 3])]


def test_a_batch_past_its_size_goes_at_once_and_a_proxy_behind_has_requests_left_out():
    async def scenario():
        transport = RecordingTransport()
        to_proxy = main._ToProxy(transport)
        big = b"\x00" * main.RELAY_BATCH_BYTES
        to_proxy.submit_raw(RawSpans(big, 64))
        sent_at_once = transport.messages()
        transport.buffered = main.MAX_BUFFERED + 1  # the proxy has not read what was sent
        refused = to_proxy.submit_raw(RawSpans(b"\x0a\x00", 7))
        await asyncio.sleep(main.RELAY_EVERY_S * 3)
        return sent_at_once, refused, to_proxy.left_out, transport.messages()

    sent_at_once, refused, left_out, messages = asyncio.run(asyncio.wait_for(scenario(), 5))
    assert sent_at_once == [("raw", [b"\x00" * main.RELAY_BATCH_BYTES], [64])]
    assert refused is False and left_out == 7 and messages == sent_at_once
