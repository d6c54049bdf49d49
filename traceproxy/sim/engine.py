"""A simulated SGLang server in a PD (prefill/decode) role, good enough for the real router.

Theory of operation
-------------------
``SimWorker`` is an aiohttp app that answers everything the three routers
(``routers.py``) ask of a worker. sglang-router 0.3.2 and smg probe the port for gRPC
first (the HTTP/2 preface gets a 400 and they fall back to HTTP); all of them call
``/health`` (and ``/health_generate``), ``/server_info`` and ``/get_server_info``
(``disaggregation_mode`` = the role; ``model_path`` is an existing, empty local
directory, so an offline router never downloads a tokenizer), ``/model_info``,
``/get_model_info``, ``/v1/models``, ``/get_load`` and ``/metrics``; smg polls
``/loads`` and ``/v1/loads``, vllm-router calls ``/v1/*/render`` and ``/tokenize``
before each request (``router_calls.py``). Every call that is not inference is kept
in ``calls`` (method, path, status), so a test can say that none got a 404.
Inference (``/generate``, ``/v1/completions``, ``/v1/chat/completions``, stream or
not) is run by ``generation.serve``, in either PD protocol (``pairing.py``); a
prefill worker also runs the bootstrap listener its decode peers wait on
(``bootstrap.py``; its main port answers the same ``GET /bootstrap/{room}`` poll).

Around each inference request the worker records what arrived (``requests``), logs
one line (rid, x-request-id, trace id, result), counts it in SGLang's gauges and its
per-stage latency histogram (``GET /metrics``), and, when tracing is configured,
exports SGLang's spans for it under the request's ``traceparent`` (``otel.py``), each
stage's as the stage ends (``stages.py``). Faults (``faults.py``) come from the worker
(``default_faults``, ``POST /admin/faults``) and from the request.

aiohttp runs with ``handler_cancellation``: when a client (the router) goes away,
the handler is cancelled, so held and waiting requests end with it and leave the
gauges.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections import deque
from typing import Any, NamedTuple

import aiohttp
from aiohttp import web

from . import gauges as g
from . import router_calls
from .aioserve import quiet_logger, start_app
from .bootstrap import BootstrapServer, Rooms, poll_handler, register_local, unregister_local
from .faults import FaultError, applies, check_role, parse_faults, request_fault_specs
from .generation import HOLD_LIMIT, Job, serve
from .otel import make_tracing
from .pairing import pairing_of
from .shapes import Reply, check_request, max_tokens, prompt_tokens, request_rid
from .stages import DECODE, PREFILL, UNIFIED, RequestTimeline
from .startup import ListenerError

INFERENCE_PATHS = ("/generate", "/v1/chat/completions", "/v1/completions")
RECORD_LIMIT = 1000  # requests remembered per worker


class Call(NamedTuple):
    """A request that was not inference (a router's registration, health or load call)."""

    method: str
    path: str  # with its query string
    status: int


class SeenRequest(NamedTuple):
    """One inference request as it reached the worker (header names lower-cased)."""

    path: str
    headers: dict[str, str]
    body: Any
    rid: str
    request_id: str
    trace_id: str
    room: int | None
    faults: tuple[str, ...]
    received_at: float  # time.monotonic()
    peer: str = ""  # HOST:PORT of the connection's far end: the same on a reused keep-alive connection


_server_log = quiet_logger("traceproxy.sim.aiohttp")


def _peer(request: web.Request) -> str:
    transport = request.transport
    peername = transport.get_extra_info("peername") if transport is not None else None
    return f"{peername[0]}:{peername[1]}" if peername else ""


def _closed(request: web.Request) -> web.Response:
    """What a handler returns once its client is gone: the connection closes, nothing is sent."""
    if request.transport is not None:
        request.transport.close()
    return web.Response(status=503)


def trace_id_of(traceparent: str) -> str:
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else ""


class SimWorker:
    def __init__(self, role: str, host: str = "127.0.0.1", port: int = 0, model: str = "sim-llama",
                 prefill_tokens_per_s: float = 8000.0, decode_tokens_per_s: float = 100.0, default_faults=(), *,
                 bootstrap_port: int = 0, bootstrap_timeout: float = 60.0, max_running_requests: int = 64,
                 model_path: str | None = None, otlp_endpoint: str | None = None,
                 prefill_url: str | None = None, pd: bool = False) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {role!r}")
        if prefill_tokens_per_s <= 0 or decode_tokens_per_s <= 0:
            raise ValueError("token rates must be positive")
        self.role, self.host, self.port, self.model = role, host, port, model
        self.prefill_tokens_per_s, self.decode_tokens_per_s = prefill_tokens_per_s, decode_tokens_per_s
        self.faults = parse_faults(default_faults)
        self.bootstrap_port = bootstrap_port
        self.bootstrap_timeout = bootstrap_timeout
        self.max_running_requests = max_running_requests
        self.model_path = model_path
        self.otlp_endpoint = otlp_endpoint
        self.prefill_url = prefill_url  # decode: poll this prefill's /bootstrap, not the body's address
        self.pd = pd  # behind a PD router: decode never serves alone, so refuses the prefill's faults
        self.log = logging.getLogger(f"traceproxy.sim.{role}")
        self.metrics = g.EngineMetrics(model)
        self.rooms = Rooms()
        self.idle_closes = 0
        self._records: deque[SeenRequest] = deque(maxlen=RECORD_LIMIT)
        self._calls: deque[Call] = deque(maxlen=RECORD_LIMIT)
        self._kv_held: dict[int, asyncio.Task] = {}  # vLLM prefill: room -> its cache kept for decode
        self._idle_timers: dict[object, asyncio.TimerHandle] = {}  # per connection (aiohttp protocol)
        self._idle_after: dict[object, float] = {}  # a request's own idle_close, for its connection
        self._own_model_path = False
        self._runner: web.AppRunner | None = None
        self._bootstrap: BootstrapServer | None = None
        self.session: aiohttp.ClientSession | None = None
        self.tracing = None
        self.stopping: asyncio.Event | None = None
        self.let_go: asyncio.Event | None = None  # set: every held request is dropped
        self.slots: asyncio.Semaphore | None = None

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> "SimWorker":
        self.stopping = asyncio.Event()
        self.let_go = asyncio.Event()
        self.slots = asyncio.Semaphore(self.max_running_requests)
        if self.model_path is None:
            self.model_path, self._own_model_path = tempfile.mkdtemp(prefix="sim-sglang-model-"), True
        self.tracing = make_tracing(self.role, self.otlp_endpoint)
        try:
            await self._listen()
        except BaseException:
            await self.stop()
            raise
        if self.role == "decode":
            self.session = aiohttp.ClientSession()
        return self

    async def _listen(self) -> None:
        """Bind the worker's port, and a prefill's bootstrap port; a failure names the listener."""
        try:
            self._runner, self.port = await start_app(self._app(), self.host, self.port, handler_cancellation=True,
                                                      shutdown_timeout=1.0, logger=_server_log)
        except OSError as exc:
            raise ListenerError(self.role, self.host, self.port, exc) from None
        if self.role == "prefill":
            try:
                self._bootstrap = await BootstrapServer(self.rooms, self.host, self.bootstrap_port).start()
            except OSError as exc:
                raise ListenerError("bootstrap", self.host, self.bootstrap_port, exc) from None
            self.bootstrap_port = self._bootstrap.port
            register_local(self.advertised_host, self.bootstrap_port, self.rooms)

    async def stop(self) -> None:
        if self.stopping is not None:
            self.stopping.set()
            self.let_go.set()  # held requests end before the runner waits for them
        held = list(self._kv_held.values())
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        for timer in self._idle_timers.values():
            timer.cancel()
        self._idle_timers.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._bootstrap is not None:
            unregister_local(self.advertised_host, self.bootstrap_port)
            await self._bootstrap.stop()
            self._bootstrap = None
        if self.session is not None:
            await self.session.close()
            self.session = None
        if self.tracing is not None:
            await self.tracing.shutdown()
            self.tracing = None
        if self._own_model_path:
            shutil.rmtree(self.model_path, ignore_errors=True)

    @property
    def advertised_host(self) -> str:
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host

    @property
    def url(self) -> str:
        return f"http://{self.advertised_host}:{self.port}"

    @property
    def engine_id(self) -> str:
        """How a vLLM prefill names itself to its decode peer (``remote_engine_id``)."""
        return f"sim-{self.role}-{self.advertised_host}:{self.port}"

    @property
    def bootstrap_url(self) -> str:
        return f"http://{self.advertised_host}:{self.bootstrap_port}"

    # -- what arrived (safe to read from any thread) ------------------------------------
    @property
    def requests(self) -> list[SeenRequest]:
        return list(self._records)

    @property
    def calls(self) -> list[Call]:
        return list(self._calls)

    def clear(self) -> None:
        self._records.clear()
        self._calls.clear()

    def set_faults(self, specs) -> None:
        self.faults = parse_faults(specs)

    async def release_held(self) -> None:
        """Drop every request a fault is holding (their connections close), and every KV cache a
        vLLM prefill keeps for a decode that has not come; later ones hold again."""
        let_go, self.let_go = self.let_go, asyncio.Event()
        let_go.set()
        for task in list(self._kv_held.values()):
            task.cancel()

    def keep_kv_for_decode(self, job: Job) -> None:
        """vLLM: after answering, a prefill keeps the room's KV cache until its decode attaches,
        completes the handshake and pulls it; the request's timeline ends then. Counted in the
        inflight queue meanwhile; not attached or pulled within ``bootstrap_timeout``, it is a
        failed transfer. ``bootstrap_stall`` and ``kv_transfer_stall`` keep it until let go."""
        job.timeline_kept = True
        room_id = job.room
        task = asyncio.get_running_loop().create_task(self._keep_kv(room_id, job))
        self._kv_held[room_id] = task
        task.add_done_callback(lambda _: self._kv_held.pop(room_id, None))

    async def _keep_kv(self, room_id: int, job: Job) -> None:
        room, stage, timeline = self.rooms.get(room_id), self.metrics.stage(), job.timeline
        stage.enter(g.PREFILL_INFLIGHT)
        timeline.transfer_queue_entered()
        outcome = "let go"
        try:
            outcome = await self._hand_over_kv(room, job)
        finally:
            stage.leave()
            if outcome:
                self.rooms.update(room, failed=room.failed or outcome)
            else:
                timeline.kv_transfer_finished()
            timeline.complete(outcome or None)

    async def _hand_over_kv(self, room, job: Job) -> str:
        """Attach, handshake, take: "" once decode has taken the KV cache, else why not."""
        if not await self.rooms.wait_for(room, lambda r: r.attached, self.bootstrap_timeout):
            self.metrics.count("sglang:num_transfer_failed_reqs")
            return "transfer timeout"
        if job.has("bootstrap_stall"):
            await asyncio.sleep(HOLD_LIMIT)  # until let go (the task is cancelled)
            return "held"
        self.rooms.update(room, handshaken=True)
        if job.has("kv_transfer_stall"):
            await asyncio.sleep(HOLD_LIMIT)
            return "held"
        if not await self.rooms.wait_for(room, lambda r: r.taken, self.bootstrap_timeout):
            self.metrics.count("sglang:num_transfer_failed_reqs")
            return "transfer timeout"
        return ""

    # -- the app -------------------------------------------------------------------------
    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._record_calls_middleware, self._idle_close_middleware])
        router_calls.add_routes(app, self)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self._health)
        for path in ("/server_info", "/get_server_info"):
            app.router.add_get(path, self._server_info)
        for path in ("/model_info", "/get_model_info"):
            app.router.add_get(path, self._model_info)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/get_load", self._load)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/admin/faults", self._get_faults)
        app.router.add_post("/admin/faults", self._set_faults)
        app.router.add_post("/admin/release", self._release)
        if self.role == "prefill":
            app.router.add_get("/bootstrap/{room}", poll_handler(self.rooms))
        for path in INFERENCE_PATHS:
            app.router.add_post(path, self._inference)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _server_info(self, request: web.Request) -> web.Response:
        info = {"disaggregation_mode": self.role, "tp_size": 1, "dp_size": 1, "model_path": self.model_path,
                "tokenizer_path": self.model_path, "served_model_name": self.model, "is_generation": True,
                "max_running_requests": self.max_running_requests, "version": "0.0.0-sim"}
        if self.role == "prefill":
            info["disaggregation_bootstrap_port"] = self.bootstrap_port
        return web.json_response(info)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "served_model_name": self.model, "is_generation": True})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "sglang", "root": self.model_path}]})

    async def _load(self, request: web.Request) -> web.Response:
        gauges = self.metrics.gauges
        return web.json_response([{"dp_rank": 0, "num_reqs": gauges[g.RUNNING] + gauges[g.QUEUED],
                                   "num_waiting_reqs": gauges[g.QUEUED], "num_tokens": 0}])

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response({"faults": [str(f) for f in self.faults.values()]})

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            payload = await request.json()
            specs = payload["faults"]
            if not isinstance(specs, list):
                raise FaultError('"faults" must be a list of fault specs')
            faults = parse_faults(specs)
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{\"faults\": [...]}}: {exc}"}, status=400)
        try:
            check_role(faults, self.role, self.pd)
        except FaultError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.faults = faults  # already parsed: set_faults would parse the specs again
        self.log.info("%s worker faults now: %s", self.role, [str(f) for f in self.faults.values()] or "none")
        return await self._get_faults(request)

    async def _release(self, request: web.Request) -> web.Response:
        await self.release_held()
        return web.json_response({"released": True})

    # -- inference ------------------------------------------------------------------------
    async def _inference(self, request: web.Request) -> web.StreamResponse:
        received = time.monotonic()
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            check_request(request.path, body)
            request_faults = parse_faults(request_fault_specs(request.headers, body))
        except ValueError as exc:  # FaultError and JSONDecodeError are ValueErrors
            return web.json_response({"error": {"message": str(exc), "type": "BadRequest", "code": 400}}, status=400)
        job = self._job(request, body, request_faults)
        if "idle_close" in job.faults:
            self._idle_after[request.protocol] = job.arg("idle_close")
        self._record(job, received)
        try:
            return await serve(job)
        except asyncio.CancelledError:
            job.result = "client_gone" if job.result == "ok" else job.result
            raise
        except ConnectionError:
            # A write found the client (the router) gone: nothing is left to answer, and it is
            # no error of the worker's (re-raised, aiohttp would log one with a traceback).
            job.result = "client_gone" if job.result == "ok" else job.result
            return _closed(request)
        finally:
            job.stage.leave()
            if job.result != "ok":
                self.metrics.count("sglang:num_aborted_requests")
            self._log_line(job, received)
            if not job.timeline_kept:
                job.timeline.complete(None if job.result == "ok" else job.error or job.result)

    def _job(self, request: web.Request, body: dict, request_faults: dict) -> Job:
        path = request.path
        pairing = pairing_of(self.role, body)
        standalone = pairing is None
        faults = {name: fault for name, fault in {**self.faults, **request_faults}.items()
                  if applies(fault, self.role, standalone)}
        reply = Reply(path, request_rid(body), self.model, prompt_tokens(path, body))
        # A decode worker serves a request alone, prefill included, when it names no prefill to pair with.
        alone = pairing is None or pairing.bootstrap is None
        mode = PREFILL if self.role == "prefill" else UNIFIED if alone else DECODE
        trace = (self.tracing.request(reply.rid, pairing.room if pairing else None, request.headers, mode)
                 if self.tracing is not None else None)
        return Job(self, request, path, body, faults, reply, max_tokens(path, body), self.metrics.stage(),
                   RequestTimeline(mode, self.metrics, trace), pairing=pairing)

    def _record(self, job: Job, received: float) -> None:
        headers: dict[str, str] = {}
        for name, value in job.request.headers.items():
            name = name.lower()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._records.append(SeenRequest(
            job.path, headers, job.body, job.reply.rid, headers.get("x-request-id", ""),
            trace_id_of(headers.get("traceparent", "")), job.room, tuple(str(f) for f in job.faults.values()),
            received, _peer(job.request)))

    def _log_line(self, job: Job, received: float) -> None:
        headers = job.request.headers
        self.log.info(
            "%s %s rid=%s x-request-id=%s trace_id=%s room=%s faults=%s status=%s tokens=%d result=%s %.3fs",
            self.role, job.path, job.reply.rid, headers.get("x-request-id", "-"),
            trace_id_of(headers.get("traceparent", "")) or "-", job.room if job.room is not None else "-",
            ",".join(str(f) for f in job.faults.values()) or "-", job.status, job.tokens, job.result,
            time.monotonic() - received)

    # -- what else was asked ------------------------------------------------------------------
    @web.middleware
    async def _record_calls_middleware(self, request: web.Request, handler):
        if request.method == "POST" and request.path in INFERENCE_PATHS:
            return await handler(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self._calls.append(Call(request.method, request.path_qs, status))

    # -- idle_close --------------------------------------------------------------------------
    @web.middleware
    async def _idle_close_middleware(self, request: web.Request, handler):
        # A worker-wide idle_close acts on connections that carried inference: the
        # router's registration and health checks (/health, /server_info, ...) on a
        # connection of their own are its housekeeping, not traffic under test.
        protocol = request.protocol
        timer = self._idle_timers.pop(protocol, None)
        if timer is not None:
            timer.cancel()  # no close while a request runs on the connection
        carries_inference = timer is not None or request.path in INFERENCE_PATHS
        try:
            return await handler(request)
        finally:
            after = self._idle_after.pop(protocol, None)
            if after is None and "idle_close" in self.faults and carries_inference:
                after = self.faults["idle_close"].arg
            if after is not None and not self.stopping.is_set():
                self._idle_timers[protocol] = asyncio.get_running_loop().call_later(
                    max(float(after), 0.01), self._close_idle, protocol)

    def _close_idle(self, protocol) -> None:
        # Fires only if no request started on this connection since it was armed.
        self._idle_timers.pop(protocol, None)
        transport = getattr(protocol, "transport", None)
        if transport is not None and not transport.is_closing():
            self.idle_closes += 1
            transport.close()
