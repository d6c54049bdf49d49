"""The real ``sglang-router`` in PD mode in front of two fake SGLang engines.

``RouterHarness`` starts a fake prefill and a fake decode worker (aiohttp, on a
loop in a background thread), then the router with the project's own launcher
(``traceproxy.sim.launch.RouterProcess``: a subprocess in its own session,
ready once a request goes through it to both workers). Every inference request a
worker receives is recorded, so tests can assert on what reaches the engines:

    with RouterHarness() as h:
        ...send to h.router_url...
        [req] = h.prefill.requests        # RecordedRequest(path, headers, body, ...)
        req.headers["traceparent"]        # header names lower-cased
        req.body["bootstrap_room"]        # the JSON body as the router re-serialised it

Or as pytest fixtures: ``from .router_harness import pd_router, router_harness``
in a test module, then ask for ``pd_router`` (records cleared, knobs reset, per
test) on top of ``router_harness`` (one per session; starting takes ~0.5 s).
Imported into several modules, each module gets its own session instance; move
the import into ``conftest.py`` to share one.

What sglang-router 0.3.2 needs from a worker (checked against the installed
router): it first probes the port for gRPC (HTTP/2 prior knowledge, which the
fake answers with a parse error, so the router falls back to HTTP), then calls
``GET /health``, ``GET /server_info`` (``disaggregation_mode`` must match the
role, plus ``tp_size``, ``dp_size``, ``model_path``, ``served_model_name``) and
``GET /model_info``. ``model_path`` is an empty local directory and
``HF_HUB_OFFLINE=1`` is set, so the router never tries to download a tokenizer
(it logs one warning per worker that the directory holds no tokenizer).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, NamedTuple

from aiohttp import web

from traceproxy.sim.aioserve import quiet_logger, start_app
from traceproxy.sim.launch import RouterProcess, RouterUnavailable, free_port, router_importable
from traceproxy.sim.startup import SimStartError

STARTUP_TIMEOUT = 60.0  # router start + worker registration, bounded
STEP_TIMEOUT = 10.0  # any single blocking step (one HTTP exchange, one loop call)
SERVED_MODEL_NAME = "fake-model"

# The inference paths the router sends to both prefill and decode in PD mode.
INFERENCE_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")


class RecordedRequest(NamedTuple):
    path: str
    headers: dict[str, str]  # lower-cased names; repeated headers joined with ", "
    body: Any  # parsed JSON, or None when the body was empty or not JSON
    method: str = "POST"
    raw: bytes = b""
    received_at: float = 0.0  # time.monotonic() when the request head arrived


# ----------------------------------------------------------------------------------
# An event loop in a thread, for the fake workers
# ----------------------------------------------------------------------------------
class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="router-harness-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = STEP_TIMEOUT):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()


_worker_log = quiet_logger("tests.router_harness.worker")


# ----------------------------------------------------------------------------------
# The fake engine
# ----------------------------------------------------------------------------------
class FakeWorker:
    """A fake SGLang server in PD role ``mode`` ("prefill" or "decode").

    ``requests``: the inference requests (POST to one of ``INFERENCE_PATHS``) in
    arrival order; ``probes``: everything else (registration and health checks).
    Both are snapshots, safe to read from any thread.

    Knobs, settable from the test thread: ``delay`` (seconds before answering an
    inference request), ``chunks`` (decode stream length), ``status`` (answer
    inference requests with this status and an SGLang-style error body).
    """

    def __init__(self, mode: str, model_path: str, served_model_name: str = SERVED_MODEL_NAME) -> None:
        if mode not in ("prefill", "decode"):
            raise ValueError(f"mode must be prefill or decode, not {mode!r}")
        self.mode = mode
        self.model_path = model_path
        self.served_model_name = served_model_name
        self.delay = 0.0
        self.chunks = 3
        self.status = 200
        self.port = 0
        self._lock = threading.Condition()
        self._requests: list[RecordedRequest] = []
        self._probes: list[RecordedRequest] = []
        self._runner: web.AppRunner | None = None

    # --- lifecycle (on the harness loop) ---

    async def start(self) -> "FakeWorker":
        app = web.Application()
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self._health)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        app.router.add_get("/v1/models", self._models)
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self._inference)
        app.middlewares.append(self._record_probe)
        self._runner, self.port = await start_app(app, "127.0.0.1", 0, logger=_worker_log)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- what was received (any thread) ---

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    @property
    def probes(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._probes)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._probes.clear()

    def wait_for_requests(self, count: int, timeout: float = STEP_TIMEOUT) -> list[RecordedRequest]:
        """Block until at least ``count`` inference requests arrived; return them all."""
        with self._lock:
            if not self._lock.wait_for(lambda: len(self._requests) >= count, timeout):
                raise AssertionError(
                    f"{self.mode} got {len(self._requests)} inference requests within {timeout} s, "
                    f"expected {count}: {[r.path for r in self._requests]}"
                )
            return list(self._requests)

    # --- handlers ---

    @web.middleware
    async def _record_probe(self, request: web.Request, handler):
        if not (request.method == "POST" and request.path in INFERENCE_PATHS):
            self._record(self._probes, request, await request.read(), time.monotonic())
        return await handler(request)

    def _record(self, sink: list, request: web.Request, raw: bytes, at: float) -> RecordedRequest:
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            name = name.lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        rec = RecordedRequest(request.path, headers, body, request.method, raw, at)
        with self._lock:
            sink.append(rec)
            self._lock.notify_all()
        return rec

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "disaggregation_mode": self.mode,
            "tp_size": 1,
            "dp_size": 1,
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "version": "0.0.0-fake",
        })

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
        })

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({
            "object": "list",
            "data": [{"id": self.served_model_name, "object": "model", "owned_by": "sglang", "root": self.model_path}],
        })

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        at = time.monotonic()
        rec = self._record(self._requests, request, await request.read(), at)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response(
                {"object": "error", "message": f"fake {self.mode} error", "type": "BadRequest", "code": self.status},
                status=self.status,
            )
        body = dict(rec.body) if isinstance(rec.body, dict) else {}
        if not isinstance(body.get("rid"), str):
            body["rid"] = uuid.uuid4().hex  # one id for every event of this response
        # A real prefill server answers like any server, with (almost) no text: the
        # router drains that answer and never shows it to the client.
        pieces = [] if self.mode == "prefill" else [f"tok{i} " for i in range(max(1, self.chunks))]
        if body.get("stream"):
            return await self._stream(request, rec.path, body, pieces)
        return web.json_response(_final_object(rec.path, body, "".join(pieces), len(pieces), self.mode))

    async def _stream(self, request: web.Request, path: str, body: dict, pieces: list[str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        text = ""
        for i, piece in enumerate(pieces):
            text += piece
            await resp.write(b"data: " + json.dumps(_chunk_object(path, body, piece, text, i + 1, last=False)).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps(_chunk_object(path, body, "", text, len(pieces), last=True)).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _meta(body: dict, completion_tokens: int, finished: bool, mode: str) -> dict:
    return {
        "id": body["rid"],
        "finish_reason": {"type": "length" if mode == "prefill" else "stop"} if finished else None,
        "prompt_tokens": 3,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
    }


def _final_object(path: str, body: dict, text: str, n: int, mode: str) -> dict:
    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
    if path == "/generate":
        return {"text": text, "meta_info": _meta(body, n, True, mode)}
    if path == "/v1/chat/completions":
        return {
            "id": body["rid"], "object": "chat.completion", "created": int(time.time()), "model": SERVED_MODEL_NAME,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage,
        }
    return {
        "id": body["rid"], "object": "text_completion", "created": int(time.time()), "model": SERVED_MODEL_NAME,
        "choices": [{"index": 0, "text": text, "finish_reason": "stop"}], "usage": usage,
    }


def _chunk_object(path: str, body: dict, piece: str, text: str, n: int, last: bool) -> dict:
    if path == "/generate":
        # SGLang's native stream sends the cumulative text in every event.
        return {"text": text, "meta_info": _meta(body, n, last, "decode")}
    if path == "/v1/chat/completions":
        delta = {} if last else {"role": "assistant", "content": piece} if n == 1 else {"content": piece}
        return {
            "id": body["rid"], "object": "chat.completion.chunk", "created": int(time.time()), "model": SERVED_MODEL_NAME,
            "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if last else None}],
        }
    return {
        "id": body["rid"], "object": "text_completion", "created": int(time.time()), "model": SERVED_MODEL_NAME,
        "choices": [{"index": 0, "text": piece, "finish_reason": "stop" if last else None}],
    }


# ----------------------------------------------------------------------------------
# The router
# ----------------------------------------------------------------------------------
class RouterHarness:
    """Fake prefill + fake decode + the real sglang-router in PD mode.

    The router is launched by ``traceproxy.sim.launch.RouterProcess`` (the same
    launcher ``traceproxy sim`` uses), on the harness's background loop.
    Attributes once started: ``router_url``, ``router_port``, ``prefill``,
    ``decode`` (``FakeWorker``), ``bootstrap_port`` (what the router writes into
    bodies), ``log_path`` (the router's stdout+stderr), ``startup_seconds``.
    """

    def __init__(self, *, startup_timeout: float = STARTUP_TIMEOUT, log_level: str = "warn",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.extra_args = tuple(extra_args)
        self.bootstrap_port = 0
        self.startup_seconds = 0.0
        self.prefill: FakeWorker | None = None
        self.decode: FakeWorker | None = None
        self.router: RouterProcess | None = None
        self._loop: _LoopThread | None = None
        self._tmp: str | None = None

    @property
    def router_port(self) -> int:
        return self.router.port

    @property
    def router_url(self) -> str:
        return self.router.url

    @property
    def log_path(self) -> str:
        return self.router.log_path if self.router is not None else ""

    # --- lifecycle ---

    def start(self) -> "RouterHarness":
        if not router_importable():
            raise RouterUnavailable("sglang_router is not importable")
        t0 = time.monotonic()
        try:
            self._tmp = tempfile.mkdtemp(prefix="router-harness-")
            model_path = os.path.join(self._tmp, "model")  # exists, holds no tokenizer
            os.mkdir(model_path)
            self._loop = _LoopThread()
            self.prefill = self._loop.run(FakeWorker("prefill", model_path).start())
            self.decode = self._loop.run(FakeWorker("decode", model_path).start())
            self.bootstrap_port = free_port()
            self.router = RouterProcess(self.prefill.url, self.bootstrap_port, self.decode.url, self._tmp,
                                        log_level=self.log_level, extra_args=self.extra_args)
            self._loop.run(self.router.start(self.startup_timeout), timeout=self.startup_timeout + STEP_TIMEOUT)
            self.startup_seconds = time.monotonic() - t0
            self.clear()
            return self
        except SimStartError as exc:
            self.stop()
            # The launcher's message is one line; a failing test wants the router's log too.
            raise RuntimeError(f"{exc}\n{exc.detail}" if exc.detail else str(exc)) from exc
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._loop is not None:
            if self.router is not None:
                self._loop.run(self.router.stop(), timeout=3 * STEP_TIMEOUT)
            for worker in (self.prefill, self.decode):
                if worker is not None:
                    try:
                        self._loop.run(worker.stop())
                    except Exception:  # noqa: BLE001 - teardown goes on
                        pass
            self._loop.stop()
            self._loop = None
        if self._tmp is not None and not os.environ.get("ROUTER_HARNESS_KEEP"):
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "RouterHarness":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- helpers for tests ---

    def clear(self) -> None:
        """Forget what the workers received so far."""
        self.prefill.clear()
        self.decode.clear()

    def log_tail(self, lines: int = 40) -> str:
        return self.router.log_tail(lines) if self.router is not None else "(no router)"


def http_exchange(port: int, method: str, path: str, headers: dict[str, str] | None = None,
                  body: bytes = b"", timeout: float = STEP_TIMEOUT) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: (status, lower-cased headers, whole body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


# ----------------------------------------------------------------------------------
# pytest
# ----------------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # the harness is usable without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def router_harness():
        """One running ``RouterHarness`` for the session (skips if sglang_router is missing)."""
        pytest.importorskip("sglang_router", reason="sglang-router cannot be imported (pip install sglang-router)",
                            exc_type=ImportError)
        with RouterHarness() as harness:
            yield harness

    @pytest.fixture
    def pd_router(router_harness):
        """The session's ``RouterHarness`` with empty records and default worker knobs."""
        router_harness.clear()
        for worker in (router_harness.prefill, router_harness.decode):
            worker.delay, worker.chunks, worker.status = 0.0, 3, 200
        yield router_harness
        router_harness.clear()
