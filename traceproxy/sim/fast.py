"""A small, fast OpenAI-compatible upstream for tests, the quick start and the benchmark.

Raw asyncio protocol with httptools, so it costs little CPU next to the proxy it is
measured through. Routes:

* ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate``: ``"stream": true``
  answers SSE (one event per token, then usage, then ``data: [DONE]``), otherwise
  one JSON completion. ``max_tokens`` sets the token count (default 16).
  Headers ``x-fake-ttft-ms`` and ``x-fake-tps`` pace the stream (default: unpaced).
* ``POST /echo``: the request body back, byte for byte, chunked.
* ``GET /health``, ``GET /v1/models``; anything else is 404.

``idle_close_after`` closes connections that sit idle that long, like uvicorn's
keep-alive timeout (5 s there), to exercise the proxy's pool against it.
"""

from __future__ import annotations

import asyncio
import json
import time

import httptools

MODEL = "traceproxy-fast-sim"


class FastUpstreamProtocol(asyncio.Protocol):
    def __init__(self, server: "FastUpstream") -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self._body: list[bytes] = []
        self._headers: dict[bytes, bytes] = {}
        self._url = b""

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        if self._idle_timer:
            self._idle_timer.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self.busy = True
        if self._idle_timer:
            self._idle_timer.cancel()
        self._body, self._headers, self._url = [], {}, b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.server.requests += 1
        method = self.parser.get_method()
        path = self._url.split(b"?", 1)[0]
        body = b"".join(self._body)
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions", b"/generate"):
            self._completion(path, body)
        elif method == b"POST" and path == b"/echo":
            self._send(200, body, b"application/octet-stream")
        elif path == b"/health":
            self._send(200, b"")
        elif path == b"/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode())
        else:
            self._send(404, b'{"error": {"message": "not found", "type": "not_found", "code": 404}}')

    # -- responses -----------------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: bytes = b"application/json") -> None:
        reason = {200: b"OK", 404: b"Not Found", 400: b"Bad Request"}.get(status, b"OK")
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, reason, ctype, len(body))
        self.transport.write(head + body)
        self._done()

    def _completion(self, path: bytes, body: bytes) -> None:
        try:
            req = json.loads(body or b"{}")
        except ValueError:
            self._send(400, b'{"error": {"message": "invalid JSON", "type": "invalid_request_error", "code": 400}}')
            return
        tokens = int(req.get("max_tokens") or req.get("sampling_params", {}).get("max_new_tokens") or 16)
        chat = path == b"/v1/chat/completions"
        rid = "chatcmpl-%d" % self.server.requests
        if not req.get("stream"):
            text = "tok " * tokens
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "length"}
            payload = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                       "model": req.get("model", MODEL), "choices": [choice],
                       "usage": {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}}
            self._send(200, json.dumps(payload).encode())
            return
        ttft = float(self._headers.get(b"x-fake-ttft-ms", b"0")) / 1000
        tps = float(self._headers.get(b"x-fake-tps", b"0"))
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        stream = _Stream(self, rid, chat, req.get("model", MODEL), tokens, 1 / tps if tps else 0)
        asyncio.get_running_loop().call_later(ttft, stream.next) if ttft else stream.next()

    def write_chunk(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def finish_stream(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(b"0\r\n\r\n")
        self._done()

    def _done(self) -> None:
        self.busy = False
        if not self.parser.should_keep_alive():
            self.transport.close()
        else:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if self.server.idle_close_after:
            self._idle_timer = asyncio.get_running_loop().call_later(self.server.idle_close_after, self._idle_close)

    def _idle_close(self) -> None:
        if not self.busy:
            self.server.idle_closes += 1
            self.transport.close()


class _Stream:
    """One SSE token stream, paced by loop timers (no task per stream)."""

    def __init__(self, proto: FastUpstreamProtocol, rid: str, chat: bool, model: str, tokens: int, interval: float):
        self.proto, self.rid, self.chat, self.model = proto, rid, chat, model
        self.left, self.total, self.interval = tokens, tokens, interval

    def next(self) -> None:
        if self.proto.transport.is_closing():
            return
        while self.left > 0:
            self.left -= 1
            self.proto.write_chunk(self._event(self.total - self.left - 1))
            if self.interval:
                asyncio.get_running_loop().call_later(self.interval, self.next)
                return
        usage = {"prompt_tokens": 8, "completion_tokens": self.total, "total_tokens": 8 + self.total}
        final = {"id": self.rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model,
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage}
        self.proto.write_chunk(b"data: " + json.dumps(final).encode() + b"\n\n")
        self.proto.write_chunk(b"data: [DONE]\n\n")
        self.proto.finish_stream()

    def _event(self, index: int) -> bytes:
        ts = int(time.time() * 1e6)
        if self.chat:
            choice = {"index": 0, "delta": {"content": f"tok{index} "}, "finish_reason": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": f"tok{index} ", "finish_reason": None}
            obj = "text_completion"
        event = {"id": self.rid, "object": obj, "created": ts // 1_000_000, "model": self.model,
                 "choices": [choice], "ts": ts}
        return b"data: " + json.dumps(event).encode() + b"\n\n"


class FastUpstream:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, idle_close_after: float = 0.0) -> None:
        self.host, self.port = host, port
        self.idle_close_after = idle_close_after
        self.connections: set[FastUpstreamProtocol] = set()
        self.requests = 0
        self.idle_closes = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> "FastUpstream":
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FastUpstreamProtocol(self), self.host, self.port, backlog=4096)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self._server.close()
        for conn in list(self.connections):
            conn.transport.abort()
        await self._server.wait_closed()
